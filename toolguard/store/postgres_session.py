"""The fenced transaction's I/O on one pooled PostgreSQL connection, sync and asyncio.

``fenced_flow`` / ``afenced_flow`` (``toolguard.store.base``) run the steps of a
fenced write; a session does their I/O: ``enter`` sends ``BEGIN; SELECT
toolguard_enter(...)`` as one message, ``finish`` the result, the audit row and
``COMMIT`` as another, and a failed write's ``ROLLBACK`` (a replay's ``COMMIT``)
goes out with its audit row in ``record_failure`` (``settle`` sends it alone if
that never happens). Apart from the stores, which only open a session per write
and hand it to the flow.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, cast

import psycopg
from psycopg.pq import TransactionStatus

from toolguard.errors import BackendUnavailable, DuplicateIntent, StoreError, ToolGuardError
from toolguard.store.base import (
    AsyncFencedTransaction,
    AuditEntry,
    FencedTransaction,
    FencePlan,
    IntentStatus,
)
from toolguard.store.postgres_connection import translate
from toolguard.store.postgres_literals import _hot_cursor
from toolguard.store.postgres_sql import (
    COMMIT_FAILURE,
    DIALECT,
    ENTER_CHECK_TX,
    ENTER_TX,
    FAILURE,
    READ_BEGIN_TX,
    ROLLBACK_FAILURE,
    _check_params,
    _enter_params,
    _failure_params,
    _finish_params,
    text_array,
)
from toolguard.store.reads import Seen, observed_detail, verdict

if TYPE_CHECKING:
    from toolguard.store.postgres import AsyncPostgresStore, PostgresStore


_OPEN = (TransactionStatus.INTRANS, TransactionStatus.INERROR)


def _duplicate(plan: FencePlan, result: Any) -> DuplicateIntent:
    msg = f"intent {plan.idempotency_key!r} was already applied; returning its recorded result"
    return DuplicateIntent(msg, result=result)


def _ended(tx_status: TransactionStatus) -> StoreError | None:
    """Why a fenced transaction cannot commit, judged from the connection's state."""
    if tx_status == TransactionStatus.INTRANS:
        return None
    if tx_status == TransactionStatus.INERROR:
        msg = ("a statement failed inside the fenced transaction and the tool carried on; "
               "nothing was committed")
        return StoreError(msg)
    msg = ("the fenced transaction was ended inside fenced() (a COMMIT or ROLLBACK by the tool); "
           "the tool must never end it itself")
    return StoreError(msg, reason="transaction_ended")


def _seen(tx: FencedTransaction | AsyncFencedTransaction, rows: list[Any]) -> None:
    """A read's versions, as ``READ_BEGIN_TX`` found them (a key never written: 0)."""
    tx.versions = {key: 0 for key in tx.keys}
    tx.versions.update({str(key): int(version) for key, version in rows})
    tx.detail = tx.detail or observed_detail(tx.versions)


def _judge(tx: FencedTransaction | AsyncFencedTransaction, plan: FencePlan,
           rows: list[Any]) -> None:
    """Refuse the write if the read check says so (or note it, in shadow mode)."""
    assert plan.reads is not None
    refusal = verdict(plan.reads, [Seen.of(row) for row in rows])
    if refusal is None:
        return
    if plan.reads.shadow:
        tx.would_refuse = refusal
        return
    raise refusal


