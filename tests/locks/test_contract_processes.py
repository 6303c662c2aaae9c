"""The lock contract across processes: each one builds its own manager from the URL.

Processes use the 'spawn' start method (no state inherited from pytest) and
report through multiprocessing queues; a crash is a real SIGKILL, a pause a real
SIGSTOP.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from locks import workers
from locks.backends import LockEnv
from toolguard.errors import LockTimeout

SLACK_S = 1.5
spawn = multiprocessing.get_context("spawn")


@pytest.mark.timeout(90)
def test_processes_lose_no_update(backend: LockEnv, tmp_path: Path) -> None:
    key = backend.key("file-counter")
    counter = tmp_path / "counter.txt"
    counter.write_text("0")
    processes, rounds = 3, 40
    with spawn.Pool(processes) as pool:
        results = pool.starmap(workers.increment_file,
                               [(backend.url, key, str(counter), rounds)] * processes)
    assert int(counter.read_text()) == processes * rounds
    tokens = [int(line) for line in counter.with_suffix(".log").read_text().split()]
    assert len(tokens) == processes * rounds
    assert all(a < b for a, b in itertools.pairwise(tokens)), "not in grant order"
    assert sorted(t for r in results for t in r) == tokens


def _start_holder(backend: LockEnv, key: str, ttl_ms: int):
    report, proceed = spawn.Queue(), spawn.Event()
    process = spawn.Process(target=workers.hold, args=(backend.url, key, ttl_ms, report, proceed),
                            daemon=True)
    process.start()
    kind, token = report.get(timeout=30)
    assert kind == "token"
    return process, report, proceed, token


@pytest.mark.timeout(60)
def test_killed_holder_frees_the_lock_within_its_ttl(backend: LockEnv) -> None:
    key = backend.key("killed")
    ttl_ms = 800
    process, _, _, token = _start_holder(backend, key, ttl_ms)
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    locks = backend.manager()
    with locks.acquire(key, ttl_ms=2_000, timeout_s=ttl_ms / 1000 + SLACK_S) as lease:
        assert lease.token > token


@pytest.mark.timeout(60)
def test_paused_holder_learns_it_lost_and_keeps_the_smaller_token(backend: LockEnv) -> None:
    key = backend.key("sigstop")
    ttl_ms = 500
    process, report, proceed, token = _start_holder(backend, key, ttl_ms)
    os.kill(process.pid, signal.SIGSTOP)  # a GC pause, a swapped-out VM...
    try:
        locks = backend.manager()
        lease = locks.acquire(key, ttl_ms=10_000, timeout_s=ttl_ms / 1000 + SLACK_S)
        assert lease.token > token
    finally:
        os.kill(process.pid, signal.SIGCONT)
    proceed.set()
    kind, detail = report.get(timeout=30)
    process.join(10)
    assert kind == "lost", f"the paused holder believed it still held the lock ({detail})"
    assert not lease.lost
    lease.release()


@pytest.mark.timeout(60)
def test_lock_is_exclusive_between_a_process_and_a_thread(backend: LockEnv) -> None:
    key = backend.key("xproc")
    # a 1 s TTL: a loaded machine (a PostgreSQL fsync stall) still renews in time
    process, report, proceed, token = _start_holder(backend, key, 1_000)
    locks = backend.manager()
    time.sleep(3.0)  # three TTLs: the holder's heartbeat must keep it
    with pytest.raises(LockTimeout):
        locks.acquire(key, timeout_s=0.05)
    proceed.set()
    kind, detail = report.get(timeout=30)
    assert (kind, detail) == ("held", False)
    process.join(10)
    with locks.acquire(key, timeout_s=2) as lease:
        assert lease.token > token
