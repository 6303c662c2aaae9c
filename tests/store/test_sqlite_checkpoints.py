"""The embedded default's WAL is checkpointed by a background thread, not inside a call's COMMIT.

SQLite's own automatic checkpoint (at 1,000 pages) made one commit in about a
hundred copy the log back and sync the file before it returned. toolguard's
connections keep it only as a far safety net and a daemon thread per file runs
PASSIVE checkpoints after writes (``toolguard.runtime.sqlite_checkpoints``).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from toolguard.locks.sqlite import SqliteBackend
from toolguard.runtime import sqlite_checkpoints
from toolguard.store import AuditEntry, open_store

PAGE = 4096


def _runs_above(found: sqlite_checkpoints._Checkpointer, runs: int) -> int:
    """The checkpointer's run count once it is above ``runs`` (waiting up to 10 s)."""
    deadline = time.monotonic() + 10
    while found.runs <= runs and time.monotonic() < deadline:
        time.sleep(0.02)
    return found.runs


def _wal_pages(path: Path) -> int:
    wal = Path(f"{path}-wal")
    return wal.stat().st_size // PAGE if wal.exists() else 0


def test_store_and_lock_connections_keep_sqlites_checkpoint_only_as_a_safety_net(
        tmp_path: Path) -> None:
    path = tmp_path / "toolguard.db"
    store = open_store(f"sqlite:///{path}", install=True, autoseal=None)
    locks = SqliteBackend(path)
    try:
        with store.connection() as conn:
            assert conn.execute("PRAGMA wal_autocheckpoint").fetchone() == (
                sqlite_checkpoints.SAFETY_NET_PAGES,)
        assert locks._connection().execute("PRAGMA wal_autocheckpoint").fetchone() == (
            sqlite_checkpoints.SAFETY_NET_PAGES,)
    finally:
        locks.close()
        store.close()


def test_commits_do_not_checkpoint_and_the_background_thread_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "toolguard.db"
    store = open_store(f"sqlite:///{path}", install=True, autoseal=None)
    try:
        # First with the thread held back: the log grows past SQLite's default threshold,
        # so no commit on the call path checkpointed it.
        monkeypatch.setattr(sqlite_checkpoints, "wrote", lambda *args, **kwargs: None)
        for n in range(1000):
            store.audit(AuditEntry(decision="accepted", reason="applied", tool="t",
                                   args={"n": n, "pad": "x" * 2000}))
        assert _wal_pages(path) > 1200  # SQLite alone would have restarted it near 1,000
        monkeypatch.undo()
        # Then with it: one more write wakes it, and it checkpoints the whole log.
        store.audit(AuditEntry(decision="accepted", reason="applied", tool="t"))
        found = sqlite_checkpoints.checkpointer(str(path))
        assert found is not None
        assert _runs_above(found, 0) >= 1
        with sqlite3.connect(path) as conn:  # nothing left to copy back: the thread did it
            busy, logged, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        assert busy == 0 and logged == copied and logged > 1000
        assert store.verify_audit().ok
    finally:
        store.close()


@pytest.fixture
def held_lock_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                   ) -> Iterator[tuple[Path, SqliteBackend, sqlite_checkpoints._Checkpointer]]:
    """A lock file written once (key "k" granted to "a"), and its checkpointer, woken fast."""
    monkeypatch.setattr(sqlite_checkpoints, "DELAY_S", 0.01)
    path = tmp_path / "locks.db"
    locks = SqliteBackend(path)
    try:
        assert locks.try_acquire("k", "a", 5_000).token is not None
        found = sqlite_checkpoints.checkpointer(str(path))
        assert found is not None
        yield path, locks, found
    finally:
        locks.close()


@pytest.fixture
def quick_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpointers end after 0.2 s without writes (set before the first one starts)."""
    monkeypatch.setattr(sqlite_checkpoints, "IDLE_S", 0.2)


def test_the_checkpointer_ends_when_idle_and_starts_again(
        quick_idle: None,
        held_lock_file: tuple[Path, SqliteBackend, sqlite_checkpoints._Checkpointer]) -> None:
    _, locks, found = held_lock_file
    first = found._thread
    assert first is not None
    first.join(timeout=5)
    assert not first.is_alive() and found.runs >= 1  # checkpointed, then ended idle
    assert locks.release("k", "a")
    second = found._thread
    assert second is not None and second is not first
    second.join(timeout=5)
    assert found.runs >= 2


def test_an_in_memory_database_has_no_checkpointer() -> None:
    assert sqlite_checkpoints.checkpointer(":memory:") is None
    sqlite_checkpoints.wrote(":memory:")  # nothing to do, nothing raised


def test_the_checkpointer_never_makes_a_file_that_is_gone(
        held_lock_file: tuple[Path, SqliteBackend, sqlite_checkpoints._Checkpointer]) -> None:
    """A lock file deleted under a live checkpointer stays gone until its backend makes it
    again, with its tables (an empty file would look like one without them)."""
    path, locks, found = held_lock_file
    runs = _runs_above(found, 0)
    assert runs >= 1
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    sqlite_checkpoints.wrote(str(path))
    time.sleep(0.3)
    assert not path.exists() and found.runs == runs
    # the backend makes the file again, with its tables, and is checkpointed there
    assert locks.try_acquire("k2", "b", 5_000).token is not None
    assert _runs_above(found, runs) > runs


def test_a_relative_path_names_the_file_in_the_working_directory_of_each_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    in_first = sqlite_checkpoints.checkpointer("toolguard.db")
    monkeypatch.chdir(second)
    in_second = sqlite_checkpoints.checkpointer("toolguard.db")
    absolute = sqlite_checkpoints.checkpointer(str(second / "toolguard.db"))
    assert in_first is not None and in_second is not None
    assert in_first.path == str(first / "toolguard.db")
    assert in_second.path == str(second / "toolguard.db")
    # the absolute name of a file already known is the same checkpointer, found again by it
    assert absolute is in_second
    assert sqlite_checkpoints.checkpointer(str(second / "toolguard.db")) is in_second