class _Session:
    """The fenced flow's I/O on one pooled connection."""

    def __init__(self, store: PostgresStore, conn: psycopg.Connection[Any]) -> None:
        self.store = store
        self.conn = conn
        self.tx: FencedTransaction | None = None
        #: ``abort`` left the ROLLBACK to ``record_failure``, to send it with the audit row.
        self.rollback_pending = False
        #: The replay ``enter`` found: its transaction ends with COMMIT, not ROLLBACK.
        self.replay: DuplicateIntent | None = None
        self.commit_pending = False

    def _execute(self, query: str, params: Any, counted: bool = False) -> psycopg.Cursor[Any]:
        # ``counted``: a psycopg cursor's ``rowcount`` already counts returned or changed rows.
        try:
            return self.conn.execute(cast(Any, query), params)
        except psycopg.Error as error:
            mapped = translate(error)
            if mapped is error:
                raise
            if self.tx is not None and isinstance(mapped, ToolGuardError):
                self.tx.failure = mapped
            raise mapped from error

    def enter(self, plan: FencePlan) -> FencedTransaction:
        conn = self.conn
        if plan.observe is not None:
            return self._enter_read(plan)
        cursor = _hot_cursor(conn, "_toolguard_enter")
        if plan.reads is None:
            cursor.execute(ENTER_TX, _enter_params(plan), prepare=False)
        else:
            cursor.execute(ENTER_CHECK_TX, (*_enter_params(plan), *_check_params(plan)),
                           prepare=False)
        cursor.nextset()  # past BEGIN's empty result
        found = cursor.pgresult
        # The usual answer, "not applied", read without loading the row.
        if found is None or found.ntuples != 1 or found.get_value(0, 0) != b"f":
            row = cursor.fetchone()
            assert row is not None
            if row[0]:
                self.replay = _duplicate(plan, row[1])
                raise self.replay
        self.tx = FencedTransaction(conn, plan, DIALECT, self._execute)
        if plan.reads is not None:
            cursor.nextset()
            _judge(self.tx, plan, cursor.fetchall())
        return self.tx

    def _enter_read(self, plan: FencePlan) -> FencedTransaction:
        cursor = psycopg.ClientCursor(self.conn)
        cursor.execute(READ_BEGIN_TX, (text_array(plan.keys),))
        cursor.nextset()
        self.tx = FencedTransaction(self.conn, plan, DIALECT, self._execute)
        _seen(self.tx, cursor.fetchall())
        return self.tx

    def finish(self, tx: FencedTransaction, entry: AuditEntry) -> None:
        if tx.failure is not None:
            raise tx.failure
        problem = _ended(self.conn.info.transaction_status)
        if problem is not None:
            raise problem
        query, params = _finish_params(tx, tx.plan, entry)
        _hot_cursor(self.conn, "_toolguard_finish").execute(query, params, prepare=False)
        self.store.sealer.wrote()

    def abort(self, error: BaseException) -> BaseException:
        # The ROLLBACK (a replay's COMMIT) goes out with the failure's audit row, in one
        # message (record_failure); ``settle`` sends it alone if that never happens.
        self.rollback_pending = not self.conn.closed and self.conn.info.transaction_status in _OPEN
        self.commit_pending = self.rollback_pending and error is self.replay
        mapped = translate(error)
        if isinstance(mapped, BackendUnavailable):
            self.store._forget_dead()
        return mapped

    def settle(self) -> None:
        """End a transaction that ``abort`` left open (before the connection goes back)."""
        conn = self.conn
        ending = "COMMIT" if self.commit_pending else "ROLLBACK"
        self.rollback_pending = self.commit_pending = False
        if not conn.closed and conn.info.transaction_status in _OPEN:
            with contextlib.suppress(psycopg.Error):
                conn.execute(ending)

    def record_failure(self, plan: FencePlan, entry: AuditEntry,
                       status: IntentStatus | None) -> None:
        params = _failure_params(plan, entry, status)
        if self.rollback_pending:
            self.rollback_pending = False
            query = COMMIT_FAILURE if self.commit_pending else ROLLBACK_FAILURE
            try:
                psycopg.ClientCursor(self.conn).execute(query, params)
                self.commit_pending = False
                self.store.sealer.wrote()
                return
            except psycopg.Error:
                self.settle()  # then try once more below, alone
        if not self.conn.closed and self.conn.info.transaction_status == TransactionStatus.IDLE:
            self.conn.execute(FAILURE, params)
        else:
            with self.store.connection(timeout=1.0) as other:
                other.execute(FAILURE, params)
        self.store.sealer.wrote()


