"""The fenced transaction's I/O on one SQLite connection: sync, and on a worker thread.

``fenced_flow`` / ``afenced_flow`` (``toolguard.store.base``) run the steps of a
fenced write; ``_Session`` does their I/O: ``BEGIN IMMEDIATE``, every fence in
sorted order, the intent row, the tool's statements, then the result, the audit
row and ``COMMIT`` (a replay commits its fence advance only). The asyncio twin,
``_AsyncSession``, runs each of those steps on one worker thread of its own
(``_Worker``) for the write's whole life, its rows fetched there (``_Rows``), so
that the statements run in order even when the awaiting task is cancelled.
Apart from the stores, which only open a session per write and hand it to the flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from toolguard.errors import (
    DuplicateIntent,
    IdempotencyConflict,
    StaleFencingToken,
    StoreError,
    ToolGuardError,
)
from toolguard.runtime.cancellation import finish
from toolguard.store.base import (
    AsyncFencedTransaction,
    AuditEntry,
    FencedTransaction,
    FencePlan,
    IntentStatus,
    dump_json,
    qmark,
)
from toolguard.store.reads import Seen, observed_detail, verdict
from toolguard.store.sqlite_connections import _Connections, translate
from toolguard.store.sqlite_sql import (
    APPLY,
    AUDIT_INSERT,
    COUNT_ATTEMPT,
    DIALECT,
    FENCE,
    INTENT_ROW,
    NEW_INTENT_IF_ABSENT,
    OBSERVE_AT,
    OBSERVE_WRITTEN,
    READ_CHECK,
    VERSIONS_OF,
    WRITTEN,
    _loads,
)

if TYPE_CHECKING:
    from toolguard.store.sqlite import SqliteStore

log = logging.getLogger("toolguard.store")

P = ParamSpec("P")
T = TypeVar("T")


def _conflict(key: str, tool: str) -> IdempotencyConflict:
    msg = f"idempotency key {key} was already used for {tool} with other arguments"
    return IdempotencyConflict(msg)


class _Session:
    """The fenced flow's I/O on one connection (used from one thread at a time)."""

    def __init__(self, store: SqliteStore, conn: sqlite3.Connection) -> None:
        self.store = store
        self.conn = conn
        self.tx: FencedTransaction | AsyncFencedTransaction | None = None
        #: The replay ``begin`` found: its fence advance is committed, not rolled back.
        self.replay: DuplicateIntent | None = None
        #: What ``begin`` found for the transaction: a read's versions, a shadowed refusal.
        self.versions: dict[str, int] = {}
        self.would_refuse: ToolGuardError | None = None

    def execute(self, query: str, params: Any, counted: bool = False) -> sqlite3.Cursor | Fetched:
        """One statement; ``counted``: its rows fetched at once, so that they can be counted
        (sqlite3 counts neither a SELECT's rows nor ``RETURNING`` rows before they are read)."""
        try:
            conn = self.conn
            cursor = conn.execute(query) if params is None else conn.execute(qmark(query), params)
            return Fetched(cursor) if counted else cursor
        except sqlite3.Error as error:
            mapped = translate(error)
            if mapped is error:
                raise
            if self.tx is not None and isinstance(mapped, ToolGuardError):
                self.tx.failure = mapped
            raise mapped from error

    def begin(self, plan: FencePlan) -> None:
        """BEGIN IMMEDIATE, every fence in sorted order, the intent row, then the read check
        (a read: the versions of its keys, before the tool's own reads)."""
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        if plan.observe is not None:
            self.versions = {key: 0 for key in plan.keys}
            self.versions.update({str(k): int(v) for k, v in
                                  conn.execute(VERSIONS_OF, (dump_json(list(plan.keys)),))})
            return
        self._fence_and_intent(plan)
        check = plan.reads
        if check is None:
            return
        keys = sorted(set(plan.keys) | set(check.decides))
        decided = sorted(set(check.decides) - set(plan.keys))
        rows = conn.execute(READ_CHECK, (dump_json(decided), dump_json(keys), check.caller,
                                         time.time() - check.ttl_s)).fetchall()
        refusal = verdict(check, [Seen.of(row) for row in rows])
        if refusal is not None and check.shadow:
            self.would_refuse = refusal
        elif refusal is not None:
            raise refusal

    def _fence_and_intent(self, plan: FencePlan) -> None:
        conn = self.conn
        for key in plan.keys:
            token = plan.tokens[key]
            if not conn.execute(FENCE, (key, token)).fetchall():
                row = conn.execute("SELECT token FROM toolguard_high_water WHERE key = ?",
                                   (key,)).fetchone()
                current = int(row[0]) if row else None
                msg = (f"stale fencing token {token} for key {key}: the store has already "
                       f"seen {current}")
                raise StaleFencingToken(msg, key=key, token=token, current=current)
        intent = plan.intent
        if intent is None or intent.idempotency_key is None:
            return
        if conn.execute(NEW_INTENT_IF_ABSENT, (
                intent.idempotency_key, intent.tool, intent.agent, intent.workflow,
                dump_json(list(intent.keys or plan.keys)), intent.args_hash)).rowcount:
            return  # the key's first attempt: its row is made
        row = conn.execute(INTENT_ROW, (intent.idempotency_key,)).fetchone()
        tool, args_hash, status, _, result = row
        if tool != intent.tool or args_hash != intent.args_hash:
            raise _conflict(intent.idempotency_key, tool)
        if status == "applied":
            msg = (f"intent {intent.idempotency_key!r} was already applied; "
                   f"returning its recorded result")
            self.replay = DuplicateIntent(msg, result=_loads(result))
            raise self.replay
        if status != "pending":  # reconciling a failed/unknown attempt ('pending': begin_intent counted it)
            conn.execute(COUNT_ATTEMPT, (intent.idempotency_key,))

    def enter(self, plan: FencePlan) -> FencedTransaction:
        self.begin(plan)
        tx = FencedTransaction(self.conn, plan, DIALECT, self.execute)
        self.found(tx)
        return tx

    def found(self, tx: FencedTransaction | AsyncFencedTransaction) -> None:
        """Hand the transaction what ``begin`` found."""
        self.tx = tx
        tx.would_refuse = self.would_refuse
        if tx.plan.observe is not None:
            tx.versions = dict(self.versions)
            tx.detail = tx.detail or observed_detail(tx.versions)

    def commit(self, tx: FencedTransaction | AsyncFencedTransaction, entry: AuditEntry) -> None:
        if tx.failure is not None:
            raise tx.failure
        if not self.conn.in_transaction:
            msg = ("the fenced transaction was ended inside fenced() (a COMMIT or ROLLBACK by "
                   "the tool); the tool must never end it itself")
            raise StoreError(msg, reason="transaction_ended")
        plan = tx.plan
        keys = dump_json(list(plan.keys))
        if plan.observe is not None:  # a read: what its caller saw
            seen = dump_json([[k, tx.versions.get(k, 0)] for k in plan.keys])
            self.conn.execute(OBSERVE_AT, (plan.observe.caller, time.time(), seen))
        else:
            key = tx.intent.idempotency_key if tx.intent else None
            if key is not None:
                self.conn.execute(APPLY, (tx.result_json, tx.tokens_json, key))
            self.conn.execute(WRITTEN, (entry.agent, entry.intent_id, keys))
            if plan.reads is not None:
                self.conn.execute(OBSERVE_WRITTEN, (plan.reads.caller, time.time(), keys))
        self.conn.execute(AUDIT_INSERT, entry.insert_values(DIALECT)).fetchall()
        self.conn.execute("COMMIT")
        self.store.sealer.wrote()

    def finish(self, tx: FencedTransaction, entry: AuditEntry) -> None:
        self.commit(tx, entry)

    def abort(self, error: BaseException) -> BaseException:
        """End the failed transaction: a replay commits its fence advance (the store has
        seen its tokens and must refuse lower ones), anything else rolls back."""
        if self.conn.in_transaction and error is self.replay:
            try:
                self.conn.execute("COMMIT")
            except sqlite3.Error as commit_error:  # the replay stands; the marks stay as they were
                log.warning("could not commit a replay's fence advance: %s", commit_error)
        if self.conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")
        return translate(error)

    def record_failure(self, plan: FencePlan, entry: AuditEntry,
                       status: IntentStatus | None) -> None:
        self.store._record_failure(self.conn, plan, entry, status)


