"""The fenced write from start to end: its plan, the lease it runs under, and the flow.

Only the thin I/O edges differ between PostgreSQL and SQLite, sync and async;
they implement a ``Session`` (enter, finish, abort, record_failure) and the
flow in ``fenced_flow`` / ``afenced_flow`` does the rest the same way for all
four, so an accepted write, a stale token and a crash are audited identically.
``FencePlan`` validates what ``fenced()`` was given (it never raises: a bad
input is audited like any other rejection) and ``classify`` says how a failure
is audited. Apart from the store's public shape (``toolguard.store.base``):
the dialects run this flow, a tool only sees the transaction it yields.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, runtime_checkable

from toolguard.errors import (
    BackendUnavailable,
    DuplicateIntent,
    IdempotencyConflict,
    IntentRejected,
    InvalidFencingToken,
    LockError,
    LockLost,
    StaleFencingToken,
    StoreError,
    ToolGuardError,
    is_control_flow,
)
from toolguard.store.reads import Observe, ReadCheck
from toolguard.store.records import AuditEntry, IntentRecord, IntentStatus
from toolguard.store.storable import text_problem

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager, AbstractContextManager

    from toolguard.store.base import AsyncFencedTransaction, FencedTransaction

log = logging.getLogger("toolguard.store")


# --- how a failed write is audited ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Failure:
    """How a failed fenced write is audited, and what becomes of its intent row."""

    decision: str
    reason: str
    status: IntentStatus | None  # None: leave the intent row alone


def classify(error: BaseException) -> Failure:
    """Pure: the audit decision/reason and intent status for an error out of ``fenced()``."""
    if isinstance(error, DuplicateIntent):
        return Failure("replayed", error.reason, None)
    if isinstance(error, IdempotencyConflict):  # the row belongs to another request
        return Failure("rejected", error.reason, None)
    if isinstance(error, StaleFencingToken | InvalidFencingToken | IntentRejected | LockError):
        return Failure("rejected", error.reason, "failed")
    if isinstance(error, BackendUnavailable):  # the commit may or may not have landed
        return Failure("failed", error.reason, "unknown")
    if isinstance(error, ToolGuardError):
        return Failure("failed", error.reason, "failed")
    if not isinstance(error, Exception):  # cancelled, interrupted, exiting
        return Failure("unknown", "cancelled", "unknown")
    if is_control_flow(error):  # a LangGraph interrupt: the call runs again on resume
        return Failure("unknown", "interrupted", "unknown")
    return Failure("failed", "error", "failed")


# --- the lease a fenced write runs under -------------------------------------------------------


@runtime_checkable
class HeldLease(Protocol):
    """What ``fenced()`` needs of a lease (``toolguard.locks.Lease`` is one): its tokens, and
    whether it is still held."""

    keys: tuple[str, ...]
    tokens: Mapping[str, int]
    released: bool

    @property
    def lost(self) -> bool: ...

    def check(self) -> None: ...


#: What ``fenced()`` takes: a lease (checked before the commit) or its tokens alone.
FenceSource = HeldLease | Mapping[str, int]


def _is_lease(value: object) -> TypeGuard[HeldLease]:
    # Duck-typed (cheaper than a runtime Protocol check, and any lease class will do).
    return all(hasattr(value, name) for name in ("tokens", "keys", "released", "lost", "check"))


def require_held(lease: HeldLease | None) -> None:
    """Raise ``LockLost`` unless ``lease`` (if any) is still held: neither lost nor released."""
    if lease is None:
        return
    if lease.released:
        msg = f"the lease on {', '.join(lease.keys)} was released before its fenced write committed"
        raise LockLost(msg, keys=lease.keys)
    lease.check()


def _lost_meanwhile(lease: HeldLease | None, error: BaseException) -> BaseException:
    """The lease's loss, if it explains a connection that broke before the commit was sent.

    A next holder may end the transaction of a holder whose lease ran out
    (PostgreSQL: ``toolguard_fence`` terminates a stale blocker), which the
    late holder sees as a lost connection: nothing was committed, and the cause
    is the lease, not the server.
    """
    if lease is None or not isinstance(error, BackendUnavailable):
        return error
    try:
        require_held(lease)
    except LockLost as lost:
        msg = f"{lost.message}; its fenced transaction was ended meanwhile ({error.message})"
        superseded = LockLost(msg, keys=lost.keys)
        superseded.__cause__ = error
        return superseded
    return error


# --- the fenced-write plan -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FencePlan:
    """Validated input of one fenced transaction: keys in canonical order, their tokens.

    Building never raises: an unusable input is kept as ``problem`` so that the
    flow can audit it like any other rejection. ``lease`` is the lease the
    tokens came from, when the caller passed one.
    """

    keys: tuple[str, ...]
    tokens: Mapping[str, int]
    intent: IntentRecord | None
    detail: str | None
    started: float
    problem: ToolGuardError | None = None
    lease: HeldLease | None = None
    #: A write's check of its caller's reads (``toolguard.store.reads``), if any.
    reads: ReadCheck | None = None
    #: A read (no fences, no intent row): what its caller saw of ``keys`` is recorded.
    observe: Observe | None = None

    @classmethod
    def reading(cls, keys: tuple[str, ...], intent: IntentRecord | None, observe: Observe,
                detail: str | None = None) -> FencePlan:
        """A read's plan: ``keys`` (sorted) observed by ``observe.caller``; no tokens."""
        problem: ToolGuardError | None = None
        for key in keys:
            if not isinstance(key, str) or not key or text_problem(key) is not None:
                problem = problem or InvalidFencingToken(f"read key {key!r} is not usable")
        if not keys:
            problem = InvalidFencingToken("a read needs at least one key")
        return cls(tuple(sorted(set(keys))) if problem is None else (), {}, intent, detail,
                   time.monotonic(), problem, None, None, observe)

    @classmethod
    def build(cls, source: FenceSource, intent: IntentRecord | None,
              detail: str | None = None, reads: ReadCheck | None = None) -> FencePlan:
        started = time.monotonic()
        problem: ToolGuardError | None = None
        clean: dict[str, int] = {}
        lease: HeldLease | None = None
        tokens: Any = source
        if not isinstance(source, Mapping) and _is_lease(source):
            lease, tokens = source, source.tokens
        try:
            items = list(tokens.items())
        except AttributeError:
            items = []
            problem = InvalidFencingToken(
                f"fenced() takes a Lease or a mapping of key to token, got {source!r}")
        for key, token in items:
            if not isinstance(key, str) or not key:
                problem = problem or InvalidFencingToken(f"fencing keys must be non-empty strings, "
                                                         f"got {key!r}")
            elif (unstorable := text_problem(key)) is not None:
                problem = problem or InvalidFencingToken(f"fencing key {key!r} {unstorable}")
            elif not isinstance(token, int) or isinstance(token, bool) or token <= 0:
                problem = problem or InvalidFencingToken(
                    f"fencing token for key {key!r} must be a positive integer, got {token!r}")
            else:
                clean[key] = token
        if not items and problem is None:
            problem = InvalidFencingToken("a fenced write needs at least one key and its token")
        given: object = intent  # untyped callers may pass anything
        if given is not None and not isinstance(given, IntentRecord):
            problem = problem or StoreError(f"intent must be an IntentRecord, got {intent!r}",
                                            reason="invalid_intent")
            intent = None
        keys = tuple(sorted(clean))
        return cls(keys, {k: clean[k] for k in keys}, intent, detail, started, problem, lease,
                   reads)

    @property
    def idempotency_key(self) -> str | None:
        return self.intent.idempotency_key if self.intent else None

    def elapsed_ms(self) -> float:
        return round((time.monotonic() - self.started) * 1000, 3)

    def entry(self, decision: str, reason: str, detail: str | None) -> AuditEntry:
        """The audit row for this write's outcome."""
        intent = self.intent
        return AuditEntry(
            decision=decision, reason=reason,
            tool=intent.tool if intent else None,
            agent=intent.agent if intent else None,
            intent_id=intent.intent_id if intent else None,
            idempotency_key=intent.idempotency_key if intent else None,
            workflow=intent.workflow if intent else None,
            keys=self.keys, tokens=self.tokens,
            args=intent.args if intent else None,
            detail=detail, duration_ms=self.elapsed_ms(),
            node_attempt=intent.node_attempt if intent else None,
            policy_version=intent.policy_version if intent else None,
        )

    @property
    def applied_reason(self) -> str:
        """The reason code of this plan's accepted row: ``read`` for a read, else ``applied``."""
        return "read" if self.observe is not None else "applied"

    def failure_entry(self, error: BaseException) -> tuple[AuditEntry, IntentStatus | None]:
        outcome = classify(error)
        text = str(error) or type(error).__name__
        status = None if self.observe is not None else outcome.status  # a read has no intent row
        return self.entry(outcome.decision, outcome.reason, text[:4000]), status



