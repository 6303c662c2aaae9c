"""Quotas through the guard: admitted before the locks, finished after, refusals audited once."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from collections import Counter
from typing import Any

import pytest

from controls import workers
from controls.guarded import intent, write
from toolguard.errors import GuardMisconfigured, RateLimited
from toolguard.guard import ToolGuard
from toolguard.policies import Policy


def policy(*quotas: dict[str, Any]) -> dict[str, Any]:
    return {"version": 1, "tools": {"transfer": {"locks": ["lead:{lead_id}"],
                                                 "quotas": list(quotas)}}}


def test_a_rate_refusal_says_when_to_retry_and_is_audited_once(harness: Any) -> None:
    h = harness(policy({"calls": 2, "window": "1h", "per": "agent"}))
    run = h.guard.run
    first = intent("transfer", {"lead_id": "l1"}, call_id="r1")
    assert run(first, write).ok and run(intent("transfer", {"lead_id": "l2"}, call_id="r2"),
                                        write).ok
    refused = run(intent("transfer", {"lead_id": "l3"}, call_id="r3"), write)
    assert (refused.kind, refused.reason) == ("rejected", "rate_limited")
    assert refused.retry_after_s is not None and 0 < refused.retry_after_s <= 3600
    assert "retry in" in refused.message and "retry in" in refused.model_text()
    assert h.decisions("r3") == [("rejected", "rate_limited")]
    with pytest.raises(RateLimited):
        h.guard.call(intent("transfer", {"lead_id": "l3"}, call_id="r4"), write)
    # a retried intent is not counted again: it gets its recorded result
    assert run(first, write).kind == "replayed"
    assert len(h.effects()) == 2


def test_a_budget_is_refunded_when_the_call_does_not_apply(harness: Any) -> None:
    h = harness(policy({"budget": 100, "arg": "amount", "window": "1d", "per": "agent"}))
    run = h.guard.run

    def boom(ctx: Any) -> None:
        raise RuntimeError("the tool broke")

    assert run(intent("transfer", {"lead_id": "l1", "amount": 60}, call_id="b1"), write).ok
    over = run(intent("transfer", {"lead_id": "l1", "amount": 50}, call_id="b2"), write)
    assert over.reason == "budget_exceeded" and over.retry_after_s is not None
    assert run(intent("transfer", {"lead_id": "l1", "amount": 30}, call_id="b3"), boom).kind == \
        "failed"
    assert run(intent("transfer", {"lead_id": "l1", "amount": 40}, call_id="b4"), write).ok
    never = run(intent("transfer", {"lead_id": "l1", "amount": 500}, call_id="b5"), write)
    assert never.reason == "budget_exceeded" and "can never fit" in never.message
    assert [h.decisions(c) for c in ("b2", "b5")] == [[("rejected", "budget_exceeded")]] * 2


def test_an_in_flight_slot_is_freed_however_the_call_ends(harness: Any) -> None:
    """A read-only tool: its body runs outside any transaction (SQLite's one writer stays free)."""
    rules = policy({"in_flight": 1, "per": "tool", "lease": "1m"})
    rules["tools"]["transfer"] = {"read_only": True, **rules["tools"]["transfer"]}
    del rules["tools"]["transfer"]["locks"]
    h = harness(rules)

    def boom(ctx: Any) -> None:
        raise RuntimeError("the tool broke")

    assert h.guard.run(intent("transfer", {"lead_id": "l1"}, call_id="f1"), boom).kind == "failed"
    assert h.guard.run(intent("transfer", {"lead_id": "l1"}, call_id="f2"), lambda c: 1).ok

    async def main() -> list[str]:
        inside = asyncio.Event()

        async def hang(ctx: Any) -> None:
            inside.set()
            await asyncio.sleep(3600)

        async with h.async_edges() as guard:
            task = asyncio.create_task(guard.arun(intent("transfer", {"lead_id": "l2"},
                                                         call_id="f3"), hang))
            await inside.wait()
            busy = await guard.arun(intent("transfer", {"lead_id": "l3"}, call_id="f4"),
                                    _awrite)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            after = await guard.arun(intent("transfer", {"lead_id": "l3"}, call_id="f5"),
                                     _awrite)
            return [busy.reason, after.reason]

    assert asyncio.run(main()) == ["in_flight_limited", "applied"]
    assert h.decisions("f3") == [("unknown", "cancelled")]


async def _awrite(ctx: Any) -> dict[str, Any]:
    return {"ok": True}


def _read_only(rules: dict[str, Any]) -> dict[str, Any]:
    tool = {k: v for k, v in rules["tools"]["transfer"].items() if k != "locks"}
    return {**rules, "tools": {"transfer": {**tool, "read_only": True}}}


def test_a_long_call_keeps_its_in_flight_slot(harness: Any) -> None:
    """The slot's lease is 1 s; the call runs past two and a half leases and still holds it."""
    _holds_its_slot(harness(_read_only(policy({"in_flight": 1, "per": "tool",
                                                "lease": "1s"}))))


def test_a_long_fenced_call_keeps_its_in_flight_slot(postgres_url: str, redis_url: str,
                                                     unique: str) -> None:
    """The same inside a fenced transaction, on PostgreSQL.

    SQLite keeps one writer per file and a fenced body holds it, so there a renewal
    (and any other call's audit) waits for the body to end: docs/policies.md says so.
    """
    from guard.harness import Backend, Harness

    backend = Backend.postgresql(postgres_url, redis_url, unique)
    h = Harness(backend, policy({"in_flight": 1, "per": "tool", "lease": "1s"}))
    try:
        _holds_its_slot(h)
    finally:
        h.close()
        backend.drop()


def _holds_its_slot(h: Any) -> None:
    seen: list[str] = []

    def long(ctx: Any) -> str:
        time.sleep(2.5)  # 2.5 leases: without renewal the slot would have expired
        other = threading.Thread(target=lambda: seen.append(h.guard.run(
            intent("transfer", {"lead_id": "other"}, call_id="l2"), lambda c: "x").reason))
        other.start()
        other.join(30)
        return "done"

    assert h.guard.run(intent("transfer", {"lead_id": "l1"}, call_id="l1"), long).ok
    assert seen == ["in_flight_limited"]
    assert h.guard.run(intent("transfer", {"lead_id": "l1"}, call_id="l3"), lambda c: 1).ok


def test_quotas_with_no_reachable_backend_raise_at_construction(backend: Any) -> None:
    store, locks = backend.store(), backend.locks()
    try:
        store.install()
        rules = Policy.from_dict(policy({"calls": 1, "window": "1m"}))
        with pytest.raises(GuardMisconfigured, match="cannot be reached"):
            ToolGuard(rules, locks=locks, store=store, quotas="redis://127.0.0.1:1/0")
    finally:
        locks.close()
        store.close()


spawn = multiprocessing.get_context("spawn")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("quotas_on", ["store", "redis"])
def test_no_over_admission_across_processes(harness: Any, quotas_on: str, redis_url: str,
                                            unique: str) -> None:
    """Four processes, 12 calls each, 17 allowed: exactly 17 apply, the rest are refused once."""
    rules = policy({"calls": 17, "window": "10m", "per": "tool"})
    h = harness(rules)
    quota_url = redis_url if quotas_on == "redis" else None
    out, start = spawn.Queue(), spawn.Event()
    processes = [spawn.Process(target=workers.guarded_calls,
                               args=(h.backend, rules, quota_url, f"tgq-{unique}", 12, n, start,
                                     out), daemon=True) for n in range(4)]
    for process in processes:
        process.start()
    time.sleep(0.5)
    start.set()
    reasons: Counter[str] = Counter()
    for _ in processes:
        status, value = out.get(timeout=150)
        assert status == "ok", value
        reasons.update(value)
    for process in processes:
        process.join(10)
    assert reasons == {"applied": 17, "rate_limited": 48 - 17}
    assert len(h.effects()) == 17
    rows = Counter((r.decision, r.reason) for r in h.audit())
    assert rows == {("accepted", "applied"): 17, ("rejected", "rate_limited"): 31}
