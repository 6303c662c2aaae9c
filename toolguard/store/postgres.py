"""The PostgreSQL guarded store (psycopg 3 + psycopg_pool), sync and asyncio.

All logic that must hold for every client lives in SQL (``toolguard/sql``);
this module only calls it. A fenced write costs two round trips besides the
tool's own statements: ``BEGIN; SELECT toolguard_enter(...)`` (every fence, in
sorted order, then the intent row: created, locked, checked for a replay or a
conflict) as one message, then ``SELECT toolguard_apply(...); INSERT INTO
toolguard_audit ...; COMMIT`` as one message. Both are sent with client-side
binding, which costs less client CPU than pipeline mode for the same single
round trip: a ``ClientCursor`` subclass kept per connection (``_HotCursor``)
quotes each value as one literal (never formatted into the SQL by hand) and
skips psycopg's per-value adapters and prepared-statement bookkeeping; any
other value type, or unusual server settings, take psycopg's own quoting. A failed write
sends its ``ROLLBACK`` together with the audit row (written after the
rollback, in a transaction of its own) the same way. A replay (the intent was
applied before) sends ``COMMIT`` instead: its fences were checked and advanced
before the replay was found, and the store must remember the tokens it has seen
(schema version 6 leaves the applied intent row unwritten, so only the fence
advance commits). Each audit row's hash is set by a trigger in the same
``INSERT`` (schema version 5): no round trip, and no lock shared between
writers; sealing the log (``seal_audit``) happens apart from the calls
(``toolguard.store.sealing``).

Connections are autocommit; a fenced write opens its own transaction. With
``schema=...`` every pooled connection uses that schema alone as its
``search_path`` (handy for tests and for several installs in one database).

A holder stopped inside its fenced transaction keeps its fence rows locked;
since schema version 3 the next holder, whose token for the key is newer, ends
that transaction once the stopped holder's lease is gone (see
``toolguard/sql/README.md``: it needs the same role for every client, or
``pg_signal_backend``). The stopped holder's attempt then fails when it wakes:
``LockLost`` when it passed its lease to ``fenced()``, else
``BackendUnavailable``; audited once, its intent not applied.

Errors: the ``TGnnn`` SQLSTATEs of ``toolguard/sql`` become their typed errors;
a statement the server ended (``statement_timeout`` or a cancel, a deadlock, a
serialization failure, ``lock_timeout``) becomes a ``TransactionAborted``
subclass with its own reason code (``statement_timeout``, ``query_canceled``,
``deadlock``, ``serialization_failure``, ``lock_not_available``); a lost
server ``BackendUnavailable``. Inside ``fenced()`` each is audited once.

This module holds the two stores and re-exports the names other code imports;
the rest lives beside it, one responsibility each: the statements with their
parameters and rows (``postgres_sql``), the hot path's client-side binding
(``postgres_literals``), the fenced transaction's I/O (``postgres_session``),
and reaching the server: URL checks, first contact, pool options and what
psycopg's errors become (``postgres_connection``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import replace
from datetime import datetime
from types import TracebackType
from typing import Any, Concatenate, NoReturn, ParamSpec, TypeVar, cast

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from toolguard.errors import BackendUnavailable
from toolguard.runtime.cancellation import finish
from toolguard.runtime.connection_errors import postgres_probe_options
from toolguard.runtime.connection_errors import redacted_url as redact
from toolguard.runtime.postgres_pool import AsyncRecentFirstPool, RecentFirstPool
from toolguard.store.autoseal import DEFAULT_AUTOSEAL, AutoSeal, AutoSealer
from toolguard.store.base import (
    AsyncFencedTransaction,
    AuditEntry,
    AuditQuery,
    Begun,
    FencedTransaction,
    FencePlan,
    FenceSource,
    IntentRecord,
    Migration,
    Replay,
    afenced_flow,
    effective_version,
    fenced_flow,
    migrations,
    pending_migrations,
)
from toolguard.store.chain import AuditVerification, ExportResult, SealResult

# The store is split by responsibility; every name other code imports from this module
# stays importable here (``X as X``: an explicit re-export).
from toolguard.store.postgres_connection import (
    DEFAULT_PREPARE_THRESHOLD as DEFAULT_PREPARE_THRESHOLD,
)
from toolguard.store.postgres_connection import POOL_EXHAUSTED as POOL_EXHAUSTED
from toolguard.store.postgres_connection import Deadlock as Deadlock
from toolguard.store.postgres_connection import LockNotAvailable as LockNotAvailable
from toolguard.store.postgres_connection import SerializationFailure as SerializationFailure
from toolguard.store.postgres_connection import StatementTimeout as StatementTimeout
from toolguard.store.postgres_connection import TransactionAborted as TransactionAborted
from toolguard.store.postgres_connection import _connection_options, _PgBase, _raise_translated
from toolguard.store.postgres_connection import check_schema as check_schema
from toolguard.store.postgres_connection import check_url as check_url
from toolguard.store.postgres_connection import translate as translate
from toolguard.store.postgres_literals import _TEMPLATES as _TEMPLATES
from toolguard.store.postgres_literals import _filled as _filled
from toolguard.store.postgres_literals import _template as _template
from toolguard.store.postgres_session import _AsyncSession
from toolguard.store.postgres_session import _Session as _Session
from toolguard.store.postgres_sql import APPLY as APPLY
from toolguard.store.postgres_sql import AUDIT_INSERT as AUDIT_INSERT
from toolguard.store.postgres_sql import AUDIT_QUERY as AUDIT_QUERY
from toolguard.store.postgres_sql import BEGIN_INTENT as BEGIN_INTENT
from toolguard.store.postgres_sql import COMMIT_FAILURE as COMMIT_FAILURE
from toolguard.store.postgres_sql import DIALECT as DIALECT
from toolguard.store.postgres_sql import ENTER as ENTER
from toolguard.store.postgres_sql import ENTER_TX as ENTER_TX
from toolguard.store.postgres_sql import FAILURE as FAILURE
from toolguard.store.postgres_sql import FINISH_TX as FINISH_TX
from toolguard.store.postgres_sql import FINISH_TX_NO_INTENT as FINISH_TX_NO_INTENT
from toolguard.store.postgres_sql import HAS_APPLIED as HAS_APPLIED
from toolguard.store.postgres_sql import HAS_VERSION_TABLE as HAS_VERSION_TABLE
from toolguard.store.postgres_sql import HIGH_WATERS as HIGH_WATERS
from toolguard.store.postgres_sql import INSTALL_LOCK as INSTALL_LOCK
from toolguard.store.postgres_sql import INSTALLED as INSTALLED
from toolguard.store.postgres_sql import MARK_UNKNOWN as MARK_UNKNOWN
from toolguard.store.postgres_sql import MARK_UNKNOWN_UPSERT as MARK_UNKNOWN_UPSERT
from toolguard.store.postgres_sql import RECORD_VERSION as RECORD_VERSION
from toolguard.store.postgres_sql import ROLLBACK_FAILURE as ROLLBACK_FAILURE
from toolguard.store.postgres_sql import VERSION_TABLE as VERSION_TABLE
from toolguard.store.postgres_sql import (
    _audit_values,
    _begin_params,
    _begun,
    _entry,
    _mark_unknown,
    _moment,
)
from toolguard.store.postgres_sql import text_array as text_array
from toolguard.store.reads import Observe, ReadCheck
from toolguard.store.sealing import MAX_SEAL_ROWS, check_anchors, pg_export, pg_seal, pg_verify

__all__ = [
    "AsyncPostgresStore",
    "Deadlock",
    "LockNotAvailable",
    "PostgresStore",
    "SerializationFailure",
    "StatementTimeout",
    "TransactionAborted",
]

log = logging.getLogger("toolguard.store")

P = ParamSpec("P")
T = TypeVar("T")


class _Borrowed:
    """One pooled connection for one ``with`` block: ``pool.connection()``'s behaviour with
    less work per call (every guarded call takes one).

    As ``pool.connection()`` does, a transaction still open at the end is committed, or
    rolled back when the block raised; an autocommit connection that is idle (the usual
    case) needs neither. Errors become toolguard's (``PostgresStore._unavailable``).
    """

    __slots__ = ("_conn", "_store", "_timeout")

    def __init__(self, store: PostgresStore, timeout: float | None) -> None:
        self._store = store
        self._timeout = timeout
        self._conn: psycopg.Connection[Any] | None = None

    def __enter__(self) -> psycopg.Connection[Any]:
        try:
            self._conn = conn = self._store._pool.getconn(timeout=self._timeout)
        except psycopg.Error as error:
            self._store._unavailable(error)
        return conn

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        conn, self._conn = self._conn, None
        assert conn is not None
        try:
            if not conn.closed and conn.pgconn.transaction_status != TransactionStatus.IDLE:
                if kind is None:
                    conn.commit()
                else:
                    try:
                        conn.rollback()
                    except Exception as rollback_error:  # the block's own error goes on
                        log.warning("error ignored in rollback: %s", rollback_error)
        except psycopg.Error as commit_error:
            error = commit_error
        finally:
            self._store._pool.putconn(conn)
        if isinstance(error, psycopg.Error):
            self._store._unavailable(error)


class _SessionScope:
    """A fenced write's connection and session; a transaction ``abort`` left open is ended
    before the connection goes back."""

    __slots__ = ("_borrowed", "_session", "_store")

    def __init__(self, store: PostgresStore) -> None:
        self._store = store
        self._borrowed = _Borrowed(store, None)
        self._session: _Session | None = None

    def __enter__(self) -> _Session:
        self._session = _Session(self._store, self._borrowed.__enter__())
        return self._session

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        session, self._session = self._session, None
        try:
            if session is not None and session.rollback_pending:
                session.settle()
        finally:
            self._borrowed.__exit__(kind, error, traceback)


class PostgresStore(_PgBase):
    """The guarded store on PostgreSQL; one pool, shared by every thread of a process."""

    def __init__(self, url: str, *, schema: str | None = None, min_size: int = 1,
                 max_size: int = 10, timeout_s: float = 10.0,
                 autoseal: AutoSeal | None = DEFAULT_AUTOSEAL,
                 prepare_threshold: int | None = DEFAULT_PREPARE_THRESHOLD) -> None:
        super().__init__(url, schema)
        #: Seals the audit rows this store writes (``toolguard.store.autoseal``; None: off).
        self.sealer = AutoSealer(functools.partial(
            self.seal_audit, wait_s=autoseal.wait_s if autoseal else 0.0), autoseal,
            name="toolguard-autoseal-pg")
        self._pool: ConnectionPool[psycopg.Connection[Any]] = RecentFirstPool(
            url, min_size=min_size, max_size=max_size, timeout=timeout_s, open=False,
            kwargs=_connection_options(prepare_threshold), configure=self._configure,
            name=f"toolguard-store{'-' + schema if schema else ''}")
        self._check_first_contact()
        self._pool.open(wait=False)

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        statement = self._set_path()
        if statement is not None:
            conn.execute(statement)

    def _forget_dead(self) -> None:
        """After a lost connection, drop the other idle ones that died with it."""
        with contextlib.suppress(Exception):
            self._pool.check()

    def connection(self, timeout: float | None = None
                   ) -> contextlib.AbstractContextManager[psycopg.Connection[Any]]:
        """A pooled autocommit connection, errors mapped to toolguard's.

        For reads and setup; writes that must be fenced go through ``fenced()``.
        """
        return _Borrowed(self, timeout)

    def _unavailable(self, error: BaseException) -> NoReturn:
        """Raise what a psycopg or pool error met on one of the pool's connections means."""
        if isinstance(error, PoolTimeout):
            msg = f"postgresql {redact(self.url)}: no connection: {self._probe()}"
            raise BackendUnavailable(msg) from error
        if isinstance(translate(error), BackendUnavailable):
            self._forget_dead()
        _raise_translated(error)

    def install(self, steps: Sequence[Migration] | None = None) -> int:
        """Create or upgrade the schema; idempotent, serialized by an advisory lock."""
        steps = tuple(steps) if steps is not None else migrations(DIALECT)
        with self.connection() as conn, conn.transaction():
            conn.execute(INSTALL_LOCK)
            create = self._create_schema()
            if create is not None:
                conn.execute(create)
            conn.execute(VERSION_TABLE)
            installed = {int(v) for (v,) in conn.execute(INSTALLED).fetchall()}
            for step in pending_migrations(steps, installed):
                log.info("installing toolguard schema %s", step.name)
                conn.execute(cast(Any, step.sql))
                conn.execute(RECORD_VERSION, (step.version, step.name))
            installed = {int(v) for (v,) in conn.execute(INSTALLED).fetchall()}
            return effective_version(installed, migrations(DIALECT))

    def schema_version(self) -> int:
        """The installed schema version (0: not installed; see ``effective_version``)."""
        with self.connection() as conn:
            row = conn.execute(HAS_VERSION_TABLE).fetchone()
            if not row or not row[0]:
                return 0
            installed = {int(v) for (v,) in conn.execute(INSTALLED).fetchall()}
            return effective_version(installed, migrations(DIALECT))

    def begin_intent(self, record: IntentRecord) -> Begun | Replay:
        """Reserve ``record.idempotency_key``: ``Begun`` (run it) or ``Replay`` (don't)."""
        params = _begin_params(record)
        with self.connection() as conn:
            row = conn.execute(BEGIN_INTENT, params).fetchone()
        assert row is not None and record.idempotency_key is not None
        return _begun(record.idempotency_key, row)

    def _session(self) -> _SessionScope:
        return _SessionScope(self)

    def fenced(self, lease: FenceSource, intent: IntentRecord | None = None, *,
               detail: str | None = None, reads: ReadCheck | None = None
               ) -> contextlib.AbstractContextManager[FencedTransaction]:
        """One transaction: fences, the tool's SQL, the result and the audit row; all or nothing.

        ``lease``: a ``Lease`` (checked right before the commit: ``LockLost`` if it was lost
        or released meanwhile) or a mapping of key to token (no such check).
        """
        return fenced_flow(self._session(), lease, intent, detail, reads)

    def read(self, keys: Iterable[str], intent: IntentRecord | None = None, *, caller: str,
             detail: str | None = None) -> contextlib.AbstractContextManager[FencedTransaction]:
        """A read: one transaction whose tool reads ``keys``; what ``caller`` saw is recorded.

        The keys' versions are read first (an observation is never newer than the
        data the tool reads after it), then the tool runs on ``tx``, then the
        observation and the audit row commit together; a failed read records no
        observation. See ``toolguard.store.reads``.
        """
        plan = FencePlan.reading(tuple(keys), intent, Observe(caller), detail)
        return fenced_flow(self._session(), plan, intent, detail)

    def audit(self, entry: AuditEntry) -> AuditEntry:
        """Append one audit row (for decisions taken outside a fenced write)."""
        with self.connection() as conn:
            row = conn.execute(AUDIT_INSERT, _audit_values(entry)).fetchone()
        assert row is not None
        self.sealer.wrote()
        return replace(entry, id=int(row[0]), at=row[1])

    def mark_unknown(self, idempotency_key: str, record: IntentRecord | None = None) -> bool:
        """Record that a call was cancelled mid-flight; never touches an applied intent.

        With ``record`` (the intent with that key) a missing row is created with
        status 'unknown' (a fenced write creates its row inside its own
        transaction, so a cancelled one may have left none); without it only an
        existing row is marked. A row of another tool or other arguments is left
        alone. True if a row was marked.
        """
        query, params = _mark_unknown(idempotency_key, record)
        with self.connection() as conn:
            return conn.execute(query, params).rowcount > 0

    def has_applied(self, tool: str, resource_key: str, workflow: str | None = None) -> bool:
        """Whether ``tool`` was applied on ``resource_key`` (in ``workflow``, if given)."""
        with self.connection() as conn:
            row = conn.execute(HAS_APPLIED, (tool, resource_key, workflow, workflow)).fetchone()
        return bool(row and row[0])

    def high_water(self, key: str) -> int:
        """The greatest token accepted for ``key`` (0 if none)."""
        return self.high_waters([key]).get(key, 0)

    def high_waters(self, keys: Iterable[str]) -> dict[str, int]:
        """High-water marks of several keys in one query (absent keys are omitted)."""
        with self.connection() as conn:
            rows = conn.execute(HIGH_WATERS, (list(keys),)).fetchall()
        return {key: int(token) for key, token in rows}

    def query_audit(self, **filters: Any) -> list[AuditEntry]:
        """Audit rows matching ``filters`` (see ``AuditQuery``), newest first by default."""
        query = AuditQuery(**filters)
        where, params = query.where(DIALECT, _moment)
        tail, more = query.tail()
        with self.connection() as conn:
            rows = conn.execute(cast(Any, AUDIT_QUERY + where + tail), [*params, *more]).fetchall()
        return [_entry(row) for row in rows]

    def seal_audit(self, *, max_rows: int = MAX_SEAL_ROWS, wait_s: float = 5.0) -> SealResult:
        """Seal the audit rows that can no longer be joined by a late commit (``toolguard audit
        seal``): every id below the highest committed one, once the transactions that were
        writing the log meanwhile have ended (``wait_s`` at most; see ``toolguard.store.sealing``).
        Concurrent sealers queue on an advisory lock; writers never wait for a sealer.
        """
        with self.connection() as conn:
            return pg_seal(conn, max_rows=max_rows, wait_s=wait_s)

    def verify_audit(self, *, anchor: str | Sequence[str] | None = None,
                     exports: Sequence[str | os.PathLike[str]] = ()) -> AuditVerification:
        """Check every audit row and seal in one snapshot (``toolguard audit verify``).

        ``anchor``: seal hashes kept outside the database (a rewrite of the whole chain
        is caught only by them); ``exports``: export files of dropped ranges.
        """
        anchors = check_anchors(anchor)
        with self.connection() as conn:
            return pg_verify(conn, anchors=anchors, exports=exports)

    def export_audit(self, path: str | os.PathLike[str], *, before: datetime | None = None,
                     through_seq: int | None = None, drop: bool = False) -> ExportResult:
        """Export whole sealed ranges older than ``before`` (or through seal ``through_seq``) to
        ``path``; ``drop=True`` then deletes them (``toolguard_audit_drop_exported``: needs the
        tables' owner), keeping the rest verifiable."""
        with self.connection() as conn:
            return pg_export(conn, path, before=before, through_seq=through_seq, drop=drop)

    def close(self) -> None:
        """Seal the audit rows this store wrote (see ``autoseal``), then close the pool."""
        self.sealer.close()
        self._pool.close()

    def __enter__(self) -> PostgresStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- asyncio ------------------------------------------------------------------------------------


