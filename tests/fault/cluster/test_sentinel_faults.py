"""Sentinel failover under the fault suite's workload: a lock granted on the primary is
lost by the promoted replica, and a primary paused past the failover comes back.

Agents find the primary through a private Sentinel group (``redis+sentinel://``) and
write to a schema of their own in the shared PostgreSQL. Replicas are fed through
proxies, so the test can hold back replication: a grant acknowledged by the
primary then never reaches the replica that replaces it.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
from redis_ha import SentinelGroup

from fault.harness import FaultRun
from fault.scripted import ScriptedAgent
from fault.workload import AgentPlan, Setup
from toolguard.locks.redis import redis_keys

pytestmark = [pytest.mark.fault, pytest.mark.sentinel]

TTL_MS = 500
#: After the sentinels named the new primary: agents' connections to the old one time out
#: (socket_timeout=1 in the URL), waiters' polls and retry pauses run out.
SLACK_S = 5.0
#: How far ahead of the new primary's the old primary's clock was (the re-seed case).
SKEW_US = 30_000_000


def sentinel_setup(group: SentinelGroup, postgres_url: str, schema: str, unique: str,
                   accounts: tuple[str, ...]) -> Setup:
    return Setup(lock_url=group.url + "?socket_timeout=1", store_url=postgres_url,
                 prefix=f"tgf:{unique}", accounts=accounts,
                 store_options={"schema": schema, "timeout_s": 3, "max_size": 8},
                 ttl_ms=TTL_MS, wait_s=3)


@pytest.mark.timeout(120)
def test_sentinel_failover_loses_a_grant_and_the_store_refuses_the_stale_holder(
        sentinel_group: SentinelGroup, postgres_url: str, pg_schema: str, unique: str,
        tmp_path: Path) -> None:
    """Two holders of one lock at once, the older one's write refused, tokens re-seeded.

    The workload runs on accounts a and b; the test itself drives two agents on z:
    ``old`` takes z on the primary while replication is held back (and that primary's
    clock is ahead, so its token is far above what the replica will mint), writes once,
    then the primary is killed. ``new`` takes z from the promoted replica, which never
    saw the grant: its first token is below the store's high-water mark, so
    ``run_fenced`` re-seeds and writes. ``old``, whose lease has not run out, writes again:
    the store refuses it.
    """
    direct = sentinel_setup(sentinel_group, postgres_url, pg_schema, unique, ("a", "b", "z"))
    agents = replace(direct, accounts=("a", "b"))
    key = direct.key("z")
    with FaultRun("redis sentinel: primary SIGKILL, unreplicated grant lost", agents, tmp_path,
                  direct=direct) as run:
        run.start_threads(4)
        run.warm_up()
        old = ScriptedAgent("old", direct, run.journal, ttl_ms=30_000)
        new = ScriptedAgent("new", direct, run.journal)
        try:
            run.fault_started()
            sentinel_group.stall_replication()
            with sentinel_group.primary.client() as primary:
                now_us = int(primary.time()[0]) * 1_000_000
            old.locks.raise_floor(key, now_us + SKEW_US)  # the old primary's clock runs ahead
            lease = old.lock("z")
            assert lease.token > now_us + SKEW_US
            assert old.write(lease, "z")["event"] == "accepted"
            killed_at = time.monotonic()
            sentinel_group.primary.kill()
            promoted = sentinel_group.wait_failover(sentinel_group.primary)
            failover_s = time.monotonic() - killed_at
            run.healed()
            with promoted.client() as client:  # the grant and its token died with the primary
                assert client.get(redis_keys(key)[0][0]) is None
                assert int(client.get(redis_keys(key)[0][1]) or 0) < lease.token
            second = new.deposit("z")
            assert second["event"] == "accepted" and second["reseeded"], second
            assert second["token"] > lease.token
            assert not lease.lost, "the old holder learnt of the loss: not two holders at once"
            stale = old.write(lease, "z")
            assert stale["event"] == "rejected" and stale["current"] == second["token"], stale
        finally:
            old.close()
            new.close()
        cells = run.finish(expect_rejections=True, bound_s=TTL_MS / 1000 + SLACK_S,
                           progress_accounts=["a", "b"])
        cells["progress"].detail += f"; the failover took {failover_s:.1f}s"


@pytest.mark.timeout(120)
def test_sentinel_primary_paused_past_the_failover(sentinel_group: SentinelGroup,
                                                   postgres_url: str, pg_schema: str,
                                                   unique: str, tmp_path: Path) -> None:
    """SIGSTOP the primary until a replica replaces it, then SIGCONT: for a moment two
    servers believe they are the primary, until the sentinels demote the old one."""
    setup = sentinel_setup(sentinel_group, postgres_url, pg_schema, unique, ("a", "b", "c"))
    old = sentinel_group.primary
    with FaultRun("redis sentinel: primary SIGSTOP past failover, resumed", setup,
                  tmp_path) as run:
        run.start_threads(4, AgentPlan(hold_s=0.02))
        run.start_threads(2, AgentPlan(mode="manual", think_s=0.3), name="m")
        run.warm_up()
        run.fault_started()
        paused_at = time.monotonic()
        old.pause()
        try:
            promoted = sentinel_group.wait_failover(old)
        finally:
            old.resume()
        failover_s = time.monotonic() - paused_at
        deadline = time.monotonic() + 20
        while old.info("replication").get("role") != "slave" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert old.info("replication").get("role") == "slave", "the old primary was not demoted"
        run.healed()
        cells = run.finish(bound_s=TTL_MS / 1000 + SLACK_S)
        cells["progress"].detail += f"; the failover took {failover_s:.1f}s"
        assert promoted is not old
