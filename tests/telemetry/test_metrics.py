"""The metrics of a mixed run add up to what the audit log says, on the sync and async paths.

One run holds every kind of decision a guard makes: accepted, replayed,
refused before the lock (invalid arguments, not authorized, unknown tool),
refused by the lock (timeout), refused by the store (a holder paused past its
TTL: stale fencing token), refused by an ``after:`` rule (out of order) and let
through by one after a wait. ``toolguard.decisions`` by tool, agent, decision
and reason must equal the audit rows counted the same way; replays, stale
tokens, lock waits and ordering waits must equal the rows they stand for.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

import pytest
from guard.harness import Harness, HarnessFactory, wait_until
from guard.tools import EFFECT

from telemetry.recorder import Recorder
from toolguard.adapters import guarded
from toolguard.call.context import current
from toolguard.call.intent import Intent
from toolguard.locks import heartbeat

POLICY: dict[str, Any] = {"version": 1, "tools": {
    "add_score": {"locks": ["lead:{lead_id}"], "agents": ["scorer"], "ttl_ms": 300,
                  "wait_timeout_s": 10, "args": {"delta": {"ge": -100, "le": 100}}},
    "quick_score": {"locks": ["lead:{lead_id}"], "agents": ["scorer"], "wait_timeout_s": 0.1},
    "attach_log": {"locks": ["ticket:{ticket_id}"]},
    "close_ticket": {"locks": ["ticket:{ticket_id}"], "after": ["attach_log"],
                     "after_wait_s": 10},
    "archive_ticket": {"locks": ["ticket:{ticket_id}"], "after": ["attach_log"],
                       "after_wait_s": 0.05},
}}

EXPECTED = Counter({
    ("add_score", "scorer", "accepted", "applied"): 2,  # the fast call, and "a1"
    ("add_score", "scorer", "replayed", "duplicate"): 1,
    ("add_score", "scorer", "rejected", "invalid_arguments"): 1,
    ("add_score", "router", "rejected", "not_authorized"): 1,
    ("add_score", "scorer", "rejected", "stale_fencing_token"): 1,
    ("quick_score", "scorer", "rejected", "lock_timeout"): 1,
    ("attach_log", "support", "accepted", "applied"): 1,
    ("close_ticket", "support", "accepted", "applied"): 1,
    ("archive_ticket", "support", "rejected", "out_of_order"): 1,
    ("_OTHER", "scorer", "rejected", "unknown_tool"): 1,
})


def effect(tool: str, resource: str) -> None:
    ctx = current()
    ctx.tx.execute(EFFECT, (tool, resource, 0, ctx.intent.call_id, max(ctx.tokens.values())))


async def aeffect(tool: str, resource: str) -> None:
    ctx = current()
    await ctx.atx.execute(EFFECT, (tool, resource, 0, ctx.intent.call_id,
                                   max(ctx.tokens.values())))


def audit_counts(h: Harness) -> Counter[tuple[Any, ...]]:
    known = set(h.policy.tools)
    return Counter((row.tool if row.tool in known else "_OTHER", row.agent, row.decision,
                    row.reason) for row in h.audit())


def assert_metrics_match_the_audit_log(h: Harness, otel: Recorder) -> None:
    rows = h.audit()
    assert audit_counts(h) == EXPECTED  # the run did what it meant to
    assert otel.counts("toolguard.decisions", "gen_ai.tool.name", "gen_ai.agent.name",
                       "toolguard.decision", "toolguard.reason") == audit_counts(h)
    assert otel.total("toolguard.replays") == sum(r.decision == "replayed" for r in rows) == 1
    assert otel.counts("toolguard.fencing.stale_tokens", "gen_ai.tool.name",
                       "toolguard.reseeded") == {("add_score", False): 1}
    locked = sum(1 for r in rows if r.reason in ("applied", "duplicate", "stale_fencing_token"))
    assert otel.counts("toolguard.lock.wait.duration", "toolguard.outcome") == {
        ("acquired",): locked, ("lock_timeout",): 1}
    assert otel.total("toolguard.lock.hold.duration") == locked
    assert otel.counts("toolguard.order.waits", "gen_ai.tool.name", "toolguard.outcome") == {
        ("close_ticket", "satisfied"): 1, ("archive_ticket", "out_of_order"): 1}
    assert otel.total("toolguard.order.wait.duration") == 2
    # and one execute_tool span per audited decision, saying the same
    assert Counter((c.attributes["toolguard.decision"], c.attributes["toolguard.reason"])
                   for c in otel.calls()) == Counter((r.decision, r.reason) for r in rows)


def test_a_mixed_sync_run(harness: HarnessFactory, otel: Recorder) -> None:
    h = harness(POLICY)
    paused, resume, closing = threading.Event(), threading.Event(), threading.Event()

    @guarded(h.guard, agent="scorer")
    def add_score(lead_id: str, delta: int) -> int:
        effect("add_score", lead_id)
        return delta

    @guarded(h.guard, agent="scorer")
    def quick_score(lead_id: str) -> None:
        effect("quick_score", lead_id)

    @guarded(h.guard, agent="support")
    def attach_log(ticket_id: str) -> None:
        effect("attach_log", ticket_id)

    @guarded(h.guard, agent="support")
    def close_ticket(ticket_id: str) -> None:
        closing.set()
        effect("close_ticket", ticket_id)

    @guarded(h.guard, agent="support")
    def archive_ticket(ticket_id: str) -> None:
        effect("archive_ticket", ticket_id)

    acquire = h.guard.locks.acquire

    def pausing_acquire(keys: Any, **options: Any) -> Any:
        lease = acquire(keys, **options)
        if threading.current_thread().name == "slow":
            heartbeat().remove(lease)  # a long pause right after the grant: no renewals
            paused.set()
            assert resume.wait(10)
        return lease

    h.guard.locks.acquire = pausing_acquire  # type: ignore[method-assign]

    args = {"lead_id": "a", "delta": 1}
    assert add_score.run(args, call_id="a1", thread_id="w").kind == "accepted"
    assert add_score.run(args, call_id="a1", thread_id="w").kind == "replayed"
    assert add_score.run({"lead_id": "a", "delta": 500}, call_id="a2", thread_id="w").reason == \
        "invalid_arguments"
    assert add_score.run(args, agent="router", call_id="a3", thread_id="w").reason == \
        "not_authorized"
    assert h.guard.run(Intent(tool="add_scores", call_id="a4", agent="scorer"),
                       lambda ctx: None).reason == "unknown_tool"

    slow_box: dict[str, Any] = {}
    slow = threading.Thread(name="slow", target=lambda: slow_box.setdefault(
        "d", add_score.run({"lead_id": "s", "delta": 1}, call_id="slow", thread_id="w")))
    slow.start()
    assert paused.wait(10)
    assert add_score.run({"lead_id": "s", "delta": 2}, call_id="fast", thread_id="w").ok
    resume.set()
    slow.join(10)
    assert slow_box["d"].reason == "stale_fencing_token"

    with h.backend.locks().acquire(["lead:q"], ttl_ms=5_000):
        assert quick_score.run({"lead_id": "q"}, call_id="q1", thread_id="w").reason == \
            "lock_timeout"

    assert archive_ticket.run({"ticket_id": "T-1"}, call_id="t1", thread_id="w").reason == \
        "out_of_order"
    looked = threading.Event()
    has_applied = h.guard.store.has_applied

    def watched_has_applied(*args: Any) -> bool:
        applied = has_applied(*args)
        if not applied:
            looked.set()  # the closer found no attach_log: it waits
        return applied

    h.guard.store.has_applied = watched_has_applied  # type: ignore[method-assign]
    box: dict[str, Any] = {}
    closer = threading.Thread(target=lambda: box.setdefault(
        "d", close_ticket.run({"ticket_id": "T-1"}, call_id="t2", thread_id="w")))
    closer.start()
    assert looked.wait(10)
    assert not closing.is_set()
    assert attach_log.run({"ticket_id": "T-1"}, call_id="t3", thread_id="w").ok
    closer.join(10)
    assert box["d"].ok

    assert_metrics_match_the_audit_log(h, otel)


def test_a_mixed_async_run(harness: HarnessFactory, otel: Recorder) -> None:
    h = harness(POLICY)

    @guarded(h.guard, agent="scorer")
    async def add_score(lead_id: str, delta: int) -> int:
        await aeffect("add_score", lead_id)
        return delta

    @guarded(h.guard, agent="scorer")
    async def quick_score(lead_id: str) -> None:
        await aeffect("quick_score", lead_id)

    @guarded(h.guard, agent="support")
    async def attach_log(ticket_id: str) -> None:
        await aeffect("attach_log", ticket_id)

    @guarded(h.guard, agent="support")
    async def close_ticket(ticket_id: str) -> None:
        await aeffect("close_ticket", ticket_id)

    @guarded(h.guard, agent="support")
    async def archive_ticket(ticket_id: str) -> None:
        await aeffect("archive_ticket", ticket_id)

    async def main() -> None:
        async with h.async_edges() as guard:
            paused, resume = asyncio.Event(), asyncio.Event()
            acquire = guard.async_locks.acquire

            async def pausing_acquire(keys: Any, **options: Any) -> Any:
                lease = await acquire(keys, **options)
                task = asyncio.current_task()
                if task is not None and task.get_name() == "slow":
                    heartbeat().remove(lease)
                    paused.set()
                    await resume.wait()
                return lease

            guard.async_locks.acquire = pausing_acquire  # type: ignore[method-assign]
            args = {"lead_id": "a", "delta": 1}
            assert (await add_score.arun(args, call_id="a1", thread_id="w")).kind == "accepted"
            assert (await add_score.arun(args, call_id="a1", thread_id="w")).kind == "replayed"
            assert (await add_score.arun({"lead_id": "a", "delta": 500}, call_id="a2",
                                         thread_id="w")).reason == "invalid_arguments"
            assert (await add_score.arun(args, agent="router", call_id="a3",
                                         thread_id="w")).reason == "not_authorized"

            async def nothing(ctx: Any) -> None:
                return None

            assert (await guard.arun(Intent(tool="add_scores", call_id="a4", agent="scorer"),
                                     nothing)).reason == "unknown_tool"

            slow = asyncio.create_task(add_score.arun({"lead_id": "s", "delta": 1},
                                                      call_id="slow", thread_id="w"), name="slow")
            await asyncio.wait_for(paused.wait(), 10)
            assert (await add_score.arun({"lead_id": "s", "delta": 2}, call_id="fast",
                                         thread_id="w")).ok
            resume.set()
            assert (await slow).reason == "stale_fencing_token"

            async with h.backend.alocks() as other:
                held = await other.acquire(["lead:q"], ttl_ms=5_000)
                try:
                    assert (await quick_score.arun({"lead_id": "q"}, call_id="q1",
                                                   thread_id="w")).reason == "lock_timeout"
                finally:
                    await held.arelease()

            assert (await archive_ticket.arun({"ticket_id": "T-1"}, call_id="t1",
                                              thread_id="w")).reason == "out_of_order"
            looked = asyncio.Event()
            has_applied = guard.async_store.has_applied

            async def watched_has_applied(*args: Any) -> bool:
                applied = await has_applied(*args)
                if not applied:
                    looked.set()  # the closer found no attach_log: it waits
                return applied

            guard.async_store.has_applied = watched_has_applied  # type: ignore[method-assign]
            closer = asyncio.create_task(close_ticket.arun({"ticket_id": "T-1"}, call_id="t2",
                                                           thread_id="w"))
            await asyncio.wait_for(looked.wait(), 10)
            assert not closer.done()
            assert (await attach_log.arun({"ticket_id": "T-1"}, call_id="t3",
                                          thread_id="w")).ok
            assert (await closer).ok

    asyncio.run(main())

    assert_metrics_match_the_audit_log(h, otel)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_lease_lost_mid_tool_is_counted_and_shown_on_the_transaction(
        harness: HarnessFactory, otel: Recorder) -> None:
    """The holder stops renewing inside the tool and another agent takes the lock: the loss is
    counted once (``toolguard.leases.lost``) and marked on the open transaction's span."""
    h = harness(POLICY)
    inside, taken, finished = threading.Event(), threading.Event(), threading.Event()

    @guarded(h.guard, agent="scorer")
    def add_score(lead_id: str, delta: int) -> int:
        ctx = current()
        heartbeat().remove(ctx.lease)
        inside.set()
        assert taken.wait(10)
        wait_until(lambda: ctx.lease.lost, what="the lease's loss")
        effect("add_score", lead_id)
        return delta

    def other_agent() -> None:
        assert inside.wait(10)
        with h.backend.locks().acquire(["lead:a"], ttl_ms=5_000, timeout_s=10):
            taken.set()
            assert finished.wait(10)

    other = threading.Thread(target=other_agent)
    other.start()
    decision = add_score.run({"lead_id": "a", "delta": 1}, call_id="lost", thread_id="w")
    finished.set()
    other.join(10)

    assert (decision.kind, decision.reason) == ("rejected", "lease_lost")
    assert otel.counts("toolguard.leases.lost", "toolguard.reason") == {("lease_lost",): 1}
    (transaction,) = otel.spans("toolguard.fenced_transaction")
    assert [e.name for e in transaction.events] == ["toolguard.lease.lost"]
    assert transaction.attributes["error.type"] == "lease_lost"
    (call,) = otel.calls()
    assert call.attributes["toolguard.reason"] == "lease_lost"
    assert h.decisions("lost") == [("rejected", "lease_lost")]


