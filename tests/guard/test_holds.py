"""Holding a record through the model's turn: ``hold: true`` reads, their ends, deadlocks.

Every test runs on both setups (SQLite, and Redis locks + PostgreSQL). Waits
are bounded waits for states (a thread inside its lock wait, a decision
returned), never assertions on durations: a deadlock is shown to be broken by
detection because the lock wait allowed is far longer than the test waits.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from guard.harness import Harness, wait_until
from guard.reads_world import Agent, Bank
from toolguard.call.decision import Decision
from toolguard.errors import PolicyProblems
from toolguard.policies import Policy
from toolguard.store.holds import Graph, yields

#: The reads keep their lock for the caller until it writes; waits far longer than any test.
HELD: dict[str, Any] = {
    "version": 1,
    "defaults": {"wait_timeout_s": 30, "max_hold_s": 60},
    "tools": {
        "get_balance": {"reads": ["account:{account_id}"], "hold": True},
        "set_balance": {"locks": ["account:{account_id}"], "requires_read": True},
    },
}


def _policy(**defaults: Any) -> dict[str, Any]:
    return {**HELD, "defaults": {**HELD["defaults"], **defaults}}


class Spy:
    """Notes which threads have entered the lock manager's ``acquire`` (waiting or not)."""

    def __init__(self, h: Harness) -> None:
        self.entered: dict[str, threading.Event] = {}
        original = h.locks.acquire

        def acquire(keys: Any, **options: Any) -> Any:
            self.event(threading.current_thread().name).set()
            return original(keys, **options)

        h.locks.acquire = acquire  # type: ignore[method-assign]

    def event(self, name: str) -> threading.Event:
        return self.entered.setdefault(name, threading.Event())


