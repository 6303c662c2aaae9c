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
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, ParamSpec, TypeVar

from toolguard.cancellation import finish
from toolguard.errors import (
    AuditAppendOnly,
    BackendUnavailable,
    ConfigurationError,
    DuplicateIntent,
    IdempotencyConflict,
    StaleFencingToken,
    StoreError,
    ToolGuardError,
)
from toolguard.store.autoseal import DEFAULT_AUTOSEAL, AutoSeal, AutoSealer
from toolguard.store.base import (
    AUDIT_COLUMNS,
    AUDIT_SELECT,
    POLICY_VERSION_MAX,
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
    finite_ms,
    migrations,
    pending_migrations,
    qmark,
    schema_missing,
)
from toolguard.store.chain import (
    CANONICAL_FIELDS,
    AuditVerification,
    ExportResult,
    SealResult,
    sqlite_row_hash,
)
from toolguard.store.sealing import (
    MAX_SEAL_ROWS,
    check_anchors,
    sqlite_export,
    sqlite_seal,
    sqlite_verify,
)

__all__ = ["AsyncSqliteStore", "SqliteStore"]

log = logging.getLogger("toolguard.store")

P = ParamSpec("P")
T = TypeVar("T")

DIALECT: Final = "sqlite"
NOW = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
ROW_HASH_FUNCTION = "toolguard_audit_row_hash"

VERSION_TABLE = f"""
CREATE TABLE IF NOT EXISTS toolguard_schema_version (
    version INTEGER PRIMARY KEY, name TEXT NOT NULL,
    installed_at TEXT NOT NULL DEFAULT ({NOW}))"""
INSTALLED = "SELECT version FROM toolguard_schema_version"
FENCE = (f"INSERT INTO toolguard_high_water (key, token) VALUES (?, ?) ON CONFLICT (key) "
         f"DO UPDATE SET token = excluded.token, updated_at = {NOW} "
         f"WHERE toolguard_high_water.token <= excluded.token RETURNING token")
INTENT_ROW = ("SELECT tool, args_hash, status, attempts, result FROM toolguard_intent "
              "WHERE idempotency_key = ?")
NEW_INTENT = ("INSERT INTO toolguard_intent (idempotency_key, tool, agent, workflow, keys, args_hash) "
              "VALUES (?, ?, ?, ?, ?, ?)")
RETRY_INTENT = (f"UPDATE toolguard_intent SET status = 'pending', attempts = attempts + 1, "
                f"updated_at = {NOW} WHERE idempotency_key = ?")
APPLY = (f"UPDATE toolguard_intent SET status = 'applied', result = ?, tokens = ?, last_error = NULL, "
         f"applied_at = {NOW}, updated_at = {NOW} WHERE idempotency_key = ? AND status <> 'applied'")
#: An attempt that reaches the fenced transaction on a failed/unknown intent is counted there
#: (only if it commits; a failed one is counted by ``FAIL_INTENT``).
COUNT_ATTEMPT = (f"UPDATE toolguard_intent SET attempts = attempts + 1, updated_at = {NOW} "
                 f"WHERE idempotency_key = ?")
# The failed attempt's own row may have been rolled back with it: upsert, never touching an
# applied row or another request's (other tool or args); count an attempt not counted yet.
FAIL_INTENT = (
    "INSERT INTO toolguard_intent AS i (idempotency_key, tool, agent, workflow, keys, args_hash, "
    "status, last_error) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
    f"ON CONFLICT (idempotency_key) DO UPDATE SET status = excluded.status, "
    f"last_error = excluded.last_error, updated_at = {NOW}, "
    f"attempts = i.attempts + (i.status <> 'pending') "
    f"WHERE i.status <> 'applied' AND i.tool = excluded.tool AND i.args_hash = excluded.args_hash")
