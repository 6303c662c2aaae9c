"""Cancellation at every await point of ``ToolGuard.arun`` is a normal outcome (DESIGN 17).

Each path is swept by ``cancel_harness.sweep``: its await points are counted on
a first run, then the call is cancelled at each one in turn, on both stores and
every lock backend, and for calls that take a quota and calls that need an
approval. What each cancellation must leave is listed in ``cancel_harness``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from guard.cancel_harness import Sweep, sweep
from guard.harness import Backend, Harness
from toolguard.call.intent import Intent
from toolguard.guard import ToolGuard

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


def make_backend(setup: str, request: pytest.FixtureRequest, tmp_path: Path,
                 unique: str) -> Backend:
    store_kind, lock_kind = (part.split("-")[0] for part in setup.split("/"))
    if store_kind == "sqlite":
        store_url, store_options = f"sqlite:///{tmp_path}/store.db", {}
    else:
        store_url = request.getfixturevalue("postgres_url")
        store_options = {"schema": f"tg_cancel_{unique}"}
    if lock_kind == "sqlite":
        lock_url, lock_options = f"sqlite:///{tmp_path}/locks.db", {}
    elif lock_kind == "redis":
        lock_url, lock_options = request.getfixturevalue("redis_url"), {"prefix": f"tgc:{unique}"}
    elif lock_kind == "postgres":
        lock_url = request.getfixturevalue("postgres_url")
        lock_options = {"schema": f"tg_cancel_locks_{unique}"}
    else:
        from etcd_server import require_etcd, shared_etcd_url

        require_etcd()
        lock_url, lock_options = shared_etcd_url(), {"prefix": f"tgc-{unique}"}
    return Backend(store_kind, store_url, lock_url, store_options, lock_options)


@pytest.fixture
def case_harness(request: pytest.FixtureRequest, tmp_path: Path,
                 unique: str) -> Iterator[Callable[[str, dict[str, Any]], Harness]]:
    made: list[tuple[Harness, Backend]] = []

    def build(setup: str, policy: dict[str, Any]) -> Harness:
        backend = make_backend(setup, request, tmp_path, unique)
        h = Harness(backend, policy)
        # the kill switch read on every call: the same await points on every run
        h.guard = ToolGuard(h.policy, locks=h.locks, store=h.store, pause_cache_s=0)
        made.append((h, backend))
        return h

    yield build
    for h, backend in made:
        h.close()
        backend.drop()
        schema = backend.lock_options.get("schema")
        if schema:
            import psycopg

            with psycopg.connect(backend.lock_url, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


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