def test_a_regressed_lock_server_is_one_call_with_two_attempts_and_a_reseeded_stale_count(
        harness: HarnessFactory, otel: Recorder) -> None:
    """The store holds a token from a clock an hour ahead: the first grant is below it, the
    store refuses it (audited), toolguard re-seeds the lock server and the retry is applied.
    One call, one decision; the refusal is counted as a stale token with ``reseeded``."""
    h = harness(POLICY)
    future = int(time.time() * 1_000_000) + 3_600 * 1_000_000
    with h.store.fenced({"lead:r": future}):
        pass

    @guarded(h.guard, agent="scorer")
    def add_score(lead_id: str, delta: int) -> int:
        effect("add_score", lead_id)
        return delta

    decision = add_score.run({"lead_id": "r", "delta": 1}, call_id="r1", thread_id="w")

    assert decision.kind == "accepted" and decision.tokens["lead:r"] > future
    assert h.decisions("r1") == [("rejected", "stale_fencing_token"), ("accepted", "applied")]
    assert otel.counts("toolguard.decisions", "toolguard.decision") == {("accepted",): 1}
    assert otel.counts("toolguard.fencing.stale_tokens", "toolguard.reseeded") == {(True,): 1}
    (call,) = otel.calls()
    # the first transaction is refused at its fence check, before the tool runs
    assert otel.tree(call) == [(0, "execute_tool add_score"), (1, "toolguard.validate"),
                               (1, "toolguard.lock.wait"), (1, "toolguard.fenced_transaction"),
                               (1, "toolguard.lock.wait"), (1, "toolguard.fenced_transaction"),
                               (2, "toolguard.tool")]
    first, second = otel.spans("toolguard.fenced_transaction")
    assert (first.attributes["toolguard.attempt"], second.attributes["toolguard.attempt"]) == (1, 2)
    assert first.attributes["error.type"] == "stale_fencing_token"
    assert "error.type" not in second.attributes
    assert list(call.attributes["toolguard.fencing_tokens"]) == [decision.tokens["lead:r"]]


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_hold_durations_by_how_each_hold_ended(harness: HarnessFactory, otel: Recorder) -> None:
    """``toolguard.hold.duration``: one sample per hold, by how it ended; a deadlock is a
    decision (``toolguard.decisions`` with reason ``hold_deadlock``) like any refusal."""
    from guard.reads_world import Agent, Bank
    from guard.test_holds import HELD

    h = harness(HELD)
    Bank(h).open({"acct": 100})
    alice, bob = Agent(h, "alice", "t-a"), Agent(h, "bob", "t-b")
    assert alice.call("set_balance", account_id="acct", balance=alice.read("acct") + 1).ok
    bob.read("acct")
    assert h.guard.release_holds(h.guard.caller("bob", "t-b")) == 1
    assert otel.counts("toolguard.hold.duration", "gen_ai.tool.name", "toolguard.reason") == {
        ("get_balance", "written"): 1, ("get_balance", "released"): 1}
