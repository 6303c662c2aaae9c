"""The SQLite store's fenced write: the statements a guarded call's transaction runs.

Counted with SQLite's own trace of the statements its connection runs, so a statement
added to the path every call on the embedded default takes shows here; what the
statements do is checked by the store's other tests (replays, conflicts, retries).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from toolguard.errors import IdempotencyConflict
from toolguard.locks import connect
from toolguard.store import IntentRecord, open_store
from toolguard.store.recovery import run_fenced
from toolguard.store.sqlite import SqliteStore


def _intent(key: str, args_hash: str = "h1") -> IntentRecord:
    return IntentRecord(tool="add", idempotency_key=key, args_hash=args_hash, agent="agent-s",
                        workflow="wf-s", keys=("lead:1",), intent_id=f"call-{key}",
                        args={"delta": 1})


def _kinds(statements: list[str]) -> list[str]:
    return [s.split()[0] for s in statements]


def test_a_first_attempt_runs_one_intent_statement_and_a_replay_reads_the_row(
        tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'tg.db'}"
    store = open_store(url, install=True)
    locks = connect(f"sqlite:///{tmp_path / 'locks.db'}")
    assert isinstance(store, SqliteStore)
    try:
        with store.connection() as conn:
            conn.execute("CREATE TABLE lead (id TEXT PRIMARY KEY, score INTEGER NOT NULL)")
            conn.execute("INSERT INTO lead VALUES ('lead-1', 0)")
        statements: list[str] = []
        conn = store._connections.take()
        conn.set_trace_callback(statements.append)
        store._connections.give(conn)  # the single thread takes this one again

        def add(tx: object) -> int:
            (score,) = tx.execute(  # type: ignore[attr-defined]
                "UPDATE lead SET score = score + 1 WHERE id = 'lead-1' RETURNING score",
                expect_rows=1).fetchone()
            return int(score)

        first = run_fenced(locks, store, "lead:1", add, intent=_intent("k-1"))
        applied = _kinds(statements)
        statements.clear()
        replay = run_fenced(locks, store, "lead:1", add, intent=_intent("k-1"))
        replayed = _kinds(statements)
        with pytest.raises(IdempotencyConflict):
            run_fenced(locks, store, "lead:1", add, intent=_intent("k-1", args_hash="h2"))
        with store.connection() as conn:
            score = conn.execute("SELECT score FROM lead").fetchone()
            intents = conn.execute("SELECT count(*), min(status) FROM toolguard_intent").fetchone()
    finally:
        locks.close()
        store.close()
    assert first.value == 1 and replay.replayed and replay.value == 1
    assert tuple(score) == (1,) and tuple(intents) == (1, "applied")
    # BEGIN, the fence, the intent row (made: no read), the tool, the result, the keys'
    # versions (decisions across calls), the audit row, COMMIT
    assert applied[:3] == ["BEGIN", "INSERT", "INSERT"] and applied[-4:] == [
        "UPDATE", "INSERT", "INSERT", "COMMIT"], applied
    assert applied.count("SELECT") == 0 and len(applied) == 8, applied
    # the replay: the intent row is there, so it is read; its fence advance is committed
    # (its audit row is written after, as every replay's)
    assert replayed[:5] == ["BEGIN", "INSERT", "INSERT", "SELECT", "COMMIT"], replayed
