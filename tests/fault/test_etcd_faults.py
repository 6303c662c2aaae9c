"""etcd faults on a private three-member cluster: the leader killed, a member paused.

Agents take their locks from the cluster (``etcd://`` URL naming every member,
the leader first, so the member they talk to is the one that fails) and write
to a schema of their own in the shared PostgreSQL.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fault.harness import FaultRun
from fault.workload import AgentPlan, Setup

pytestmark = pytest.mark.fault

TTL_MS = 500


@pytest.fixture
def cluster() -> Iterator[Any]:
    """A private three-member etcd cluster per test (skips locally / fails on CI without etcd)."""
    from etcd_server import EtcdCluster, require_etcd

    require_etcd()
    started = EtcdCluster(3).start()
    try:
        yield started
    finally:
        started.stop()


def leader_of(cluster: Any, timeout_s: float = 10.0) -> Any:
    """The member that is the Raft leader right now."""
    from etcd3gw.client import Etcd3Client

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for member in cluster.members:
            if member.process is None:
                continue
            try:
                status = Etcd3Client(host="127.0.0.1", port=member.client_port, timeout=1).status()
            except Exception:  # this member is down or busy: ask another one
                continue
            if int(status.get("leader", 0)) == int(status["header"]["member_id"]):
                return member
        time.sleep(0.05)
    msg = "the etcd cluster has no leader"
    raise AssertionError(msg)


def leader_first_url(cluster: Any, leader: Any) -> str:
    members = [leader, *(m for m in cluster.members if m is not leader)]
    return "etcd://" + ",".join(f"127.0.0.1:{m.client_port}" for m in members)


def etcd_setup(lock_url: str, request: pytest.FixtureRequest, unique: str) -> Setup:
    postgres_url = request.getfixturevalue("postgres_url")
    schema = request.getfixturevalue("pg_schema")
    return Setup(lock_url=lock_url, store_url=postgres_url, prefix=f"tgf:{unique}",
                 store_options={"schema": schema, "timeout_s": 3, "max_size": 6},
                 accounts=("a", "b"), ttl_ms=TTL_MS, wait_s=5)


@pytest.mark.timeout(90)
def test_etcd_leader_killed_while_agents_hold_and_wait(cluster: Any,
                                                       request: pytest.FixtureRequest,
                                                       unique: str, tmp_path: Path) -> None:
    leader = leader_of(cluster)
    setup = etcd_setup(leader_first_url(cluster, leader), request, unique)
    # Four agents on two accounts, 100 ms inside each write: some hold, the others wait.
    with FaultRun("etcd: leader SIGKILL", setup, tmp_path) as run:
        run.start_threads(4, AgentPlan(hold_s=0.1))
        run.warm_up()
        deadline = time.monotonic() + 10
        while len(run.holding()) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert run.holding(), "no agent held a lock when the leader was to be killed"
        run.fault_started()
        leader.kill()
        run.healed()  # two of three members remain: the cluster must carry on by itself
        run.finish()
        assert leader_of(cluster) is not leader


@pytest.mark.timeout(90)
def test_etcd_member_paused_and_resumed(cluster: Any, request: pytest.FixtureRequest,
                                        unique: str, tmp_path: Path) -> None:
    leader = leader_of(cluster)
    setup = etcd_setup(leader_first_url(cluster, leader), request, unique)
    with FaultRun("etcd: leader SIGSTOP/SIGCONT", setup, tmp_path) as run:
        run.start_threads(4, AgentPlan(hold_s=0.05))
        run.warm_up()
        run.fault_started()
        assert leader.process is not None
        os.kill(leader.process.pid, signal.SIGSTOP)  # requests to it hang; followers elect anew
        try:
            time.sleep(2.0)
        finally:
            os.kill(leader.process.pid, signal.SIGCONT)
        run.healed()
        run.finish()
