"""The SQLite guarded store: the embedded default, same semantics as PostgreSQL.

A fenced write is one ``BEGIN IMMEDIATE`` transaction: SQLite then holds the
database's single write lock until ``COMMIT``, so fenced writes are serialized
outright, and the fence check-and-advance is one upsert per key (in sorted
order) that returns nothing when the token is stale. A replay (the intent was
applied before) commits that fence advance and nothing else: the store has seen
its tokens and refuses lower ones afterwards. The tables, triggers and
statuses mirror ``toolguard/sql/001_initial.sql`` (see ``sql/sqlite``).

Keep fenced bodies short: while one runs, every other writer of the file
waits, including a SQLite lock backend that shares the file (the embedded
default) and its lease renewals. A holder whose process is stopped inside its
fenced transaction therefore blocks every writer until it wakes or dies:
nothing can end another process's SQLite transaction. A blocked writer gives up
after ``busy_timeout_ms`` (``BackendUnavailable``), and the stopped holder's
late commit is refused by the lease check of ``fenced(lease, ...)``
(``LockLost``); no other write could land meanwhile, so nothing is lost, but
the wait is not bounded (PostgreSQL bounds it: ``toolguard/sql/README.md``).
For the same reason a fenced body must not call another writing operation of
the store or of such a lock backend itself: that call waits for the body's own
write lock until the busy timeout and fails with ``BackendUnavailable``.

The asyncio twin runs each step in a worker thread; a fenced write keeps one
connection and one worker thread for its whole life, so its statements run in
order even when the awaiting task is cancelled.

This module holds the two stores and the install's script splitting, and
re-exports the names other code imports; beside it, one responsibility each:
the statements and the audit rows' text forms (``sqlite_sql``), the
connections to the file and what sqlite3's errors become
(``sqlite_connections``), and the fenced transaction's I/O, sync and on a
worker thread (``sqlite_session``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, ParamSpec, TypeVar

from toolguard.errors import ConfigurationError, StoreError
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
    IntentStatus,
    Migration,
    Replay,
    afenced_flow,
    dump_json,
    effective_version,
    fenced_flow,
    migrations,
    pending_migrations,
    qmark,
)
from toolguard.store.chain import AuditVerification, ExportResult, SealResult
from toolguard.store.reads import Observe, ReadCheck
from toolguard.store.sealing import (
    MAX_SEAL_ROWS,
    check_anchors,
    sqlite_export,
    sqlite_seal,
    sqlite_verify,
)

# The store is split by responsibility; every name other code imports from this module
# stays importable here (``X as X``: an explicit re-export).
from toolguard.store.sqlite_connections import _Connections, _raise_translated
from toolguard.store.sqlite_connections import translate as translate
from toolguard.store.sqlite_session import Fetched as Fetched
from toolguard.store.sqlite_session import (
    _AsyncSession,
    _conflict,
    _give_taken,
    _given_back,
    _Session,
    _Worker,
)
from toolguard.store.sqlite_sql import APPLY as APPLY
from toolguard.store.sqlite_sql import AUDIT_INSERT as AUDIT_INSERT
from toolguard.store.sqlite_sql import AUDIT_QUERY as AUDIT_QUERY
from toolguard.store.sqlite_sql import COUNT_ATTEMPT as COUNT_ATTEMPT
from toolguard.store.sqlite_sql import DIALECT as DIALECT
from toolguard.store.sqlite_sql import FAIL_INTENT as FAIL_INTENT
from toolguard.store.sqlite_sql import FENCE as FENCE
from toolguard.store.sqlite_sql import HAS_APPLIED as HAS_APPLIED
from toolguard.store.sqlite_sql import INSTALLED as INSTALLED
from toolguard.store.sqlite_sql import INTENT_ROW as INTENT_ROW
from toolguard.store.sqlite_sql import MARK_UNKNOWN as MARK_UNKNOWN
from toolguard.store.sqlite_sql import MARK_UNKNOWN_UPSERT as MARK_UNKNOWN_UPSERT
from toolguard.store.sqlite_sql import NEW_INTENT as NEW_INTENT
from toolguard.store.sqlite_sql import NOW as NOW
from toolguard.store.sqlite_sql import RETRY_INTENT as RETRY_INTENT
from toolguard.store.sqlite_sql import ROW_HASH_FUNCTION as ROW_HASH_FUNCTION
from toolguard.store.sqlite_sql import VERSION_TABLE as VERSION_TABLE
from toolguard.store.sqlite_sql import _entry, _iso, _lenient_text, _loads

__all__ = ["AsyncSqliteStore", "SqliteStore"]

log = logging.getLogger("toolguard.store")

P = ParamSpec("P")
T = TypeVar("T")


class SqliteStore:
    """The guarded store in one SQLite file, shared by every process on the machine."""

    dialect = DIALECT

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout_ms: int = 30_000,
                 synchronous: str = "NORMAL", autoseal: AutoSeal | None = DEFAULT_AUTOSEAL
                 ) -> None:
        self.path = str(path)
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            msg = f"synchronous must be OFF, NORMAL, FULL or EXTRA, got {synchronous!r}"
            raise ConfigurationError(msg)
        self._connections = _Connections(self.path, busy_timeout_ms, synchronous.upper())
        #: Seals the audit rows this store writes (``toolguard.store.autoseal``; None: off).
        self.sealer = AutoSealer(self.seal_audit, autoseal, name="toolguard-autoseal-sqlite")

    def __repr__(self) -> str:
        return f"SqliteStore({self.path!r})"

    @contextlib.contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        """An autocommit connection, errors mapped to toolguard's.

        For reads and setup; writes that must be fenced go through ``fenced()``.
        """
        conn = self._connections.take()
        try:
            yield conn
        except sqlite3.Error as error:
            _raise_translated(error)
        finally:
            self._connections.give(conn)

    @contextlib.contextmanager
    def _immediate(self) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction: committed on success, rolled back on error."""
        with self.connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def install(self, steps: Sequence[Migration] | None = None) -> int:
        """Create or upgrade the schema; idempotent, serialized by the write lock."""
        steps = tuple(steps) if steps is not None else migrations(DIALECT)
        with self._immediate() as conn:
            conn.execute(VERSION_TABLE)
            installed = {int(v) for (v,) in conn.execute(INSTALLED).fetchall()}
            for step in pending_migrations(steps, installed):
                log.info("installing toolguard schema %s (sqlite)", step.name)
                for statement in _statements(step.sql):
                    conn.execute(statement)
                conn.execute("INSERT OR IGNORE INTO toolguard_schema_version (version, name) "
                             "VALUES (?, ?)", (step.version, step.name))
            installed = {int(v) for (v,) in conn.execute(INSTALLED).fetchall()}
            return effective_version(installed, migrations(DIALECT))

    def schema_version(self) -> int:
        """The installed schema version (0: not installed; see ``effective_version``)."""
        with self.connection() as conn:
            present = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' "
                                   "AND name = 'toolguard_schema_version'").fetchone()
            if present is None:
                return 0
            installed = {int(v) for (v,) in conn.execute(INSTALLED).fetchall()}
            return effective_version(installed, migrations(DIALECT))

    def begin_intent(self, record: IntentRecord) -> Begun | Replay:
        """Reserve ``record.idempotency_key``: ``Begun`` (run it) or ``Replay`` (don't)."""
        key = record.idempotency_key
        if key is None:
            msg = f"begin_intent needs an idempotency key (tool {record.tool!r})"
            raise StoreError(msg, reason="invalid_intent")
        with self._immediate() as conn:
            row = conn.execute(INTENT_ROW, (key,)).fetchone()
            if row is None:
                conn.execute(NEW_INTENT, (key, record.tool, record.agent, record.workflow,
                                          dump_json(list(record.keys)), record.args_hash))
                return Begun(key, 1, None)
            tool, args_hash, status, attempts, result = row
            if tool != record.tool or args_hash != record.args_hash:
                raise _conflict(key, tool)
            if status == "applied":
                return Replay(key, _loads(result), int(attempts))
            conn.execute(RETRY_INTENT, (key,))
            return Begun(key, int(attempts) + 1, status)

    @contextlib.contextmanager
    def _session(self) -> Iterator[_Session]:
        with self.connection() as conn:
            yield _Session(self, conn)

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

    def _record_failure(self, conn: sqlite3.Connection, plan: FencePlan, entry: AuditEntry,
                        status: IntentStatus | None) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            intent = plan.intent
            if status is not None and intent is not None and intent.idempotency_key is not None:
                conn.execute(FAIL_INTENT, (intent.idempotency_key, intent.tool, intent.agent,
                                           intent.workflow, dump_json(list(intent.keys or plan.keys)),
                                           intent.args_hash, status, entry.reason))
            conn.execute(AUDIT_INSERT, entry.insert_values(DIALECT)).fetchall()
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        self.sealer.wrote()

    def audit(self, entry: AuditEntry) -> AuditEntry:
        """Append one audit row (for decisions taken outside a fenced write)."""
        with self.connection() as conn:
            (row,) = conn.execute(AUDIT_INSERT, entry.insert_values(DIALECT)).fetchall()
        self.sealer.wrote()
        return replace(entry, id=int(row[0]), at=datetime.fromisoformat(row[1]))

    def mark_unknown(self, idempotency_key: str, record: IntentRecord | None = None) -> bool:
        """Record that a call was cancelled mid-flight; never touches an applied intent.

        With ``record`` (the intent with that key) a missing row is created with
        status 'unknown'; without it only an existing row is marked. A row of
        another tool or other arguments is left alone. True if a row was marked.
        """
        params: tuple[str | None, ...]
        if record is None:
            query, params = MARK_UNKNOWN, (idempotency_key,)
        elif record.idempotency_key != idempotency_key:
            msg = (f"mark_unknown: the record's idempotency key {record.idempotency_key!r} is not "
                   f"{idempotency_key!r}")
            raise StoreError(msg, reason="invalid_intent")
        else:
            query, params = MARK_UNKNOWN_UPSERT, (
                idempotency_key, record.tool, record.agent, record.workflow,
                dump_json(list(record.keys)), record.args_hash)
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
        wanted = list(keys)
        if not wanted:
            return {}
        with self.connection() as conn:
            rows = conn.execute("SELECT key, token FROM toolguard_high_water WHERE key IN "
                                "(SELECT value FROM json_each(?))", (dump_json(wanted),)).fetchall()
        return {key: int(token) for key, token in rows}

    def query_audit(self, **filters: Any) -> list[AuditEntry]:
        """Audit rows matching ``filters`` (see ``AuditQuery``), newest first by default."""
        query = AuditQuery(**filters)
        where, params = query.where(DIALECT, _iso)
        tail, more = query.tail()
        with self.connection() as conn:
            # Text another program wrote that is not UTF-8 reads with U+FFFD in place of the
            # bad bytes, not as an error.
            previous = conn.text_factory
            conn.text_factory = _lenient_text
            try:
                rows = conn.execute(qmark(AUDIT_QUERY + where + tail), [*params, *more]).fetchall()
            finally:
                conn.text_factory = previous
        return [_entry(row) for row in rows]

    def seal_audit(self, *, max_rows: int = MAX_SEAL_ROWS, wait_s: float = 5.0) -> SealResult:
        """Seal every audit row not sealed yet into the chain (``toolguard audit seal``).

        Writers are serialized by the write lock, so every committed row can be
        sealed (``wait_s`` only matters on PostgreSQL); one seal of at most
        ``max_rows`` rows per write transaction, so writers wait briefly.
        """
        with self.connection() as conn:
            return sqlite_seal(conn, max_rows=max_rows)

    def verify_audit(self, *, anchor: str | Sequence[str] | None = None,
                     exports: Sequence[str | os.PathLike[str]] = ()) -> AuditVerification:
        """Check every audit row and seal (``toolguard audit verify``): see ``AuditVerification``.

        ``anchor``: seal hashes kept outside the store (a rewrite of the whole chain
        is caught only by them); ``exports``: export files of dropped ranges.
        """
        anchors = check_anchors(anchor)
        with self.connection() as conn:
            return sqlite_verify(conn, anchors=anchors, exports=exports)

    def export_audit(self, path: str | os.PathLike[str], *, before: datetime | None = None,
                     through_seq: int | None = None, drop: bool = False) -> ExportResult:
        """Export whole sealed ranges older than ``before`` (or through seal ``through_seq``) to
        ``path``; ``drop=True`` then deletes them from the store, keeping the rest verifiable."""
        with self.connection() as conn:
            return sqlite_export(conn, path, before=before, through_seq=through_seq, drop=drop)

    def close(self) -> None:
        """Seal the audit rows this store wrote (see ``autoseal``), then close its connections."""
        self.sealer.close()
        self._connections.close()

    def __enter__(self) -> SqliteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _statements(script: str) -> Iterator[str]:
    """Split a script into statements (triggers keep their inner ``;``), dropping comments."""
    buffer = ""
    for line in script.splitlines(keepends=True):
        if not buffer and (not line.strip() or line.lstrip().startswith("--")):
            continue
        buffer += line
        if sqlite3.complete_statement(buffer):
            yield buffer.strip()
            buffer = ""
    if buffer.strip():
        yield buffer.strip()


