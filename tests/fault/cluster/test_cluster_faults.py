"""Redis Cluster faults under the fault suite's workload: a primary killed and its replica
promoted, and the workload's slots resharded between primaries while it runs.

Agents take their locks from a private cluster (``redis+cluster://``) and write to a
schema of their own in the shared PostgreSQL.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
from redis.cluster import key_slot
from redis_ha import RedisClusterGroup

from fault.harness import FaultRun
from fault.workload import AgentPlan, Setup
from toolguard.locks.redis import redis_keys

pytestmark = [pytest.mark.fault, pytest.mark.cluster]

TTL_MS = 500
#: After the new primary serves the slots: redis-py refreshes its slot map, waiters' polls
#: and the agents' retry pauses run out. Progress must resume within TTL + this.
SLACK_S = 5.0


def cluster_setup(cluster: RedisClusterGroup, postgres_url: str, schema: str,
                  unique: str) -> Setup:
    return Setup(lock_url=cluster.url + "?socket_timeout=1", store_url=postgres_url,
                 prefix=f"tgf:{unique}",
                 store_options={"schema": schema, "timeout_s": 3, "max_size": 8},
                 ttl_ms=TTL_MS, wait_s=3)


def slot_of(setup: Setup, account: str) -> int:
    return key_slot(redis_keys(setup.key(account))[0][0].encode())


def error_replies(cluster: RedisClusterGroup) -> dict[str, int]:
    """Redirections and retries the nodes replied with (``INFO errorstats``), summed."""
    totals = dict.fromkeys(("MOVED", "ASK", "TRYAGAIN"), 0)
    for node in cluster.live():
        for name, value in node.info("errorstats").items():
            kind = name.removeprefix("errorstat_")
            if kind in totals:
                totals[kind] += int(value["count"])  # type: ignore[index]
    return totals


@pytest.mark.timeout(120)
def test_cluster_primary_killed_and_replica_promoted(redis_cluster: RedisClusterGroup,
                                                     postgres_url: str, pg_schema: str,
                                                     unique: str, tmp_path: Path) -> None:
    setup = cluster_setup(redis_cluster, postgres_url, pg_schema, unique)
    victim = redis_cluster.primary_of_slot(slot_of(setup, "a"))
    with FaultRun("redis cluster: primary SIGKILL, replica promoted", setup, tmp_path) as run:
        run.start_threads(4)
        # Holders that stall past their TTL while the cluster fails over: when they wake,
        # a newer holder (granted by the promoted replica) may have written.
        run.start_threads(2, AgentPlan(mode="manual", pause_p=0.5, pause_s=3 * TTL_MS / 1000),
                          name="m")
        run.warm_up()
        run.fault_started()
        time.sleep(0.3)
        killed_at = time.monotonic()
        redis_cluster.kill(victim)
        promoted = redis_cluster.wait_promoted(victim)
        failover_s = time.monotonic() - killed_at
        time.sleep(1.0)  # paused holders wake up after the failover
        run.healed()
        cells = run.finish(expect_rejections=True, bound_s=TTL_MS / 1000 + SLACK_S,
                           progress_accounts=["a"])
        cells["progress"].detail += f"; the failover took {failover_s:.1f}s"
        assert promoted.port != victim.port


@pytest.mark.timeout(120)
def test_cluster_slots_resharded_under_load(redis_cluster: RedisClusterGroup, postgres_url: str,
                                            pg_schema: str, unique: str, tmp_path: Path) -> None:
    setup = cluster_setup(redis_cluster, postgres_url, pg_schema, unique)
    primaries = itertools.cycle(redis_cluster.primaries())
    with FaultRun("redis cluster: slots resharded under load", setup, tmp_path) as run:
        run.start_threads(4, AgentPlan(hold_s=0.02))
        run.warm_up()
        run.fault_started()
        moved = []
        for _ in range(2):
            for account in setup.accounts:
                slot = slot_of(setup, account)
                source = redis_cluster.primary_of_slot(slot)
                target = next(p for p in primaries if p is not source)
                # The steps of a resharding, slowed down so that agents meet every state:
                # ASK (keys moved, slot still migrating), TRYAGAIN (keys split), MOVED.
                redis_cluster.begin_migration(slot, target)
                time.sleep(0.1)
                keys = redis_cluster.move_keys(slot, source, target)
                time.sleep(0.1)
                redis_cluster.end_migration(slot, target)
                moved.append((account, source.port, target.port, keys))
                time.sleep(0.2)
        run.healed()
        cells = run.finish()
        redirects = error_replies(redis_cluster)
        cells["progress"].detail += f"; {len(moved)} slot moves, agents met {redirects}"
        assert redirects["MOVED"] > 0 and redirects["ASK"] > 0, f"agents met only {redirects}"
        for account in setup.accounts:  # every account's slot ended on its last target
            last = [m for m in moved if m[0] == account][-1]
            assert redis_cluster.primary_of_slot(slot_of(setup, account)).port == last[2]
