"""toolguard's Redis lock side by side with redis-py's Lock, python-redis-lock and a bare floor.

    python benchmarks/locks.py [--redis-url URL] [--seconds S] [--quick] [--plain]

1. Uncontended: acquire+release cycles per second and p50/p99 cycle latency, one
   thread, a fresh key per cycle. The implementations run in interleaved rounds
   so slow drifts of the machine hit all of them alike. Ratio: against the floor,
   the median of the per-round ratios.
2. Contended: 2, 8 and 16 threads on one key, each holding it for a 1 ms
   critical section (``time.sleep(0.001)``) in a loop for ``--seconds``.
   Critical sections per second; hand-off latency, i.e. the gap between one
   holder's last instant in its critical section and the next holder's first
   (both taken with ``time.perf_counter`` inside the critical section, so it
   covers release, wake-up and grant); wait (duration of each acquire call begun in
   the run, also one that ends after it, so a starved thread shows);
   acquisitions per thread (min/max) and Jain's fairness index. Ratio: against
   python-redis-lock at the same thread count. Each run is cut into ~1 s
   segments, interleaved across implementations like the uncontended rounds;
   min/max and Jain's index are taken per segment and averaged.

The floor is what any Redis lock has to pay at least: ``SET key val NX PX ttl``
to acquire and one compare-and-delete script by SHA to release (contended: it
retries SET NX after a 0.5 ms sleep, so it is neither fair nor server-woken).

Every key carries a random run id and lives in the URL's database (default 14);
the script deletes its own keys at the end and never touches anything else.
Each run is bounded by time; the script always exits 0 (a miss is a finding,
not a crash).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import itertools
import math
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import (  # the sibling module, importable once the path is set
    Table,
    fmt_count,
    fmt_rate,
    fmt_ratio,
    fmt_s,
    jain_index,
    ratio,
    summarize,
    verdict,
)

DEFAULT_URL = "redis://127.0.0.1:6379/14"
TTL_S = 30                 # long enough that no lock expires during a run
WAIT_S = 5                 # acquire timeout: bounds every run even if a lock misbehaves
CRITICAL_S = 0.001         # the contended critical section
SPIN_S = 0.0005            # the floor's retry sleep under contention
THREADS = (2, 8, 16)
ROUNDS = 10                # uncontended rounds, interleaved
FLOOR = "floor"
PRL = "python-redis-lock"
TOOLGUARD = "toolguard"

CAD = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"

Acquire = Callable[[], bool]
Release = Callable[[], None]


# --- the contenders -------------------------------------------------------------------
#
# Each gives a ``cycle(key)`` (one acquire + release in the library's natural
# form, object construction included) and a ``worker(key)`` (a per-thread pair of
# acquire/release callables for the contended loop; acquire returns False on
# timeout). Each has its own connection pool.


class Contender:
    name: str
    note: str

    def cycle(self, key: str) -> None:
        raise NotImplementedError

    def worker(self, key: str) -> tuple[Acquire, Release]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ToolguardLock(Contender):
    name = TOOLGUARD
    note = "toolguard.locks.connect(url): fenced, FIFO, BLPOP direct hand-off, shared heartbeat"

    def __init__(self, url: str, ns: str) -> None:
        from toolguard.errors import LockTimeout
        from toolguard.locks import connect

        self._timeout_error = LockTimeout
        self.locks = connect(url, prefix=f"{ns}:tg")

    def cycle(self, key: str) -> None:
        with self.locks.acquire(key, ttl_ms=TTL_S * 1000, timeout_s=WAIT_S):
            pass

    def worker(self, key: str) -> tuple[Acquire, Release]:
        held = []

        def acquire() -> bool:
            try:
                held.append(self.locks.acquire(key, ttl_ms=TTL_S * 1000, timeout_s=WAIT_S))
            except self._timeout_error:
                return False
            return True

        def release() -> None:
            held.pop().release()

        return acquire, release

    def close(self) -> None:
        self.locks.close()


class RedisPyLock(Contender):
    name = "redis-py Lock"
    note = "client.lock(name, timeout, blocking_timeout): SET NX + retry after sleep=0.1 s (default)"

    def __init__(self, url: str, ns: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.ns = ns

    def cycle(self, key: str) -> None:
        with self.client.lock(f"{self.ns}:rp:{key}", timeout=TTL_S, blocking_timeout=WAIT_S):
            pass

    def worker(self, key: str) -> tuple[Acquire, Release]:
        lock = self.client.lock(f"{self.ns}:rp:{key}", timeout=TTL_S, blocking_timeout=WAIT_S)
        return lock.acquire, lock.release

    def close(self) -> None:
        self.client.close()


class PythonRedisLock(Contender):
    name = PRL
    note = "redis_lock.Lock(client, name, expire, auto_renewal=False): SET NX, BLPOP on a signal list"

    def __init__(self, url: str, ns: str) -> None:
        import redis_lock

        self._lock_class = redis_lock.Lock
        self.client = redis.Redis.from_url(url)
        self.ns = ns

    def _lock(self, key: str):  # redis_lock ships no types
        return self._lock_class(self.client, f"{self.ns}:prl:{key}", expire=TTL_S, auto_renewal=False)

    def cycle(self, key: str) -> None:
        with self._lock(key):
            pass

    def worker(self, key: str) -> tuple[Acquire, Release]:
        lock = self._lock(key)

        def acquire() -> bool:
            return bool(lock.acquire(timeout=WAIT_S))

        return acquire, lock.release

    def close(self) -> None:
        self.client.close()


class FloorLock(Contender):
    name = FLOOR
    note = (f"SET key val NX PX ttl, then one compare-and-delete by EVALSHA "
            f"(contended: retry after {SPIN_S * 1000:g} ms)")

    def __init__(self, url: str, ns: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.ns = ns
        self.sha = self.client.script_load(CAD)

    def cycle(self, key: str) -> None:
        name, value = f"{self.ns}:fl:{key}", uuid.uuid4().hex
        if self.client.set(name, value, nx=True, px=TTL_S * 1000):
            self.client.evalsha(self.sha, 1, name, value)

    def worker(self, key: str) -> tuple[Acquire, Release]:
        name, value = f"{self.ns}:fl:{key}", uuid.uuid4().hex
        client, sha = self.client, self.sha

        def acquire() -> bool:
            deadline = time.monotonic() + WAIT_S
            while not client.set(name, value, nx=True, px=TTL_S * 1000):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(SPIN_S)
            return True

        def release() -> None:
            client.evalsha(sha, 1, name, value)

        return acquire, release

    def close(self) -> None:
        self.client.close()


CONTENDERS = (ToolguardLock, PythonRedisLock, RedisPyLock, FloorLock)


# --- 1. uncontended ---------------------------------------------------------------------


@dataclass
class Uncontended:
    name: str
    cycles: int = 0
    latencies_s: list[float] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)  # elapsed time of each round
    error: str = ""

    @property
    def rate(self) -> float:
        """Cycles per second of the median round (a burst of load on the machine during
        one round does not drag the figure, as it would a total over all rounds)."""
        if not self.round_s:
            return math.nan
        return self.cycles / len(self.round_s) / statistics.median(self.round_s)

    def ratio_to(self, baseline: Uncontended) -> float:
        """Median over rounds of baseline time / own time: each round's pair ran back to back,
        so a slow phase of the machine cancels out instead of landing on one side."""
        if self.error or baseline.error or len(self.round_s) != len(baseline.round_s):
            return math.nan
        return statistics.median(b / s for s, b in zip(self.round_s, baseline.round_s, strict=True))


def run_uncontended(contenders: list[Contender], cycles: int, rounds: int,
                    ns: str) -> dict[str, Uncontended]:
    results = {c.name: Uncontended(c.name) for c in contenders}
    per_round = max(1, cycles // rounds)
    for c in contenders:  # warm up: connections, script cache, first-call imports
        try:
            for i in range(min(200, per_round)):
                c.cycle(f"{ns}:warm:{i}")
        except Exception as error:  # a broken contender is reported, the others still run
            results[c.name].error = f"{type(error).__name__}: {error}"
    perf = time.perf_counter
    for r in range(rounds):
        for c in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:
            result = results[c.name]
            if result.error:
                continue
            keys = [f"{ns}:u{r}:{i}" for i in range(per_round)]
            samples = result.latencies_s
            cycle = c.cycle
            try:
                started = perf()
                for key in keys:
                    t0 = perf()
                    cycle(key)
                    samples.append(perf() - t0)
                took = perf() - started
                result.round_s.append(took)
                result.cycles += per_round
            except Exception as error:
                result.error = f"{type(error).__name__}: {error}"
    return results


# --- 2. contended -------------------------------------------------------------------------


@dataclass
class Contended:
    name: str
    threads: int
    window_s: float
    sections: int = 0
    handoffs_s: list[float] = field(default_factory=list)
    waits_s: list[float] = field(default_factory=list)
    shares: list[list[int]] = field(default_factory=list)  # per segment: sections per thread
    timeouts: int = 0
    overlaps: int = 0
    errors: list[str] = field(default_factory=list)
    hung: int = 0

    @property
    def rate(self) -> float:
        return self.sections / self.window_s if self.window_s > 0 else math.nan

    @property
    def jain(self) -> float:
        """Jain's index of each segment's per-thread shares, averaged over the segments.

        Per segment, because segments of one run can differ in speed (the machine
        drifts) and that is no unfairness between the threads of one segment."""
        values = [jain_index(counts) for counts in self.shares if sum(counts)]
        return statistics.fmean(values) if values else math.nan

    def share_range(self) -> str:
        """Fewest / most sections of one thread, averaged over the segments."""
        if not self.shares:
            return "-"
        low = statistics.fmean(min(counts) for counts in self.shares)
        high = statistics.fmean(max(counts) for counts in self.shares)
        return f"{low:.0f}/{high:.0f}"


def run_contended(c: Contender, threads: int, seconds: float, key: str) -> Contended:
    """``threads`` threads loop acquire / 1 ms / release on ``key`` for ``seconds``."""
    perf = time.perf_counter
    barrier = threading.Barrier(threads + 1)
    # (grant, exit, thread): appended inside the critical section.
    sections: list[tuple[float, float, int]] = []
    # (start, duration) of every acquire call, granted or timed out.
    waits: list[tuple[float, float]] = []
    timeouts = [0] * threads
    errors: list[str] = []
    window: list[float] = []

    def loop(index: int) -> None:
        try:
            acquire, release = c.worker(key)
            barrier.wait(timeout=30)
            stop = window[1]
            while True:
                t0 = perf()
                if t0 >= stop:
                    return
                granted = acquire()
                t1 = perf()
                waits.append((t0, t1 - t0))
                if not granted:
                    timeouts[index] += 1
                    continue
                try:
                    time.sleep(CRITICAL_S)
                    sections.append((t1, perf(), index))
                finally:
                    release()
        except threading.BrokenBarrierError:
            return
        except Exception as error:
            errors.append(f"thread {index}: {type(error).__name__}: {error}")

    workers = [threading.Thread(target=loop, args=(i,), daemon=True, name=f"bench-{i}")
               for i in range(threads)]
    for w in workers:
        w.start()
    start = perf()  # the threads read the window once the barrier lets them go
    window[:] = [start, start + seconds]
    try:
        barrier.wait(timeout=30)
    except threading.BrokenBarrierError:
        errors.append("threads did not start")
    # Any thread still waiting at the end gets the lock within one timeout and exits.
    join_by = time.monotonic() + seconds + WAIT_S + 5
    for w in workers:
        w.join(timeout=max(0.0, join_by - time.monotonic()))
    end = window[1]

    inside = [s for s in sections if s[0] < end]
    result = Contended(c.name, threads, window_s=seconds, sections=len(inside),
                       timeouts=sum(timeouts), errors=errors,
                       hung=sum(w.is_alive() for w in workers))
    counts = [0] * threads
    for _grant, _exit, index in inside:
        counts[index] += 1
    result.shares = [counts]
    # Waits of calls started in the window, also those granted (or timed out) after
    # it: a thread starved until the end shows up here.
    result.waits_s = [duration for began, duration in waits if began < end]
    ordered = sorted(sections)
    for before, after in itertools.pairwise(ordered):
        if after[0] < before[1]:
            result.overlaps += 1  # two holders inside at once: a broken lock
        elif after[0] < end:
            result.handoffs_s.append(after[0] - before[1])
    return result


def merge(parts: list[Contended]) -> Contended:
    """One result from several segments of the same run (shares stay per segment)."""
    first = parts[0]
    total = Contended(first.name, first.threads, window_s=0.0)
    for part in parts:
        total.window_s += part.window_s
        total.sections += part.sections
        total.handoffs_s += part.handoffs_s
        total.waits_s += part.waits_s
        total.shares += part.shares
        total.timeouts += part.timeouts
        total.overlaps += part.overlaps
        total.errors += part.errors
        total.hung += part.hung
    return total


def rotated(items: list[Contender], shift: int) -> list[Contender]:
    shift %= len(items)
    return items[shift:] + items[:shift]


# --- report ----------------------------------------------------------------------------------


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def server_info(client: redis.Redis) -> str:
    info = client.info("server")
    return f"Redis {info.get('redis_version', '?')}"


def cleanup(url: str, ns: str) -> int:
    client = redis.Redis.from_url(url)
    removed = 0
    try:
        batch = []
        for name in client.scan_iter(match=f"*{ns}*", count=1000):
            batch.append(name)
            if len(batch) >= 500:
                removed += client.unlink(*batch)
                batch = []
        if batch:
            removed += client.unlink(*batch)
    finally:
        client.close()
    return removed


def print_uncontended(results: dict[str, Uncontended], plain: bool) -> None:
    floor = results.get(FLOOR)
    table = Table("1. Uncontended: acquire+release, 1 thread, a fresh key per cycle",
                  ["implementation", "cycles", "cycles/s", "p50", "p99", "vs floor"], plain=plain,
                  caption="cycles/s: the median round; p50/p99: every cycle's latency")
    for result in results.values():
        if result.error:
            table.add_row(result.name, "-", "-", "-", "-", f"error: {result.error[:60]}")
            continue
        stats = summarize(result.latencies_s)
        versus = result.ratio_to(floor) if floor else math.nan
        table.add_row(result.name, fmt_count(result.cycles), fmt_rate(result.rate), fmt_s(stats.p50),
                      fmt_s(stats.p99), fmt_ratio(versus))
    table.print()


def print_contended(runs: list[Contended], plain: bool) -> None:
    table = Table(f"2. Contended: one key, {CRITICAL_S * 1000:g} ms critical section",
                  ["implementation", "threads", "sections/s", "vs prl", "hand-off p50",
                   "hand-off p99", "wait p99", "per thread min/max", "Jain", "timeouts"], plain=plain,
                  caption="hand-off: one holder's exit to the next holder's entry; wait: one acquire "
                          "call; min/max sections per thread and Jain's index: per ~1 s segment, "
                          "averaged")
    baseline = {r.threads: r.rate for r in runs if r.name == PRL}
    previous = None
    for run in runs:
        if previous is not None and run.threads != previous:
            table.add_section()
        previous = run.threads
        handoff = summarize(run.handoffs_s)
        wait = summarize(run.waits_s)
        table.add_row(run.name, run.threads, fmt_rate(run.rate),
                      fmt_ratio(ratio(run.rate, baseline.get(run.threads, math.nan))),
                      fmt_s(handoff.p50), fmt_s(handoff.p99), fmt_s(wait.p99), run.share_range(),
                      f"{run.jain:.3f}", run.timeouts)
    table.print()
    for run in runs:
        problems = []
        if run.overlaps:
            problems.append(f"{run.overlaps} overlapping critical sections (mutual exclusion broken)")
        if run.hung:
            problems.append(f"{run.hung} threads still running after the deadline")
        problems += run.errors[:3]
        if problems:
            print(f"  ! {run.name}, {run.threads} threads: " + "; ".join(problems))


def print_targets(uncontended: dict[str, Uncontended], runs: list[Contended], plain: bool) -> None:
    tg, floor = uncontended.get(TOOLGUARD), uncontended.get(FLOOR)
    tg_ratio = tg.ratio_to(floor) if tg and floor else math.nan
    by = {(r.name, r.threads): r for r in runs}
    tg16, prl16 = by.get((TOOLGUARD, max(THREADS))), by.get((PRL, max(THREADS)))
    table = Table("3. Targets (toolguard)", ["target", "measured", "goal", "verdict"], plain=plain)

    def known(value: float) -> bool:
        return not math.isnan(value)

    table.add_row("uncontended cycles/s vs floor", fmt_ratio(tg_ratio), ">= 0.85x",
                  verdict(tg_ratio >= 0.85 if known(tg_ratio) else None))
    if tg16 and prl16:
        speed = ratio(tg16.rate, prl16.rate)
        tg_p50, prl_p50 = summarize(tg16.handoffs_s).p50, summarize(prl16.handoffs_s).p50
        jain = tg16.jain
        table.add_row(f"{tg16.threads} threads sections/s vs {PRL}", fmt_ratio(speed), ">= 1.10x",
                      verdict(speed >= 1.1 if known(speed) else None))
        table.add_row(f"{tg16.threads} threads hand-off p50", f"{fmt_s(tg_p50)} vs {fmt_s(prl_p50)}",
                      f"<= {PRL}'s", verdict(tg_p50 <= prl_p50 if known(tg_p50 + prl_p50) else None))
        table.add_row(f"{tg16.threads} threads Jain's index", f"{jain:.3f}", ">= 0.99",
                      verdict(jain >= 0.99 if known(jain) else None))
    table.print()


def with_timeouts(url: str) -> str:
    """``url`` with socket timeouts (unless it sets its own): a server that stops answering
    turns into errors in the table, not a benchmark that never ends. They exceed every
    blocking wait the contenders use (BLPOP up to ``WAIT_S``)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query.setdefault("socket_timeout", str(WAIT_S + 10))
    query.setdefault("socket_connect_timeout", "5")
    return urlunsplit(parts._replace(query=urlencode(query)))