class AsyncPostgresStore(_PgBase):
    """The asyncio guarded store on PostgreSQL; the pool opens on first use."""

    def __init__(self, url: str, *, schema: str | None = None, min_size: int = 1,
                 max_size: int = 10, timeout_s: float = 10.0, install: bool = False,
                 autoseal: AutoSeal | None = DEFAULT_AUTOSEAL,
                 prepare_threshold: int | None = DEFAULT_PREPARE_THRESHOLD) -> None:
        super().__init__(url, schema)
        #: Seals the audit rows this store writes, in a thread on a connection of its own.
        self.sealer = AutoSealer(functools.partial(
            self._run_batch, pg_seal, max_rows=MAX_SEAL_ROWS,
            wait_s=autoseal.wait_s if autoseal else 0.0), autoseal, name="toolguard-autoseal-apg")
        #: The pool's bounds, for callers that hold a connection while they need another
        #: (``toolguard.fences.inflight``).
        self.pool_max_size = max_size
        self.pool_timeout_s = timeout_s
        #: ``install=True``: the schema is installed (or upgraded) before the first operation.
        self._install_pending = install
        self._install_lock = asyncio.Lock()
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncRecentFirstPool(
            url, min_size=min_size, max_size=max_size, timeout=timeout_s, open=False,
            kwargs=_connection_options(prepare_threshold), configure=self._configure,
            name=f"toolguard-astore{'-' + schema if schema else ''}")
        self._opened = False

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        statement = self._set_path()
        if statement is not None:
            await conn.execute(statement)

    async def _aprobe(self) -> str:
        """The asyncio twin of ``_probe`` (``ConfigurationError`` for a final answer)."""
        try:
            conn = await psycopg.AsyncConnection.connect(self.url, **postgres_probe_options())
        except psycopg.Error as error:
            self._refuse_definitive(error)
            return str(error).strip()
        await conn.close()
        return POOL_EXHAUSTED

    async def _forget_dead(self) -> None:
        with contextlib.suppress(Exception):
            await self._pool.check()

    async def _ready(self) -> None:
        """Run the install ``install=True`` asked for, once (retried by the next call if it fails)."""
        if not self._install_pending:
            return
        async with self._install_lock:
            if self._install_pending:
                await self._install(None)

    @contextlib.asynccontextmanager
    async def connection(self, timeout: float | None = None
                         ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pooled autocommit async connection, errors mapped to toolguard's."""
        await self._ready()
        async with self._pooled(timeout) as conn:
            yield conn

    @contextlib.asynccontextmanager
    async def _pooled(self, timeout: float | None = None
                      ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if not self._opened:
            await self._aprobe()  # a typo raises ConfigurationError now, before the pool waits
            await self._pool.open(wait=False)
            self._opened = True
        try:
            async with self._pool.connection(timeout=timeout) as conn:
                yield conn
        except PoolTimeout as error:
            msg = f"postgresql {redact(self.url)}: no connection: {await self._aprobe()}"
            raise BackendUnavailable(msg) from error
        except psycopg.Error as error:
            if isinstance(translate(error), BackendUnavailable):
                await self._forget_dead()
            _raise_translated(error)

    async def install(self, steps: Sequence[Migration] | None = None) -> int:
        """Create or upgrade the schema; idempotent, serialized by an advisory lock."""
        async with self._install_lock:
            return await self._install(steps)

    async def _install(self, steps: Sequence[Migration] | None) -> int:
        version = await self._migrate(tuple(steps) if steps is not None else migrations(DIALECT))
        self._install_pending = False
        return version

    async def _migrate(self, steps: Sequence[Migration]) -> int:
        async with self._pooled() as conn, conn.transaction():
            await conn.execute(INSTALL_LOCK)
            create = self._create_schema()
            if create is not None:
                await conn.execute(create)
            await conn.execute(VERSION_TABLE)
            rows = await (await conn.execute(INSTALLED)).fetchall()
            for step in pending_migrations(steps, {int(v) for (v,) in rows}):
                log.info("installing toolguard schema %s", step.name)
                await conn.execute(cast(Any, step.sql))
                await conn.execute(RECORD_VERSION, (step.version, step.name))
            rows = await (await conn.execute(INSTALLED)).fetchall()
            return effective_version({int(v) for (v,) in rows}, migrations(DIALECT))

    async def schema_version(self) -> int:
        """The installed schema version (0: not installed; see ``effective_version``)."""
        async with self.connection() as conn:
            row = await (await conn.execute(HAS_VERSION_TABLE)).fetchone()
            if not row or not row[0]:
                return 0
            rows = await (await conn.execute(INSTALLED)).fetchall()
            return effective_version({int(v) for (v,) in rows}, migrations(DIALECT))

    async def begin_intent(self, record: IntentRecord) -> Begun | Replay:
        """Reserve ``record.idempotency_key``: ``Begun`` (run it) or ``Replay`` (don't)."""
        params = _begin_params(record)
        async with self.connection() as conn:
            row = await (await conn.execute(BEGIN_INTENT, params)).fetchone()
        assert row is not None and record.idempotency_key is not None
        return _begun(record.idempotency_key, row)

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[_AsyncSession]:
        async with self.connection() as conn:
            session = _AsyncSession(self, conn)
            try:
                yield session
            finally:
                if session.rollback_pending:
                    await finish(session.settle())

    def fenced(self, lease: FenceSource, intent: IntentRecord | None = None, *,
               detail: str | None = None, reads: ReadCheck | None = None
               ) -> contextlib.AbstractAsyncContextManager[AsyncFencedTransaction]:
        """``async with store.fenced(lease, intent) as tx``: as ``PostgresStore.fenced``."""
        return afenced_flow(self._session(), lease, intent, detail, reads)

    def read(self, keys: Iterable[str], intent: IntentRecord | None = None, *, caller: str,
             detail: str | None = None
             ) -> contextlib.AbstractAsyncContextManager[AsyncFencedTransaction]:
        """``async with store.read(keys, intent, caller=...) as tx``: as the sync ``read``."""
        plan = FencePlan.reading(tuple(keys), intent, Observe(caller), detail)
        return afenced_flow(self._session(), plan, intent, detail)

    async def audit(self, entry: AuditEntry) -> AuditEntry:
        """Append one audit row (for decisions taken outside a fenced write)."""
        async with self.connection() as conn:
            row = await (await conn.execute(AUDIT_INSERT, _audit_values(entry))).fetchone()
        assert row is not None
        self.sealer.wrote()
        return replace(entry, id=int(row[0]), at=row[1])

    async def mark_unknown(self, idempotency_key: str,
                           record: IntentRecord | None = None) -> bool:
        """Record that a call was cancelled mid-flight (see ``PostgresStore.mark_unknown``)."""
        query, params = _mark_unknown(idempotency_key, record)
        async with self.connection() as conn:
            return (await conn.execute(query, params)).rowcount > 0

    async def has_applied(self, tool: str, resource_key: str, workflow: str | None = None) -> bool:
        """Whether ``tool`` was applied on ``resource_key`` (in ``workflow``, if given)."""
        async with self.connection() as conn:
            cursor = await conn.execute(HAS_APPLIED, (tool, resource_key, workflow, workflow))
            row = await cursor.fetchone()
        return bool(row and row[0])

    async def high_water(self, key: str) -> int:
        """The greatest token accepted for ``key`` (0 if none)."""
        return (await self.high_waters([key])).get(key, 0)

    async def high_waters(self, keys: Iterable[str]) -> dict[str, int]:
        """High-water marks of several keys in one query (absent keys are omitted)."""
        async with self.connection() as conn:
            rows = await (await conn.execute(HIGH_WATERS, (list(keys),))).fetchall()
        return {key: int(token) for key, token in rows}

    async def query_audit(self, **filters: Any) -> list[AuditEntry]:
        """Audit rows matching ``filters`` (see ``AuditQuery``), newest first by default."""
        query = AuditQuery(**filters)
        where, params = query.where(DIALECT, _moment)
        tail, more = query.tail()
        async with self.connection() as conn:
            cursor = await conn.execute(cast(Any, AUDIT_QUERY + where + tail), [*params, *more])
            rows = await cursor.fetchall()
        return [_entry(row) for row in rows]

    async def seal_audit(self, *, max_rows: int = MAX_SEAL_ROWS,
                         wait_s: float = 5.0) -> SealResult:
        """Seal the audit rows that can be sealed (see ``PostgresStore.seal_audit``); a batch
        job, run in a worker thread on a connection of its own."""
        return await self._batch(pg_seal, max_rows=max_rows, wait_s=wait_s)

    async def verify_audit(self, *, anchor: str | Sequence[str] | None = None,
                           exports: Sequence[str | os.PathLike[str]] = ()
                           ) -> AuditVerification:
        """Check every audit row and seal (see ``PostgresStore.verify_audit``)."""
        return await self._batch(pg_verify, anchors=check_anchors(anchor), exports=exports)

    async def export_audit(self, path: str | os.PathLike[str], *,
                           before: datetime | None = None, through_seq: int | None = None,
                           drop: bool = False) -> ExportResult:
        """Export (and with ``drop=True`` drop) old sealed ranges (see
        ``PostgresStore.export_audit``)."""
        return await self._batch(pg_export, path, before=before, through_seq=through_seq,
                                 drop=drop)

    async def _batch(self, job: Callable[Concatenate[psycopg.Connection[Any], P], T],
                     *args: P.args, **kwargs: P.kwargs) -> T:
        await self._ready()
        run: Callable[[], T] = functools.partial(self._run_batch, job, *args, **kwargs)
        return await asyncio.to_thread(run)

    def _run_batch(self, job: Callable[Concatenate[psycopg.Connection[Any], P], T],
                   *args: P.args, **kwargs: P.kwargs) -> T:
        """``job(conn, ...)`` on a sync connection of its own (the pool is the event loop's)."""
        try:
            with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:
                statement = self._set_path()
                if statement is not None:
                    conn.execute(statement)
                return job(conn, *args, **kwargs)
        except psycopg.Error as error:
            raise translate(error) from error

    async def close(self) -> None:
        """Seal the audit rows this store wrote (see ``autoseal``), then close the pool."""
        if not self.sealer.idle:
            await asyncio.to_thread(self.sealer.close)
        await self._pool.close()

    aclose = close

    async def __aenter__(self) -> AsyncPostgresStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