# --- the flow --------------------------------------------------------------------------


class Session(Protocol):
    """One connection's worth of the fenced flow (sync)."""

    def enter(self, plan: FencePlan) -> FencedTransaction: ...

    def finish(self, tx: FencedTransaction, entry: AuditEntry) -> None: ...

    def abort(self, error: BaseException) -> BaseException:
        """End the transaction (or leave its end to ``record_failure``): a replay that
        ``enter`` found commits its fence advance, anything else rolls back."""
        ...

    def record_failure(self, plan: FencePlan, entry: AuditEntry,
                       status: IntentStatus | None) -> None: ...


class AsyncSession(Protocol):
    """One connection's worth of the fenced flow (asyncio)."""

    async def enter(self, plan: FencePlan) -> AsyncFencedTransaction: ...

    async def finish(self, tx: AsyncFencedTransaction, entry: AuditEntry) -> None: ...

    async def abort(self, error: BaseException) -> BaseException: ...

    async def record_failure(self, plan: FencePlan, entry: AuditEntry,
                             status: IntentStatus | None) -> None: ...


_AUDITED = "_toolguard_audited"


def mark_audited(error: BaseException) -> None:
    """Note on the exception that its audit row is written, so no caller writes a second one."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(error, _AUDITED, True)


def was_audited(error: BaseException) -> bool:
    return bool(getattr(error, _AUDITED, False))


def _raise(error: BaseException, cause: BaseException) -> None:
    if error is cause:
        raise error
    raise error from cause


@contextlib.contextmanager
def fenced_flow(session: AbstractContextManager[Session], source: FenceSource | FencePlan,
                intent: IntentRecord | None, detail: str | None,
                reads: ReadCheck | None = None) -> Iterator[FencedTransaction]:
    """Fence, run the tool, record and audit, commit; on failure roll back and audit outside.

    A replay (``DuplicateIntent`` from ``enter``) is the one failure whose fence
    advance is committed: its tokens were checked, so lower ones must be refused
    afterwards; the intent row is left as it was. With a lease, it must still
    be held right before the commit is sent (``LockLost`` otherwise). It is not
    checked at entry: a holder that paused before its write meets the fence
    there, the data tier's own refusal.
    """
    plan = source if isinstance(source, FencePlan) else FencePlan.build(source, intent, detail,
                                                                        reads)
    committing = False
    with session as s:
        try:
            if plan.problem is not None:
                raise plan.problem
            tx = s.enter(plan)
            yield tx
            require_held(plan.lease)
            committing = True
            s.finish(tx, plan.entry("accepted", plan.applied_reason, tx.detail))
        except BaseException as raised:
            error = s.abort(raised)
            if not committing:
                error = _lost_meanwhile(plan.lease, error)
            entry, status = plan.failure_entry(error)
            try:
                s.record_failure(plan, entry, status)
                mark_audited(error)
                mark_audited(raised)
            except Exception as audit_error:  # never hide the real failure behind the audit's
                log.warning("could not audit a failed fenced write (%s): %s", entry.reason,
                            audit_error)
            _raise(error, raised)


@contextlib.asynccontextmanager
async def afenced_flow(session: AbstractAsyncContextManager[AsyncSession],
                       source: FenceSource | FencePlan, intent: IntentRecord | None,
                       detail: str | None,
                       reads: ReadCheck | None = None) -> AsyncIterator[AsyncFencedTransaction]:
    """The asyncio twin of ``fenced_flow``; a cancelled write is audited as ``unknown``.

    A commit, once sent, runs to its end: a cancellation that arrives meanwhile
    is raised after it, marked audited when the commit wrote the call's row.
    """
    plan = source if isinstance(source, FencePlan) else FencePlan.build(source, intent, detail,
                                                                        reads)
    committing = committed = False
    try:
        async with session as s:
            try:
                if plan.problem is not None:
                    raise plan.problem
                tx = await s.enter(plan)
                yield tx
                require_held(plan.lease)
                committing = True
                # The commit is not cut by a cancellation (a worker thread or the server would
                # finish it anyway): its outcome is awaited, so the call is audited as what it
                # became, once, and the connection goes back idle.
                cancelled = await _to_the_end(
                    s.finish(tx, plan.entry("accepted", plan.applied_reason, tx.detail)))
                committed = True
                if cancelled is not None:  # committed and audited: the caller still stops
                    mark_audited(cancelled)
                    raise cancelled
            except BaseException as raised:
                if committed:
                    raise
                error = await s.abort(raised)
                if not committing:
                    error = _lost_meanwhile(plan.lease, error)
                entry, status = plan.failure_entry(error)
                try:
                    await s.record_failure(plan, entry, status)
                    mark_audited(error)
                    mark_audited(raised)
                except Exception as audit_error:
                    log.warning("could not audit a failed fenced write (%s): %s", entry.reason,
                                audit_error)
                _raise(error, raised)
    except asyncio.CancelledError as cancelled:
        # the session's own end (the connection going back) may be cut after the commit:
        # the commit wrote the call's row, so no other follows
        if committed:
            mark_audited(cancelled)
        raise


async def _to_the_end(work: Awaitable[None]) -> asyncio.CancelledError | None:
    """Await ``work`` to its end whatever cancellation arrives meanwhile; the first one, if any.

    Used for the commit: the database may apply it whether or not the caller
    still waits, so the caller learns how it ended before it stops.
    """
    task = asyncio.ensure_future(work)
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as error:
            if task.cancelled():  # the commit itself was cancelled (the loop is shutting down)
                raise
            cancelled = cancelled or error
            continue
        return cancelled
