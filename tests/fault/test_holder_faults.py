"""Holder faults on every lock backend: paused past the TTL, stopped, killed.

* A pause injected between lock and write (renewals stopped, as in a GC pause):
  the holder wakes with a lease that ran out, maybe after a newer holder wrote.
* SIGSTOP / SIGCONT on an agent process holding a lock (heartbeat frozen too).
* SIGKILL on an agent process holding a lock (maybe mid-transaction): its lock
  must free itself within the TTL, its open transaction roll back, and the
  intent it was running is resolved afterwards through its idempotency key.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from fault.harness import FaultRun, backend_setup
from fault.workload import AgentPlan

pytestmark = pytest.mark.fault

TTL_MS = 400


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["redis", "postgres", "sqlite", "etcd"])
def test_holders_paused_between_lock_and_write(request: pytest.FixtureRequest, kind: str,
                                                unique: str, tmp_path: Path) -> None:
    setup = backend_setup(kind, request, unique, tmp_path, accounts=("a", "b"), ttl_ms=TTL_MS,
                          wait_s=5)
    plan = AgentPlan(mode="manual", pause_p=0.3, pause_s=2.5 * TTL_MS / 1000)
    with FaultRun(f"{kind}: holders paused past TTL", setup, tmp_path) as run:
        run.start_threads(4, plan)
        run.warm_up()
        run.fault_started()  # from now on a holder stalls with probability pause_p
        time.sleep(3.0)
        # on a loaded machine a stalled holder's keys may see no other taker in 3 s: the
        # fault goes on (bounded) until it made a stale holder at least once
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and not any(
                e.get("event") == "rejected" for e in run.events()):
            time.sleep(0.2)
        run.healed()
        run.finish(expect_rejections=True)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["redis", "postgres"])
def test_holder_processes_stopped_and_continued(request: pytest.FixtureRequest, kind: str,
                                                unique: str, tmp_path: Path) -> None:
    setup = backend_setup(kind, request, unique, tmp_path, accounts=("a", "b"), ttl_ms=TTL_MS,
                          wait_s=5)
    # A holder thinks a little between lock and write: a SIGSTOP there leaves it holding
    # a lease that runs out while it is frozen.
    plan = AgentPlan(mode="manual", think_s=0.15)
    with FaultRun(f"{kind}: holder SIGSTOP/SIGCONT", setup, tmp_path) as run:
        run.start_processes(3, threads=2, plan=plan)
        run.warm_up(timeout_s=30)
        run.fault_started()
        stopped: list[str] = []
        # At least three stops; more (bounded) until one made a stale holder: on a loaded
        # machine a stopped holder's keys may see no other taker while it is frozen.
        for attempt in range(8):
            if attempt >= 3 and any(e.get("event") == "rejected" for e in run.events()):
                break
            found = run.wait_holding_process()
            assert found is not None, "no agent process was ever seen holding a lock"
            process, _ = found
            os.kill(process.pid, signal.SIGSTOP)
            try:
                time.sleep(2.5 * TTL_MS / 1000)
            finally:
                os.kill(process.pid, signal.SIGCONT)
            stopped.append(process.name)
            time.sleep(0.2)
        run.healed()
        run.finish(expect_rejections=True)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["redis", "postgres", "sqlite"])
def test_holder_processes_killed(request: pytest.FixtureRequest, kind: str, unique: str,
                                 tmp_path: Path) -> None:
    setup = backend_setup(kind, request, unique, tmp_path, accounts=("a", "b", "c"),
                          ttl_ms=TTL_MS, wait_s=5)
    plan = AgentPlan(mode="run_fenced", hold_s=0.1)  # 100 ms inside each fenced transaction
    with FaultRun(f"{kind}: holder SIGKILL", setup, tmp_path) as run:
        run.start_processes(3, threads=2, plan=plan)
        run.warm_up(timeout_s=30)
        run.fault_started()
        killed, held = [], set()
        for _ in range(2):
            found = run.wait_holding_process(exclude=tuple(killed))
            assert found is not None, "no agent process was ever seen holding a lock"
            process, accounts = found
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)  # mid-transaction, lock held
            process.join(5)
            killed.append(process)
            held.update(accounts)
        run.healed()
        # The killed holders' accounts are written again: their locks freed themselves.
        run.finish(progress_accounts=sorted(held))
