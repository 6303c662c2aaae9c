"""Lock-layer faults on every backend, with lock-level invariants in the fault table.

The agents here hold locks only (no store): three processes (two with threads,
one with asyncio tasks), three agents each, on four keys. Every lease is logged
and checked by ``locks.exclusion``:

* ``one_holder``: per key, no two leases valid at the same moment;
* ``grant_order``: per key, tokens grow in the order leases were held;
* ``server_token``: a lease is the lock server's current grant when returned;
* ``lock_progress``: every key was granted again after the last disruption;
* ``no_lock_errors``: no agent's acquire ended in an error (waits are 30 s).

Scenarios: agents stopped (SIGSTOP) past their TTL, holders and waiters alike,
as in issue 9's double-holder reproduction; the lock server restarted or away
for a moment while agents wait; a waiter killed while in line (the line must move
within its presence window). Redis without persistence forgets its holders in a
restart (efficiency-grade, see the README): there ``one_holder`` and
``server_token`` are not applicable across the restart, and the store's fences
are what refuses the stale writes (``test_redis_faults``).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from locks import workers
from locks.backends import BACKENDS
from locks.exclusion import Outcome, Workload, run_workload, violations

from fault.report import record
from fault.workload import Cell
from toolguard.errors import LockTimeout
from toolguard.locks import Lease, connect

pytestmark = pytest.mark.fault

KINDS = ["redis", "postgres", "sqlite", "etcd"]
MODES = ["sync", "sync", "async"]
PRESENCE_S = 2.0
SLACK_S = 2.5
spawn = multiprocessing.get_context("spawn")


def lock_url(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    factory = BACKENDS[kind]
    server = request.getfixturevalue(factory.server_fixture) if factory.server_fixture else None
    return factory.make_url(server, tmp_path)


def lock_cells(outcome: Outcome, keys: Sequence[str], *,
               not_applicable: Mapping[str, str] | None = None) -> dict[str, Cell]:
    """One cell per lock invariant for what the agents logged."""
    cells: dict[str, Cell] = {}
    leases = outcome.leases
    for name, found in violations(outcome.records).items():
        if not_applicable and name in not_applicable:
            cells[name] = Cell(None, not_applicable[name])
        elif found:
            cells[name] = Cell(False, f"{len(found)} of {len(leases)} leases: {found[0][:300]}")
        else:
            cells[name] = Cell(True, f"{len(leases)} leases after {outcome.stops} disruptions")
    late = {key: sum(1 for r in leases if r["key"] == key and r["start"] >= outcome.healed_at)
            for key in keys}
    stuck = [key for key, count in late.items() if not count]
    cells["lock_progress"] = Cell(not stuck, f"keys never granted after the last disruption: "
                                             f"{stuck}" if stuck else f"grants after it: {late}")
    errors = outcome.errors()
    cells["no_lock_errors"] = Cell(not errors, f"{len(errors)} failed acquires, e.g. "
                                               f"{errors[:2]}" if errors else "none")
    return cells


def finish(scenario: str, cells: dict[str, Cell]) -> None:
    record(scenario, cells)
    failed = {name: cell.detail for name, cell in cells.items() if cell.ok is False}
    assert not failed, f"{scenario}: invariants violated: {failed}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", KINDS)
def test_lock_agents_stopped_past_their_ttl(kind: str, request: pytest.FixtureRequest,
                                            unique: str, tmp_path: Path) -> None:
    keys = tuple(f"tgf:{unique}:k{i}" for i in range(4))
    work = Workload(url=lock_url(kind, request, tmp_path), keys=keys, ttl_ms=1_000)
    outcome = run_workload(work, tmp_path, MODES, agents=3, seconds=8.0, pause_ttls=(2.0, 3.0),
                           settle_s=1.5)
    finish(f"{kind}: lock agents SIGSTOP past TTL (3x3, 4 keys)", lock_cells(outcome, keys))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", KINDS)
def test_lock_agents_ride_out_a_lock_server_restart(kind: str, unique: str,
                                                    tmp_path: Path) -> None:
    factory = BACKENDS[kind]
    assert factory.outage is not None
    keys = tuple(f"tgf:{unique}:k{i}" for i in range(4))
    with factory.outage(tmp_path) as server:
        work = Workload(url=server.url, keys=keys, ttl_ms=1_000, options=dict(server.options))

        def restart(_processes: Sequence[Any], _rng: Any) -> None:
            server.blip()

        outcome = run_workload(work, tmp_path, MODES, agents=3, seconds=4.0, gap_s=(1.0, 1.5),
                               disrupt=restart, settle_s=1.5)
    forgets = {"one_holder": "a Redis without persistence forgets its holders in a restart",
               "server_token": "a Redis without persistence forgets its tokens in a restart"}
    what = {"redis": "restarted empty", "postgres": "restarted (fast shutdown)",
            "etcd": "member SIGKILL + restart", "sqlite": "file locked 0.5 s"}[kind]
    finish(f"{kind}: lock server {what} while agents wait",
           lock_cells(outcome, keys, not_applicable=forgets if kind == "redis" else None))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_a_killed_waiter_holds_up_the_line_no_longer_than_its_presence(
        kind: str, request: pytest.FixtureRequest, unique: str, tmp_path: Path) -> None:
    url = lock_url(kind, request, tmp_path)
    key, other = f"tgf:{unique}:line", f"tgf:{unique}:elsewhere"
    holder, successor = connect(url), connect(url)
    report = spawn.Queue()
    process = spawn.Process(target=workers.hold_then_queue,
                            args=(url, other, key, 20_000, report), daemon=True)
    try:
        first = holder.acquire(key, ttl_ms=30_000)
        process.start()
        assert report.get(timeout=30) == ("holding",)
        time.sleep(1.0)  # in line for the key, with a 20 s TTL
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
        got: queue.Queue[Lease | BaseException] = queue.Queue()

        def take() -> None:
            try:
                got.put(successor.acquire(key, ttl_ms=5_000, timeout_s=PRESENCE_S + SLACK_S))
            except BaseException as error:  # reported below
                got.put(error)

        thread = threading.Thread(target=take, daemon=True)
        thread.start()
        time.sleep(0.3)
        released_at = time.monotonic()
        first.release()
        outcome = got.get(timeout=30)
        waited = time.monotonic() - released_at
        if isinstance(outcome, Lease):
            outcome.release()
            cell = Cell(True, f"the line moved {waited:.2f}s after the release "
                              f"(presence {PRESENCE_S:g} s, the dead waiter's TTL 20 s)")
        else:
            kind_of = "timed out" if isinstance(outcome, LockTimeout) else repr(outcome)
            cell = Cell(False, f"the successor {kind_of} after {waited:.2f}s: the dead waiter "
                               f"held up the line beyond its {PRESENCE_S:g} s presence")
    finally:
        if process.is_alive():
            process.kill()
        process.join(5)
        holder.close()
        successor.close()
    finish(f"{kind}: lock waiter SIGKILL while in line", {"dead_waiter_bound": cell})