class _Worker:
    """One thread running one connection's steps in order (a fenced write's whole life)."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="toolguard-sqlite")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self.executor.shutdown(wait=False)


async def _given_back(worker: _Worker, give: Callable[P, None], *args: P.args,
                      **kwargs: P.kwargs) -> None:
    """Run ``give`` on the session's worker thread (after its last statement) to its end,
    whatever cancellation arrives meanwhile; then the worker stops."""
    try:
        await finish(asyncio.wrap_future(worker.executor.submit(give, *args, **kwargs)))
    finally:
        worker.close()


def _give_taken(connections: _Connections, taking: Future[sqlite3.Connection]) -> None:
    """Give back the connection ``taking`` took (run after it on the same worker thread)."""
    if not taking.cancelled() and taking.exception() is None:
        connections.give(taking.result())


class _RowsBase:
    """A statement's rows, all fetched at once; ``matched`` counts them (or the rows changed)."""

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        self.description = cursor.description
        self._rows = cursor.fetchall() if cursor.description else []
        self.rowcount = cursor.rowcount  # read after the fetch: RETURNING rows count only then
        self.lastrowid = cursor.lastrowid
        self.matched = len(self._rows) if cursor.description else cursor.rowcount
        self._at = 0

    def _one(self) -> Any:
        if self._at >= len(self._rows):
            return None
        self._at += 1
        return self._rows[self._at - 1]

    def _all(self) -> list[Any]:
        rows, self._at = self._rows[self._at:], len(self._rows)
        return rows

    def _many(self, size: int) -> list[Any]:
        rows = self._rows[self._at:self._at + size]
        self._at += len(rows)
        return rows


