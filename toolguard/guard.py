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
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
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
from toolguard.envelope import envelope_problem
from toolguard.errors import (
    ConfigurationError,
    GuardMisconfigured,
    IntentRejected,
    InvalidArguments,
    InvalidIntent,
    OutOfOrder,
    ToolGuardError,
    UnknownToolWarning,
    is_control_flow,
)
from toolguard.intent import Intent, args_hash, bounded_key, check_limits, json_args
from toolguard.locks import AsyncLockManager, LockManager
from toolguard.policies import (
    Policy,
    ToolPolicy,
    authorize,
    check_constraints,
    idempotency_key,
    lock_keys,
    lookup_tool,
    ordering_keys,
    redacted_args,
    strict_model,
    validate_args,
)
from toolguard.policies.redaction import Secrets, scrub, scrub_text, secrets_of
from toolguard.policies.strict import SchemaSource
from toolguard.recording import audit_entry, storable, storable_text
from toolguard.store import AsyncGuardedStore, GuardedStore
from toolguard.store.base import (
    AsyncFencedTransaction,
    FencedTransaction,
    IntentRecord,
    was_audited,
)
from toolguard.store.recovery import Outcome, arun_fenced, run_fenced

__all__ = ["FAILURE_TEMPLATE", "REJECTION_TEMPLATE", "Decision", "DecisionKind", "ToolFailed",
           "ToolGuard"]

log = logging.getLogger("toolguard.guard")

_ORDER_POLL_MIN_S = 0.02
_ORDER_POLL_MAX_S = 0.25

_NO_ID = ("invalid tool call: id: missing; a model's tool call needs an id, or the tool's policy "
          "an idempotency_key template, so that a call sent twice is applied once")