# --- asyncio ------------------------------------------------------------------------------------


class AsyncSqliteStore:
    """The asyncio face of ``SqliteStore``: every call runs in a worker thread."""

    dialect = DIALECT

    def __init__(self, path: str | os.PathLike[str], *, install: bool = False,
                 **options: Any) -> None:
        self.sync = SqliteStore(path, **options)
        self.path = self.sync.path
        #: ``install=True``: the schema is installed (or upgraded) before the first operation.
        self._install_pending = install
        self._install_lock = asyncio.Lock()

    async def _ready(self) -> None:
        """Run the install ``install=True`` asked for, once (retried by the next call if it fails)."""
        if not self._install_pending:
            return
        async with self._install_lock:
            if self._install_pending:
                await asyncio.to_thread(self.sync.install)
                self._install_pending = False

    async def _call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        await self._ready()
        return await asyncio.to_thread(fn, *args, **kwargs)

    def __repr__(self) -> str:
        return f"AsyncSqliteStore({self.path!r})"

    async def install(self, steps: Sequence[Migration] | None = None) -> int:
        """Create or upgrade the schema; idempotent."""
        async with self._install_lock:
            version = await asyncio.to_thread(self.sync.install, steps)
            self._install_pending = False
        return version

    async def schema_version(self) -> int:
        """The installed schema version (0: not installed)."""
        return await self._call(self.sync.schema_version)

    async def begin_intent(self, record: IntentRecord) -> Begun | Replay:
        """Reserve ``record.idempotency_key``: ``Begun`` (run it) or ``Replay`` (don't)."""
        return await self._call(self.sync.begin_intent, record)

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[_AsyncSession]:
        await self._ready()
        worker = _Worker()
        taking = worker.executor.submit(self.sync._connections.take)
        try:
            conn = await asyncio.wrap_future(taking)
        except BaseException:  # cancelled while the worker takes it: given back once taken
            await _given_back(worker, _give_taken, self.sync._connections, taking)
            raise
        try:
            yield _AsyncSession(_Session(self.sync, conn), worker)
        finally:
            # Queued behind any statement still running: the connection goes back idle
            # before the session ends, however it ends.
            await _given_back(worker, self.sync._connections.give, conn)

    def fenced(self, lease: FenceSource, intent: IntentRecord | None = None, *,
               detail: str | None = None, reads: ReadCheck | None = None
               ) -> contextlib.AbstractAsyncContextManager[AsyncFencedTransaction]:
        """``async with store.fenced(lease, intent) as tx``: as ``SqliteStore.fenced``."""
        return afenced_flow(self._session(), lease, intent, detail, reads)

    def read(self, keys: Iterable[str], intent: IntentRecord | None = None, *, caller: str,
             detail: str | None = None
             ) -> contextlib.AbstractAsyncContextManager[AsyncFencedTransaction]:
        """``async with store.read(keys, intent, caller=...) as tx``: as the sync ``read``."""
        plan = FencePlan.reading(tuple(keys), intent, Observe(caller), detail)
        return afenced_flow(self._session(), plan, intent, detail)

    async def audit(self, entry: AuditEntry) -> AuditEntry:
        """Append one audit row (for decisions taken outside a fenced write)."""
        return await self._call(self.sync.audit, entry)

    async def mark_unknown(self, idempotency_key: str,
                           record: IntentRecord | None = None) -> bool:
        """Record that a call was cancelled mid-flight (see ``SqliteStore.mark_unknown``)."""
        return await self._call(self.sync.mark_unknown, idempotency_key, record)

    async def has_applied(self, tool: str, resource_key: str, workflow: str | None = None) -> bool:
        """Whether ``tool`` was applied on ``resource_key`` (in ``workflow``, if given)."""
        return await self._call(self.sync.has_applied, tool, resource_key, workflow)

    async def high_water(self, key: str) -> int:
        """The greatest token accepted for ``key`` (0 if none)."""
        return await self._call(self.sync.high_water, key)

    async def high_waters(self, keys: Iterable[str]) -> dict[str, int]:
        """High-water marks of several keys in one query (absent keys are omitted)."""
        return await self._call(self.sync.high_waters, list(keys))

    async def query_audit(self, **filters: Any) -> list[AuditEntry]:
        """Audit rows matching ``filters`` (see ``AuditQuery``), newest first by default."""
        return await self._call(functools.partial(self.sync.query_audit, **filters))

    async def seal_audit(self, *, max_rows: int = MAX_SEAL_ROWS,
                         wait_s: float = 5.0) -> SealResult:
        """Seal the audit rows not sealed yet (see ``SqliteStore.seal_audit``)."""
        return await self._call(functools.partial(self.sync.seal_audit, max_rows=max_rows,
                                                  wait_s=wait_s))

    async def verify_audit(self, *, anchor: str | Sequence[str] | None = None,
                           exports: Sequence[str | os.PathLike[str]] = ()
                           ) -> AuditVerification:
        """Check every audit row and seal (see ``SqliteStore.verify_audit``)."""
        return await self._call(functools.partial(self.sync.verify_audit, anchor=anchor,
                                                  exports=exports))

    async def export_audit(self, path: str | os.PathLike[str], *,
                           before: datetime | None = None, through_seq: int | None = None,
                           drop: bool = False) -> ExportResult:
        """Export (and with ``drop=True`` drop) old sealed ranges (see
        ``SqliteStore.export_audit``)."""
        return await self._call(functools.partial(self.sync.export_audit, path, before=before,
                                                  through_seq=through_seq, drop=drop))

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[sqlite3.Connection]:
        """A raw autocommit connection; use it from ``asyncio.to_thread`` calls only."""
        await self._ready()
        conn = await asyncio.to_thread(self.sync._connections.take)
        try:
            yield conn
        finally:
            self.sync._connections.give(conn)

    async def close(self) -> None:
        """Seal the audit rows this store wrote (in a thread), then close its connections."""
        if not self.sync.sealer.idle:
            await asyncio.to_thread(self.sync.sealer.close)
        self.sync.close()

    aclose = close

    async def __aenter__(self) -> AsyncSqliteStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