#: The row's id and time are chosen in the statement (the next AUTOINCREMENT id, SQLite's
#: clock), so that its hash can cover them: ``toolguard_audit_row_hash`` (registered on every
#: connection, ``chain.sqlite_row_hash``) hashes the values as the columns will keep them.
#: Writers hold the database's write lock, so the id cannot be taken by anyone else meanwhile.
_NEXT_ID = ("max(coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'toolguard_audit'), 0), "
            "coalesce((SELECT max(id) FROM toolguard_audit), 0)) + 1")
_AUDIT_ROW = ", ".join(f"v.{c}" for c in ("id", "at", *AUDIT_COLUMNS))
AUDIT_INSERT = (
    f"INSERT INTO toolguard_audit (id, at, {', '.join(AUDIT_COLUMNS)}, row_hash) "
    f"SELECT {_AUDIT_ROW}, {ROW_HASH_FUNCTION}({_AUDIT_ROW}) "
    f"FROM (SELECT {_NEXT_ID} AS id, {NOW} AS at, "
    f"{', '.join(f'? AS {c}' for c in AUDIT_COLUMNS)}) AS v RETURNING id, at")
MARK_UNKNOWN = (f"UPDATE toolguard_intent SET status = 'unknown', updated_at = {NOW} "
                f"WHERE idempotency_key = ? AND status <> 'applied'")
MARK_UNKNOWN_UPSERT = (
    "INSERT INTO toolguard_intent AS i (idempotency_key, tool, agent, workflow, keys, args_hash, "
    "status) VALUES (?, ?, ?, ?, ?, ?, 'unknown') "
    f"ON CONFLICT (idempotency_key) DO UPDATE SET status = 'unknown', updated_at = {NOW} "
    f"WHERE i.status <> 'applied' AND i.tool = excluded.tool AND i.args_hash = excluded.args_hash")
HAS_APPLIED = ("SELECT EXISTS (SELECT 1 FROM toolguard_intent WHERE status = 'applied' AND tool = ? "
               "AND EXISTS (SELECT 1 FROM json_each(toolguard_intent.keys) WHERE json_each.value = ?) "
               "AND (? IS NULL OR workflow = ?))")
AUDIT_QUERY = f"SELECT {', '.join(AUDIT_SELECT)} FROM toolguard_audit"

_APPEND_ONLY = " is append-only: "  # toolguard_audit, toolguard_audit_seal, ..._retention


def translate(error: BaseException) -> BaseException:
    """sqlite3 errors to toolguard's; anything else is returned unchanged."""
    if not isinstance(error, sqlite3.Error):
        return error
    text = str(error)
    if _APPEND_ONLY in text and text.startswith("toolguard_audit"):
        return AuditAppendOnly(text)
    if isinstance(error, sqlite3.OperationalError):
        if "no such table: toolguard_" in text:
            return schema_missing(error)
        if "locked" in text or "busy" in text or "unable to open" in text or "disk I/O" in text:
            return BackendUnavailable(f"sqlite: {text}")
    return error


def _raise_translated(error: BaseException) -> None:
    mapped = translate(error)
    if mapped is error:
        raise error
    raise mapped from error