class Fetched(_RowsBase):
    """A sync cursor over rows already fetched (``tx.execute(..., expect_rows=n)``)."""

    def fetchone(self) -> Any:
        return self._one()

    def fetchall(self) -> list[Any]:
        return self._all()

    def fetchmany(self, size: int = 1) -> list[Any]:
        return self._many(size)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._all())


class _Rows(_RowsBase):
    """An async cursor over rows already fetched in the worker thread."""

    async def fetchone(self) -> Any:
        return self._one()

    async def fetchall(self) -> list[Any]:
        return self._all()

    async def fetchmany(self, size: int = 1) -> list[Any]:
        return self._many(size)


class _AsyncSession:
    """The sync session's steps, each run on the write's own worker thread."""

    def __init__(self, sync: _Session, worker: _Worker) -> None:
        self.sync = sync
        self.worker = worker
        self.committed = False

    def _execute_rows(self, query: str, params: Any) -> _Rows:
        cursor = self.sync.execute(query, params)
        assert isinstance(cursor, sqlite3.Cursor)
        return _Rows(cursor)

    async def _execute(self, query: str, params: Any, counted: bool = False) -> _Rows:
        # Always counted: every row is fetched in the worker thread anyway.
        return await self.worker.run(self._execute_rows, query, params)

    async def enter(self, plan: FencePlan) -> AsyncFencedTransaction:
        await self.worker.run(self.sync.begin, plan)
        tx = AsyncFencedTransaction(self.sync.conn, plan, DIALECT, self._execute)
        self.sync.found(tx)
        return tx

    async def finish(self, tx: AsyncFencedTransaction, entry: AuditEntry) -> None:
        # A commit the caller stops waiting for still lands: its end is awaited, so that
        # a cancellation after it is not recorded as a failure next to its ``accepted`` row.
        committing = asyncio.ensure_future(self.worker.run(self.sync.commit, tx, entry))
        cancelled: asyncio.CancelledError | None = None
        while not committing.done():
            try:
                await asyncio.wait({committing})
            except asyncio.CancelledError as error:
                cancelled = cancelled or error
        committing.result()  # a failed commit is a failure, cancelled or not
        self.committed = True
        if cancelled is not None:
            raise cancelled

    async def abort(self, error: BaseException) -> BaseException:
        if self.committed:  # cancelled after the commit: nothing to end
            return error
        return await finish(self.worker.run(self.sync.abort, error))

    async def record_failure(self, plan: FencePlan, entry: AuditEntry,
                             status: IntentStatus | None) -> None:
        if self.committed:  # applied and audited ``accepted`` already
            return
        await finish(self.worker.run(self.sync.record_failure, plan, entry, status))
