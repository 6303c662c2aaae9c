"""The SQLite lock's uncontended grant and release: one read and the writes that must happen.

Counted with SQLite's own trace of the statements a connection runs, so a change that
adds a statement to the path every guarded call takes on the embedded default shows
here; the contract tests (``test_contract*``) check what the statements do.
"""

from __future__ import annotations

from pathlib import Path

from toolguard.locks.sqlite import SqliteBackend


def _traced(backend: SqliteBackend) -> list[str]:
    statements: list[str] = []
    backend._connection().set_trace_callback(statements.append)
    return statements


def test_an_uncontended_grant_and_release_run_five_statements_each(tmp_path: Path) -> None:
    backend = SqliteBackend(tmp_path / "locks.db")
    try:
        statements = _traced(backend)
        first = backend.try_acquire("lead:1", "owner-a", 5_000)
        granted = list(statements)
        statements.clear()
        assert backend.release("lead:1", "owner-a") is True
        released = list(statements)
        second = backend.try_acquire("lead:1", "owner-b", 5_000)
    finally:
        backend.close()
    assert first.token is not None and second.token is not None and second.token > first.token
    # BEGIN IMMEDIATE, the one read (holder, first waiter, expired waiters), the token, the
    # grant, COMMIT
    assert len(granted) == 5, granted
    assert [s.split()[0] for s in granted] == ["BEGIN", "SELECT", "INSERT", "INSERT", "COMMIT"]
    # BEGIN IMMEDIATE, this owner's queue place and absent waiters, the grant, the next
    # waiter, COMMIT
    assert [s.split()[0] for s in released] == ["BEGIN", "DELETE", "DELETE", "SELECT", "COMMIT"]


def test_a_token_is_minted_above_the_last_one_even_when_the_clock_is_behind(
        tmp_path: Path) -> None:
    backend = SqliteBackend(tmp_path / "locks.db")
    try:
        future = 2**62  # a floor far ahead of the clock (raised by the store's high water)
        backend.raise_floor("lead:1", future)
        attempt = backend.try_acquire("lead:1", "owner-a", 5_000)
        assert attempt.token == future + 1 and backend.current_token("lead:1") == future + 1
        assert backend.release("lead:1", "owner-a")
        assert backend.try_acquire("lead:1", "owner-b", 5_000).token == future + 2
    finally:
        backend.close()
