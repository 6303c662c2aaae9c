"""The guard: one tool call from untrusted intent to audited, fenced effect.

validate -> authorize -> resolve keys -> order -> lock -> fenced transaction
(fences, dedupe by idempotency key, execute, record, audit) -> release, every
decision audited with a stable reason code.

The deciding steps (``_prepare``) are pure and shared by ``run`` and ``arun``;
only the I/O edges (ordering wait, lock + fenced transaction) come in pairs.
Expected rejections come back as a ``Decision``; ``call``/``acall`` raise the
typed error instead, for plain Python callers. Cancellation and LangGraph
interrupts release the locks, record the outcome as unknown (reconciled by the
idempotency key on the next attempt) and propagate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from toolguard.context import CallContext, bind, current
from toolguard.errors import (
    BackendUnavailable,
    IntentRejected,
    InvalidArguments,
    LockError,
    OutOfOrder,
    StoreError,
    ToolGuardError,
    is_control_flow,
)
from toolguard.intent import Intent, args_hash, check_limits, json_args
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
from toolguard.policies.strict import SchemaSource
from toolguard.store import AsyncGuardedStore, GuardedStore
from toolguard.store.base import AuditEntry, IntentRecord, was_audited
from toolguard.store.recovery import arun_fenced, run_fenced

__all__ = ["Decision", "DecisionKind", "ToolFailed", "ToolGuard"]

log = logging.getLogger("toolguard.guard")

DecisionKind = Literal["accepted", "replayed", "rejected", "failed", "unknown"]

#: What the model reads when the guard refused its call (module constant: one wording).
REJECTION_TEMPLATE = "rejected by toolguard ({reason}): {message}"

_ORDER_POLL_MIN_S = 0.02
_ORDER_POLL_MAX_S = 0.25


class ToolFailed(ToolGuardError):
    """The tool itself reported an error; its transaction was rolled back."""

    reason = "tool_error"


@dataclass(frozen=True, slots=True)
class Decision:
    """What the guard did with one intent."""

    kind: DecisionKind
    reason: str
    intent: Intent
    result: Any = None
    message: str = ""
    keys: tuple[str, ...] = ()
    tokens: Mapping[str, int] = field(default_factory=dict)
    idempotency_key: str | None = None
    error: ToolGuardError | None = None

    @property
    def ok(self) -> bool:
        return self.kind in ("accepted", "replayed")

    def model_text(self) -> str:
        """The text a model reads for a refused or failed call."""
        return REJECTION_TEMPLATE.format(reason=self.reason, message=self.message)

    def raise_for_rejection(self) -> Any:
        """Return the result, or raise the typed error (for plain Python callers)."""
        if self.ok:
            return self.result
        assert self.error is not None
        raise self.error


@dataclass(frozen=True, slots=True)
class _Prepared:
    """An intent that passed every pure check: validated args, keys, its record."""

    rule: ToolPolicy
    args: dict[str, Any]
    model: BaseModel | None
    keys: tuple[str, ...]
    record: IntentRecord
    after: tuple[tuple[str, tuple[str, ...]], ...]


class ToolGuard:
    """Runs tool calls through a policy, fenced locks and the guarded store.

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
        self.policy = policy
        self.locks = locks
        self.store = store
        self.async_locks = async_locks
        self.async_store = async_store
        self._models: dict[str, type[BaseModel]] = {}
        for name, source in (schemas or {}).items():
            self.register(name, source)

    # --- tools -------------------------------------------------------------------------

    def register(self, name: str, source: SchemaSource) -> type[BaseModel]:
        """Validate ``name``'s arguments with a strict model derived from ``source``.

        Checks the policy against the schema (template fields that are not
        arguments, constraints of the wrong kind...) and raises
        ``PolicyProblems`` naming file and line.
        """
        model = strict_model(source, name=name)
        if name in self.policy.tools:
            self.policy.check_against({name: model})
        self._models[name] = model
        return model

    def has_schema(self, name: str) -> bool:
        return name in self._models

    # --- the pure part -------------------------------------------------------------------

    def _prepare(self, intent: Intent) -> _Prepared:
        rule = lookup_tool(self.policy, intent.tool)
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
            key = f"intent:{intent.id}"  # no stable identity: this call alone, no replay
        record = IntentRecord(
            tool=intent.tool, idempotency_key=key, args_hash=args_hash(args),
            agent=_text(intent.agent), workflow=_workflow(intent), keys=keys,
            intent_id=_text(intent.call_id or intent.id),
            args=_storable(redacted_args(rule, args) if rule.redact else args),
            node_attempt=intent.node_attempt)
        after = tuple((earlier, ordering_keys(rule, self.policy.tools[earlier], args))
                      for earlier in rule.after)
        return _Prepared(rule, args, model, keys, record, after)

    def _context(self, intent: Intent, prepared: _Prepared, tx: Any, lease: Any) -> CallContext:
        return CallContext(intent=intent, tool=intent.tool, args=prepared.args, model=prepared.model,
                           idempotency_key=prepared.record.idempotency_key or "",
                           keys=prepared.keys, lease=lease, tx=tx)

    # --- sync ---------------------------------------------------------------------------

    def run(self, intent: Intent, execute: Callable[[CallContext], Any]) -> Decision:
        """Guard one call; ``execute(ctx)`` performs the effect (inside the fenced transaction)."""
        started = time.monotonic()
        prepared: _Prepared | None = None
        try:
            prepared = self._prepare(intent)
            self._wait_for_order(prepared)
            if not prepared.keys:
                return self._run_unlocked(intent, prepared, execute, started)
            locks, store = self._sync_edges()

            def body(tx: Any) -> Any:
                with bind(self._context(intent, prepared, tx, tx.lease)):
                    return execute(current())

            outcome = run_fenced(locks, store, prepared.keys, _with_lease(body),
                                 intent=prepared.record, ttl_ms=prepared.rule.ttl_ms,
                                 timeout_s=prepared.rule.wait_timeout_s)
            return _accepted(intent, prepared, outcome.value, outcome.replayed, outcome.tokens)
        except BaseException as error:
            if is_control_flow(error):
                self._record_unknown(intent, prepared, error, started)
                raise
            if not isinstance(error, Exception):
                raise
            decision = _refusal(intent, prepared, error)
            if not was_audited(error):
                self._audit(decision, prepared, started)
            return decision

    def call(self, intent: Intent, execute: Callable[[CallContext], Any]) -> Any:
        """Like ``run``, but return the result or raise the typed error."""
        return self.run(intent, execute).raise_for_rejection()

    def _sync_edges(self) -> tuple[LockManager, GuardedStore]:
        if self.locks is None or self.store is None:
            msg = "this ToolGuard has no sync lock manager and store (pass locks= and store=)"
            raise ToolGuardError(msg, reason="configuration")
        return self.locks, self.store

    def _wait_for_order(self, prepared: _Prepared) -> None:
        if not prepared.after:
            return
        _, store = self._sync_edges()
        wait = _OrderWait(prepared)
        while (missing := next((c for c in wait.checks() if not store.has_applied(*c)), None)):
            time.sleep(wait.pause_or_raise(missing))

    def _run_unlocked(self, intent: Intent, prepared: _Prepared,
                      execute: Callable[[CallContext], Any], started: float) -> Decision:
        with bind(self._context(intent, prepared, None, None)) as ctx:
            result = execute(ctx)
        decision = _accepted(intent, prepared, result, False, {})
        self._audit(decision, prepared, started)
        return decision

    def _record_unknown(self, intent: Intent, prepared: _Prepared | None, error: BaseException,
                        started: float) -> None:
        """A cancelled or interrupted call: its outcome is unknown until the key is seen again."""
        if self.store is None or prepared is None:
            return
        try:
            if prepared.record.idempotency_key:
                self.store.mark_unknown(prepared.record.idempotency_key, prepared.record)
            if not was_audited(error):
                self.store.audit(_entry(_unknown(intent, prepared, error), prepared, started))
        except Exception as audit_error:  # never hide the interrupt behind a bookkeeping failure
            log.warning("could not record an interrupted call as unknown: %s", audit_error)

    def _audit(self, decision: Decision, prepared: _Prepared | None, started: float) -> None:
        if self.store is None:
            return
        try:
            self.store.audit(_entry(decision, prepared, started))
        except Exception as audit_error:  # the store may be what is down; the decision stands
            log.warning("could not audit %s/%s: %s", decision.kind, decision.reason, audit_error)

    # --- async -------------------------------------------------------------------------

    async def arun(self, intent: Intent,
                   execute: Callable[[CallContext], Awaitable[Any]]) -> Decision:
        """The asyncio twin of ``run``; ``execute`` is a coroutine function."""
        started = time.monotonic()
        prepared: _Prepared | None = None
        try:
            prepared = self._prepare(intent)
            await self._await_order(prepared)
            if not prepared.keys:
                with bind(self._context(intent, prepared, None, None)) as ctx:
                    result = await execute(ctx)
                decision = _accepted(intent, prepared, result, False, {})
                await self._aaudit(decision, prepared, started)
                return decision
            locks, store = self._async_edges()

            async def body(tx: Any) -> Any:
                with bind(self._context(intent, prepared, tx, tx.lease)):
                    return await execute(current())

            outcome = await arun_fenced(locks, store, prepared.keys, _with_lease_async(body),
                                        intent=prepared.record, ttl_ms=prepared.rule.ttl_ms,
                                        timeout_s=prepared.rule.wait_timeout_s)
            return _accepted(intent, prepared, outcome.value, outcome.replayed, outcome.tokens)
        except BaseException as error:
            if is_control_flow(error):
                await asyncio.shield(self._arecord_unknown(intent, prepared, error, started))
                raise
            if not isinstance(error, Exception):
                raise
            decision = _refusal(intent, prepared, error)
            if not was_audited(error):
                await self._aaudit(decision, prepared, started)
            return decision

    async def acall(self, intent: Intent, execute: Callable[[CallContext], Awaitable[Any]]) -> Any:
        return (await self.arun(intent, execute)).raise_for_rejection()

    def _async_edges(self) -> tuple[AsyncLockManager, AsyncGuardedStore]:
        if self.async_locks is None or self.async_store is None:
            msg = ("this ToolGuard has no asyncio lock manager and store "
                   "(pass async_locks= and async_store=)")
            raise ToolGuardError(msg, reason="configuration")
        return self.async_locks, self.async_store

    async def _await_order(self, prepared: _Prepared) -> None:
        if not prepared.after:
            return
        _, store = self._async_edges()
        wait = _OrderWait(prepared)
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
                               error: BaseException, started: float) -> None:
        if self.async_store is None or prepared is None:
            return
        try:
            if prepared.record.idempotency_key:
                await self.async_store.mark_unknown(prepared.record.idempotency_key,
                                                    prepared.record)
            if not was_audited(error):
                await self.async_store.audit(_entry(_unknown(intent, prepared, error), prepared,
                                                    started))
        except Exception as audit_error:
            log.warning("could not record an interrupted call as unknown: %s", audit_error)

    async def _aaudit(self, decision: Decision, prepared: _Prepared | None,
                      started: float) -> None:
        if self.async_store is None:
            return
        try:
            await self.async_store.audit(_entry(decision, prepared, started))
        except Exception as audit_error:
            log.warning("could not audit %s/%s: %s", decision.kind, decision.reason, audit_error)


