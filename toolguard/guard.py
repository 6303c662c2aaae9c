"""The guard: one tool call from untrusted intent to audited, fenced effect.

pause -> envelope, validate, authorize, resolve keys -> approval -> quotas ->
order -> lock -> fenced transaction (fences, dedupe by idempotency key,
execute, record, audit) -> release, every decision audited exactly once with a
stable reason code and the version (digest) of the policy that decided.

Each step lives in its own module under ``toolguard.steps``; this class runs
them in order, reading the policy once per call (a snapshot: a policy swapped
by ``PolicyWatcher`` meanwhile applies from the next call). The deciding
parts are pure and shared by ``run`` and ``arun``; only the I/O edges come in
pairs. Expected rejections come back as a ``Decision``; ``call``/``acall``
raise the typed error instead, for plain Python callers. A
``ConfigurationError`` (the guard or a tool wired wrongly) is audited and then
raised: the developer has to fix it, no model can. Cancellation and LangGraph
interrupts release the locks, record the outcome as unknown (reconciled by the
idempotency key on the next attempt) and propagate; the interrupt that pauses
a call for a person's approval is neither: nothing ran.
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

from toolguard.call.context import CallContext, bind
from toolguard.call.decision import (
    FAILURE_TEMPLATE,
    REJECTION_TEMPLATE,
    Decision,
    DecisionKind,
    ToolFailed,
    refusal,
)
from toolguard.call.intent import Intent
from toolguard.call.recording import audit_entry, storable_text
from toolguard.controls.approvals import ApprovalBook, Approved, AsyncApprovalBook
from toolguard.controls.quotas import AsyncQuotaBackend, QuotaBackend
from toolguard.controls.shadow import Enforcement
from toolguard.errors import (
    ApprovalRequired,
    ConfigurationError,
    GuardMisconfigured,
    UnknownToolWarning,
    is_control_flow,
)
from toolguard.locks import AsyncLockManager, LockManager
from toolguard.policies import Policy, strict_model
from toolguard.policies.redaction import scrub_text
from toolguard.policies.reload import PolicyWatcher
from toolguard.policies.strict import SchemaSource
from toolguard.runtime import telemetry
from toolguard.runtime.cancellation import finish
from toolguard.steps.approval import Interrupt, aapprove, approve, is_pending
from toolguard.steps.controls import Controls
from toolguard.steps.execute import Body, context_of
from toolguard.steps.holds import Holds, caller_for
from toolguard.steps.order import await_order, wait_for_order
from toolguard.steps.pause import acheck_pause, check_pause
from toolguard.steps.prepared import Prepared, accepted, unknown, unvalidated_unknown
from toolguard.steps.quota import aadmit, admit, aheld, held
from toolguard.steps.reads import aread, read, read_check, shadow_row
from toolguard.steps.schema import SchemaCheck
from toolguard.steps.shadow import ShadowRow
from toolguard.steps.validate import facts_of, prepare
from toolguard.steps.wiring import check_slot
from toolguard.store import AsyncGuardedStore, GuardedStore
from toolguard.store.base import AuditEntry, mark_audited, was_audited
from toolguard.store.policy_versions import PolicyRecorder
from toolguard.store.recovery import arun_fenced, run_fenced

__all__ = ["FAILURE_TEMPLATE", "REJECTION_TEMPLATE", "Decision", "DecisionKind", "ToolFailed",
           "ToolGuard"]

log = logging.getLogger("toolguard.guard")


class _Call:
    """One call's state across the steps: its policy snapshot, mode, facts so far."""

    __slots__ = ("decided", "enforcement", "intent", "policy", "prepared", "shadow", "started")

    def __init__(self, intent: Intent, policy: Policy) -> None:
        self.intent = intent
        self.policy = policy
        self.started = time.monotonic()
        self.enforcement = Enforcement("enforce")
        self.shadow = ShadowRow(self.enforcement)
        self.prepared: Prepared | None = None
        #: The call's decision row is written (a cancellation after it adds no other row).
        self.decided = False

    def entry(self, decision: Decision) -> AuditEntry:
        record = self.prepared.record if self.prepared is not None else None
        return audit_entry(decision, record, self.started, policy_version=self.policy.digest)

    def shadow_entry(self) -> AuditEntry | None:
        return self.shadow.entry(self.intent, self.prepared, self.started, self.policy.digest)