def start_watchdog(limit_s: float) -> None:
    """Last resort against a hang nobody foresaw: end the process, exit status 0, after limit_s."""

    def bite() -> None:
        time.sleep(limit_s)
        print(f"\n! watchdog: the benchmark ran over {limit_s:.0f} s and was stopped; "
              "the figures above are incomplete", flush=True)
        os._exit(0)

    threading.Thread(target=bite, name="bench-watchdog", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=os.environ.get("TOOLGUARD_BENCH_REDIS_URL", DEFAULT_URL))
    parser.add_argument("--seconds", type=float, default=None,
                        help="duration of each contended run (default 3, --quick 1)")
    parser.add_argument("--cycles", type=int, default=None,
                        help="uncontended cycles per implementation (default 5000, --quick 1500)")
    parser.add_argument("--quick", action="store_true", help="shorter runs, for a smoke test")
    parser.add_argument("--plain", action="store_true", help="plain text tables even if rich is installed")
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (1.0 if args.quick else 3.0)
    cycles = args.cycles if args.cycles is not None else (1500 if args.quick else 5000)
    seconds = max(0.1, seconds)
    segments = max(1, round(seconds))  # ~1 s segments, interleaved like the uncontended rounds
    ns = f"tgbench-{uuid.uuid4().hex[:10]}"
    url = with_timeouts(args.redis_url)
    # Expected: uncontended ~1 ms per cycle at worst, contended seconds per run plus drain.
    start_watchdog(60 + 3 * (len(CONTENDERS) * (cycles / 1000 + len(THREADS) * (seconds + 2))))

    probe = redis.Redis.from_url(url)
    try:
        server = server_info(probe)
    except redis.RedisError as error:
        print(f"cannot reach Redis at {args.redis_url}: {error}; nothing measured")
        return 0
    finally:
        probe.close()

    began = time.monotonic()
    contenders: list[Contender] = []
    for make in CONTENDERS:
        try:
            contenders.append(make(url, ns))
        except Exception as error:
            print(f"  ! {make.name} unavailable: {type(error).__name__}: {error}")

    print(f"toolguard lock benchmark  |  {server}, redis-py {version('redis')}, "
          f"python-redis-lock {version('python-redis-lock')}, toolguard {version('toolguard')}  |  "
          f"Python {platform.python_version()}, {os.cpu_count()} CPUs  |  key namespace {ns}")
    print("Baselines: uncontended 'vs floor' = floor's time / this implementation's time for the same "
          f"cycles (> 1 is faster); contended 'vs prl' = sections/s / {PRL}'s sections/s at the same "
          "thread count.")
    print(f"Uncontended: {cycles} cycles each, in {ROUNDS} interleaved rounds; 'vs floor' is the median "
          f"of the per-round ratios.  Contended: {seconds:g} s per implementation and thread count, "
          f"in {segments} interleaved segment(s); TTL {TTL_S} s, acquire timeout {WAIT_S} s.")
    for c in contenders:
        print(f"  {c.name:<18} {c.note}")
    print()

    try:
        uncontended = run_uncontended(contenders, cycles, rounds=ROUNDS, ns=f"{ns}:u")
        print_uncontended(uncontended, args.plain)
        print()
        runs: list[Contended] = []
        for threads in THREADS:
            parts: dict[str, list[Contended]] = {c.name: [] for c in contenders}
            for segment in range(segments):
                for c in rotated(contenders, segment):
                    parts[c.name].append(run_contended(c, threads, seconds / segments,
                                                       key=f"{ns}:c{threads}"))
            runs += [merge(parts[c.name]) for c in contenders]
        print_contended(runs, args.plain)
        print()
        print_targets(uncontended, runs, args.plain)
    finally:
        for c in contenders:
            with contextlib.suppress(Exception):
                c.close()
        with contextlib.suppress(Exception):
            cleanup(url, ns)
    print(f"\ntotal {time.monotonic() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