def _iso(moment: datetime) -> str:
    """The ``at`` column's text form (UTC, milliseconds), so text order is time order."""
    utc = moment.astimezone(UTC)
    return utc.strftime("%Y-%m-%dT%H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z"


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


#: The audit columns the store writes as text (JSON columns included).
_TEXT = ("at", "decision", "reason", "tool", "agent", "intent_id", "idempotency_key", "workflow",
         "keys", "tokens", "args", "detail", "policy_version")


def _entry(row: Sequence[Any]) -> AuditEntry:
    values = dict(zip(AUDIT_SELECT, row, strict=True))
    try:
        if not all(values[name] is None or isinstance(values[name], str) for name in _TEXT):
            raise TypeError("a text column holds another type")
        values["at"] = datetime.fromisoformat(values["at"]) if values["at"] else None
        values["keys"] = tuple(_loads(values["keys"]) or ())
        values["tokens"] = {k: int(v) for k, v in (_loads(values["tokens"]) or {}).items()}
        values["args"] = _loads(values["args"])
        values["duration_ms"] = finite_ms(values["duration_ms"])
        return AuditEntry(**values)
    except (TypeError, ValueError, AttributeError, StoreError):
        return _salvaged(dict(zip(AUDIT_SELECT, row, strict=True)))


def _salvaged(values: dict[str, Any]) -> AuditEntry:
    """A row no store writes (its file's owner, or another program, put other values in it),
    read as far as it goes: what does not parse is shown as its text, or left out. Its row
    hash no longer matches, so ``toolguard audit verify`` reports it."""
    def text(value: Any) -> str | None:
        if value is None or value == "":
            return None
        return value.hex() if isinstance(value, bytes) else str(value)

    def loaded(value: Any) -> Any:
        try:
            return _loads(value)
        except (TypeError, ValueError):
            return text(value)

    try:
        at: datetime | None = datetime.fromisoformat(str(values["at"])) if values["at"] else None
    except ValueError:
        at = None
    if at is not None and at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    keys = loaded(values["keys"])
    tokens = loaded(values["tokens"])
    try:
        duration = finite_ms(values["duration_ms"])
    except (TypeError, ValueError):
        duration = None
    node = values["node_attempt"]
    version = text(values["policy_version"])
    return AuditEntry(
        id=values["id"] if isinstance(values["id"], int) else None, at=at,
        decision=text(values["decision"]) or "?", reason=text(values["reason"]) or "?",
        tool=text(values["tool"]), agent=text(values["agent"]),
        intent_id=text(values["intent_id"]), idempotency_key=text(values["idempotency_key"]),
        workflow=text(values["workflow"]),
        keys=tuple(str(k) for k in keys) if isinstance(keys, list) else (),
        tokens={str(k): v for k, v in tokens.items() if isinstance(v, int)}
        if isinstance(tokens, dict) else {},
        args=loaded(values["args"]), detail=text(values["detail"]), duration_ms=duration,
        node_attempt=node if isinstance(node, int) and not isinstance(node, bool) else None,
        policy_version=version if version and len(version) <= POLICY_VERSION_MAX else None)


def _conflict(key: str, tool: str) -> IdempotencyConflict:
    msg = f"idempotency key {key} was already used for {tool} with other arguments"
    return IdempotencyConflict(msg)


def _file_of(path: str) -> tuple[int, int] | None:
    """The identity (device, inode) of the file at ``path``; None when there is none."""
    if path == ":memory:":
        return (0, 0)
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return (found.st_dev, found.st_ino)


def _lenient_text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


class _Connections:
    """A small thread-safe pool of autocommit connections to one file (per process).

    A connection keeps the file it opened alive after the file is deleted or replaced:
    writes through it would go where nobody looks again, and reads would find fences
    the other processes no longer see. So a connection is used only while its file is
    still the one at ``path`` (one ``stat`` per take and per give); otherwise it is
    closed and a new one opened on the file now there. A store file deleted mid-run
    thus shows as a store without its schema, a clear ``StoreError``, and nothing applies.
    """

    def __init__(self, path: str, busy_timeout_ms: int, synchronous: str) -> None:
        self.path = path
        self.busy_timeout_ms = busy_timeout_ms
        self.synchronous = synchronous
        self._idle: list[sqlite3.Connection] = []
        self._files: dict[int, tuple[int, int] | None] = {}  # id(connection) -> its file
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _open(self) -> sqlite3.Connection:
        """A new connection; the file's folder is made here (first use, not construction:
        the asyncio store is built in the caller's event loop, and opens in a worker thread)."""
        if self.path != ":memory:":
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                msg = f"sqlite {self.path}: cannot create its directory: {error}"
                raise BackendUnavailable(msg) from error
        conn: sqlite3.Connection | None = None
        try:
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_ms / 1000,
                                   isolation_level=None, check_same_thread=False)
            self._wal(conn)
            conn.execute(f"PRAGMA synchronous={self.synchronous}")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.create_function(ROW_HASH_FUNCTION, len(CANONICAL_FIELDS), sqlite_row_hash,
                                 deterministic=True)
        except sqlite3.Error as error:
            if conn is not None:
                conn.close()
            msg = f"sqlite {self.path}: {error}"
            raise BackendUnavailable(msg) from error
        with self._lock:
            self._files[id(conn)] = _file_of(self.path)
        return conn

    def _discard(self, conn: sqlite3.Connection) -> None:
        with self._lock:
            self._files.pop(id(conn), None)
        with contextlib.suppress(sqlite3.Error):
            conn.close()

    def _wal(self, conn: sqlite3.Connection) -> None:
        """Switch the file to WAL. Several processes opening a new file at once race for it:
        the switch can fail with "database is locked" without waiting for the busy timeout,
        so retry until that timeout."""
        deadline = time.monotonic() + self.busy_timeout_ms / 1000
        pause = 0.005
        while True:
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as error:
                if "locked" not in str(error) or time.monotonic() >= deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def take(self) -> sqlite3.Connection:
        current = _file_of(self.path)
        elsewhere: list[sqlite3.Connection] = []
        found: sqlite3.Connection | None = None
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's connections are not ours
                self._idle, self._files, self._pid = [], {}, os.getpid()
            while self._idle:
                conn = self._idle.pop()
                if current is not None and self._files.get(id(conn)) == current:
                    found = conn
                    break
                elsewhere.append(conn)  # its file was deleted or replaced
        for conn in elsewhere:
            self._discard(conn)
        return found if found is not None else self._open()

    def give(self, conn: sqlite3.Connection) -> None:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        current = _file_of(self.path)
        with self._lock:
            if (self._pid == os.getpid() and current is not None
                    and self._files.get(id(conn)) == current):
                self._idle.append(conn)
                return
        self._discard(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            self._discard(conn)


class _Session:
    """The fenced flow's I/O on one connection (used from one thread at a time)."""

    def __init__(self, store: SqliteStore, conn: sqlite3.Connection) -> None:
        self.store = store
        self.conn = conn
        self.tx: FencedTransaction | AsyncFencedTransaction | None = None
        #: The replay ``begin`` found: its fence advance is committed, not rolled back.
        self.replay: DuplicateIntent | None = None

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
        """BEGIN IMMEDIATE, every fence in sorted order, then the intent row."""
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
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
        row = conn.execute(INTENT_ROW, (intent.idempotency_key,)).fetchone()
        if row is None:
            conn.execute(NEW_INTENT, (intent.idempotency_key, intent.tool, intent.agent,
                                      intent.workflow, dump_json(list(intent.keys or plan.keys)),
                                      intent.args_hash))
            return
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
        self.tx = tx
        return tx

    def commit(self, tx: FencedTransaction | AsyncFencedTransaction, entry: AuditEntry) -> None:
        if tx.failure is not None:
            raise tx.failure
        if not self.conn.in_transaction:
            msg = ("the fenced transaction was ended inside fenced() (a COMMIT or ROLLBACK by "
                   "the tool); the tool must never end it itself")
            raise StoreError(msg, reason="transaction_ended")
        key = tx.intent.idempotency_key if tx.intent else None
        if key is not None:
            self.conn.execute(APPLY, (tx.result_json, tx.tokens_json, key))
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
               detail: str | None = None) -> contextlib.AbstractContextManager[FencedTransaction]:
        """One transaction: fences, the tool's SQL, the result and the audit row; all or nothing.

        ``lease``: a ``Lease`` (checked right before the commit: ``LockLost`` if it was lost
        or released meanwhile) or a mapping of key to token (no such check).
        """
        return fenced_flow(self._session(), lease, intent, detail)

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
        self.sync.tx = tx
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
               detail: str | None = None
               ) -> contextlib.AbstractAsyncContextManager[AsyncFencedTransaction]:
        """``async with store.fenced(lease, intent) as tx``: as ``SqliteStore.fenced``."""
        return afenced_flow(self._session(), lease, intent, detail)

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
