"""A replay found inside the fenced transaction still advances the fence.

The store checks a replay's tokens before it finds the intent applied: it has
then seen those tokens, and must refuse every lower one afterwards, exactly as
if the write had run. Only the fence advance is committed: the intent row is
left as it was, nothing of the tool runs, and the audit row says ``replayed``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from store.envs import StoreEnv, create_ledger, deposit, ledger_state, rows
from toolguard.errors import DuplicateIntent, StaleFencingToken
from toolguard.store import AsyncGuardedStore, GuardedStore, IntentRecord, Replay, latest_version
from toolguard.store import postgres as pg_store


def intent(key: str, args_hash: str = "h1") -> IntentRecord:
    return IntentRecord(tool="deposit", idempotency_key=key, args_hash=args_hash, agent="agent-r",
                        keys=("acct:a",), intent_id=f"call-{key}")


@pytest.fixture
def ledger(store: GuardedStore) -> GuardedStore:
    create_ledger(store, ["a", "b"])
    return store


def intent_row(store: GuardedStore, key: str) -> list[tuple[Any, ...]]:
    return rows(store, "SELECT status, attempts, result, tokens, updated_at, applied_at, "
                       "last_error FROM toolguard_intent WHERE idempotency_key = %s", (key,))


def decisions(store: GuardedStore) -> list[tuple[str, str, str | None]]:
    return [(e.decision, e.reason, e.idempotency_key)
            for e in store.query_audit(newest_first=False, limit=None)]


def test_a_replay_advances_the_fence_so_a_lower_token_is_refused(ledger: GuardedStore) -> None:
    with ledger.fenced({"acct:a": 10}, intent("k1")) as tx:
        tx.record(deposit(tx, "a", 5, "first"))
    applied = intent_row(ledger, "k1")
    with pytest.raises(DuplicateIntent) as caught, ledger.fenced({"acct:a": 20}, intent("k1")):
        pytest.fail("a replay must not run")
    assert caught.value.result == 5
    assert ledger.high_water("acct:a") == 20  # the store has seen 20
    assert intent_row(ledger, "k1") == applied  # the intent row is not touched
    with pytest.raises(StaleFencingToken) as stale, ledger.fenced({"acct:a": 15}, intent("k2")) as tx:
        deposit(tx, "a", 5, "a holder older than the replay's")
    assert (stale.value.token, stale.value.current) == (15, 20)
    assert ledger_state(ledger)[0]["a"] == (5, 1)
    assert decisions(ledger) == [("accepted", "applied", "k1"), ("replayed", "duplicate", "k1"),
                                 ("rejected", "stale_fencing_token", "k2")]
    (replayed,) = ledger.query_audit(decision="replayed")
    assert replayed.tokens == {"acct:a": 20}


def test_a_replay_advances_every_key_and_a_stale_replay_changes_nothing(
        ledger: GuardedStore) -> None:
    both = {"acct:a": 3, "acct:b": 3}
    with ledger.fenced(both, intent("multi")) as tx:
        tx.record("done")
    with pytest.raises(DuplicateIntent), ledger.fenced({"acct:a": 9, "acct:b": 7}, intent("multi")):
        pytest.fail("a replay must not run")
    assert ledger.high_waters(["acct:a", "acct:b"]) == {"acct:a": 9, "acct:b": 7}
    # a replay whose token is below the mark is refused as stale before it is found applied
    with pytest.raises(StaleFencingToken), ledger.fenced({"acct:a": 8, "acct:b": 8},
                                                         intent("multi")):
        pytest.fail("must not run")
    assert ledger.high_waters(["acct:a", "acct:b"]) == {"acct:a": 9, "acct:b": 7}
    assert [d for d, _, _ in decisions(ledger)] == ["accepted", "replayed", "rejected"]


def test_a_conflicting_key_still_rolls_the_fence_back(ledger: GuardedStore) -> None:
    """Only a replay commits: a key reused with other arguments is refused, fence untouched."""
    with ledger.fenced({"acct:a": 4}, intent("c1")) as tx:
        tx.record(1)
    with pytest.raises(Exception, match="other arguments"), \
            ledger.fenced({"acct:a": 30}, intent("c1", args_hash="other")):
        pytest.fail("must not run")
    assert ledger.high_water("acct:a") == 4


def test_an_async_replay_advances_the_fence(env: StoreEnv, ledger: GuardedStore) -> None:
    async def scenario(store: AsyncGuardedStore) -> None:
        assert await store.install() == latest_version(env.kind)
        async with store.fenced({"acct:a": 10}, intent("ak1")) as tx:
            tx.record("first")
        with pytest.raises(DuplicateIntent):
            async with store.fenced({"acct:a": 20}, intent("ak1")):
                pytest.fail("a replay must not run")
        assert await store.high_water("acct:a") == 20
        with pytest.raises(StaleFencingToken):
            async with store.fenced({"acct:a": 15}, intent("ak2")):
                pytest.fail("a stale write must not run")

    async def main() -> None:
        store = env.open_async()
        try:
            await scenario(store)
        finally:
            await store.close()

    asyncio.run(main())
    assert ledger.begin_intent(intent("ak1")) == Replay("ak1", "first", 1)
    assert [d for d, _, _ in decisions(ledger)] == ["accepted", "replayed", "rejected"]


@pytest.mark.parametrize("env", ["postgresql"], indirect=True)  # PostgreSQL's messages
def test_a_postgres_replay_costs_the_same_two_messages(env: StoreEnv, ledger: GuardedStore,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``BEGIN; SELECT toolguard_enter(...)``, then ``COMMIT`` with the audit row: one message each."""
    with ledger.fenced({"acct:a": 10}, intent("rt")) as tx:
        tx.record(1)
    sent: list[str] = []
    real = psycopg.ClientCursor.execute

    def counting(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        sent.append(str(query))
        return real(self, query, params, **kwargs)

    monkeypatch.setattr(psycopg.ClientCursor, "execute", counting)
    monkeypatch.setattr(psycopg.Connection, "execute", lambda *a, **k: pytest.fail(
        f"a replay sent another message: {a[1:]!r}"))
    with pytest.raises(DuplicateIntent), ledger.fenced({"acct:a": 20}, intent("rt")):
        pytest.fail("a replay must not run")
    monkeypatch.undo()
    assert len(sent) == 2, sent
    assert sent[0] == pg_store.ENTER_TX
    assert sent[1].startswith("COMMIT; ")
    assert ledger.high_water("acct:a") == 20
