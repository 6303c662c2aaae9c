"""A "two holders at once" checker, and the multi-process workload it watches.

Agents (threads or asyncio tasks in spawned processes) take random keys in a
loop. Each holder appends one JSON line per lease to a shared file opened with
``O_APPEND`` (a SIGSTOP or SIGKILL loses nothing written before it):

* ``token``, ``start`` (``time.monotonic()`` right after ``acquire`` returned:
  CLOCK_MONOTONIC is one clock for every process of the machine), ``end`` (the
  earlier of "just before release" and the lease's own local deadline then);
* ``server``: the lock server's own current token for the key, read right after
  the grant, and ``lost``: whether the lease was already lost after that read.

``problems(records)`` then states the invariants:

1. per key, the validity intervals ``[start, end]`` of leases never overlap;
2. per key, in the order of those intervals, tokens strictly increase;
3. a lease not yet lost after reading the server's current token has that token.

The parent stops (SIGSTOP) random agent processes for a few TTLs and continues
them: holders, waiters and hand-offs in flight are frozen past their TTLs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import os
import random
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolguard.errors import BackendUnavailable, LockTimeout
from toolguard.locks import AsyncLockManager, Lease, LockManager, connect, connect_async

__all__ = ["INVARIANTS", "Outcome", "Workload", "problems", "read_records", "run_workload",
           "stop_one", "violations"]

spawn = multiprocessing.get_context("spawn")


@dataclass(frozen=True)
class Workload:
    """What the agents do (picklable: each spawned process gets a copy)."""

    url: str
    keys: tuple[str, ...]
    ttl_ms: int = 400
    hold_s: float = 0.02
    wait_s: float = 30.0
    options: Mapping[str, Any] = field(default_factory=dict)


class _Log:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, **record: Any) -> None:
        os.write(self.fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        os.close(self.fd)


def _record(log: _Log, key: str, lease: Lease, start: float, server: int, lost: bool,
            end: float) -> None:
    log.write(key=key, token=lease.tokens[key], start=start, end=min(end, lease.deadline),
              server=server, lost=lost, pid=os.getpid(), owner=lease.owner)


def _sync_agent(work: Workload, locks: LockManager, index: int, log: _Log, stop: str) -> None:
    rng = random.Random(f"{os.getpid()}-{index}")
    backend: Any = locks.backend
    while not os.path.exists(stop):
        key = rng.choice(work.keys)
        try:
            lease = locks.acquire(key, ttl_ms=work.ttl_ms, timeout_s=work.wait_s)
        except (LockTimeout, BackendUnavailable) as error:
            log.write(event=type(error).__name__, key=key, pid=os.getpid())
            continue
        start = time.monotonic()
        try:
            server = backend.current_token(key)
            lost = lease.lost
            time.sleep(rng.uniform(0, work.hold_s))
            _record(log, key, lease, start, server, lost, time.monotonic())
        finally:
            lease.release()


async def _async_agent(work: Workload, locks: AsyncLockManager, index: int, log: _Log,
                       stop: str) -> None:
    rng = random.Random(f"{os.getpid()}-a{index}")
    backend: Any = locks.renewer
    while not os.path.exists(stop):
        key = rng.choice(work.keys)
        try:
            lease = await locks.acquire(key, ttl_ms=work.ttl_ms, timeout_s=work.wait_s)
        except (LockTimeout, BackendUnavailable) as error:
            log.write(event=type(error).__name__, key=key, pid=os.getpid())
            continue
        start = time.monotonic()
        try:
            server = await asyncio.to_thread(backend.current_token, key)
            lost = lease.lost
            await asyncio.sleep(rng.uniform(0, work.hold_s))
            _record(log, key, lease, start, server, lost, time.monotonic())
        finally:
            await lease.arelease()


def agent_process(work: Workload, mode: str, agents: int, log_path: str, stop: str) -> None:
    """Entry point of one spawned agent process: ``agents`` threads (sync) or tasks (async)."""
    log = _Log(log_path)
    log.write(event="started", pid=os.getpid())
    try:
        if mode == "async":
            asyncio.run(_async_main(work, agents, log, stop))
            return
        locks = connect(work.url, **work.options)
        threads = [threading.Thread(target=_sync_agent, args=(work, locks, i, log, stop))
                   for i in range(agents)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        locks.close()
    finally:
        log.close()


async def _async_main(work: Workload, agents: int, log: _Log, stop: str) -> None:
    locks = connect_async(work.url, **work.options)
    try:
        await asyncio.gather(*(_async_agent(work, locks, i, log, stop) for i in range(agents)))
    finally:
        await locks.aclose()


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


#: The invariants ``violations`` checks, in the order of the module docstring.
INVARIANTS = ("one_holder", "grant_order", "server_token")


def violations(records: Iterable[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Per invariant, every violation found (empty lists: none)."""
    found: dict[str, list[str]] = {name: [] for name in INVARIANTS}
    by_key: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for record in records:
        if "token" in record:
            by_key[record["key"]].append(record)
    for key, held in by_key.items():
        valid = sorted((r for r in held if r["end"] > r["start"]), key=lambda r: r["start"])
        for a, b in itertools.pairwise(valid):
            if b["start"] < a["end"]:
                found["one_holder"].append(f"two holders of {key} at once: {dict(a)} and "
                                           f"{dict(b)}")
            if b["token"] <= a["token"]:
                found["grant_order"].append(f"{key}: token {b['token']} held after token "
                                            f"{a['token']}")
        for record in held:
            if not record["lost"] and record["server"] != record["token"]:
                found["server_token"].append(
                    f"{key}: lease with token {record['token']} (pid {record['pid']}) returned "
                    f"while the server's current token was {record['server']}")
    return found


