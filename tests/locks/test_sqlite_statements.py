"""The SQLite lock's uncontended grant and release: one read and the writes that must happen.

Counted with SQLite's own trace of the statements a connection runs, so a change that
adds a statement to the path every guarded call takes on the embedded default shows
here; the contract tests (``test_contract*``) check what the statements do.
"""

from __future__ import annotations

import time
from pathlib import Path

from toolguard.locks.sqlite import SqliteBackend


def _traced(backend: SqliteBackend) -> list[str]:
    statements: list[str] = []
    backend._connection().set_trace_callback(statements.append)
    return statements


def test_an_uncontended_grant_runs_four_statements_and_its_release_one(tmp_path: Path) -> None:
    backend = SqliteBackend(tmp_path / "locks.db")
    try:
        statements = _traced(backend)
        first = backend.try_acquire("lead:1", "owner-a:5000", 5_000)
        granted = list(statements)
        statements.clear()
        assert backend.release("lead:1", "owner-a:5000") is True
        released = list(statements)
        second = backend.try_acquire("lead:1", "owner-b:5000", 5_000)
    finally:
        backend.close()
    assert first.token is not None and second.token is not None and second.token > first.token
    # BEGIN IMMEDIATE, the token if the key is free and nobody is queued, the grant, COMMIT
    assert [s.split()[0] for s in granted] == ["BEGIN", "INSERT", "INSERT", "COMMIT"], granted
    # nobody queued: the hold is deleted in one statement, its own transaction
    assert [s.split()[0] for s in released] == ["DELETE"], released


def test_a_queue_takes_the_full_paths_and_the_key_goes_to_its_head(tmp_path: Path) -> None:
    backend = SqliteBackend(tmp_path / "locks.db")
    try:
        statements = _traced(backend)
        held = backend.try_acquire("lead:1", "owner-a:5000", 5_000)
        queued = backend.try_acquire("lead:1", "owner-b:5000", 5_000)
        assert held.token is not None and queued.token is None
        statements.clear()
        # a third owner arriving while the key is held is queued behind owner-b
        assert backend.try_acquire("lead:1", "owner-c:5000", 5_000).token is None
        # the release finds a queue: the full release hands the key to its head
        statements.clear()
        assert backend.release("lead:1", "owner-a:5000") is True
        released = [s.split()[0] for s in statements]
        # owner-c may not jump the queue once the key is owner-b's
        assert backend.try_acquire("lead:1", "owner-c:5000", 5_000).token is None
        handed = backend.try_acquire("lead:1", "owner-b:5000", 5_000)
        assert handed.token is not None and handed.token > held.token
        assert backend.current_token("lead:1") == handed.token
        # a release by someone who does not hold the key changes nothing
        assert backend.release("lead:1", "owner-a:5000") is False
        assert backend.try_acquire("lead:1", "owner-c:5000", 5_000).token is None
    finally:
        backend.close()
    assert released[0] == "DELETE" and "BEGIN" in released and released[-1] == "COMMIT", released


def test_a_hold_past_its_expiry_is_taken_over_on_the_short_path(tmp_path: Path) -> None:
    backend = SqliteBackend(tmp_path / "locks.db")
    try:
        first = backend.try_acquire("lead:1", "owner-a:5000", 1)
        assert first.token is not None
        db = backend._connection()
        db.execute("UPDATE tg_lock SET expires_us = expires_us - 10000000 WHERE key = 'lead:1'")
        statements = _traced(backend)
        taken = backend.try_acquire("lead:1", "owner-b:5000", 5_000)
        assert taken.token is not None and taken.token > first.token
        assert [s.split()[0] for s in statements] == ["BEGIN", "INSERT", "INSERT", "COMMIT"]
        # the stale holder's release deletes nothing
        assert backend.release("lead:1", "owner-a:5000") is False
        assert db.execute("SELECT owner FROM tg_lock WHERE key = 'lead:1'").fetchone() == (
            "owner-b:5000",)
    finally:
        backend.close()


def test_the_holder_asking_again_extends_its_hold(tmp_path: Path) -> None:
    backend = SqliteBackend(tmp_path / "locks.db")
    try:
        first = backend.try_acquire("lead:1", "owner-a:5000", 5_000)
        again = backend.try_acquire("lead:1", "owner-a:5000", 60_000)
        (expires_us,) = backend._connection().execute(
            "SELECT expires_us FROM tg_lock WHERE key = 'lead:1'").fetchone()
    finally:
        backend.close()
    assert first.token is not None and again.token == first.token
    assert expires_us > time.time_ns() // 1000 + 50_000_000


def test_a_token_is_minted_above_the_last_one_even_when_the_clock_is_behind(
        tmp_path: Path) -> None:
    backend = SqliteBackend(tmp_path / "locks.db")
    try:
        future = 2**62  # a floor far ahead of the clock (raised by the store's high water)
        backend.raise_floor("lead:1", future)
        attempt = backend.try_acquire("lead:1", "owner-a:5000", 5_000)
        assert attempt.token == future + 1 and backend.current_token("lead:1") == future + 1
        assert backend.release("lead:1", "owner-a:5000")
        assert backend.try_acquire("lead:1", "owner-b:5000", 5_000).token == future + 2
    finally:
        backend.close()