class _AsyncSession:
    """The fenced flow's I/O on one pooled async connection."""

    def __init__(self, store: AsyncPostgresStore, conn: psycopg.AsyncConnection[Any]) -> None:
        self.store = store
        self.conn = conn
        self.tx: AsyncFencedTransaction | None = None
        self.rollback_pending = False
        self.replay: DuplicateIntent | None = None  # as in the sync session
        self.commit_pending = False

    async def _execute(self, query: str, params: Any,
                       counted: bool = False) -> psycopg.AsyncCursor[Any]:
        try:
            return await self.conn.execute(cast(Any, query), params)
        except psycopg.Error as error:
            mapped = translate(error)
            if mapped is error:
                raise
            if self.tx is not None and isinstance(mapped, ToolGuardError):
                self.tx.failure = mapped
            raise mapped from error

    async def enter(self, plan: FencePlan) -> AsyncFencedTransaction:
        conn = self.conn
        cursor = psycopg.AsyncClientCursor(conn)
        if plan.observe is not None:
            await cursor.execute(READ_BEGIN_TX, (text_array(plan.keys),))
            cursor.nextset()
            self.tx = AsyncFencedTransaction(conn, plan, DIALECT, self._execute)
            _seen(self.tx, await cursor.fetchall())
            return self.tx
        if plan.reads is None:
            await cursor.execute(ENTER_TX, _enter_params(plan))
        else:
            await cursor.execute(ENTER_CHECK_TX, (*_enter_params(plan), *_check_params(plan)))
        cursor.nextset()  # past BEGIN's empty result
        row = await cursor.fetchone()
        assert row is not None
        if row[0]:
            self.replay = _duplicate(plan, row[1])
            raise self.replay
        self.tx = AsyncFencedTransaction(conn, plan, DIALECT, self._execute)
        if plan.reads is not None:
            cursor.nextset()
            _judge(self.tx, plan, await cursor.fetchall())
        return self.tx

    async def finish(self, tx: AsyncFencedTransaction, entry: AuditEntry) -> None:
        if tx.failure is not None:
            raise tx.failure
        problem = _ended(self.conn.info.transaction_status)
        if problem is not None:
            raise problem
        query, params = _finish_params(tx, tx.plan, entry)
        await psycopg.AsyncClientCursor(self.conn).execute(query, params)
        self.store.sealer.wrote()

    async def abort(self, error: BaseException) -> BaseException:
        # As the sync twin: the ROLLBACK (a replay's COMMIT) goes out with the audit row (or
        # alone, in ``settle``).
        self.rollback_pending = not self.conn.closed and self.conn.info.transaction_status in _OPEN
        self.commit_pending = self.rollback_pending and error is self.replay
        mapped = translate(error)
        if isinstance(mapped, BackendUnavailable):
            await self.store._forget_dead()
        return mapped

    async def settle(self) -> None:
        """End a transaction that ``abort`` left open (before the connection goes back)."""
        conn = self.conn
        ending = "COMMIT" if self.commit_pending else "ROLLBACK"
        self.rollback_pending = self.commit_pending = False
        if not conn.closed and conn.info.transaction_status in _OPEN:
            with contextlib.suppress(psycopg.Error):
                await conn.execute(ending)

    async def record_failure(self, plan: FencePlan, entry: AuditEntry,
                             status: IntentStatus | None) -> None:
        params = _failure_params(plan, entry, status)
        if self.rollback_pending:
            self.rollback_pending = False
            query = COMMIT_FAILURE if self.commit_pending else ROLLBACK_FAILURE
            try:
                await psycopg.AsyncClientCursor(self.conn).execute(query, params)
                self.commit_pending = False
                self.store.sealer.wrote()
                return
            except psycopg.Error:
                await self.settle()
        if not self.conn.closed and self.conn.info.transaction_status == TransactionStatus.IDLE:
            await self.conn.execute(FAILURE, params)
        else:
            async with self.store.connection(timeout=1.0) as other:
                await other.execute(FAILURE, params)
        self.store.sealer.wrote()
