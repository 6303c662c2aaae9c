"""The kill switch in the guard: first of all, before validation; fails closed; audited once."""

from __future__ import annotations

import asyncio
from typing import Any

from controls.guarded import intent, write
from toolguard.call.intent import Intent
from toolguard.controls.pause import PauseBoard

POLICY: dict[str, Any] = {
    "version": 1,
    "tools": {
        "transfer": {"locks": ["lead:{lead_id}"], "agents": ["scorer"],
                     "args": {"amount": {"ge": 0}}},
        "lookup": {"read_only": True},
    },
}


def test_a_paused_tool_is_refused_before_validation_and_audited_once(harness: Any) -> None:
    h = harness(POLICY, pause_cache_s=0)
    board = PauseBoard(h.store)
    board.pause("tool", "transfer", by="ops", reason="incident 42")
    # even a call validation would refuse is refused as paused: a paused tool costs nothing
    bad = intent("transfer", {"lead_id": "l1", "amount": -5}, call_id="c-bad")
    good = intent("transfer", {"lead_id": "l1", "amount": 5}, call_id="c-good")
    assert [h.guard.run(i, write).reason for i in (bad, good)] == ["paused", "paused"]
    assert h.effects() == []
    assert h.decisions("c-bad") == [("rejected", "paused")]
    assert h.decisions("c-good") == [("rejected", "paused")]
    other = h.guard.run(intent("lookup", {"q": 1}, call_id="c-other"), lambda ctx: 1)
    assert other.ok  # only the paused tool stops
    assert board.resume("tool", "transfer", by="ops")
    assert h.guard.run(good, write).ok and len(h.effects()) == 1


def test_an_agent_or_everything_can_be_paused(harness: Any) -> None:
    h = harness(POLICY, pause_cache_s=0)
    board = PauseBoard(h.store)
    board.pause("agent", "scorer")
    assert h.guard.run(intent("lookup", {}, call_id="a1"), lambda ctx: 1).reason == "paused"
    assert h.guard.run(intent("lookup", {}, agent="other", call_id="a2"), lambda ctx: 1).ok
    board.pause("all")
    refused = h.guard.run(intent("lookup", {}, agent="other", call_id="a3"), lambda ctx: 1)
    assert refused.reason == "paused" and "every call" in refused.message
    # a hostile envelope (a name that is not text) cannot name a pause; "all" still stops it
    hostile = Intent.from_tool_call({"name": 7, "args": {}, "id": "a4"}, agent="scorer")
    assert h.guard.run(hostile, lambda ctx: 1).reason == "paused"
    assert h.decisions("a4") == [("rejected", "paused")]


def test_the_kill_switch_fails_closed_when_the_pause_set_cannot_be_read(harness: Any) -> None:
    h = harness(POLICY, pause_cache_s=0)
    h.sql("DROP TABLE toolguard_pause")
    decision = h.guard.run(intent("transfer", {"lead_id": "l1", "amount": 5}, call_id="c1"), write)
    assert (decision.kind, decision.reason) == ("failed", "backend_unavailable")
    assert "fails closed" in decision.message
    assert h.effects() == [] and h.decisions("c1") == [("failed", "backend_unavailable")]


def test_the_async_path_checks_the_same_pauses(harness: Any) -> None:
    h = harness(POLICY, pause_cache_s=0)
    PauseBoard(h.store).pause("tool", "lookup")

    async def body(ctx: Any) -> int:
        return 1

    async def main() -> Any:
        async with h.async_edges() as guard:
            return await guard.arun(intent("lookup", {}, call_id="as1"), body)

    decision = asyncio.run(main())
    assert decision.reason == "paused" and h.decisions("as1") == [("rejected", "paused")]


def test_every_row_of_the_guard_records_the_policy_version(harness: Any) -> None:
    h = harness(POLICY)
    digest = h.guard.policy.digest

    def boom(ctx: Any) -> None:
        raise RuntimeError("tool broke")

    same = intent("transfer", {"lead_id": "l1", "amount": 5}, call_id="v-ok")
    h.guard.run(same, write)                                                # accepted (store)
    h.guard.run(same, write)                                                # replayed (store)
    h.guard.run(intent("transfer", {"lead_id": "l1", "amount": -1}, call_id="v-bad"), write)
    h.guard.run(intent("nope", {}, call_id="v-unknown"), write)             # before validation
    h.guard.run(intent("transfer", {"lead_id": "l2", "amount": 1}, call_id="v-boom"), boom)
    h.guard.run(intent("lookup", {}, call_id="v-read"), lambda ctx: 1)     # unlocked (guard)
    rows = h.audit()
    assert {(r.decision, r.reason) for r in rows} >= {
        ("accepted", "applied"), ("replayed", "duplicate"), ("rejected", "invalid_arguments"),
        ("rejected", "unknown_tool"), ("failed", "error")}
    assert len(rows) == 6
    assert {r.policy_version for r in rows} == {digest}