@dataclass(frozen=True, slots=True)
class _Prepared:
    """An intent that passed every pure check: validated args, keys, its record."""

    rule: ToolPolicy
    args: dict[str, Any]
    model: BaseModel | None
    keys: tuple[str, ...]
    record: IntentRecord
    after: tuple[tuple[str, tuple[str, ...]], ...]
    secrets: Secrets


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
        given: object = policy  # untyped callers may pass anything
        if not isinstance(given, Policy):
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

    # --- the pure part -------------------------------------------------------------------

    def _prepare(self, intent: Intent) -> _Prepared:
        problem = envelope_problem(intent)
        if problem is not None:
            raise InvalidIntent(f"invalid tool call: {problem}")
        rule = lookup_tool(self.policy, intent.tool)
        if not intent.call_id and intent.origin == "model" and rule.idempotency_key is None:
            raise InvalidIntent(_NO_ID)
        check_limits(intent.args, rule.limits)
        schema = self._models.get(intent.tool)
        model: BaseModel | None = None
        if schema is not None:
            model = validate_args(schema, intent.args)
            args = json_args(model)
        elif isinstance(intent.args, Mapping):
            args = json_args(intent.args)
        else:
            raise InvalidArguments("args: expected an object of named arguments")
        authorize(rule, intent.agent)
        check_constraints(rule, args)
        keys = () if rule.read_only else lock_keys(rule, args)
        key = idempotency_key(intent, rule, args, key_fn=self.policy.key_fn)
        if key is None:
            if not rule.fenced:
                msg = ("an unfenced tool needs a stable idempotency key (a tool-call id with a "
                       "thread or run id, or an idempotency_key template in its policy)")
                raise IntentRejected(msg, reason="missing_idempotency_key")
            key = bounded_key(f"intent:{intent.id}")  # no stable identity: this call alone
        secrets = secrets_of(rule, args)
        audited = redacted_args(rule, args) if rule.redact else args
        flow = intent.workflow
        record = IntentRecord(
            tool=intent.tool, idempotency_key=key, args_hash=args_hash(args),
            agent=storable_text(intent.agent), workflow=storable_text(flow.thread_id or flow.run_id),
            keys=keys, intent_id=storable_text(intent.call_id or intent.id),
            args=storable(scrub(audited, secrets)), node_attempt=intent.node_attempt)
        after = tuple((earlier, ordering_keys(rule, self.policy.tools[earlier], args))
                      for earlier in rule.after)
        return _Prepared(rule, args, model, keys, record, after, secrets)

    def _context(self, intent: Intent, prepared: _Prepared,
                 tx: FencedTransaction | AsyncFencedTransaction | None) -> CallContext:
        return CallContext(intent=intent, tool=intent.tool, args=prepared.args,
                           model=prepared.model,
                           idempotency_key=prepared.record.idempotency_key or "",
                           keys=prepared.keys, lease=tx.lease if tx is not None else None, tx=tx)

    def _refusal(self, intent: Intent, prepared: _Prepared | None, error: Exception) -> Decision:
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
        prepared: _Prepared | None = None
        with telemetry.start_call(intent, self.policy.tools) as call:
            try:
                locks, store = self._sync_edges()
                prepared = self._traced_prepare(intent, call)
                self._wait_for_order(store, prepared, call)
                if not prepared.keys:
                    return self._run_unlocked(intent, prepared, execute, started, call)
                body = _Body(self, intent, prepared, call)
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

    def _traced_prepare(self, intent: Intent, call: telemetry.Call) -> _Prepared:
        with call.step(telemetry.SPAN_VALIDATE):
            prepared = self._prepare(intent)
        call.prepared(prepared.keys, telemetry.traceable_key(
            prepared.rule, self.policy, prepared.record.idempotency_key))
        return prepared

    def _wait_for_order(self, store: GuardedStore, prepared: _Prepared,
                        call: telemetry.Call) -> None:
        if not prepared.after:
            return
        wait = _OrderWait(prepared, call)
        with call.step(telemetry.SPAN_ORDER_WAIT), wait:
            while (missing := next((c for c in wait.checks() if not store.has_applied(*c)),
                                   None)):
                time.sleep(wait.pause_or_raise(missing))

    def _run_unlocked(self, intent: Intent, prepared: _Prepared,
                      execute: Callable[[CallContext], Any], started: float,
                      call: telemetry.Call) -> Decision:
        with bind(self._context(intent, prepared, None)) as ctx, call.step(telemetry.SPAN_TOOL):
            result = execute(ctx)
        decision = call.decided(_accepted(intent, prepared, result, False, {}))
        self._audit(decision, prepared, started, call)
        return decision

    def _record_unknown(self, intent: Intent, prepared: _Prepared | None, error: BaseException,
                        started: float, call: telemetry.Call) -> None:
        """A cancelled or interrupted call: its outcome is unknown until the key is seen again."""
        if prepared is not None:
            call.decided(_unknown(intent, prepared, error))
        if self.store is None or prepared is None:
            return
        try:
            with call.step(telemetry.SPAN_AUDIT):
                if prepared.record.idempotency_key:
                    self.store.mark_unknown(prepared.record.idempotency_key, prepared.record)
                if not was_audited(error):
                    self.store.audit(audit_entry(_unknown(intent, prepared, error),
                                                 prepared.record, started))
        except Exception as audit_error:  # never hide the interrupt behind a bookkeeping failure
            log.warning("could not record an interrupted call as unknown: %s", audit_error)

    def _audit(self, decision: Decision, prepared: _Prepared | None, started: float,
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
        prepared: _Prepared | None = None
        with telemetry.start_call(intent, self.policy.tools) as call:
            try:
                locks, store = self._async_edges()
                prepared = self._traced_prepare(intent, call)
                await self._await_order(store, prepared, call)
                if not prepared.keys:
                    with bind(self._context(intent, prepared, None)) as ctx, \
                            call.step(telemetry.SPAN_TOOL):
                        result = await execute(ctx)
                    decision = call.decided(_accepted(intent, prepared, result, False, {}))
                    await self._aaudit(decision, prepared, started, call)
                    return decision
                body = _Body(self, intent, prepared, call)
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

    async def _await_order(self, store: AsyncGuardedStore, prepared: _Prepared,
                           call: telemetry.Call) -> None:
        if not prepared.after:
            return
        wait = _OrderWait(prepared, call)
        with call.step(telemetry.SPAN_ORDER_WAIT), wait:
            while True:
                missing = None
                for check in wait.checks():
                    if not await store.has_applied(*check):
                        missing = check
                        break
                if missing is None:
                    return
                await asyncio.sleep(wait.pause_or_raise(missing))

    async def _arecord_unknown(self, intent: Intent, prepared: _Prepared | None,
                               error: BaseException, started: float,
                               call: telemetry.Call) -> None:
        if prepared is not None:
            call.decided(_unknown(intent, prepared, error))
        if self.async_store is None or prepared is None:
            return
        try:
            with call.step(telemetry.SPAN_AUDIT):
                if prepared.record.idempotency_key:
                    await self.async_store.mark_unknown(prepared.record.idempotency_key,
                                                        prepared.record)
                if not was_audited(error):
                    await self.async_store.audit(audit_entry(_unknown(intent, prepared, error),
                                                             prepared.record, started))
        except Exception as audit_error:
            log.warning("could not record an interrupted call as unknown: %s", audit_error)

    async def _aaudit(self, decision: Decision, prepared: _Prepared | None,
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


class _Body:
    """What runs inside the fenced transaction, on either path.

    Binds the call's context, runs the tool, refuses to commit under a lease
    lost meanwhile, and records the result: with the policy's redacted values
    masked for the store (what a replay returns), in clear for the caller.
    """

    __slots__ = ("call", "clear", "guard", "intent", "prepared")

    def __init__(self, guard: ToolGuard, intent: Intent, prepared: _Prepared,
                 call: telemetry.Call) -> None:
        self.guard = guard
        self.intent = intent
        self.prepared = prepared
        self.call = call
        self.clear: Any = None

    def sync(self, execute: Callable[[CallContext], Any]) -> Callable[[FencedTransaction], Any]:
        def body(tx: FencedTransaction) -> Any:
            with bind(self.guard._context(self.intent, self.prepared, tx)) as ctx, \
                    self.call.step(telemetry.SPAN_TOOL):
                try:
                    value = execute(ctx)
                except Exception as error:
                    raise self._masked(error)  # noqa: B904 - the cause is kept on the error itself
            return self._record(tx, value)

        return body

    def asynchronous(self, execute: Callable[[CallContext], Awaitable[Any]]
                     ) -> Callable[[AsyncFencedTransaction], Awaitable[Any]]:
        async def body(tx: AsyncFencedTransaction) -> Any:
            with bind(self.guard._context(self.intent, self.prepared, tx)) as ctx, \
                    self.call.step(telemetry.SPAN_TOOL):
                try:
                    value = await execute(ctx)
                except Exception as error:
                    raise self._masked(error)  # noqa: B904 - the cause is kept on the error itself
            return self._record(tx, value)

        return body

    def _record(self, tx: FencedTransaction | AsyncFencedTransaction, value: Any) -> Any:
        if tx.lease is not None:
            tx.lease.check()
        if not tx.recorded:
            tx.record(value)
        self.clear = tx.result
        secrets = self.prepared.secrets
        if secrets:
            tx.record(scrub(self.clear, secrets))
        return tx.result

    def _masked(self, error: Exception) -> Exception:
        """``error`` with the redacted values out of its text: the store audits ``str(error)``."""
        secrets = self.prepared.secrets
        if not secrets or is_control_flow(error):
            return error
        text = str(error)
        masked = scrub_text(text, secrets)
        if masked == text:
            return error
        if isinstance(error, ToolGuardError):  # keep the type: the flow depends on it
            error.args = (masked, *error.args[1:])
            return error
        wrapped = ToolFailed(f"{type(error).__name__}: {masked}", reason="error")
        wrapped.__cause__ = error
        return wrapped

    def decision(self, outcome: Outcome[Any]) -> Decision:
        result = outcome.value if outcome.replayed else self.clear
        return _accepted(self.intent, self.prepared, result, outcome.replayed, outcome.tokens)


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


class _OrderWait:
    """The bounded wait of an ``after:`` rule: what to check, and how long to pause between looks.

    As a context manager around the wait, it reports a wait that paused at least once
    (``toolguard.order.waits``), satisfied or ended ``out_of_order``.
    """

    def __init__(self, prepared: _Prepared, call: telemetry.Call) -> None:
        self.prepared = prepared
        self.call = call
        self.started = time.monotonic()
        self.deadline = self.started + prepared.rule.after_wait_s
        self.pause = _ORDER_POLL_MIN_S
        self.paused = False

    def __enter__(self) -> _OrderWait:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: object) -> None:
        if self.paused:
            outcome = "satisfied" if error is None else \
                ("out_of_order" if isinstance(error, OutOfOrder) else "error")
            self.call.order_waited(time.monotonic() - self.started, outcome)

    def checks(self) -> Iterator[tuple[str, str]]:
        """``(earlier tool, resource key)`` pairs whose applied record must exist."""
        for earlier, keys in self.prepared.after:
            for key in keys:
                yield earlier, key

    def pause_or_raise(self, missing: tuple[str, str]) -> float:
        """The next pause (doubling up to a cap), or ``OutOfOrder`` once the wait is over."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _out_of_order(self.prepared, missing)
        pause, self.pause = min(self.pause, left), min(self.pause * 2, _ORDER_POLL_MAX_S)
        self.paused = True
        return pause


def _out_of_order(prepared: _Prepared, missing: tuple[str, str]) -> OutOfOrder:
    earlier, key = missing
    msg = (f"{prepared.record.tool} must run after {earlier} on {key}, and no applied "
           f"{earlier} was recorded within {prepared.rule.after_wait_s:g}s")
    return OutOfOrder(msg)


def _accepted(intent: Intent, prepared: _Prepared, result: Any, replayed: bool,
              tokens: Mapping[str, int]) -> Decision:
    return Decision(kind="replayed" if replayed else "accepted",
                    reason="duplicate" if replayed else "applied", intent=intent, result=result,
                    keys=prepared.keys, tokens=dict(tokens),
                    idempotency_key=prepared.record.idempotency_key)


def _unknown(intent: Intent, prepared: _Prepared, error: BaseException) -> Decision:
    reason = "interrupted" if isinstance(error, Exception) else "cancelled"
    return Decision(kind="unknown", reason=reason, intent=intent, message=type(error).__name__,
                    keys=prepared.keys, idempotency_key=prepared.record.idempotency_key)