def _in_thread(name: str, work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``work`` in a thread; ``out`` gets its result, or the error it raised."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(work())
        except BaseException as error:
            out.append(error)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, out


def _holds_rows(h: Harness) -> list[tuple[Any, ...]]:
    return h.sql("SELECT key, caller FROM toolguard_hold") + \
        h.sql("SELECT key, caller FROM toolguard_hold_wait")


def test_hold_needs_reads() -> None:
    with pytest.raises(PolicyProblems, match="hold: true keeps the lock"):
        Policy.from_dict({"version": 1, "tools": {"t": {"locks": ["a:{x}"], "hold": True}}})


def test_the_youngest_caller_on_a_cycle_yields() -> None:
    graph = Graph([("a", "b"), ("b", "a")], {"a": 1.0, "b": 2.0})
    assert yields("b", graph) == ("b", "a")
    assert yields("a", graph) is None
    ring = Graph([("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")], {"a": 3, "b": 1, "c": 2, "d": 9})
    assert [who for who in "abcd" if yields(who, ring)] == ["a"]
    assert yields("a", Graph([("a", "b")], {"a": 5, "b": 1})) is None  # no cycle: no yield


def test_two_depositors_with_holds_end_exact_without_a_stale_read(harness: Any) -> None:
    """The second read waits for the first write: nobody decides on a value about to change."""
    h: Harness = harness(HELD)
    bank = Bank(h)
    bank.open({"acct": 100})
    spy = Spy(h)
    alice, bob = Agent(h, "alice", "t-a"), Agent(h, "bob", "t-b")
    seen = alice.read("acct")
    token = h.guard.holds.holding(h.guard.caller("alice", "t-a"))[0].lease.tokens["account:acct"]

    def bob_deposits() -> Decision:
        balance = bob.read("acct")
        return bob.call("set_balance", account_id="acct", balance=balance + 30)

    thread, out = _in_thread("bob", bob_deposits)
    assert spy.event("bob").wait(10)  # bob's read is at the lock, which alice holds
    written = alice.call("set_balance", account_id="acct", balance=seen + 25)
    assert written.ok and written.tokens == {"account:acct": token}  # under the held lease
    thread.join(20)
    assert out and out[0].ok, out
    assert bob.seen["acct"] == 125  # bob read after alice's write
    assert bank.balances("acct") == {"acct": 155}
    assert not [d for d in alice.decisions + bob.decisions if d.reason == "stale_read"]
    assert h.guard.holds.holding(h.guard.caller("bob", "t-b")) == []
    assert _holds_rows(h) == []
    detail = h.audit(intent_id=alice.decisions[0].intent.call_id)[0].detail or ""
    assert "hold taken" in detail and f"token {token}" in detail
    (row,) = h.audit(intent_id=written.intent.call_id)
    assert f"held since call {alice.decisions[0].intent.call_id}" in (row.detail or "")


def _transfer_both(agent: Agent, first: str, second: str, both_hold: threading.Barrier | None,
                   tries: int = 5) -> list[Decision]:
    """Read (hold) first, then second, then write both +1; told hold_deadlock, start over."""
    for _ in range(tries):
        a = agent.call("get_balance", account_id=first)
        if both_hold is not None:
            both_hold.wait(20)
            both_hold = None
        b = agent.call("get_balance", account_id=second)
        if not (a.ok and b.ok):
            assert b.reason == "hold_deadlock", b
            continue
        return [agent.call("set_balance", account_id=first, balance=int(a.result) + 1),
                agent.call("set_balance", account_id=second, balance=int(b.result) + 1)]
    raise AssertionError("never finished")


def _deadlock_round(h: Harness, tag: str) -> None:
    """Alice holds x and reads y, bob holds y and reads x, both at once: one yields, both end."""
    bank = Bank(h)
    bank.open({"x": 100, "y": 100})
    alice, bob = Agent(h, "alice", f"t-a{tag}"), Agent(h, "bob", f"t-b{tag}")
    barrier = threading.Barrier(2)
    ta, out_a = _in_thread("alice", lambda: _transfer_both(alice, "x", "y", barrier))
    tb, out_b = _in_thread("bob", lambda: _transfer_both(bob, "y", "x", barrier))
    # the lock wait allowed is 30 s: ending well before it means the cycle was detected
    ta.join(20)
    tb.join(20)
    assert out_a and out_b, "a deadlock was not broken"
    for out in (out_a, out_b):
        if isinstance(out[0], BaseException):
            raise out[0]
    _check_deadlock_round(h, [alice, bob], out_a[0] + out_b[0])


def _check_deadlock_round(h: Harness, agents: list[Agent], writes: list[Decision]) -> None:
    assert all(d.ok for d in writes), writes
    assert Bank(h).balances("x", "y") == {"x": 102, "y": 102}
    decisions = [d for agent in agents for d in agent.decisions]
    refused = [d for d in decisions if not d.ok]
    assert refused and {d.reason for d in refused} == {"hold_deadlock"}
    ended = [r for r in h.audit() if r.reason == "hold_ended"]
    assert ended and all("hold_deadlock" in (r.detail or "") for r in ended)
    assert _holds_rows(h) == []


@pytest.mark.parametrize("attempt", range(3))
def test_opposite_order_holds_are_broken_by_deadlock_at_once(harness: Any, attempt: int) -> None:
    _deadlock_round(harness(HELD), str(attempt))


async def _atransfer_both(agent: Agent, first: str, second: str,
                          both_hold: asyncio.Barrier | None) -> list[Decision]:
    for _ in range(5):
        a = await agent.acall("get_balance", account_id=first)
        if both_hold is not None:
            await asyncio.wait_for(both_hold.wait(), 20)
            both_hold = None
        b = await agent.acall("get_balance", account_id=second)
        if not (a.ok and b.ok):
            assert b.reason == "hold_deadlock", b
            continue
        return [await agent.acall("set_balance", account_id=first, balance=int(a.result) + 1),
                await agent.acall("set_balance", account_id=second, balance=int(b.result) + 1)]
    raise AssertionError("never finished")


def _adeadlock_round(h: Harness, tag: str) -> None:
    Bank(h).open({"x": 100, "y": 100})
    alice, bob = Agent(h, "alice", f"t-a{tag}"), Agent(h, "bob", f"t-b{tag}")

    async def main() -> list[list[Decision]]:
        async with h.async_edges():
            barrier = asyncio.Barrier(2)
            return list(await asyncio.wait_for(asyncio.gather(
                _atransfer_both(alice, "x", "y", barrier),
                _atransfer_both(bob, "y", "x", barrier)), 20))  # the lock wait allowed: 30 s

    done = asyncio.run(main())
    _check_deadlock_round(h, [alice, bob], done[0] + done[1])


@pytest.mark.parametrize("attempt", range(2))
def test_opposite_order_holds_on_the_async_path(harness: Any, attempt: int) -> None:
    _adeadlock_round(harness(HELD), str(attempt))


@pytest.mark.parametrize("setup", ["sqlite-store/sqlite-locks", "sqlite-store/etcd-locks",
                                   "postgresql-store/redis-locks",
                                   "postgresql-store/postgres-locks"])
def test_every_lock_backend(case_harness: Any, setup: str) -> None:
    h: Harness = case_harness(setup, HELD)
    bank = Bank(h)
    bank.open({"acct": 100})
    spy = Spy(h)
    alice, bob = Agent(h, "alice", "t-a"), Agent(h, "bob", "t-b")
    seen = alice.read("acct")
    thread, out = _in_thread("bob", lambda: bob.read("acct"))
    assert spy.event("bob").wait(10)
    assert alice.call("set_balance", account_id="acct", balance=seen + 25).ok
    thread.join(20)
    assert out == [125]
    assert bob.call("set_balance", account_id="acct", balance=155).ok
    _deadlock_round(h, "sync")
    _adeadlock_round(h, "async")


def test_opposite_order_holds_across_two_processes(backend: Any) -> None:
    """Each process sees only its own holds: the cycle is found in the store's wait-for graph."""
    import multiprocessing

    from guard import holds_processes

    h = Harness(backend, HELD)
    rounds = 5
    try:
        Bank(h).open({"x": 100, "y": 100})
        spawn = multiprocessing.get_context("spawn")
        barrier, out = spawn.Barrier(2), spawn.Queue()
        workers = [spawn.Process(target=holds_processes.transfers,
                                 args=(backend, HELD, name, first, second, rounds, barrier, out))
                   for name, first, second in (("alice", "x", "y"), ("bob", "y", "x"))]
        for worker in workers:
            worker.start()
        # each round's lock wait is allowed 30 s: the rounds ending well before means detection
        results = dict(out.get(timeout=120) for _ in workers)
        for worker in workers:
            worker.join(30)
        assert Bank(h).balances("x", "y") == {"x": 100 + 2 * rounds, "y": 100 + 2 * rounds}
        reasons = results["alice"] + results["bob"]
        assert set(reasons) == {"applied", "hold_deadlock"}, reasons
        assert reasons.count("applied") == 4 * rounds
        assert _holds_rows(h) == []
    finally:
        h.close()


def test_a_hold_ends_at_max_hold_s_and_the_late_write_is_refused(harness: Any) -> None:
    h: Harness = harness(_policy(max_hold_s=0.3))
    bank = Bank(h)
    bank.open({"acct": 100})
    hung, other = Agent(h, "hung", "t-h"), Agent(h, "other", "t-o")
    seen = hung.read("acct")  # and its model never comes back in time
    assert other.read("acct") == 100  # waits until the hold runs out (lock wait: 30 s)
    assert other.call("set_balance", account_id="acct", balance=110).ok
    late = hung.call("set_balance", account_id="acct", balance=seen + 1)
    assert (late.kind, late.reason) == ("rejected", "hold_lost")
    assert "read the record again" in late.model_text().lower()
    assert bank.balances("acct") == {"acct": 110}
    ended = [r for r in h.audit() if r.reason == "hold_ended"]
    assert [r.agent for r in ended] == ["hung"] and "max_hold_s" in (ended[0].detail or "")
    assert hung.read("acct") == 110  # a new read takes a new hold, and the write goes through
    assert hung.call("set_balance", account_id="acct", balance=111).ok


def test_release_holds_frees_the_key_at_once(harness: Any) -> None:
    h: Harness = harness(HELD)
    bank = Bank(h)
    bank.open({"acct": 100})
    spy = Spy(h)
    owner, waiter = Agent(h, "owner", "t-1"), Agent(h, "waiter", "t-2")
    owner.read("acct")
    thread, out = _in_thread("waiter", lambda: waiter.read("acct"))
    assert spy.event("waiter").wait(10)
    assert h.guard.release_holds(h.guard.caller("owner", "t-1")) == 1
    thread.join(20)  # far less than the 30 s lock wait or the 60 s max_hold_s
    assert out == [100]
    refused = owner.call("set_balance", account_id="acct", balance=200)
    assert refused.reason == "hold_lost"
    assert bank.balances("acct") == {"acct": 100}


def test_the_async_path_holds_and_cancellation_leaves_no_hold(harness: Any) -> None:
    h: Harness = harness(HELD)
    bank = Bank(h)
    bank.open({"acct": 100})
    alice, bob = Agent(h, "alice", "t-a"), Agent(h, "bob", "t-b")

    async def main() -> None:
        async with h.async_edges():
            seen = (await alice.acall("get_balance", account_id="acct")).result
            read_b = asyncio.create_task(bob.acall("get_balance", account_id="acct"))
            await asyncio.sleep(0)
            written = await alice.acall("set_balance", account_id="acct", balance=seen + 25)
            assert written.ok
            assert (await read_b).result == 125
            assert (await bob.acall("set_balance", account_id="acct", balance=155)).ok

            # a read cancelled while its tool runs leaves no hold behind
            started = asyncio.Event()

            async def stuck(ctx: Any) -> Any:
                started.set()
                await asyncio.Event().wait()

            task = asyncio.create_task(h.guard.arun(alice.intent("get_balance", account_id="acct"),
                                                    stuck))
            await asyncio.wait_for(started.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert h.guard.holds.holding(h.guard.caller("alice", "t-a")) == []
            assert (await bob.acall("get_balance", account_id="acct")).result == 155

    asyncio.run(main())
    assert bank.balances("acct") == {"acct": 155}
    wait_until(lambda: not h.sql("SELECT key FROM toolguard_hold WHERE caller = %s",
                                 (h.guard.caller("alice", "t-a"),)), what="no hold row")


def test_a_write_after_the_held_lease_was_lost_is_refused(harness: Any) -> None:
    from toolguard.errors import LockLost

    h: Harness = harness(HELD)
    bank = Bank(h)
    bank.open({"acct": 100})
    alice = Agent(h, "alice", "t-a")
    seen = alice.read("acct")
    (held,) = h.guard.holds.holding(h.guard.caller("alice", "t-a"))
    held.lease.mark_lost(LockLost("renewals failed", keys=held.lease.keys))  # as the heartbeat
    late = alice.call("set_balance", account_id="acct", balance=seen + 1)
    assert (late.kind, late.reason) == ("rejected", "hold_lost")
    assert bank.balances("acct") == {"acct": 100}
    ended = h.audit(reason="hold_ended")
    assert len(ended) == 1 and "lease was lost" in (ended[0].detail or "")
    assert alice.read("acct") == 100 and alice.call("set_balance", account_id="acct",
                                                     balance=101).ok


def test_a_paused_holder_cannot_write_after_its_hold_expired(harness: Any) -> None:
    """A holder stopped past its lease (no renewals): the next caller gets the key when the
    TTL runs out and writes; the zombie's late write is refused, nothing of it applied."""
    from toolguard.locks.lease import heartbeat

    h: Harness = harness(_policy(ttl_ms=400))
    bank = Bank(h)
    bank.open({"acct": 100})
    zombie, other = Agent(h, "zombie", "t-z"), Agent(h, "other", "t-o")
    seen = zombie.read("acct")
    (held,) = h.guard.holds.holding(h.guard.caller("zombie", "t-z"))
    heartbeat().remove(held.lease)  # the process is paused: nothing renews its lease
    assert other.read("acct") == 100  # waits for the TTL, then holds the key itself
    assert other.call("set_balance", account_id="acct", balance=150).ok
    late = zombie.call("set_balance", account_id="acct", balance=seen + 1)
    assert late.kind == "rejected" and late.reason in ("hold_lost", "lease_lost",
                                                       "stale_fencing_token"), late
    assert bank.balances("acct") == {"acct": 150}


def test_a_killed_holders_hold_expires_with_its_ttl(backend: Any) -> None:
    import multiprocessing

    from guard import holds_processes

    policy = _policy(ttl_ms=500)
    h = Harness(backend, policy)
    try:
        Bank(h).open({"acct": 100})
        spawn = multiprocessing.get_context("spawn")
        ready = spawn.Event()
        doomed = spawn.Process(target=holds_processes.hold_and_die, args=(backend, policy, ready))
        doomed.start()
        assert ready.wait(60)
        doomed.join(30)
        survivor = Agent(h, "survivor", "t-s")
        assert survivor.read("acct") == 100  # the dead process's hold lapsed with its TTL
        assert survivor.call("set_balance", account_id="acct", balance=101).ok
        assert Bank(h).balances("acct") == {"acct": 101}
        assert h.sql("SELECT caller FROM toolguard_hold") == []
    finally:
        h.close()


def test_max_hold_s_ends_an_asyncio_hold_on_its_loop(harness: Any) -> None:
    h: Harness = harness(_policy(max_hold_s=0.3))
    Bank(h).open({"acct": 100})
    hung, other = Agent(h, "hung", "t-h"), Agent(h, "other", "t-o")

    async def main() -> tuple[Any, ...]:
        async with h.async_edges():
            seen = (await hung.acall("get_balance", account_id="acct")).result
            waited = (await other.acall("get_balance", account_id="acct")).result
            wrote = await other.acall("set_balance", account_id="acct", balance=120)
            late = await hung.acall("set_balance", account_id="acct", balance=seen + 1)
            return waited, wrote.ok, late.reason

    assert asyncio.run(main()) == (100, True, "hold_lost")
    assert Bank(h).balances("acct") == {"acct": 120}
    ended = h.audit(reason="hold_ended")
    assert [r.agent for r in ended] == ["hung"] and "max_hold_s" in (ended[0].detail or "")
