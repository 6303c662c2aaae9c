"""WAL checkpoints of a SQLite file, run by a background thread instead of inside a call's COMMIT.

By default SQLite checkpoints when a commit leaves more than 1,000 pages in the
write-ahead log: that commit copies the pages back into the database and syncs
the file before it returns. A guarded call writes a few pages (lock, fence,
intent, audit row and their indexes), so about one call in a hundred paid for
a checkpoint (a single thread's p99 was 15x its p50 on the embedded default).
toolguard's connections (the SQLite store's and the SQLite lock backend's) keep
SQLite's own checkpoint only as a safety net (``SAFETY_NET_PAGES``, for a
checkpointer that cannot keep up), and ``wrote(path)`` after a write wakes one
daemon thread per file and process that runs a PASSIVE checkpoint: it never
waits for a lock, never blocks a reader or a writer, and copies what it can.
The thread closes its connection and ends after ``IDLE_S`` without writes (a
file deleted or replaced meanwhile is not kept open), and starts again at the
next write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
import urllib.parse

__all__ = ["SAFETY_NET_PAGES", "configure", "wrote"]

log = logging.getLogger("toolguard.sqlite")

#: The WAL size (pages) at which a commit still checkpoints itself (about 80 MB of 4 KB pages).
SAFETY_NET_PAGES = 20_000
#: How soon after a write the checkpointer runs, at most (writes meanwhile share the run).
DELAY_S = 0.2
#: How long the checkpointer waits for another write before it closes and ends.
IDLE_S = 5.0


def configure(conn: sqlite3.Connection) -> None:
    """Set a new connection's automatic checkpoint to the safety net (see the module)."""
    conn.execute(f"PRAGMA wal_autocheckpoint={SAFETY_NET_PAGES}")


class _Checkpointer:
    """One file's checkpoints in this process: a daemon thread woken by ``wrote``."""

    def __init__(self, path: str, busy_timeout_s: float) -> None:
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self.runs = 0  # checkpoints done (for tests and diagnostics)
        self._written = threading.Event()
        self._mutex = threading.Lock()
        self._thread: threading.Thread | None = None

    def wrote(self) -> None:
        if not self._written.is_set():  # set and not yet taken: the coming run covers this write
            self._written.set()
        thread = self._thread
        if thread is None or not thread.is_alive():
            with self._mutex:
                if self._thread is None or not self._thread.is_alive():
                    thread = threading.Thread(
                        target=self._run, name="toolguard-sqlite-checkpoint", daemon=True)
                    try:
                        thread.start()
                    except RuntimeError as error:  # no thread to be had: the safety net stays
                        log.warning("sqlite %s: no checkpoint thread: %s", self.path, error)
                        return
                    self._thread = thread

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        opened: tuple[int, int] | None = None
        try:
            while self._written.wait(IDLE_S):
                self._written.clear()
                time.sleep(DELAY_S)  # let the writes of a burst land first
                now = _identity(self.path)
                if now is None:
                    continue  # deleted: its next writer makes a new file (and wakes us)
                if conn is not None and now != opened:  # replaced: follow the file now there
                    with contextlib.suppress(sqlite3.Error):
                        conn.close()
                    conn = None
                if conn is None:
                    # mode=rw: never create the file (a missing lock file is made by its backend,
                    # with its tables; an empty one made here would look like one without them)
                    conn = sqlite3.connect(f"file:{urllib.parse.quote(self.path)}?mode=rw",
                                           uri=True, timeout=self.busy_timeout_s,
                                           isolation_level=None, check_same_thread=False)
                    opened = now
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                self.runs += 1
        except sqlite3.Error as error:  # the file went away, or is busy: the next write retries
            log.debug("sqlite %s: checkpoint skipped: %s", self.path, error)
        finally:
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    conn.close()


def _identity(path: str) -> tuple[int, int] | None:
    """The file at ``path`` (device, inode), or None when there is none."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return (found.st_dev, found.st_ino)


_CHECKPOINTERS: dict[tuple[int, str], _Checkpointer] = {}
#: The same checkpointers by the absolute path a caller gave (which names one file whatever
#: the working directory), so that ``wrote`` need not normalize it on every commit.
_GIVEN: dict[tuple[int, str], _Checkpointer] = {}
_REGISTRY = threading.Lock()


def checkpointer(path: str, busy_timeout_s: float = 30.0) -> _Checkpointer | None:
    """The checkpointer of the file at ``path`` in this process (None for ``:memory:``)."""
    if path == ":memory:" or path.startswith("file::memory:"):
        return None
    pid = os.getpid()  # a forked child gets its own thread
    found = _GIVEN.get((pid, path))  # an absolute path seen before: no cwd to resolve it against
    if found is not None:
        return found
    key = (pid, os.path.abspath(path))
    found = _CHECKPOINTERS.get(key)
    if found is None:
        with _REGISTRY:
            found = _CHECKPOINTERS.get(key)
            if found is None:
                found = _CHECKPOINTERS[key] = _Checkpointer(key[1], busy_timeout_s)
    if os.path.isabs(path):
        _GIVEN[(pid, path)] = found
    return found


def wrote(path: str, busy_timeout_s: float = 30.0) -> None:
    """A write to ``path`` committed: checkpoint its WAL soon, off the caller's path."""
    found = checkpointer(path, busy_timeout_s)
    if found is not None:
        found.wrote()
