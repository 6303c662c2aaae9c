"""What the guard writes about a call: its audit entry, in text every store can keep.

Every decision leaves exactly one audit row, so nothing a model sends may make
that insert fail. Text from the call (tool name, agent, ids, messages) is
bounded before it reaches an indexed column, and NUL and lone surrogates are
escaped (``\\x00``, ``\\ud800``): PostgreSQL refuses NUL in ``text`` and
``\\u0000`` in ``jsonb``, and UTF-8 has no lone surrogates. Only what the audit
log keeps is changed; the tool, the lock keys and the args hash see the
validated values unchanged. Idempotency keys are bounded where they are made
(``toolguard.call.intent.bounded_key``). Pure: no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from toolguard.call.decision import Decision
from toolguard.runtime.safe_text import STORED_LIMIT, safe_str, storable_text
from toolguard.store.base import AuditEntry, IntentRecord

__all__ = ["audit_entry", "shape", "storable", "storable_text"]

#: Characters kept of a name or an id in the audit log (``storable_text``'s default).
TEXT_LIMIT = STORED_LIMIT
#: Characters kept of a decision's message (not indexed).
DETAIL_LIMIT = 2_000


def storable(value: Any) -> Any:
    """A JSON value with every string and object key passed through ``storable_text`` (unbounded)."""
    if isinstance(value, str):
        return storable_text(value, len(value))
    if isinstance(value, Mapping):
        return {storable_text(str(k), len(str(k))): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]
    return value


def shape(value: Any, depth: int = 0) -> Any:
    """A redacted outline of untrusted input: types and sizes, no values."""
    if depth > 2:
        return "..."
    if isinstance(value, Mapping):
        return {storable_text(safe_str(k, 40)): shape(v, depth + 1)
                for k, v in list(value.items())[:20]}
    if isinstance(value, list | tuple):
        return f"list[{len(value)}]"
    if isinstance(value, str):
        return f"str[{len(value)}]"
    return type(value).__name__


def audit_entry(decision: Decision, record: IntentRecord | None, started: float, *,
                policy_version: str | None = None) -> AuditEntry:
    """The audit row of ``decision``; ``record`` is None when the call was never validated.

    ``policy_version`` (the deciding policy's digest) is the record's when it has one.
    """
    intent = decision.intent
    flow = intent.workflow
    # Never validated: keep only its shape, never the raw (maybe huge, maybe secret) values.
    args = record.args if record is not None else {"_unvalidated": shape(intent.args)}
    return AuditEntry(
        decision=decision.kind, reason=decision.reason, tool=storable_text(intent.tool) or None,
        agent=storable_text(intent.agent) or None,
        intent_id=storable_text(intent.call_id or intent.id),
        idempotency_key=decision.idempotency_key, workflow=storable_text(flow.thread_id or
                                                                         flow.run_id),
        keys=decision.keys, tokens=dict(decision.tokens), args=args,
        detail=storable_text(decision.message, DETAIL_LIMIT) or None,
        duration_ms=round((time.monotonic() - started) * 1000, 3),
        node_attempt=intent.node_attempt,
        policy_version=(record.policy_version if record is not None and record.policy_version
                        else policy_version))
