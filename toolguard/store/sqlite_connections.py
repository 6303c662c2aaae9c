"""The SQLite store's connections to its file, and what sqlite3's errors become.

``_Connections`` is the store's small per-process pool: every connection in WAL
mode with the row-hash function registered, used only while its file is still
the one at the path (a deleted or replaced file shows as a store without its
schema, not as writes nobody sees). ``translate`` maps sqlite3's errors to
toolguard's (a busy or locked file: ``BackendUnavailable``; the append-only
triggers: ``AuditAppendOnly``). Shared by the store, its sessions and the
asyncio twin's worker threads; ``toolguard.store.sqlite`` re-exports ``translate``.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from pathlib import Path

from toolguard.errors import AuditAppendOnly, BackendUnavailable
from toolguard.runtime import sqlite_checkpoints
from toolguard.store.base import schema_missing
from toolguard.store.chain import CANONICAL_FIELDS, sqlite_row_hash
from toolguard.store.sqlite_sql import ROW_HASH_FUNCTION

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


def _file_of(path: str) -> tuple[int, int] | None:
    """The identity (device, inode) of the file at ``path``; None when there is none."""
    if path == ":memory:":
        return (0, 0)
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return (found.st_dev, found.st_ino)


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
        self._changes: dict[int, int] = {}  # id(connection) -> its total_changes when last given
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
            sqlite_checkpoints.configure(conn)
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
            self._changes.pop(id(conn), None)
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
        changes = conn.total_changes
        with self._lock:
            wrote = changes != self._changes.get(id(conn), 0)
            self._changes[id(conn)] = changes
        if wrote:  # checkpoint its WAL soon, on the checkpointer's thread
            sqlite_checkpoints.wrote(self.path, self.busy_timeout_ms / 1000)
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
