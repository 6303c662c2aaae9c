"""Where a guarded call's CPU goes, process by process, with one and with 8 threads.

    python benchmarks/guard_cpu.py [--redis-url URL] [--database-url URL] [--seconds S]
                                   [--quick] [--plain]

``benchmarks/guard.py`` measures calls/s with 8 threads. On a machine where the
calling threads and the servers share a few cores, calls/s follow the CPU that
one call costs all the processes together: this script splits it. The guarded
call of ``guard.py`` (Redis locks, PostgreSQL store, one read-modify-write of a
lead) and the expert's hand-written (d) and (d2) (``benchmarks/expert.py``) run
in interleaved, rotated segments, one thread and then 8; around each segment it
reads, from ``/proc`` (Linux):

* the client: user and system CPU of this process (the calling threads and the
  pools' and toolguard's background threads), ``getrusage``;
* PostgreSQL: every process whose parent is the postmaster of the server the
  run talks to (backends, WAL writer, checkpointer, autovacuum), found from a
  backend's parent pid, so the server must run on this machine;
* Redis: the process ``INFO server`` names (its ``process_id``);
* the whole machine: busy CPU from ``/proc/stat`` (all processes, interrupts
  and the kernel's loopback networking), as cores busy over the segment.

Per call it prints each process's CPU, their sum, and the ratios to (d): when
the machine is busy, calls/s at 8 threads track the inverse of the sum. The
last table splits the guarded call's extra CPU over (d) by process. The
figures include whatever else the servers serve meanwhile: run it on a quiet
machine. Always exits 0.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import AGENTS, rotated, throughput
from _stats import Table, fmt_rate, fmt_ratio, ratio
from guard import Setup, guard_parser

TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> tuple[int, float]:
    """(parent pid, user + system CPU seconds) of process ``pid`` from ``/proc``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def children_cpu(parent: int) -> float:
    """CPU seconds used so far by every live process whose parent is ``parent``."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):  # ended meanwhile
            ppid, used = _proc_cpu(int(entry.name))
            if ppid == parent:
                total += used
    return total


def machine_busy() -> float:
    """CPU seconds the machine has been busy (all cores: not idle, not waiting on I/O)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK


@dataclass
class Meters:
    """Reads the CPU used so far by the client, the PostgreSQL server, Redis and the machine."""

    postmaster: int
    redis_pid: int

    @classmethod
    def of(cls, setup: Setup) -> Meters:
        with setup.pool.connection() as conn:
            (backend,) = conn.execute("SELECT pg_backend_pid()").fetchone() or (0,)
        info: dict[str, Any] = setup.redis.info("server")  # type: ignore[assignment]
        postmaster, _ = _proc_cpu(int(backend))
        return cls(postmaster, int(info["process_id"]))

    def read(self) -> dict[str, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {"client": usage.ru_utime + usage.ru_stime,
                "PostgreSQL": children_cpu(self.postmaster),
                "Redis": _proc_cpu(self.redis_pid)[1],
                "machine": machine_busy()}


@dataclass
class Tally:
    calls: int = 0
    elapsed: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)

    def per_call_us(self, process: str) -> float:
        return 1e6 * self.cpu.get(process, 0.0) / self.calls if self.calls else float("nan")


PROCESSES = ("client", "PostgreSQL", "Redis")


def measure(meters: Meters, impls: dict[str, Callable[[str], None]], seconds: float,
            segments: int, agents: int) -> dict[str, Tally]:
    """Each implementation's ``seconds`` over ``segments`` rotated segments of ``agents``
    threads, with the CPU each process used during its segments."""
    tallies = {name: Tally() for name in impls}
    names = list(impls)
    for segment in range(segments):
        for name in rotated(names, segment):
            before = meters.read()
            load = throughput(impls[name], seconds / segments, agents)
            after = meters.read()
            tally = tallies[name]
            tally.calls += load.calls
            tally.elapsed += load.elapsed
            for process, value in after.items():
                tally.cpu[process] = tally.cpu.get(process, 0.0) + value - before[process]
    return tallies


def report(title: str, tallies: dict[str, Tally], *, plain: bool) -> None:
    expert = tallies["expert (d)"]
    expert_total = sum(expert.per_call_us(p) for p in PROCESSES)
    table = Table(title, ["impl", "calls/s", *(f"{p} CPU" for p in PROCESSES), "sum",
                          "machine busy", "calls/s vs (d)", "sum vs (d)", "(d) sum / sum"],
                  plain=plain)
    for name, tally in tallies.items():
        per_call = [tally.per_call_us(p) for p in PROCESSES]
        total = sum(per_call)
        table.add_row(name, fmt_rate(tally.calls / tally.elapsed),
                      *(f"{us:,.0f} us" for us in per_call), f"{total:,.0f} us",
                      f"{tally.cpu['machine'] / tally.elapsed:.2f} cores",
                      fmt_ratio(ratio(tally.calls / tally.elapsed,
                                      expert.calls / expert.elapsed)),
                      fmt_ratio(ratio(total, expert_total)),
                      fmt_ratio(ratio(expert_total, total)))
    table.print()


def gap(results: dict[int, dict[str, Tally]], *, plain: bool) -> None:
    """The guarded call's CPU per call beyond (d)'s and (d2)'s, by process."""
    table = Table("3. the guarded call's CPU per call beyond the expert's, by process",
                  ["threads", "vs", *PROCESSES, "sum"], plain=plain)
    for agents, tallies in results.items():
        guarded = tallies["guarded"]
        for reference in ("expert (d)", "expert (d2)"):
            extra = [guarded.per_call_us(p) - tallies[reference].per_call_us(p)
                     for p in PROCESSES]
            table.add_row(str(agents), reference, *(f"{us:+,.0f} us" for us in extra),
                          f"{sum(extra):+,.0f} us")
    table.print()


def main(argv: list[str] | None = None) -> int:
    parser = guard_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=None,
                        help="length of each implementation's phase (default 12, --quick 2)")
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (2.0 if args.quick else 12.0)
    segments = 1 if args.quick else 3
    try:
        setup = Setup(args.database_url, args.redis_url, uuid.uuid4().hex[:10])
    except Exception as error:
        print(f"cannot set up the benchmark (PostgreSQL {args.database_url}, "
              f"Redis {args.redis_url}): {type(error).__name__}: {error}")
        return 0
    try:
        try:
            meters = Meters.of(setup)
            meters.read()
        except (OSError, KeyError, ValueError) as error:
            print(f"cannot read the servers' CPU (they must run on this machine, Linux): "
                  f"{type(error).__name__}: {error}")
            return 0
        impls: dict[str, Callable[[str], None]] = {
            "expert (d)": setup.expert.d, "expert (d2)": setup.expert.d2,
            "guarded": setup.guarded}
        for call in impls.values():  # warm-up: pools, scripts, caches
            throughput(call, 1.0 if not args.quick else 0.3, AGENTS)
        print(f"CPU per call by process; python {sys.version.split()[0]}; {os.cpu_count()} "
              f"cores; {seconds:g} s per implementation and thread count")
        results: dict[int, dict[str, Tally]] = {}
        for index, agents in enumerate((1, AGENTS), start=1):
            results[agents] = measure(meters, impls, seconds, segments, agents)
            report(f"{index}. {agents} thread{'s' if agents > 1 else ''} (interleaved "
                   "segments; CPU per call)", results[agents], plain=args.plain)
        gap(results, plain=args.plain)
    finally:
        setup.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
