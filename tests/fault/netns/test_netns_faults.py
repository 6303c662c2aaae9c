"""Agents on several "hosts" (network namespaces), the lock server and PostgreSQL on another.

* A holder cut from Redis but not from PostgreSQL: its lease runs out, a holder on the
  other host writes, then the cut-off holder's late write reaches the store: refused.
* A holder cut from PostgreSQL in the middle of its fenced transaction.
* 200 ms of added round-trip time and 5 % packet loss between the agents and Redis.

Faults are nftables rules inside an agent host's own namespace (packets dropped, as
on a link that went dark); latency comes from a relay in the server's namespace (see
``tests/netns.py``). The same invariants as the rest of the fault suite, and progress
after the heal within ``HEAL_BOUND_S``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from netns import DelayRelay, NsProcess

from fault.harness import FaultRun
from fault.netns.conftest import Site, host_progress, start_agents, touch, wait_event
from fault.workload import AgentPlan

pytestmark = [pytest.mark.fault, pytest.mark.netns]

#: After a link heals: connections that died during the cut time out (socket_timeout=1,
#: the store's pool), TCP's retransmission backoff, waiters' polls and retry pauses.
HEAL_BOUND_S = 10.0


def wait_both_hosts(run: FaultRun) -> None:
    """Before ``finish``: give the agents of each host ``HEAL_BOUND_S`` to write again."""
    assert run.healed_at is not None
    deadline = run.healed_at + HEAL_BOUND_S
    while time.monotonic() < deadline and any(host_progress(run, p, run.healed_at) is None
                                              for p in ("pa", "pb")):
        time.sleep(0.05)


def check_both_hosts(run: FaultRun, cells: dict) -> None:
    """Agents on both hosts wrote again after the heal (not only the host never cut)."""
    assert run.healed_at is not None
    delays = {p: host_progress(run, p, run.healed_at) for p in ("pa", "pb")}
    cells["progress"].detail += "; per host: " + ", ".join(
        f"{p[1]} {d:.2f}s" if d is not None else f"{p[1]} none" for p, d in delays.items())
    assert all(d is not None and d <= HEAL_BOUND_S for d in delays.values()), delays


@pytest.mark.timeout(120)
def test_holder_cut_from_redis_but_not_from_postgres(site: Site, tmp_path: Path) -> None:
    agents, direct = site.setups(accounts=("a", "b"))
    with FaultRun("netns: holder cut from Redis, not from PostgreSQL", agents, tmp_path,
                  direct=direct) as run:
        start_agents(run, site.a, "pa", 2)
        start_agents(run, site.b, "pb", 2)
        run.warm_up(timeout_s=40)
        go = tmp_path / "go"
        journal = tmp_path / "journal-sa.jsonl"
        holder = NsProcess(site.a, "sa", {
            "role": "stale_holder", "setup": agents, "name": "sa", "account": "a",
            "journal_path": str(journal), "go_path": str(go), "ttl_ms": 1_000})
        run.processes.append(holder)
        run.process_journals.append(journal)
        wait_event(run, lambda e: e.get("agent") == "sa" and e.get("event") == "locked",
                   "the scripted holder taking account a", timeout_s=30)
        run.fault_started()
        cut_at = time.monotonic()
        site.a.cut(site.srv.address, site.redis.PORT)  # Redis only: PostgreSQL still answers
        lost = wait_event(run, lambda e: e.get("agent") == "sa" and e.get("event") == "lease_lost",
                          "the cut-off holder learning its lease is gone")
        assert run.wait_applied(1, since=cut_at, accounts=["a"], timeout_s=20), \
            "no agent on host b wrote account a while host a was cut off"
        touch(go)  # the late write, through the link that still works
        late = wait_event(run, lambda e: e.get("agent") == "sa"
                          and e.get("event") in ("accepted", "rejected", "unknown"),
                          "the late write's outcome")
        assert late["event"] == "rejected", late
        assert late["current"] > late["token"]
        site.a.heal()
        run.healed()
        wait_both_hosts(run)
        cells = run.finish(expect_rejections=True, bound_s=HEAL_BOUND_S)
        cells["no_stale_write"].detail += f"; the cut-off holder's lease: {lost['reason'][:60]}"
        check_both_hosts(run, cells)


@pytest.mark.timeout(120)
def test_holder_cut_from_postgres_mid_transaction(site: Site, tmp_path: Path) -> None:
    agents, direct = site.setups(accounts=("a", "b"))
    with FaultRun("netns: holder cut from PostgreSQL mid-transaction", agents, tmp_path,
                  direct=direct) as run:
        start_agents(run, site.a, "pa", 2, AgentPlan(hold_s=0.3))  # 300 ms inside each write
        start_agents(run, site.b, "pb", 2)
        run.warm_up(timeout_s=40)
        deadline = time.monotonic() + 20
        inside: list[str] = []
        while not inside and time.monotonic() < deadline:  # run_fenced journals only in_body
            inside = [a for a in run.holding() if a.startswith("pa")]
            time.sleep(0.01)
        assert inside, "no agent on host a was ever inside a fenced transaction"
        run.fault_started()
        site.a.cut(site.srv.address, site.postgres.PORT)  # Redis still answers: leases live on
        time.sleep(2.0)
        site.a.heal()
        run.healed()
        wait_both_hosts(run)
        cells = run.finish(bound_s=HEAL_BOUND_S)
        check_both_hosts(run, cells)


@pytest.mark.timeout(120)
def test_latency_and_loss_between_agents_and_redis(site: Site, tmp_path: Path) -> None:
    relay = DelayRelay(site.srv, site.redis.PORT, delay_ms=100).start()  # 100 ms each way
    lock_url = f"redis://{site.srv.address}:{relay.port}/0?socket_timeout=2"
    agents, direct = site.setups(ttl_ms=2_000, lock_url=lock_url)
    with FaultRun("netns: +200 ms RTT and 5% loss to Redis", agents, tmp_path,
                  direct=direct) as run:
        start_agents(run, site.a, "pa", 2)
        start_agents(run, site.b, "pb", 2)
        run.warm_up(timeout_s=40)
        before = time.monotonic()
        time.sleep(2.0)
        run.fault_started()
        impaired_at = time.monotonic()
        relay.delay(True)
        for host in (site.a, site.b):
            host.lossy(site.srv.address, relay.port, 5)
        time.sleep(5.0)
        relay.delay(False)
        for host in (site.a, site.b):
            host.heal()
        run.healed()
        assert run.healed_at is not None
        wait_both_hosts(run)
        cells = run.finish(bound_s=HEAL_BOUND_S)
        # counted once the agents are done: an attempt begun while impaired may end later
        rate_before = run.applied_between(before, impaired_at)
        during = run.applied_between(impaired_at, run.healed_at)
        cells["progress"].detail += (f"; {rate_before / 2.0:.0f} writes/s before, "
                                     f"{during / 5.0:.1f} writes/s while impaired")
        assert during > 0, "no write got through while the link was slow and lossy"
        check_both_hosts(run, cells)
