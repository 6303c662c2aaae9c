"""Cancellation at every await point of ``ToolGuard.arun`` is a normal outcome (DESIGN 17).

Each path is swept by ``cancel_harness.sweep``: its await points are counted on
a first run, then the call is cancelled at each one in turn, on both stores and
every lock backend, and for calls that take a quota and calls that need an
approval. What each cancellation must leave is listed in ``cancel_harness``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from guard.cancel_harness import Sweep, sweep
from toolguard.call.intent import Intent

#: path name -> (policy, decision kind of the uncancelled call)
POLICIES: dict[str, tuple[dict[str, Any], str]] = {
    "plain": ({"version": 1, "tools": {"add_score": {"locks": ["lead:{lead_id}"],
                                                     "agents": ["scorer"]}}}, "accepted"),
    "quota": ({"version": 1, "tools": {"add_score": {
        "locks": ["lead:{lead_id}"], "agents": ["scorer"],
        "quotas": [{"calls": 100_000, "window": "1h", "per": "agent"}]}}}, "accepted"),
    "approval": ({"version": 1, "tools": {"add_score": {
        "locks": ["lead:{lead_id}"], "agents": ["scorer"], "approval": True}}}, "rejected"),
}

#: setup name -> how to build its Backend (store kind + lock backend)
SETUPS = ["sqlite-store/sqlite-locks", "sqlite-store/etcd-locks",
          "postgresql-store/redis-locks", "postgresql-store/postgres-locks"]

#: (setup, path) pairs swept: every setup on the plain path, quotas and approvals on both stores
CASES = [*((setup, "plain") for setup in SETUPS),
         ("sqlite-store/sqlite-locks", "quota"), ("postgresql-store/redis-locks", "quota"),
         ("sqlite-store/sqlite-locks", "approval"), ("postgresql-store/redis-locks", "approval")]

#: points counted per case (printed at the end of the run of this module)
POINTS: dict[str, int] = {}


def intent_for(call_id: str, lead: str = "a") -> Intent:
    return Intent(tool="add_score", agent="scorer", call_id=call_id,
                  args={"lead_id": lead, "delta": 1})


@pytest.mark.parametrize(("setup", "path"), CASES, ids=[f"{s}:{p}" for s, p in CASES])
def test_cancelled_at_every_await_point(case_harness: Any, setup: str, path: str) -> None:
    policy, expect = POLICIES[path]
    h = case_harness(setup, policy)

    async def main() -> Sweep:
        async with h.async_edges():
            return await sweep(h, intent_for, keys=("lead:a",), expect_first=expect)

    found = asyncio.run(main())
    POINTS[f"{setup}:{path}"] = found.points
    print(f"\n{setup}:{path}: {found.points} await points; outcomes {found.outcomes}")
    assert found.points > 0