# --- helpers shared by both paths ------------------------------------------------------------


def _with_lease(body: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Refuse to commit under a lease that was lost while the tool ran."""

    def wrapped(tx: Any) -> Any:
        result = body(tx)
        if tx.lease is not None:
            tx.lease.check()
        return result

    return wrapped


def _with_lease_async(body: Callable[[Any], Awaitable[Any]]) -> Callable[[Any], Awaitable[Any]]:
    async def wrapped(tx: Any) -> Any:
        result = await body(tx)
        if tx.lease is not None:
            tx.lease.check()
        return result

    return wrapped


def _workflow(intent: Intent) -> str | None:
    flow = intent.workflow
    return _text(flow.thread_id or flow.run_id)


def _text(value: str | None, limit: int = 200) -> str | None:
    """Untrusted text as every store can keep it (see ``_clean``), bounded; None stays None."""
    return None if value is None else _clean(value[:limit])


def _clean(text: str) -> str:
    """``text`` without NUL and lone surrogates (each becomes U+FFFD).

    PostgreSQL refuses NUL in ``text`` and ``\\u0000`` in ``jsonb``, and UTF-8
    has no lone surrogates: an audit row holding one could not be written, and
    the call would go unaudited. Only what the audit log keeps is cleaned; the
    tool, the lock keys and the args hash see the validated values unchanged.
    """
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    if not text.isascii():
        text = "".join("\ufffd" if "\ud800" <= ch <= "\udfff" else ch for ch in text)
    return text


def _storable(value: Any) -> Any:
    """A JSON value with every string and object key passed through ``_clean``."""
    if isinstance(value, str):
        return _clean(value)
    if isinstance(value, Mapping):
        return {_clean(str(k)): _storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_storable(v) for v in value]
    return value


class _OrderWait:
    """The bounded wait of an ``after:`` rule: what to check, and how long to pause between looks."""

    def __init__(self, prepared: _Prepared) -> None:
        self.prepared = prepared
        self.deadline = time.monotonic() + prepared.rule.after_wait_s
        self.pause = _ORDER_POLL_MIN_S

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


def _refusal(intent: Intent, prepared: _Prepared | None, error: Exception) -> Decision:
    if isinstance(error, ToolGuardError):
        typed = error
    else:  # a bug or an unexpected failure in the tool: refused, audited, never crashes the graph
        typed = ToolFailed(f"{type(error).__name__}: {error}", reason="error")
        typed.__cause__ = error
    if isinstance(typed, IntentRejected | LockError) or typed.reason == "stale_fencing_token":
        kind: DecisionKind = "rejected"
    elif isinstance(typed, BackendUnavailable):
        kind = "failed"
    elif isinstance(typed, StoreError) and typed.reason in ("idempotency_conflict",):
        kind = "rejected"
    else:
        kind = "failed"
    return Decision(kind=kind, reason=typed.reason, intent=intent, message=typed.message,
                    keys=prepared.keys if prepared else (),
                    idempotency_key=prepared.record.idempotency_key if prepared else None,
                    error=typed)


def _unknown(intent: Intent, prepared: _Prepared, error: BaseException) -> Decision:
    reason = "interrupted" if isinstance(error, Exception) else "cancelled"
    return Decision(kind="unknown", reason=reason, intent=intent, message=type(error).__name__,
                    keys=prepared.keys, idempotency_key=prepared.record.idempotency_key)


def _entry(decision: Decision, prepared: _Prepared | None, started: float) -> AuditEntry:
    intent = decision.intent
    if prepared is not None:
        args: Any = prepared.record.args
    else:  # never validated: keep only its shape, never the raw (maybe huge, maybe secret) values
        args = {"_unvalidated": _shape(intent.args)}
    return AuditEntry(
        decision=decision.kind, reason=decision.reason, tool=_text(intent.tool),
        agent=_text(intent.agent) or None, intent_id=_text(intent.call_id or intent.id),
        idempotency_key=decision.idempotency_key, workflow=_workflow(intent),
        keys=decision.keys, tokens=dict(decision.tokens), args=args,
        detail=_text(decision.message, limit=2000) or None,
        duration_ms=round((time.monotonic() - started) * 1000, 3),
        node_attempt=intent.node_attempt)


def _shape(value: Any, depth: int = 0) -> Any:
    """A redacted outline of untrusted input: types and sizes, no values."""
    if depth > 2:
        return "..."
    if isinstance(value, Mapping):
        return {_clean(str(k)[:40]): _shape(v, depth + 1) for k, v in list(value.items())[:20]}
    if isinstance(value, list | tuple):
        return f"list[{len(value)}]"
    if isinstance(value, str):
        return f"str[{len(value)}]"
    return type(value).__name__
