"""The ledger invariant under paused holders, and the seed's GC-pause diagram as a test.

PostgreSQL runs with Redis locks, SQLite with SQLite locks (``env`` fixture).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from store.envs import StoreEnv, check_ledger, create_ledger, deposit, ledger_state
from store.ledger_worker import Plan, run_process
from toolguard.errors import StaleFencingToken
from toolguard.locks import heartbeat
from toolguard.store import GuardedStore, IntentRecord
from toolguard.store.recovery import lock_regressed


@pytest.mark.timeout(120)
def test_ledger_invariant_with_paused_holders(env: StoreEnv, store: GuardedStore,
                                              tmp_path: Path) -> None:
    accounts = ("a", "b", "c")
    create_ledger(store, accounts)
    plan = Plan(env=env, accounts=accounts, threads=3, ops=12, ttl_ms=300, pause_p=0.2,
                pause_s=0.8, seed=random.randrange(1 << 30))
    context = multiprocessing.get_context("spawn")
    paths = [tmp_path / f"writer-{i}.json" for i in range(3)]
    children = [context.Process(target=run_process, args=(plan, f"p{i}", str(path)))
                for i, path in enumerate(paths)]
    for child in children:
        child.start()
    rng = random.Random(plan.seed)
    stops = 0
    try:
        time.sleep(1.5)  # let the writers get going (spawn imports take a while)
        # Freeze whole processes (heartbeat included) for longer than the TTL, at random points.
        while stops < 3 and any(c.is_alive() for c in children):
            victim = rng.choice([c for c in children if c.is_alive()])
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.pid or 0, signal.SIGSTOP)
                time.sleep(plan.ttl_ms / 1000 * 2.5)
                os.kill(victim.pid or 0, signal.SIGCONT)
            stops += 1
            time.sleep(rng.uniform(0.2, 0.6))
        for child in children:
            child.join(100)
    finally:
        for child in children:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(child.pid, signal.SIGCONT)  # type: ignore[arg-type]
            if child.is_alive():
                child.kill()
    assert [c.exitcode for c in children] == [0, 0, 0]
    reports = [r for path in paths for r in json.loads(path.read_text())["reports"]]
    assert len(reports) == 3 * plan.threads * plan.ops
    assert {r["outcome"] for r in reports} <= {"accepted", "rejected", "lease_lost"}
    check_ledger(store, env, reports)
    # a holder whose lease ran out before its commit: refused, audited once, never applied
    lost = [e.intent_id for e in store.query_audit(reason="lease_lost", limit=None)]
    assert sorted(lost) == sorted(r["intent_id"] for r in reports if r["outcome"] == "lease_lost")
    rejected = sum(r["outcome"] == "rejected" for r in reports)
    assert rejected >= 1, "no holder was ever stale: the pauses did not overlap another writer"


def test_gc_pause_diagram(env: StoreEnv, store: GuardedStore) -> None:
    """A gets N, pauses past its TTL; B gets N+1 and writes; A wakes and writes: rejected."""
    create_ledger(store, ["101"])
    key = env.key("acct:101")
    locks = env.locks(ttl_ms=300)
    try:
        lease_a = locks.acquire([key], ttl_ms=300)  # 1-2: granted token N
        heartbeat().remove(lease_a)  # [GC pause on A]: no renewals, the TTL runs out
        lease_b = locks.acquire([key], ttl_ms=5_000, timeout_s=5)  # 3-4: granted N+1
        assert lease_b.tokens[key] > lease_a.tokens[key]
        assert lease_a.lost
        with store.fenced(lease_b.tokens, IntentRecord(tool="deposit", agent="B",
                                                       intent_id="b-write")) as tx:
            deposit(tx, "101", 10, "b-write")  # 5: accepted
        with pytest.raises(StaleFencingToken) as caught, store.fenced(
                lease_a.tokens, IntentRecord(tool="deposit", agent="A", intent_id="a-write")) as tx:
            deposit(tx, "101", 99, "a-write")  # 6: rejected, N < N+1
        error = caught.value
        assert (error.key, error.token, error.current) == (key, lease_a.tokens[key],
                                                           lease_b.tokens[key])
        assert not lock_regressed(lease_a, error)  # a genuine stale holder: no re-seed
        lease_b.release()
        lease_a.release()
    finally:
        locks.close()
    assert ledger_state(store)[0]["101"] == (10, 1)
    (rejected,) = store.query_audit(decision="rejected")
    assert (rejected.agent, rejected.reason, rejected.tokens) == (
        "A", "stale_fencing_token", {key: error.token})
    (accepted,) = store.query_audit(decision="accepted")
    assert accepted.agent == "B"


def test_holder_waking_between_read_and_write_is_rejected(env: StoreEnv,
                                                          store: GuardedStore) -> None:
    """The lost-update window: B has read (inside its fenced transaction), A wakes and writes.

    A's fence waits for B's transaction, then sees B's newer token: rejected,
    and B's write is computed from a read no one can invalidate.
    """
    create_ledger(store, ["x"])
    key = env.key("acct:x")
    b_has_read = threading.Event()
    a_tried = threading.Event()
    outcome: dict[str, object] = {}

    def stale_a() -> None:
        b_has_read.wait(5)
        try:
            a_tried.set()
            with store.fenced({key: 1}, IntentRecord(tool="deposit", agent="A")) as tx:
                deposit(tx, "x", 50, "a")
            outcome["a"] = "accepted"
        except StaleFencingToken as error:
            outcome["a"] = ("rejected", error.current)

    thread = threading.Thread(target=stale_a)
    thread.start()
    with store.fenced({key: 2}, IntentRecord(tool="deposit", agent="B")) as tx:
        (balance,) = tx.execute("SELECT balance FROM ledger_account WHERE id = %s",
                                ("x",)).fetchone()
        b_has_read.set()
        a_tried.wait(5)
        time.sleep(0.2)  # A is now blocked on B's fence row (PostgreSQL) / write lock (SQLite)
        tx.execute("UPDATE ledger_account SET balance = %s, version = version + 1 WHERE id = %s",
                   (balance + 7, "x"))
    thread.join(10)
    assert outcome["a"] == ("rejected", 2)
    assert ledger_state(store)[0]["x"] == (7, 1)
