"""SQLite backend: the embedded default, shared by every process on one machine.

Each operation is one ``BEGIN IMMEDIATE`` transaction on a WAL database, so the
grant and the token are one atomic step here too. Waiters are woken by the
releaser, which hands the lock over in its own transaction (for the waiter's
hand-off TTL, carried in its owner id) and then sends the token as a datagram
to the socket the waiter opened for that key (Linux abstract namespace: no files
to clean up); a bounded poll covers a holder that crashed. Tokens use the same
hybrid clock as the Redis backend, and the fence rows are durable.

Stale datagrams: the releaser sends after its commit, so a datagram may arrive
long after its grant ended (the releaser or the waiter was stopped, the waiter
gave up and queued again). Each "queued" answer records the key's last token as
it saw it, and ``wait`` drops datagrams at or below it: a grant still the
owner's would have been returned by that call, so an older token is one that is
over. A socket per (owner, key) keeps the datagrams of one key from another's
wait.

The uncontended call takes short paths: a grant that mints its token only if
the key is free and nobody is queued (no read first), and a release that is one
``DELETE`` when nobody is queued. Anything else falls through to the full step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import sqlite3
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from toolguard.errors import BackendUnavailable
from toolguard.locks.base import MIN_TTL_MS, Attempt, BackendInfo, check_ms, owner_handoff_ms
from toolguard.runtime import sqlite_checkpoints

__all__ = ["AsyncSqliteBackend", "SqliteBackend"]

INFO = BackendInfo(
    name="sqlite",
    durable_tokens=True,
    server_wakeup=sys.platform.startswith("linux"),
    fair=True,
    note="one machine only; processes share the database file",
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS tg_lock (
    key TEXT PRIMARY KEY, owner TEXT NOT NULL, token INTEGER NOT NULL,
    expires_us INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tg_lock_fence (
    key TEXT PRIMARY KEY, token INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tg_lock_waiter (
    key TEXT NOT NULL, owner TEXT NOT NULL, arrived_us INTEGER NOT NULL,
    present_until_us INTEGER NOT NULL, wake TEXT, PRIMARY KEY (key, owner));
CREATE INDEX IF NOT EXISTS tg_lock_waiter_order ON tg_lock_waiter (key, arrived_us);
"""

WAKE_SUPPORTED = sys.platform.startswith("linux")

#: One read for ``try_acquire``: the key's holder (owner, token, expiry; NULLs when free), the
#: first waiter still present, and whether any waiter is no longer present (to delete).
_LOOK = """
SELECT l.owner, l.token, l.expires_us,
       (SELECT w.owner FROM tg_lock_waiter w WHERE w.key = ?1 AND w.present_until_us >= ?2
        ORDER BY w.arrived_us, w.owner LIMIT 1),
       EXISTS (SELECT 1 FROM tg_lock_waiter w WHERE w.key = ?1 AND w.present_until_us < ?2)
FROM (SELECT 1) LEFT JOIN tg_lock l ON l.key = ?1"""
#: The key's next token (the last one + 1, or the clock ``?2`` if that is ahead), stored.
_MINT = ("INSERT INTO tg_lock_fence (key, token) VALUES (?1, ?2) ON CONFLICT (key) "
         "DO UPDATE SET token = max(token + 1, excluded.token) RETURNING token")
#: ``_MINT`` only when the key is free at ``?2`` and nobody is queued for it (no row at all:
#: an absent waiter's row is cleaned up by the full path): the grant every uncontended call
#: takes, without the read ``_LOOK`` does for the other cases. No row returned: not free.
_MINT_IF_FREE = (
    "INSERT INTO tg_lock_fence (key, token) SELECT ?1, ?2 "
    "WHERE NOT EXISTS (SELECT 1 FROM tg_lock WHERE key = ?1 AND expires_us > ?2) "
    "AND NOT EXISTS (SELECT 1 FROM tg_lock_waiter WHERE key = ?1) "
    "ON CONFLICT (key) DO UPDATE SET token = max(token + 1, excluded.token) RETURNING token")
_GRANT = ("INSERT INTO tg_lock (key, owner, token, expires_us) VALUES (?, ?, ?, ?) "
          "ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, "
          "token = excluded.token, expires_us = excluded.expires_us")
