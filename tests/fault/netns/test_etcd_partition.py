"""A three-member etcd cluster, one member per namespace, with its leader partitioned away.

Host a's agents talk to the two members that keep a majority; host b's agents talk
only to the member that is cut off (the leader, when the partition starts), and
both sides hold and wait for locks on the same accounts when it does. The
majority elects a new leader and carries on; the minority can grant nothing (its
leases run out, its requests fail) until the partition heals; the store refuses
whatever a holder on the losing side still tries.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
from netns import NsEtcdCluster

from fault.harness import FaultRun
from fault.netns.conftest import Site, host_progress, start_agents
from fault.netns.test_netns_faults import HEAL_BOUND_S, check_both_hosts, wait_both_hosts
from fault.workload import AgentPlan

pytestmark = [pytest.mark.fault, pytest.mark.netns]

TTL_MS = 500
#: etcd's request timeout (5 s + 2 election timeouts) for a proposal sent to the old
#: leader, then the election and the minority holders' leases (1 s) running out.
MAJORITY_BOUND_S = 12.0


@pytest.mark.timeout(150)
def test_etcd_leader_partitioned_while_both_sides_hold_and_wait(site: Site,
                                                                tmp_path: Path) -> None:
    from etcd_server import require_etcd

    require_etcd()
    members = [site.lab.host(f"m{i}") for i in range(3)]
    cluster = NsEtcdCluster(members).start()
    try:
        leader = cluster.leader()
        majority = [m for m in members if m is not leader]
        agents, direct = site.setups(ttl_ms=TTL_MS, accounts=("a", "b"))
        on_majority = replace(agents, lock_url=cluster.url(majority), wait_s=5)
        on_minority = replace(agents, lock_url=cluster.url([leader]), wait_s=5)
        direct = replace(direct, lock_url=cluster.url(majority))  # the resolver runs on host a
        with FaultRun("netns: etcd leader partitioned, agents on both sides", on_majority,
                      tmp_path, direct=direct) as run:
            plan = AgentPlan(hold_s=0.1)  # 100 ms inside each write: some hold, others wait
            start_agents(run, site.a, "pa", 2, plan)
            start_agents(run, site.b, "pb", 2, plan, setup=on_minority)
            run.warm_up(timeout_s=40)
            deadline = time.monotonic() + 20
            sides: set[str] = set()
            while time.monotonic() < deadline and sides != {"pa", "pb"}:
                sides = {agent[:2] for agent in run.holding()}
                time.sleep(0.005)
            assert sides == {"pa", "pb"}, f"agents holding when the partition began: {sides}"
            run.fault_started()
            cut_at = time.monotonic()
            leader.isolate([m.address for m in majority])
            # The majority side elects a leader and writes again (requests in flight to the
            # old leader time out first); the minority side meanwhile holds on to nothing.
            until = cut_at + MAJORITY_BOUND_S
            while (during := host_progress(run, "pa", cut_at)) is None and time.monotonic() < until:
                time.sleep(0.05)
            time.sleep(1.0)
            leader.heal()
            run.healed()
            assert run.healed_at is not None
            # No quorum, no grant: nothing begun on the minority side during the partition
            # was applied before it healed.
            minority = [e for e in run.events() if str(e.get("agent", "")).startswith("pb")
                        and e.get("event") == "accepted" and cut_at <= e["began"]
                        and e["at"] < run.healed_at]
            assert not minority, f"the minority side was granted locks: {minority[:2]}"
            wait_both_hosts(run)
            cells = site.a.call(lambda: run.finish(bound_s=HEAL_BOUND_S))
            check_both_hosts(run, cells)
            assert during is not None, \
                f"the majority side wrote nothing in {MAJORITY_BOUND_S:.0f}s of partition"
            cells["progress"].detail += f"; majority side wrote {during:.2f}s into the partition"
            assert cluster.leader() in members
    finally:
        cluster.close()
