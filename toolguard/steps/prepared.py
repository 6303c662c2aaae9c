"""An intent that passed every pure check, and the decisions built from it (pure: no I/O)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from toolguard.call.decision import Decision
from toolguard.call.intent import Intent
from toolguard.policies import ToolPolicy
from toolguard.policies.redaction import Secrets
from toolguard.store.base import IntentRecord

__all__ = ["Prepared", "accepted", "unknown", "unvalidated_unknown"]


@dataclass(frozen=True, slots=True)
class Prepared:
    """An intent that passed every pure check: validated args, keys, its record."""

    rule: ToolPolicy
    args: dict[str, Any]
    model: BaseModel | None
    keys: tuple[str, ...]
    record: IntentRecord
    after: tuple[tuple[str, tuple[str, ...]], ...]
    secrets: Secrets
    #: The top-level arguments a person replaced when approving (validated), else None.
    edited: Mapping[str, Any] | None = None
    #: A read's keys (``reads:``): what its caller's observation records.
    reads: tuple[str, ...] = ()
    #: Keys a write reads but does not write, that its decision rests on (``decides_on:``).
    decides: tuple[str, ...] = ()
    #: Whose reads count (agent + conversation, ``toolguard.steps.reads.caller_for``).
    caller: str | None = None


def accepted(intent: Intent, prepared: Prepared, result: Any, replayed: bool,
             tokens: Mapping[str, int]) -> Decision:
    """The decision of a call that applied (or was answered from its recorded result)."""
    return Decision(kind="replayed" if replayed else "accepted",
                    reason="duplicate" if replayed else ("read" if prepared.reads else "applied"),
                    intent=intent, result=result,
                    keys=prepared.keys or prepared.reads, tokens=dict(tokens),
                    idempotency_key=prepared.record.idempotency_key)


def unknown(intent: Intent, prepared: Prepared, error: BaseException) -> Decision:
    """The decision of a call cancelled or interrupted mid-flight: its outcome is unknown."""
    reason = "interrupted" if isinstance(error, Exception) else "cancelled"
    return Decision(kind="unknown", reason=reason, intent=intent, message=type(error).__name__,
                    keys=prepared.keys, idempotency_key=prepared.record.idempotency_key)


def unvalidated_unknown(intent: Intent, error: BaseException) -> Decision:
    """The decision of a call cancelled before it was validated: nothing of it ran."""
    reason = "interrupted" if isinstance(error, Exception) else "cancelled"
    return Decision(kind="unknown", reason=reason, intent=intent, message=type(error).__name__)
