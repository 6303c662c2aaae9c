"""The guard: one tool call from untrusted intent to audited, fenced effect.

envelope -> validate -> authorize -> resolve keys -> order -> lock -> fenced
transaction (fences, dedupe by idempotency key, execute, record, audit) ->
release, every decision audited exactly once with a stable reason code.

The deciding steps (``_prepare``) are pure and shared by ``run`` and ``arun``;
only the I/O edges (ordering wait, lock + fenced transaction, audit) come in
pairs. Expected rejections come back as a ``Decision``; ``call``/``acall``
raise the typed error instead, for plain Python callers. A
``ConfigurationError`` (the guard or a tool wired wrongly) is audited and then
raised: the developer has to fix it, no model can. Cancellation and LangGraph
interrupts release the locks, record the outcome as unknown (reconciled by the
idempotency key on the next attempt) and propagate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import warnings
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pydantic import BaseModel

from toolguard import telemetry
from toolguard.context import CallContext, bind
from toolguard.decision import (
    FAILURE_TEMPLATE,
    REJECTION_TEMPLATE,
    Decision,
    DecisionKind,
    ToolFailed,
    refusal,
)
from toolguard.errors import (
    ConfigurationError,
    GuardMisconfigured,
    UnknownToolWarning,
    is_control_flow,
)
from toolguard.intent import Intent
from toolguard.locks import AsyncLockManager, LockManager
from toolguard.policies import Policy, strict_model
from toolguard.policies.redaction import scrub_text
from toolguard.policies.strict import SchemaSource
from toolguard.recording import audit_entry, storable_text
from toolguard.steps.execute import Body, context_of
from toolguard.steps.order import await_order, wait_for_order
from toolguard.steps.prepared import Prepared, accepted, unknown
from toolguard.steps.validate import prepare
from toolguard.store import AsyncGuardedStore, GuardedStore
from toolguard.store.base import was_audited
from toolguard.store.recovery import arun_fenced, run_fenced

__all__ = ["FAILURE_TEMPLATE", "REJECTION_TEMPLATE", "Decision", "DecisionKind", "ToolFailed",
           "ToolGuard"]

log = logging.getLogger("toolguard.guard")


class ToolGuard:
    """Runs tool calls through a policy, fenced locks and the guarded store.

    Give it a sync pair (``locks=``, ``store=``) for ``run``, an asyncio pair
    (``async_locks=``, ``async_store=``) for ``arun``, or both; a path without
    its pair raises ``GuardMisconfigured`` at its first call.

    >>> guard = ToolGuard(load_policy("policy.yml"), locks=connect(), store=open_store())
    >>> decision = guard.run(intent, lambda ctx: update_lead(ctx.tx, **ctx.args))
    """

    def __init__(
        self,
        policy: Policy,
        *,
        locks: LockManager | None = None,
        store: GuardedStore | None = None,
        async_locks: AsyncLockManager | None = None,
        async_store: AsyncGuardedStore | None = None,
        schemas: Mapping[str, SchemaSource] | None = None,
    ) -> None:
        if not isinstance(policy, Policy):
            msg = (f"ToolGuard needs a Policy (load_policy(...) or Policy.from_dict(...)), "
                   f"got {type(policy).__name__}")
            raise GuardMisconfigured(msg)
        for sync, edge, names in ((locks, store, "locks= and store="),
                                  (async_locks, async_store, "async_locks= and async_store=")):
            if (sync is None) != (edge is None):
                msg = f"pass {names} together: a guarded call needs both"
                raise GuardMisconfigured(msg)
        if locks is None and async_locks is None:
            msg = ("a ToolGuard needs locks= and store= (sync path), async_locks= and "
                   "async_store= (asyncio path), or both")
            raise GuardMisconfigured(msg)
        self.policy = policy
        self.locks = locks
        self.store = store
        self.async_locks = async_locks
        self.async_store = async_store
        self._models: dict[str, type[BaseModel]] = {}
        for name, source in (schemas or {}).items():
            self.register(name, source, stacklevel=3)

    # --- tools -------------------------------------------------------------------------

    def register(self, name: str, source: SchemaSource, *, stacklevel: int = 2) -> type[BaseModel]:
        """Validate ``name``'s arguments with a strict model derived from ``source``.

        Checks the policy against the schema (template fields that are not
        arguments, constraints of the wrong kind...) and raises
        ``PolicyProblems`` naming file and line. A name the policy does not
        know warns (``UnknownToolWarning``): with ``on_unknown_tool: deny``
        every call to it would be refused. ``stacklevel`` points the warning at
        the caller's code, as for ``warnings.warn``.
        """
        model = strict_model(source, name=name)
        if name in self.policy.tools:
            self.policy.check_against({name: model})
        else:
            warnings.warn(_unknown_tool_text(self.policy, name), UnknownToolWarning,
                          stacklevel=stacklevel)
        self._models[name] = model
        return model

    def has_schema(self, name: str) -> bool:
        return name in self._models

    def _refusal(self, intent: Intent, prepared: Prepared | None, error: Exception) -> Decision:
        if prepared is None:
            return refusal(intent, error)
        decision = refusal(intent, error, keys=prepared.keys,
                           idempotency_key=prepared.record.idempotency_key)
        if prepared.secrets:
            decision = dataclasses.replace(
                decision, message=scrub_text(decision.message, prepared.secrets))
        return decision

    # --- sync ---------------------------------------------------------------------------

    def run(self, intent: Intent, execute: Callable[[CallContext], Any]) -> Decision:
        """Guard one call; ``execute(ctx)`` performs the effect (inside the fenced transaction).

        Never raises for anything the call brings: every refusal and failure is
        a ``Decision``, audited once. Raises ``ConfigurationError`` (after
        auditing it) when the guard or the tool is wired wrongly, and lets
        cancellation and LangGraph interrupts through.
        """
        started = time.monotonic()
        prepared: Prepared | None = None
        with telemetry.start_call(intent, self.policy.tools) as call:
            try:
                locks, store = self._sync_edges()
                prepared = self._traced_prepare(intent, call)
                wait_for_order(store, prepared, call)
                if not prepared.keys:
                    return self._run_unlocked(intent, prepared, execute, started, call)
                body = Body(intent, prepared, call)
                outcome = run_fenced(locks, store, prepared.keys, body.sync(execute),
                                     intent=prepared.record, ttl_ms=prepared.rule.ttl_ms,
                                     timeout_s=prepared.rule.wait_timeout_s)
                return call.decided(body.decision(outcome))
            except BaseException as error:
                if is_control_flow(error):
                    self._record_unknown(intent, prepared, error, started, call)
                    raise
                if not isinstance(error, Exception):
                    raise
                decision = call.decided(self._refusal(intent, prepared, error))
                if not was_audited(error):
                    self._audit(decision, prepared, started, call)
                _log(decision)
                if isinstance(error, ConfigurationError):
                    raise
                return decision

    def call(self, intent: Intent, execute: Callable[[CallContext], Any]) -> Any:
        """Like ``run``, but return the result or raise the typed error."""
        return self.run(intent, execute).raise_for_rejection()

    def _sync_edges(self) -> tuple[LockManager, GuardedStore]:
        if self.locks is None or self.store is None:
            msg = ("this ToolGuard has no sync lock manager and store: pass locks= and store=, "
                   "or run the graph with ainvoke()/arun()")
            raise GuardMisconfigured(msg)
        return self.locks, self.store

    def _traced_prepare(self, intent: Intent, call: telemetry.Call) -> Prepared:
        with call.step(telemetry.SPAN_VALIDATE):
            prepared = prepare(intent, self.policy, self._models)
        call.prepared(prepared.keys, telemetry.traceable_key(
            prepared.rule, self.policy, prepared.record.idempotency_key))
        return prepared

    def _run_unlocked(self, intent: Intent, prepared: Prepared,
                      execute: Callable[[CallContext], Any], started: float,
                      call: telemetry.Call) -> Decision:
        with bind(context_of(intent, prepared, None)) as ctx, call.step(telemetry.SPAN_TOOL):
            result = execute(ctx)
        decision = call.decided(accepted(intent, prepared, result, False, {}))
        self._audit(decision, prepared, started, call)
        return decision

    def _record_unknown(self, intent: Intent, prepared: Prepared | None, error: BaseException,
                        started: float, call: telemetry.Call) -> None:
        """A cancelled or interrupted call: its outcome is unknown until the key is seen again."""
        if prepared is not None:
            call.decided(unknown(intent, prepared, error))
        if self.store is None or prepared is None:
            return
        try:
            with call.step(telemetry.SPAN_AUDIT):
                if prepared.record.idempotency_key:
                    self.store.mark_unknown(prepared.record.idempotency_key, prepared.record)
                if not was_audited(error):
                    self.store.audit(audit_entry(unknown(intent, prepared, error),
                                                 prepared.record, started))
        except Exception as audit_error:  # never hide the interrupt behind a bookkeeping failure
            log.warning("could not record an interrupted call as unknown: %s", audit_error)

    def _audit(self, decision: Decision, prepared: Prepared | None, started: float,
               call: telemetry.Call) -> None:
        if self.store is None:
            log.warning("no sync store to audit %s/%s", decision.kind, decision.reason)
            return
        try:
            with call.step(telemetry.SPAN_AUDIT):
                self.store.audit(audit_entry(decision, prepared.record if prepared else None,
                                             started))
        except Exception as audit_error:  # the store may be what is down; the decision stands
            log.warning("could not audit %s/%s: %s", decision.kind, decision.reason, audit_error)

    # --- async -------------------------------------------------------------------------

    async def arun(self, intent: Intent,
                   execute: Callable[[CallContext], Awaitable[Any]]) -> Decision:
        """The asyncio twin of ``run``; ``execute`` is a coroutine function."""
        started = time.monotonic()
        prepared: Prepared | None = None
        with telemetry.start_call(intent, self.policy.tools) as call:
            try:
                locks, store = self._async_edges()
                prepared = self._traced_prepare(intent, call)
                await await_order(store, prepared, call)
                if not prepared.keys:
                    with bind(context_of(intent, prepared, None)) as ctx, \
                            call.step(telemetry.SPAN_TOOL):
                        result = await execute(ctx)
                    decision = call.decided(accepted(intent, prepared, result, False, {}))
                    await self._aaudit(decision, prepared, started, call)
                    return decision
                body = Body(intent, prepared, call)
                outcome = await arun_fenced(locks, store, prepared.keys,
                                            body.asynchronous(execute), intent=prepared.record,
                                            ttl_ms=prepared.rule.ttl_ms,
                                            timeout_s=prepared.rule.wait_timeout_s)
                return call.decided(body.decision(outcome))
            except BaseException as error:
                if is_control_flow(error):
                    await asyncio.shield(self._arecord_unknown(intent, prepared, error, started,
                                                               call))
                    raise
                if not isinstance(error, Exception):
                    raise
                decision = call.decided(self._refusal(intent, prepared, error))
                if not was_audited(error):
                    await self._aaudit(decision, prepared, started, call)
                _log(decision)
                if isinstance(error, ConfigurationError):
                    raise
                return decision

    async def acall(self, intent: Intent, execute: Callable[[CallContext], Awaitable[Any]]) -> Any:
        return (await self.arun(intent, execute)).raise_for_rejection()

    def _async_edges(self) -> tuple[AsyncLockManager, AsyncGuardedStore]:
        if self.async_locks is None or self.async_store is None:
            msg = ("this ToolGuard has no asyncio lock manager and store: pass async_locks= "
                   "and async_store= (connect_async(), open_async_store()), or run the graph "
                   "with invoke()/run()")
            raise GuardMisconfigured(msg)
        return self.async_locks, self.async_store

    async def _arecord_unknown(self, intent: Intent, prepared: Prepared | None,
                               error: BaseException, started: float,
                               call: telemetry.Call) -> None:
        if prepared is not None:
            call.decided(unknown(intent, prepared, error))
        if self.async_store is None or prepared is None:
            return
        try:
            with call.step(telemetry.SPAN_AUDIT):
                if prepared.record.idempotency_key:
                    await self.async_store.mark_unknown(prepared.record.idempotency_key,
                                                        prepared.record)
                if not was_audited(error):
                    await self.async_store.audit(audit_entry(unknown(intent, prepared, error),
                                                             prepared.record, started))
        except Exception as audit_error:
            log.warning("could not record an interrupted call as unknown: %s", audit_error)

    async def _aaudit(self, decision: Decision, prepared: Prepared | None,
                      started: float, call: telemetry.Call) -> None:
        entry = audit_entry(decision, prepared.record if prepared else None, started)
        try:
            with call.step(telemetry.SPAN_AUDIT):
                if self.async_store is not None:
                    await self.async_store.audit(entry)
                elif self.store is not None:  # a sync-only guard on the async path: still audited
                    await asyncio.to_thread(self.store.audit, entry)
                else:
                    log.warning("no store to audit %s/%s", decision.kind, decision.reason)
        except Exception as audit_error:
            log.warning("could not audit %s/%s: %s", decision.kind, decision.reason, audit_error)


# --- helpers shared by both paths ------------------------------------------------------------


def _unknown_tool_text(policy: Policy, name: str) -> str:
    if policy.defaults.on_unknown_tool == "allow":
        return (f"tool {name!r} is not in the policy, which allows unknown tools: it will run "
                f"without locks or fences, known only through the audit log")
    return (f"tool {name!r} is not in the policy, which denies unknown tools: every call to it "
            f"will be refused (unknown_tool); add it under tools: in the policy")


def _log(decision: Decision) -> None:
    """Failures go to the log with their detail (the model only gets a short text)."""
    if decision.kind != "failed":
        return
    level = logging.ERROR if isinstance(decision.error, ConfigurationError) else logging.WARNING
    log.log(level, "%s %s: %s", storable_text(decision.intent.tool), decision.reason,
            storable_text(decision.message, 2_000))
