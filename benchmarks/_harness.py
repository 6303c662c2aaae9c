"""The measuring loops the guarded-call benchmarks share (``guard.py``, ``deployments.py``).

Every implementation is a ``Callable[[str], None]`` taking a lead id; the loops
time it one thread at a time (``latency``, interleaved rounds), from ``AGENTS``
threads (``throughput``, ``throughput_rounds``: interleaved, rotated segments),
and in CPU time of the calling thread (``cpu_per_call``).
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LEADS = 1_000
AGENTS = 8


def lead_schema_pool(database_url: str, schema: str, size: int = AGENTS + 4) -> Any:
    """A new schema holding the ``lead`` table (``LEADS`` rows at score 0), and a pool of
    ``size`` autocommit connections whose search_path is that schema."""
    import psycopg
    from psycopg import sql
    from psycopg_pool import ConnectionPool

    path = sql.SQL("SET search_path TO {}").format(sql.Identifier(schema))
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(path)
        conn.execute("CREATE TABLE lead (id text PRIMARY KEY, score bigint NOT NULL)")
        conn.execute("INSERT INTO lead SELECT 'lead-' || i, 0 FROM generate_series(0, %s) i",
                     (LEADS - 1,))

    def configure(conn: psycopg.Connection[Any]) -> None:
        conn.execute(path)

    pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
        database_url, min_size=size, max_size=size, kwargs={"autocommit": True},
        configure=configure, open=True)
    pool.wait()
    return pool


def lead_of(rng: random.Random) -> str:
    return f"lead-{rng.randrange(LEADS)}"


def latency(setup: Any, impls: dict[str, Callable[[str], None]], seconds: float,
            rounds: int) -> dict[str, list[float]]:
    """Alternate the implementations' batches, one thread, until ``seconds`` are spent.

    ``setup`` is unused (kept for the callers' signature)."""
    rng = random.Random(7)
    samples: dict[str, list[float]] = {name: [] for name in impls}
    for call in impls.values():  # warm-up: pools, scripts, caches
        for _ in range(50):
            call(lead_of(rng))
    deadline = time.monotonic() + seconds
    per_round = seconds / rounds
    while time.monotonic() < deadline:
        for name, call in impls.items():
            until = time.monotonic() + per_round / len(impls)
            while time.monotonic() < until:
                lead = lead_of(rng)
                started = time.perf_counter()
                call(lead)
                samples[name].append(time.perf_counter() - started)
    return samples


@dataclass
class Load:
    calls: int
    elapsed: float
    latencies: list[float]


def throughput(call: Callable[[str], None], seconds: float, agents: int = AGENTS) -> Load:
    """``agents`` threads calling on random leads for ``seconds``."""
    start = threading.Barrier(agents + 1)
    stop = threading.Event()
    per_thread: list[list[float]] = [[] for _ in range(agents)]
    errors: list[BaseException] = []

    def agent(index: int) -> None:
        rng = random.Random(index)
        start.wait()
        try:
            while not stop.is_set():
                lead = lead_of(rng)
                started = time.perf_counter()
                call(lead)
                per_thread[index].append(time.perf_counter() - started)
        except BaseException as error:  # reported after the run
            errors.append(error)

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(agents)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(30)
    elapsed = time.perf_counter() - began
    if errors:
        print(f"  ! {len(errors)} agent(s) stopped early: {errors[0]!r}")
    latencies = [x for each in per_thread for x in each]
    return Load(len(latencies), elapsed, latencies)


def rotated(names: list[str], turn: int) -> list[str]:
    """``names`` starting ``turn`` places further on, so each round of interleaved
    measurements starts with another implementation."""
    shift = turn % len(names)
    return names[shift:] + names[:shift]


def throughput_rounds(impls: dict[str, Callable[[str], None]], seconds: float,
                      segments: int) -> dict[str, Load]:
    """Each implementation's ``seconds`` cut into ``segments`` interleaved (rotated) runs,
    so a busy phase of the machine hits all of them alike."""
    parts: dict[str, list[Load]] = {name: [] for name in impls}
    names = list(impls)
    for segment in range(segments):
        for name in rotated(names, segment):
            parts[name].append(throughput(impls[name], seconds / segments))
    return {name: Load(sum(p.calls for p in loads), sum(p.elapsed for p in loads),
                       [x for p in loads for x in p.latencies])
            for name, loads in parts.items()}


def cpu_per_call(call: Callable[[str], None], calls: int, seed: int) -> list[float]:
    """CPU time of the calling thread for each of ``calls`` calls on random leads."""
    rng = random.Random(seed)
    cpu = []
    for _ in range(calls):
        started = time.thread_time()
        call(lead_of(rng))
        cpu.append(time.thread_time() - started)
    return cpu


def run_arguments(parser: argparse.ArgumentParser) -> None:
    """``--quick`` and ``--plain``, which every benchmark script takes."""
    parser.add_argument("--quick", action="store_true", help="shorter runs, for a smoke test")
    parser.add_argument("--plain", action="store_true", help="plain text tables")