class ToolGuard:
    """Runs tool calls through a policy, fenced locks and the guarded store.

    Give it a sync pair (``locks=``, ``store=``) for ``run``, an asyncio pair
    (``async_locks=``, ``async_store=``) for ``arun``, or both; a path without
    its pair raises ``GuardMisconfigured`` at its first call, and an object in
    the other face's slot (``connect_async()`` as ``locks=``...) at once.

    ``policy`` is a ``Policy``, or a ``PolicyWatcher`` whose current policy
    each call reads once (hot reload). The production controls run on the
    guard's stores: the kill switch (``pauses``, read at most every
    ``pause_cache_s``), approval requests (``approvals=`` / ``async_approvals=``
    to pass your own book) and quotas (on the store's server, or ``quotas=`` /
    ``async_quotas=``: a backend or a Redis URL).

    >>> guard = ToolGuard(load_policy("policy.yml"), locks=connect(), store=open_store())
    >>> decision = guard.run(intent, lambda ctx: update_lead(ctx.tx, **ctx.args))
    """

    def __init__(
        self,
        policy: Policy | PolicyWatcher,
        *,
        locks: LockManager | None = None,
        store: GuardedStore | None = None,
        async_locks: AsyncLockManager | None = None,
        async_store: AsyncGuardedStore | None = None,
        schemas: Mapping[str, SchemaSource] | None = None,
        quotas: QuotaBackend | str | None = None,
        async_quotas: AsyncQuotaBackend | str | None = None,
        pauses: bool = True,
        pause_cache_s: float = 1.0,
        approvals: ApprovalBook | None = None,
        async_approvals: AsyncApprovalBook | None = None,
    ) -> None:
        given: object = policy  # checked at run time: the caller may not use a type checker
        if not isinstance(given, Policy | PolicyWatcher):
            msg = (f"ToolGuard needs a Policy (load_policy(...) or Policy.from_dict(...)) or a "
                   f"PolicyWatcher, got {type(given).__name__}")
            raise GuardMisconfigured(msg)
        for name, value in (("locks", locks), ("store", store), ("async_locks", async_locks),
                            ("async_store", async_store), ("quotas", quotas),
                            ("async_quotas", async_quotas), ("approvals", approvals),
                            ("async_approvals", async_approvals)):
            check_slot(name, value)  # a sync object in an asyncio slot, or the reverse
        for sync, edge, names in ((locks, store, "locks= and store="),
                                  (async_locks, async_store, "async_locks= and async_store=")):
            if (sync is None) != (edge is None):
                msg = f"pass {names} together: a guarded call needs both"
                raise GuardMisconfigured(msg)
        if locks is None and async_locks is None:
            msg = ("a ToolGuard needs locks= and store= (sync path), async_locks= and "
                   "async_store= (asyncio path), or both")
            raise GuardMisconfigured(msg)
        self._watcher = policy if isinstance(policy, PolicyWatcher) else None
        self._policy = policy if isinstance(policy, Policy) else policy.current
        self.locks = locks
        self.store = store
        self.async_locks = async_locks
        self.async_store = async_store
        self._models: dict[str, type[BaseModel]] = {}
        self._schema = SchemaCheck()
        #: Writes each policy version's text to the store once, before its first decision.
        self._versions = PolicyRecorder()
        #: Locks kept by ``hold: true`` reads for their callers (``toolguard.steps.holds``).
        self.holds = Holds()
        self.controls = Controls.build(
            self._policy, store=store, async_store=async_store, quotas=quotas,
            async_quotas=async_quotas, pauses=pauses, pause_cache_s=pause_cache_s,
            approvals=approvals, async_approvals=async_approvals)
        if self._watcher is not None and self._watcher.schemas is None:
            self._watcher.schemas = lambda: dict(self._models)  # reloads are checked against them
        for name, source in (schemas or {}).items():
            self.register(name, source, stacklevel=3)

    # The edges may be set after construction too (an app opening its asyncio pair in its
    # event loop); each assignment is checked as the constructor's arguments are.

    @property
    def locks(self) -> LockManager | None:
        return self._locks

    @locks.setter
    def locks(self, value: LockManager | None) -> None:
        check_slot("locks", value)
        self._locks = value

    @property
    def store(self) -> GuardedStore | None:
        return self._store

    @store.setter
    def store(self, value: GuardedStore | None) -> None:
        check_slot("store", value)
        self._store = value

    @property
    def async_locks(self) -> AsyncLockManager | None:
        return self._async_locks

    @async_locks.setter
    def async_locks(self, value: AsyncLockManager | None) -> None:
        check_slot("async_locks", value)
        self._async_locks = value

    @property
    def async_store(self) -> AsyncGuardedStore | None:
        return self._async_store

    @async_store.setter
    def async_store(self, value: AsyncGuardedStore | None) -> None:
        check_slot("async_store", value)
        self._async_store = value

    @property
    def policy(self) -> Policy:
        """The policy in force: the watcher's current one, else the one given."""
        return self._watcher.current if self._watcher is not None else self._policy

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
        policy = self.policy
        if name in policy.tools:
            policy.check_against({name: model})
        else:
            warnings.warn(_unknown_tool_text(policy, name), UnknownToolWarning,
                          stacklevel=stacklevel)
        self._models[name] = model
        return model

    def has_schema(self, name: str) -> bool:
        return name in self._models

    # --- holds -------------------------------------------------------------------------

    @staticmethod
    def caller(agent: str, thread: str | None = None) -> str | None:
        """The caller (``agent`` in conversation ``thread``) whose reads and holds are one."""
        return caller_for(agent, thread)

    def release_holds(self, caller: str | None) -> int:
        """End every hold ``caller`` keeps (``hold: true`` reads); the number ended."""
        return self.holds.release(caller)

    async def arelease_holds(self, caller: str | None) -> int:
        """The asyncio twin of ``release_holds``."""
        return await self.holds.arelease(caller)

    def _refusal(self, state: _Call, error: Exception) -> Decision:
        prepared = state.prepared
        if prepared is None:
            return refusal(state.intent, error)
        decision = refusal(state.intent, error, keys=prepared.keys,
                           idempotency_key=prepared.record.idempotency_key)
        if prepared.secrets:
            decision = dataclasses.replace(
                decision, message=scrub_text(decision.message, prepared.secrets))
        return decision

    def _traced_prepare(self, state: _Call, call: telemetry.Call,
                        intent: Intent | None = None) -> Prepared:
        with call.step(telemetry.SPAN_VALIDATE):
            prepared = prepare(intent or state.intent, state.policy, self._models,
                               state.enforcement)
        call.prepared(prepared.keys, telemetry.traceable_key(
            prepared.rule, state.policy, prepared.record.idempotency_key))
        return prepared

    def _edited(self, state: _Call, approved: Approved | None, call: telemetry.Call) -> Prepared:
        """The call to run: as asked, or as a person edited it (validated again, from the top)."""
        assert state.prepared is not None
        if approved is None or not approved.edited:
            return state.prepared
        edited = state.intent.model_copy(update={"args": approved.args(state.prepared.args)})
        prepared = self._traced_prepare(state, call, edited)
        names = approved.record.edited_args or {}
        return dataclasses.replace(prepared, edited={k: prepared.args[k] for k in names
                                                     if k in prepared.args})

    # --- sync ---------------------------------------------------------------------------

    def run(self, intent: Intent, execute: Callable[[CallContext], Any], *,
            interrupt: Interrupt | None = None) -> Decision:
        """Guard one call; ``execute(ctx)`` performs the effect (inside the fenced transaction).

        Never raises for anything the call brings: every refusal and failure is
        a ``Decision``, audited once. Raises ``ConfigurationError`` (after
        auditing it) when the guard or the tool is wired wrongly, and lets
        cancellation and LangGraph interrupts through. ``interrupt`` (LangGraph's,
        passed by the adapters) asks a person when the call needs approval;
        without it such a call is refused ``approval_required``.
        """
        state = _Call(intent, self.policy)
        with telemetry.start_call(intent, state.policy.tools) as call:
            try:
                locks, store = self._sync_edges()
                self._schema.check(store)
                self._versions.record(store, state.policy)
                check_pause(self.controls.pauses, intent)
                state.prepared = proposed = self._traced_prepare(state, call)
                facts = facts_of(intent, proposed)
                approved = approve(
                    self.controls.approvals, proposed, facts, state.enforcement,
                    call_id=intent.call_id, interrupt=interrupt,
                    on_request=lambda asked: self._asked(state, asked, call))
                state.prepared = prepared = self._edited(state, approved, call)
                if prepared is not proposed:  # a person edited the arguments
                    facts = facts_of(intent, prepared)
                admission = admit(self.controls.quotas, prepared, facts, state.enforcement,
                                  store=store)
                self._audit_entry(state.shadow_entry(), call)
                with held(admission) as done:
                    decision = self._execute(state, prepared, execute, call, locks, store)
                    done.applied = decision.ok
                return decision
            except BaseException as error:
                if is_pending(error):  # paused for a person: audited when asked, nothing ran
                    call.decided(self._refusal(state, _pending()))
                    raise
                if is_control_flow(error):
                    self.holds.drop(state.prepared)  # a cancelled read keeps no hold
                    self._record_unknown(state, error, call)
                    raise
                if not isinstance(error, Exception):
                    raise
                decision = call.decided(self._refusal(state, error))
                self._audit_entry(state.shadow_entry(), call)
                if not was_audited(error):
                    self._audit(decision, state, call)
                _log(decision)
                if isinstance(error, ConfigurationError):
                    raise
                return decision

    def call(self, intent: Intent, execute: Callable[[CallContext], Any], *,
             interrupt: Interrupt | None = None) -> Any:
        """Like ``run``, but return the result or raise the typed error (``ApprovalRequired``...)."""
        return self.run(intent, execute, interrupt=interrupt).raise_for_rejection()

    def _sync_edges(self) -> tuple[LockManager, GuardedStore]:
        if self.locks is None or self.store is None:
            msg = ("this ToolGuard has no sync lock manager and store: pass locks= and store=, "
                   "or run the graph with ainvoke()/arun()")
            raise GuardMisconfigured(msg)
        self.controls = self.controls.follow(self.policy, self.store, self.async_store)
        return self.locks, self.store

    def _execute(self, state: _Call, prepared: Prepared, execute: Callable[[CallContext], Any],
                 call: telemetry.Call, locks: LockManager, store: GuardedStore) -> Decision:
        intent = state.intent
        wait_for_order(store, prepared, call)
        if prepared.reads:  # its row is written with its observation, in the read's transaction
            if prepared.rule.hold:
                return call.decided(self.holds.read(
                    locks, store, prepared,
                    lambda note: read(store, intent, prepared, execute, call, note)))
            return call.decided(read(store, intent, prepared, execute, call))
        if not prepared.keys:
            with bind(context_of(intent, prepared, None)) as ctx, call.step(telemetry.SPAN_TOOL):
                result = execute(ctx)
            decision = call.decided(accepted(intent, prepared, result, False, {}))
            self._audit(decision, state, call)
            return decision
        body = Body(intent, prepared, call)
        held = self.holds.write(locks, store, prepared)  # under its caller's holds, if any
        try:
            work = body.sync(execute) if held is None else held.sync(body.sync(execute))
            outcome = run_fenced(locks, store, prepared.keys, work,
                                 intent=prepared.record, ttl_ms=prepared.rule.ttl_ms,
                                 timeout_s=prepared.rule.wait_timeout_s,
                                 reads=read_check(state.policy, prepared,
                                                  state.enforcement.shadow),
                                 held=held.lease if held is not None else None)
        finally:
            self.holds.written(held)
        decision = call.decided(body.decision(outcome))
        if body.would_refuse is not None:
            self._audit_entry(shadow_row(state.entry(decision), body.would_refuse), call)
        return decision

    def _asked(self, state: _Call, asked: ApprovalRequired, call: telemetry.Call) -> None:
        """A request for approval was made: its row (the call waits, as ``approval_required``)."""
        self._audit(self._refusal(state, asked), state, call)

    def _record_unknown(self, state: _Call, error: BaseException, call: telemetry.Call) -> None:
        """A cancelled or interrupted call: its outcome is unknown until the key is seen again."""
        prepared = state.prepared
        if prepared is not None:
            call.decided(unknown(state.intent, prepared, error))
        if self.store is None or prepared is None:
            return
        try:
            with call.step(telemetry.SPAN_AUDIT):
                if prepared.record.idempotency_key and not prepared.reads:  # a read keeps none
                    self.store.mark_unknown(prepared.record.idempotency_key, prepared.record)
                if not was_audited(error):
                    self.store.audit(state.entry(unknown(state.intent, prepared, error)))
        except Exception as audit_error:  # never hide the interrupt behind a bookkeeping failure
            log.warning("could not record an interrupted call as unknown: %s", audit_error)

    def _audit(self, decision: Decision, state: _Call, call: telemetry.Call) -> None:
        if self.store is None:
            log.warning("no sync store to audit %s/%s", decision.kind, decision.reason)
            return
        self._audit_entry(state.entry(decision), call)

    def _audit_entry(self, entry: AuditEntry | None, call: telemetry.Call) -> None:
        if entry is None or self.store is None:
            return
        try:
            with call.step(telemetry.SPAN_AUDIT):
                self.store.audit(entry)
        except Exception as audit_error:  # the store may be what is down; the decision stands
            log.warning("could not audit %s/%s: %s", entry.decision, entry.reason, audit_error)

    # --- async -------------------------------------------------------------------------

    async def arun(self, intent: Intent, execute: Callable[[CallContext], Awaitable[Any]], *,
                   interrupt: Interrupt | None = None) -> Decision:
        """The asyncio twin of ``run``; ``execute`` is a coroutine function."""
        state = _Call(intent, self.policy)
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0

        def swallowed() -> None:
            """A cancellation a library returned through (``asyncio.wait_for`` before 3.12
            returns a result that arrived as the task was cancelled) is raised here, at the
            next step, rather than lost: the caller gave up on this call."""
            if task is not None and task.cancelling() > cancels:
                raise asyncio.CancelledError

        with telemetry.start_call(intent, state.policy.tools) as call:
            try:
                locks, store = self._async_edges()
                await self._schema.acheck(store)
                await self._versions.arecord(store, state.policy)
                await acheck_pause(self.controls.async_pauses, intent)
                swallowed()
                state.prepared = proposed = self._traced_prepare(state, call)

                async def asked(request: ApprovalRequired) -> None:
                    await self._aaudit(self._refusal(state, request), state, call)

                facts = facts_of(intent, proposed)
                approved = await aapprove(
                    self.controls.async_approvals, proposed, facts, state.enforcement,
                    call_id=intent.call_id, interrupt=interrupt, on_request=asked)
                swallowed()
                state.prepared = prepared = self._edited(state, approved, call)
                if prepared is not proposed:  # a person edited the arguments
                    facts = facts_of(intent, prepared)
                admission = await aadmit(self.controls.async_quotas, prepared, facts,
                                         state.enforcement, store=store)
                await self._aaudit_entry(state.shadow_entry(), call)
                async with aheld(admission) as done:
                    swallowed()  # inside: the admission is finished either way
                    decision = await self._aexecute(state, prepared, execute, call, locks, store)
                    state.decided = True
                    done.applied = decision.ok
                return decision
            except BaseException as error:
                if is_pending(error):
                    call.decided(self._refusal(state, _pending()))
                    raise
                if is_control_flow(error):
                    if state.decided:  # cancelled after its row was written: that row stands
                        mark_audited(error)
                    if self.holds.taken_by(state.prepared):  # a cancelled read keeps no hold
                        await finish(self.holds.adrop(state.prepared))
                    await finish(self._arecord_unknown(state, error, call))
                    raise
                if not isinstance(error, Exception):
                    raise
                decision = call.decided(self._refusal(state, error))
                await self._aaudit_entry(state.shadow_entry(), call)
                if not was_audited(error):
                    await self._aaudit(decision, state, call)
                _log(decision)
                if isinstance(error, ConfigurationError):
                    raise
                return decision

    async def acall(self, intent: Intent, execute: Callable[[CallContext], Awaitable[Any]], *,
                    interrupt: Interrupt | None = None) -> Any:
        return (await self.arun(intent, execute, interrupt=interrupt)).raise_for_rejection()

    def _async_edges(self) -> tuple[AsyncLockManager, AsyncGuardedStore]:
        if self.async_locks is None or self.async_store is None:
            msg = ("this ToolGuard has no asyncio lock manager and store: pass async_locks= "
                   "and async_store= (connect_async(), open_async_store()), or run the graph "
                   "with invoke()/run()")
            raise GuardMisconfigured(msg)
        self.controls = self.controls.follow(self.policy, self.store, self.async_store)
        return self.async_locks, self.async_store

    async def _aexecute(self, state: _Call, prepared: Prepared,
                        execute: Callable[[CallContext], Awaitable[Any]], call: telemetry.Call,
                        locks: AsyncLockManager, store: AsyncGuardedStore) -> Decision:
        intent = state.intent
        await await_order(store, prepared, call)
        if prepared.reads:  # its row is written with its observation, in the read's transaction
            if prepared.rule.hold:
                decision = call.decided(await self.holds.aread(
                    locks, store, prepared,
                    lambda note: aread(store, intent, prepared, execute, call, note)))
            else:
                decision = call.decided(await aread(store, intent, prepared, execute, call))
            state.decided = True
            return decision
        if not prepared.keys:
            with bind(context_of(intent, prepared, None)) as ctx, call.step(telemetry.SPAN_TOOL):
                result = await execute(ctx)
            decision = call.decided(accepted(intent, prepared, result, False, {}))
            await self._aaudit(decision, state, call)
            return decision
        body = Body(intent, prepared, call)
        held = await self.holds.awrite(locks, store, prepared)
        outcome = None
        try:
            awork = body.asynchronous(execute)
            outcome = await arun_fenced(locks, store, prepared.keys,
                                        awork if held is None else held.asynchronous(awork),
                                        intent=prepared.record, ttl_ms=prepared.rule.ttl_ms,
                                        timeout_s=prepared.rule.wait_timeout_s,
                                        reads=read_check(state.policy, prepared,
                                                         state.enforcement.shadow),
                                        held=held.lease if held is not None else None)
        finally:
            if held is not None:
                try:
                    await finish(self.holds.awritten(held))
                except asyncio.CancelledError as cancelled:
                    if outcome is not None:  # committed: its row stands
                        state.decided = True
                        mark_audited(cancelled)
                    raise
        decision = call.decided(body.decision(outcome))
        if body.would_refuse is not None:
            state.decided = True  # the call's own row is written (the commit wrote it)
            await self._aaudit_entry(shadow_row(state.entry(decision), body.would_refuse), call)
        return decision

    async def _arecord_unknown(self, state: _Call, error: BaseException,
                               call: telemetry.Call) -> None:
        """As ``_record_unknown``; a call cancelled before it was validated is audited too
        (unknown, cancelled: nothing of it ran), so every call leaves its one row."""
        prepared = state.prepared
        decision = (unknown(state.intent, prepared, error) if prepared is not None
                    else unvalidated_unknown(state.intent, error))
        call.decided(decision)
        if self.async_store is None:
            return
        try:
            with call.step(telemetry.SPAN_AUDIT):
                if prepared is not None and prepared.record.idempotency_key \
                        and not prepared.reads:  # a read keeps no intent row
                    await self.async_store.mark_unknown(prepared.record.idempotency_key,
                                                        prepared.record)
                if not was_audited(error):
                    await self.async_store.audit(state.entry(decision))
        except Exception as audit_error:
            log.warning("could not record an interrupted call as unknown: %s", audit_error)

    async def _aaudit(self, decision: Decision, state: _Call, call: telemetry.Call) -> None:
        """The decision's row; a cancellation meanwhile does not stop it (the row is the
        call's one row, so it is noted on the cancellation, and no ``unknown`` row follows)."""
        try:
            await finish(self._aaudit_entry(state.entry(decision), call))
        except asyncio.CancelledError as cancelled:
            state.decided = True
            mark_audited(cancelled)
            raise
        state.decided = True

    async def _aaudit_entry(self, entry: AuditEntry | None, call: telemetry.Call) -> None:
        if entry is None:
            return
        try:
            with call.step(telemetry.SPAN_AUDIT):
                if self.async_store is not None:
                    await self.async_store.audit(entry)
                elif self.store is not None:  # a sync-only guard on the async path: still audited
                    await asyncio.to_thread(self.store.audit, entry)
                else:
                    log.warning("no store to audit %s/%s", entry.decision, entry.reason)
        except Exception as audit_error:
            log.warning("could not audit %s/%s: %s", entry.decision, entry.reason, audit_error)


# --- helpers shared by both paths ------------------------------------------------------------


def _pending() -> ApprovalRequired:
    """The refusal a call paused for approval stands for (telemetry's view of it)."""
    return ApprovalRequired("waiting for a person's approval", approval_id="pending")


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