def problems(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every violation of the three invariants (empty: none)."""
    return [problem for found in violations(records).values() for problem in found]


@dataclass
class Outcome:
    records: list[dict[str, Any]]
    stops: int
    #: When the last disruption ended (``time.monotonic()``).
    healed_at: float = 0.0

    @property
    def leases(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "token" in r]

    def errors(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") in ("LockTimeout", "BackendUnavailable")]


def stop_one(processes: Sequence[Any], rng: random.Random, work: Workload,
             pause_ttls: tuple[float, float] = (2.0, 3.0)) -> None:
    """SIGSTOP one random agent process for ``pause_ttls`` TTLs, then SIGCONT it."""
    victim = rng.choice(processes)
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        time.sleep(rng.uniform(*pause_ttls) * work.ttl_ms / 1000)
    finally:
        os.kill(victim.pid, signal.SIGCONT)


def run_workload(work: Workload, tmp_path: Path, modes: Sequence[str], *, agents: int = 3,
                 seconds: float = 5.0, pause_ttls: tuple[float, float] = (2.0, 3.0),
                 seed: int = 0, gap_s: tuple[float, float] = (0.05, 0.3),
                 disrupt: Callable[[Sequence[Any], random.Random], None] | None = None,
                 settle_s: float = 0.0) -> Outcome:
    """Agent processes (one per entry of ``modes``) under repeated disruptions for
    ``seconds`` (by default: a random process stopped for two to three TTLs), then
    ``settle_s`` undisturbed; returns what they recorded once all of them have stopped."""
    log_path = tmp_path / f"leases-{seed}.jsonl"
    stop = tmp_path / f"stop-{seed}"
    processes = [spawn.Process(target=agent_process, daemon=True,
                               args=(work, mode, agents, str(log_path), str(stop)))
                 for mode in modes]
    for process in processes:
        process.start()
    rng = random.Random(seed)
    if disrupt is None:
        def disrupt(procs: Sequence[Any], rng: random.Random) -> None:
            stop_one(procs, rng, work, pause_ttls)
    stops = 0
    healed_at = time.monotonic()
    try:
        deadline = time.monotonic() + 60
        while (sum(1 for r in read_records(log_path) if r.get("event") == "started")
               < len(processes)):
            assert time.monotonic() < deadline, "the agent processes did not start"
            time.sleep(0.05)
        time.sleep(0.5)  # every agent is holding or in line
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            disrupt(processes, rng)
            stops += 1
            healed_at = time.monotonic()
            time.sleep(rng.uniform(*gap_s))
        time.sleep(settle_s)
    finally:
        stop.touch()
        for process in processes:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signal.SIGCONT)
            process.join(work.wait_s + 30)
            if process.is_alive():
                process.kill()
                process.join(5)
    return Outcome(read_records(log_path), stops, healed_at)