#: The release when nobody is queued for the key: one statement, its own transaction (no
#: waiter row can appear meanwhile: SQLite runs one writer at a time). Nothing deleted: not
#: held, or a queue to hand the key to; the full release in one transaction decides.
_RELEASE_UNQUEUED = ("DELETE FROM tg_lock WHERE key = ?1 AND owner = ?2 "
                     "AND NOT EXISTS (SELECT 1 FROM tg_lock_waiter WHERE key = ?1)")


def _now_us() -> int:
    return time.time_ns() // 1000


def _key_digest(key: str) -> str:
    """Names the key in a waiter's socket address in a bounded size."""
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


class SqliteBackend:
    """Locks in a SQLite file; one connection per thread, opened lazily."""

    info = INFO

    def __init__(self, path: str | os.PathLike[str] = "toolguard.db", *,
                 presence_ms: int = 2_000, busy_timeout_ms: int = 30_000) -> None:
        self.path = str(path)
        self.presence_ms = check_ms("presence_ms", presence_ms, MIN_TTL_MS)
        self.busy_timeout_ms = check_ms("busy_timeout_ms", busy_timeout_ms, 0)
        self._local = threading.local()
        self._sockets: dict[tuple[str, str], socket.socket] = {}
        #: (owner, key) -> the key's last token when the owner was last queued for it
        self._floors: dict[tuple[str, str], int] = {}
        self._sockets_lock = threading.Lock()
        self._prepared = False

    def prepare(self) -> None:
        """Create the file (and its folder) with the lock tables, if missing.

        Done by the first operation otherwise: ``connect()`` calls it so that a path
        that cannot be written fails at once; ``connect_async()`` leaves it to the
        first operation, which runs in a worker thread (file I/O blocks the loop).
        """
        try:
            self._connection()
        except (sqlite3.Error, OSError) as error:
            raise BackendUnavailable(f"sqlite {self.path}: {error}") from error

    # --- plumbing -------------------------------------------------------------------

    def _file(self) -> tuple[int, int] | None:
        """The lock file's identity (device, inode); None when it does not exist (or in memory)."""
        if self.path == ":memory:":
            return (0, 0)
        try:
            found = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (found.st_dev, found.st_ino)

    def _connection(self) -> sqlite3.Connection:
        """This thread's connection, to the file now at ``path``.

        An open connection keeps a deleted (or replaced) file alive: a process that
        kept using it would grant and renew locks nobody else sees, while every other
        process grants from the new file. So each use checks the file is still the one
        the connection opened (one ``stat``); if not, the connection is reopened on the
        file now there (created with the schema if it is gone), as a lock server
        restarted empty: leases held in the old file are lost at their next renewal,
        and tokens start again from the clock (the store re-seeds the floors).
        """
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is not None and getattr(self._local, "pid", None) == os.getpid():
            if self._file() == getattr(self._local, "file", None):
                return db
            with contextlib.suppress(sqlite3.Error):
                db.close()
            fresh = True
        else:
            fresh = self._file() is None or not self._prepared
        if fresh and self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=self.busy_timeout_ms / 1000,
                             isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        sqlite_checkpoints.configure(db)
        if fresh:
            db.executescript(SCHEMA)
            self._prepared = True
        self._local.db = db
        self._local.pid = os.getpid()
        self._local.file = self._file()
        return db

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        try:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
        except (sqlite3.Error, OSError) as error:  # OSError: the file's folder cannot be made
            raise BackendUnavailable(f"sqlite {self.path}: {error}") from error
        try:
            yield db
            db.execute("COMMIT")
            sqlite_checkpoints.wrote(self.path, self.busy_timeout_ms / 1000)
        except BaseException as error:
            with contextlib.suppress(sqlite3.Error):  # an open transaction would poison the connection
                db.execute("ROLLBACK")
            if isinstance(error, sqlite3.Error):  # translated at the boundary, like connect errors
                raise BackendUnavailable(f"sqlite {self.path}: {error}") from error
            raise

    def _wake_address(self, owner: str, key: str) -> str:
        return f"\0toolguard-{os.getpid()}-{owner}-{_key_digest(key)}"

    def _listen(self, owner: str, key: str) -> str | None:
        if not WAKE_SUPPORTED:
            return None
        address = self._wake_address(owner, key)
        with self._sockets_lock:
            if (owner, key) not in self._sockets:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sock.bind(address)
                self._sockets[(owner, key)] = sock
        return address

    def _socket(self, owner: str, key: str) -> socket.socket | None:
        with self._sockets_lock:
            return self._sockets.get((owner, key))

    def _forget(self, owner: str, key: str) -> None:
        with self._sockets_lock:
            sock = self._sockets.pop((owner, key), None)
            self._floors.pop((owner, key), None)
        if sock is not None:
            sock.close()

    def _handed(self, key: str, owner: str, data: bytes) -> int | None:
        """The token of a hand-off datagram if it is newer than the floor."""
        try:
            token = int(data)
        except ValueError:
            return None
        with self._sockets_lock:
            floor = self._floors.get((owner, key), 0)
        return token if token > floor else None

    @staticmethod
    def _mint(db: sqlite3.Connection, key: str, now_us: int) -> int:
        """The key's next token, stored: the last one + 1, or the clock if that is ahead."""
        (token,) = db.execute(_MINT, (key, now_us)).fetchone()
        return int(token)

    # --- the protocol ----------------------------------------------------------------

    def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        with self._transaction() as db:
            now = _now_us()
            minted = db.execute(_MINT_IF_FREE, (key, now)).fetchone()
            if minted is not None:  # free, nobody queued: granted at once
                token = int(minted[0])
                db.execute(_GRANT, (key, owner, token, now + ttl_ms * 1000))
                self._forget(owner, key)
                return Attempt(token=token)
            holder, token, expires_us, head, expired = db.execute(_LOOK, (key, now)).fetchone()
            if holder == owner and expires_us > now:  # ours already: extend it from now
                db.execute("UPDATE tg_lock SET expires_us = ? WHERE key = ?",
                           (now + ttl_ms * 1000, key))
                self._forget(owner, key)
                return Attempt(token=token)
            if holder is not None and expires_us > now:
                return self._enqueue(db, key, owner, now, retry_us=expires_us - now)
            if expired:
                db.execute("DELETE FROM tg_lock_waiter WHERE key = ? AND present_until_us < ?",
                           (key, now))
            if head is not None and head != owner:
                return self._enqueue(db, key, owner, now, retry_us=0)
            token = self._mint(db, key, now)
            db.execute(_GRANT, (key, owner, token, now + ttl_ms * 1000))
            if head is not None:
                db.execute("DELETE FROM tg_lock_waiter WHERE key = ? AND owner = ?", (key, owner))
        self._forget(owner, key)
        return Attempt(token=token)

    def _enqueue(self, db: sqlite3.Connection, key: str, owner: str, now: int,
                 retry_us: int) -> Attempt:
        wake = self._listen(owner, key)
        db.execute("INSERT INTO tg_lock_waiter (key, owner, arrived_us, present_until_us, wake) "
                   "VALUES (?, ?, ?, ?, ?) ON CONFLICT (key, owner) "
                   "DO UPDATE SET present_until_us = excluded.present_until_us",
                   (key, owner, now, now + self.presence_ms * 1000, wake))
        row = db.execute("SELECT token FROM tg_lock_fence WHERE key = ?", (key,)).fetchone()
        with self._sockets_lock:
            self._floors[(owner, key)] = row[0] if row else 0
        return Attempt(token=None, retry_ms=max(1, retry_us // 1000))

    def wait(self, key: str, owner: str, timeout_s: float) -> int | None:
        sock = self._socket(owner, key)
        if sock is None:
            time.sleep(timeout_s)
            return None
        until = time.monotonic() + max(timeout_s, 0.001)
        while (left := until - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data = sock.recv(64)
            except (TimeoutError, OSError):
                return None
            token = self._handed(key, owner, data)
            if token is not None:
                self._forget(owner, key)
                return token
        return None

    def release(self, key: str, owner: str) -> bool:
        if self._released_unqueued(key, owner):
            self._forget(owner, key)
            return True
        wake: tuple[str, int] | None = None
        with self._transaction() as db:
            now = _now_us()
            # This owner's own place in the queue, and every waiter no longer present.
            db.execute("DELETE FROM tg_lock_waiter WHERE key = ? AND (owner = ? OR "
                       "present_until_us < ?)", (key, owner, now))
            held = db.execute("DELETE FROM tg_lock WHERE key = ? AND owner = ?",
                              (key, owner)).rowcount > 0
            if held:
                wake = self._hand_off(db, key, now)
        self._forget(owner, key)
        if wake is not None and wake[0]:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, \
                    contextlib.suppress(OSError):  # the waiter left: it will find the grant
                sock.sendto(str(wake[1]).encode("ascii"), wake[0])
        return held

    def _released_unqueued(self, key: str, owner: str) -> bool:
        """Release ``owner``'s hold in one statement if nobody is queued for ``key``."""
        try:
            deleted = self._connection().execute(_RELEASE_UNQUEUED, (key, owner)).rowcount > 0
        except (sqlite3.Error, OSError) as error:
            raise BackendUnavailable(f"sqlite {self.path}: {error}") from error
        if deleted:
            sqlite_checkpoints.wrote(self.path, self.busy_timeout_ms / 1000)
        return deleted

    def _hand_off(self, db: sqlite3.Connection, key: str, now: int) -> tuple[str, int] | None:
        """Grant the key to the first waiter still present (the expired ones are gone)."""
        head = db.execute("SELECT owner, wake FROM tg_lock_waiter WHERE key = ? "
                          "ORDER BY arrived_us, owner LIMIT 1", (key,)).fetchone()
        if head is None:
            return None
        next_owner, wake = head
        token = self._mint(db, key, now)
        db.execute("INSERT INTO tg_lock (key, owner, token, expires_us) VALUES (?, ?, ?, ?)",
                   (key, next_owner, token, now + owner_handoff_ms(next_owner) * 1000))
        db.execute("DELETE FROM tg_lock_waiter WHERE key = ? AND owner = ?", (key, next_owner))
        return (wake or "", token)

    def renew(self, held: Sequence[tuple[str, str, int]]) -> list[bool]:
        with self._transaction() as db:
            now = _now_us()
            return [
                db.execute("UPDATE tg_lock SET expires_us = ? WHERE key = ? AND owner = ? "
                           "AND expires_us > ?", (now + ttl_ms * 1000, key, owner, now)).rowcount > 0
                for key, owner, ttl_ms in held
            ]

    def raise_floor(self, key: str, token: int) -> None:
        with self._transaction() as db:
            db.execute("INSERT INTO tg_lock_fence (key, token) VALUES (?, ?) ON CONFLICT (key) "
                       "DO UPDATE SET token = max(token, excluded.token)", (key, token))

    def current_token(self, key: str) -> int:
        row = self._connection().execute("SELECT token FROM tg_lock_fence WHERE key = ?",
                                         (key,)).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None
        with self._sockets_lock:
            for sock in self._sockets.values():
                sock.close()
            self._sockets.clear()
            self._floors.clear()


class AsyncSqliteBackend:
    """The asyncio face of ``SqliteBackend``: each step runs in a worker thread."""

    info = INFO

    def __init__(self, sync: SqliteBackend) -> None:
        self.sync = sync

    async def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        return await asyncio.to_thread(self.sync.try_acquire, key, owner, ttl_ms)

    async def wait(self, key: str, owner: str, timeout_s: float) -> int | None:
        """Await the releaser's datagram on the event loop itself.

        A blocking ``recv`` in ``to_thread`` would pin one default-executor
        thread per waiter: a handful of waiters then starve the releases that
        should wake them, and every hand-off falls back to the poll.
        """
        sock = self.sync._socket(owner, key)
        if sock is None:
            await asyncio.sleep(timeout_s)
            return None
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        until = time.monotonic() + max(timeout_s, 0.001)
        while (left := until - time.monotonic()) > 0:
            try:
                data = await asyncio.wait_for(loop.sock_recv(sock, 64), left)
            except (TimeoutError, OSError):
                return None
            token = self.sync._handed(key, owner, data)
            if token is not None:
                self.sync._forget(owner, key)
                return token
        return None

    async def release(self, key: str, owner: str) -> bool:
        return await asyncio.to_thread(self.sync.release, key, owner)

    async def raise_floor(self, key: str, token: int) -> None:
        await asyncio.to_thread(self.sync.raise_floor, key, token)

    async def aclose(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sync, name)
