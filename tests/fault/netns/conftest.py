"""Hosts of the namespace scenarios: agents in namespaces of their own, servers in another.

Run them alone with ``pytest -m netns`` (as root; without root they skip, except on
CI where they fail). Their rows join the fault suite's scenarios x invariants table.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from netns import Host, NetLab, NsPostgres, NsProcess, NsRedis, require_netns, require_postgres

from fault.harness import FaultRun
from fault.workload import AgentPlan, Setup


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "netns: scenarios across network namespaces made by "
                                       "the test (needs root: ip netns, veth, nftables)")


@pytest.fixture
def lab() -> Iterator[NetLab]:
    """A private lab of namespaces; everything in it is removed afterwards, also on failure."""
    require_netns()
    with NetLab() as made:
        yield made


@dataclass
class Site:
    """A server host (Redis and PostgreSQL) and two agent hosts, a and b."""

    lab: NetLab
    srv: Host
    a: Host
    b: Host
    redis: NsRedis
    postgres: NsPostgres

    def setups(self, *, ttl_ms: int = 500, lock_url: str | None = None,
               accounts: tuple[str, ...] = ("a", "b", "c")) -> tuple[Setup, Setup]:
        """(what the agents use, over the lab's links; what the test uses, over Unix sockets)."""
        prefix = f"tgf:{self.lab.tag}"
        agents = Setup(lock_url=lock_url or f"{self.redis.url}?socket_timeout=1",
                       store_url=self.postgres.url, prefix=prefix, accounts=accounts,
                       store_options={"timeout_s": 3, "max_size": 4}, ttl_ms=ttl_ms, wait_s=3)
        direct = Setup(lock_url=self.redis.local_url, store_url=self.postgres.local_url,
                       prefix=prefix, accounts=accounts,
                       store_options={"timeout_s": 3, "max_size": 6}, ttl_ms=ttl_ms, wait_s=3)
        return agents, direct


@pytest.fixture
def site(lab: NetLab) -> Iterator[Site]:
    require_postgres()
    srv, a, b = lab.host("srv"), lab.host("a"), lab.host("b")
    postgres = NsPostgres(srv)
    try:
        built = Site(lab, srv, a, b, NsRedis(srv).start(), postgres.start())
        yield built
    finally:
        postgres.cleanup()


def start_agents(run: FaultRun, host: Host, name: str, threads: int,
                 plan: AgentPlan | None = None, setup: Setup | None = None) -> NsProcess:
    """An agent process of ``threads`` agents in ``host``'s namespace, journaled for ``run``."""
    journal = run.tmp_path / f"journal-{name}.jsonl"
    process = NsProcess(host, name, {
        "role": "workload", "setup": setup or run.setup, "plan": plan or AgentPlan(),
        "name": name, "threads": threads, "journal_path": str(journal),
        "stop_path": str(run.stop_path), "fault_path": str(run.fault_path)})
    run.processes.append(process)
    run.process_journals.append(journal)
    return process


def wait_event(run: FaultRun, found: Callable[[dict[str, Any]], bool], what: str,
               timeout_s: float = 15.0) -> dict[str, Any]:
    """The first journaled event matching ``found``, waiting for it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in sorted(run.events(), key=lambda e: e["at"]):
            if found(event):
                return event
        time.sleep(0.02)
    msg = f"{run.scenario}: {what} did not happen within {timeout_s}s"
    raise AssertionError(msg)


def host_progress(run: FaultRun, prefix: str, since: float) -> float | None:
    """Seconds from ``since`` to the first write begun after it by an agent named ``prefix``*."""
    accepted = [e["at"] for e in run.events()
                if e.get("event") in ("accepted", "replayed") and e.get("began", 0) >= since
                and str(e.get("agent", "")).startswith(prefix) and not e.get("resolver")]
    return min(accepted) - since if accepted else None


def touch(path: Path) -> None:
    path.write_text(str(os.getpid()))
