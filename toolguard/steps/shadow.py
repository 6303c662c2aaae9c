"""The shadow row: what enforcement would have refused, audited once, beside the call's own row.

``ShadowRow(enforcement)`` turns the call's would-be refusal (recorded by the
steps under ``mode: shadow``) into its own audit row, ``decision = "shadow"``
with the reason it would have been refused with, built from the call's row.
``entry`` gives it at most once per call: before the call runs, or with the
refusal of a step that is never shadowed.
"""

from __future__ import annotations

from toolguard.call.decision import Decision
from toolguard.call.intent import Intent
from toolguard.call.recording import audit_entry
from toolguard.controls.shadow import Enforcement
from toolguard.steps.prepared import Prepared
from toolguard.store.base import AuditEntry

__all__ = ["ShadowRow"]


class ShadowRow:
    """The call's shadow row, handed out once."""

    __slots__ = ("enforcement", "given")

    def __init__(self, enforcement: Enforcement) -> None:
        self.enforcement = enforcement
        self.given = False

    def entry(self, intent: Intent, prepared: Prepared | None, started: float,
              policy_version: str) -> AuditEntry | None:
        """The shadow row (first call only), or None when nothing would have been refused."""
        if self.given or self.enforcement.verdict is None:
            return None
        self.given = True
        keys = prepared.keys if prepared is not None else ()
        key = prepared.record.idempotency_key if prepared is not None else None
        base = Decision(kind="accepted", reason="applied", intent=intent, keys=keys,
                        idempotency_key=key)
        row = audit_entry(base, prepared.record if prepared is not None else None, started,
                          policy_version=policy_version)
        return self.enforcement.entry(row)
