"""The read step: a read records what its caller saw; a write is checked against it.

A model reads in one call and writes what it decided in a later one. A tool
with ``reads:`` runs in a read transaction of the store (``store.read``): its
keys' versions are read first, the tool reads after, and the observation
commits with the call's audit row. A write runs its ``ReadCheck`` inside the
fenced transaction (``store.fenced(..., reads=...)``), after the fences and
before the tool: see ``toolguard.store.reads``. This module decides which
check a call gets (pure) and runs a read on either path.

The caller is the agent plus its conversation: the LangGraph / ``create_agent``
thread (else the run), the ``thread_id`` a plain call's ``WorkflowIdentity``
names (``scope=`` on ``@guarded``), the thread an MCP client names in ``_meta``
(``toolguard.store.reads.caller_of``, computed when the call is validated).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from toolguard.call.context import CallContext
from toolguard.call.decision import Decision
from toolguard.call.intent import Intent
from toolguard.controls.shadow import SHADOW_DECISION
from toolguard.errors import ToolGuardError
from toolguard.policies import Policy, ToolPolicy
from toolguard.runtime import telemetry
from toolguard.steps.execute import Body
from toolguard.steps.prepared import Prepared
from toolguard.store import AsyncGuardedStore, GuardedStore
from toolguard.store.base import AuditEntry
from toolguard.store.reads import ReadCheck
from toolguard.store.recovery import Outcome

__all__ = ["aread", "checks_reads", "read", "read_check", "shadow_row"]


def checks_reads(policy: Policy, rule: ToolPolicy) -> bool:
    """Whether a write under ``rule`` is checked against its caller's reads."""
    return bool(rule.requires_read or rule.decides_on or policy.tracks_reads)


def read_check(policy: Policy, prepared: Prepared, shadowed: bool) -> ReadCheck | None:
    """The check a write's fenced transaction runs, or None (nothing in the policy reads).

    ``shadowed``: the tool runs in ``mode: shadow``; with ``stale_reads: shadow`` too,
    a failed check is audited as a would-be refusal and the write applies.
    """
    rule = prepared.rule
    if not prepared.keys or prepared.caller is None or not checks_reads(policy, rule):
        return None
    return ReadCheck(caller=prepared.caller, decides=prepared.decides,
                     required=rule.requires_read, ttl_s=rule.read_ttl_s,
                     wait_s=rule.wait_timeout_s,
                     shadow=shadowed or rule.stale_reads == "shadow")


def read(store: GuardedStore, intent: Intent, prepared: Prepared,
         execute: Callable[[CallContext], Any], call: telemetry.Call, note: str = "") -> Decision:
    """Run a ``reads:`` tool in a read transaction; its observation commits with its row
    (``note``: added to the row's detail, e.g. the hold the read took)."""
    assert prepared.caller is not None
    body = Body(intent, prepared, call)
    with store.read(prepared.reads, prepared.record, caller=prepared.caller) as tx:
        body.sync(execute)(tx)
        if note:
            tx.detail = (tx.detail or "") + note
    return body.decision(Outcome(tx.result, tokens={}))


async def aread(store: AsyncGuardedStore, intent: Intent, prepared: Prepared,
                execute: Callable[[CallContext], Awaitable[Any]],
                call: telemetry.Call, note: str = "") -> Decision:
    """The asyncio twin of ``read``."""
    assert prepared.caller is not None
    body = Body(intent, prepared, call)
    async with store.read(prepared.reads, prepared.record, caller=prepared.caller) as tx:
        await body.asynchronous(execute)(tx)
        if note:
            tx.detail = (tx.detail or "") + note
    return body.decision(Outcome(tx.result, tokens={}))


def shadow_row(call_row: AuditEntry, would_refuse: ToolGuardError) -> AuditEntry:
    """The would-be refusal of a shadowed read check, as a ``shadow`` row beside the call's."""
    return replace(call_row, decision=SHADOW_DECISION, reason=would_refuse.reason,
                   detail=would_refuse.message[:2000], tokens={}, duration_ms=None)
