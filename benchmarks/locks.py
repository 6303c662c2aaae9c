"""toolguard's Redis lock side by side with redis-py's Lock, python-redis-lock and a bare floor.

    python benchmarks/locks.py [--redis-url URL] [--seconds S] [--quick] [--plain]
        [--backends redis,sqlite,postgres,etcd] [--postgres-url URL] [--etcd-url URL]

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

4. Across backends: toolguard's own lock on each backend (``--backends``), one row
   each, in shorter interleaved segments: uncontended cycles/s (median ~0.4 s
   round), p50/p99, and contended 8 and 16 threads (sections/s, hand-off p50,
   Jain's index). Ratio: against toolguard on Redis measured in the same section.
   SQLite uses a temp file; PostgreSQL ``--postgres-url``; etcd ``--etcd-url`` or,
   by default, a private single-member etcd from ``/usr/bin/etcd`` on free loopback
   ports with a temp data dir (fsync on), stopped at the end. A backend that cannot
   be reached or started is a row "skipped: ...".

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
import base64
import contextlib
import importlib.metadata
import itertools
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import run_arguments  # the sibling modules, importable once the path is set
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
REDIS_PY = "redis-py Lock"
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
    name = REDIS_PY
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


# --- 4. toolguard across backends ----------------------------------------------------------

BACKENDS = ("redis", "sqlite", "postgres", "etcd")
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
ETCD_BINARY = "/usr/bin/etcd"
X_THREADS = (8, 16)
X_ROUNDS = 5               # uncontended rounds per backend, interleaved
X_ROUND_S = 0.4            # length of one uncontended round
X_SECONDS = 2.0            # contended run per backend and thread count (~1 s segments)
X_WARM = 30                # warm-up cycles: connections, schema, leases, watches

#: Run on a watchdog's bite too, which skips every ``finally`` (e.g. stop the private etcd).
LAST_RITES: list[Callable[[], None]] = []


class BackendLock(ToolguardLock):
    """toolguard's lock on one backend; the row name is the backend's."""

    def __init__(self, backend: str, url: str, note: str, **options: object) -> None:
        from toolguard.errors import LockTimeout
        from toolguard.locks import connect

        self.name = backend
        self.note = note
        self._timeout_error = LockTimeout
        self.locks = connect(url, **options)


@dataclass
class Paced:
    """Uncontended cycles of one backend in rounds of fixed length (cycle counts differ)."""

    name: str
    cycles: int = 0
    latencies_s: list[float] = field(default_factory=list)
    round_rates: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def rate(self) -> float:
        return statistics.median(self.round_rates) if self.round_rates else math.nan

    def ratio_to(self, baseline: Paced) -> float:
        """Median over rounds of own rate / baseline's rate (each pair ran back to back)."""
        if self.error or baseline.error or len(self.round_rates) != len(baseline.round_rates) \
                or not self.round_rates:
            return math.nan
        return statistics.median(
            s / b for s, b in zip(self.round_rates, baseline.round_rates, strict=True) if b > 0)


def run_paced(contenders: list[Contender], rounds: int, round_s: float, ns: str) -> dict[str, Paced]:
    results = {c.name: Paced(c.name) for c in contenders}
    for c in contenders:
        try:
            for i in range(X_WARM):
                c.cycle(f"{ns}:warm:{i}")
        except Exception as error:
            results[c.name].error = f"{type(error).__name__}: {error}"
    perf = time.perf_counter
    live = [c for c in contenders if not results[c.name].error]
    for r in range(rounds):
        for c in rotated(live, r) if live else []:
            result = results[c.name]
            if result.error:
                continue
            samples, cycle, n = result.latencies_s, c.cycle, 0
            try:
                started = perf()
                stop = started + round_s
                while True:
                    t0 = perf()
                    if t0 >= stop:
                        break
                    cycle(f"{ns}:u{r}:{n}")
                    samples.append(perf() - t0)
                    n += 1
                result.round_rates.append(n / (perf() - started))
                result.cycles += n
            except Exception as error:
                result.error = f"{type(error).__name__}: {error}"
    return results


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, body: dict[str, object] | None = None, timeout: float = 2.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def etcd_health(host: str, port: int) -> None:
    reply = http_json(f"http://{host}:{port}/health")
    if str(reply.get("health")).lower() != "true":
        msg = f"etcd at {host}:{port} is not healthy: {reply}"
        raise RuntimeError(msg)


class PrivateEtcd:
    """A single-member etcd on free loopback ports and a temp data dir; ``stop`` removes both."""

    def __init__(self, binary: str = ETCD_BINARY) -> None:
        self.dir = tempfile.mkdtemp(prefix="tgbench-etcd-")
        self.port, peer = free_port(), free_port()
        self.url = f"etcd://127.0.0.1:{self.port}"
        self.log = Path(self.dir) / "etcd.log"
        client, peer_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        command = [binary, "--name", "b", "--data-dir", str(Path(self.dir) / "data"),
                   "--listen-client-urls", client, "--advertise-client-urls", client,
                   "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                   "--initial-cluster", f"b={peer_url}", "--initial-cluster-state", "new"]
        self.proc: subprocess.Popen[bytes] | None = None
        LAST_RITES.append(self.stop)
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        self.version = "?"
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                msg = f"etcd exited with status {self.proc.returncode}: {self._last_log_line()}"
                raise RuntimeError(msg)
            try:
                etcd_health("127.0.0.1", self.port)
                break
            except Exception as error:
                if time.monotonic() > deadline:
                    msg = f"etcd not healthy after 15 s: {error}"
                    raise RuntimeError(msg) from error
                time.sleep(0.05)
        with contextlib.suppress(Exception):
            self.version = http_json(f"{client}/version").get("etcdserver", "?")

    def _last_log_line(self) -> str:
        with contextlib.suppress(OSError):
            lines = self.log.read_text(errors="replace").strip().splitlines()
            return lines[-1][-160:] if lines else "(no output)"
        return "(no log)"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when this process dies (Linux), so that even a
    killed benchmark leaves no etcd behind."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def etcd_url_with_prefix(url: str, ns: str) -> str:
    """``url`` with the run's own key prefix under whatever prefix it names."""
    parts = urlsplit(url)
    base = parts.path.strip("/") or "toolguard-bench"
    return urlunsplit(parts._replace(path=f"/{base}/{ns}/"))


def etcd_cleanup(url: str) -> None:
    from toolguard.locks.etcd import parse_etcd_url

    endpoints, prefix = parse_etcd_url(url)
    if not prefix:
        return
    key = prefix.encode()
    end = key[:-1] + bytes([key[-1] + 1])
    for host, port in endpoints:
        with contextlib.suppress(Exception):
            http_json(f"http://{host}:{port}/v3/kv/deleterange",
                      {"key": base64.b64encode(key).decode(), "range_end": base64.b64encode(end).decode()})
            return


def postgres_probe(url: str) -> str:
    import psycopg

    with psycopg.connect(url, connect_timeout=3, autocommit=True) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return f"PostgreSQL {row[0] if row else '?'}"


def postgres_cleanup(url: str, ns: str) -> None:
    import psycopg

    with psycopg.connect(url, connect_timeout=3, autocommit=True) as conn:
        for table in ("toolguard_lock_waiter", "toolguard_lock_holder", "toolguard_lock_fence"):
            with contextlib.suppress(psycopg.Error):
                conn.execute(f"DELETE FROM {table} WHERE key LIKE %s", (f"{ns}%",))


@dataclass
class Across:
    """The outcome of section 4: per backend, the uncontended and contended results."""

    notes: dict[str, str] = field(default_factory=dict)  # backend -> what it ran against
    skipped: dict[str, str] = field(default_factory=dict)  # backend -> why
    uncontended: dict[str, Paced] = field(default_factory=dict)
    runs: list[Contended] = field(default_factory=list)


def run_across(backends: list[str], *, redis_url: str | None, redis_note: str, postgres_url: str,
               etcd_url: str | None, ns: str, rounds: int, round_s: float, seconds: float,
               threads_list: tuple[int, ...], stack: contextlib.ExitStack) -> Across:
    """Open each backend (recording why one cannot be), then measure the ones that opened.
    Everything to close or delete is pushed on ``stack``."""
    out = Across()
    contenders: list[Contender] = []

    def opened(c: Contender) -> None:
        contenders.append(c)
        stack.callback(_quietly, c.close)

    for backend in backends:
        try:
            if backend == "redis":
                if redis_url is None:
                    out.skipped[backend] = redis_note
                    continue
                opened(BackendLock(backend, redis_url, redis_note, prefix=f"{ns}:tgx"))
            elif backend == "sqlite":
                folder = tempfile.mkdtemp(prefix="tgbench-sqlite-")
                stack.callback(shutil.rmtree, folder, ignore_errors=True)
                path = Path(folder) / "locks.db"
                opened(BackendLock(backend, f"sqlite:///{path}", f"temp file {path} (WAL)"))
            elif backend == "postgres":
                server = postgres_probe(postgres_url)
                stack.callback(_quietly, postgres_cleanup, postgres_url, ns)
                opened(BackendLock(backend, postgres_url, f"{server} at {safe_url(postgres_url)}"))
            elif backend == "etcd":
                if etcd_url is None:
                    private = PrivateEtcd()
                    stack.callback(private.stop)
                    url, where = private.url, (f"private etcd {private.version} at 127.0.0.1:"
                                               f"{private.port}, temp data dir, fsync on")
                else:
                    url, where = etcd_url, f"etcd at {safe_url(etcd_url)}"
                    from toolguard.locks.etcd import parse_etcd_url

                    host, port = parse_etcd_url(url)[0][0]
                    etcd_health(host, port)
                url = etcd_url_with_prefix(url, ns)
                stack.callback(_quietly, etcd_cleanup, url)
                opened(BackendLock(backend, url, where))
        except Exception as error:
            out.skipped[backend] = f"{type(error).__name__}: {error}"

    for c in contenders:
        out.notes[c.name] = c.note
    out.uncontended = run_paced(contenders, rounds, round_s, ns=f"{ns}:xu")
    live = [c for c in contenders if not out.uncontended[c.name].error]
    segments = max(1, round(seconds))
    for threads in threads_list:
        parts: dict[str, list[Contended]] = {c.name: [] for c in live}
        for segment in range(segments):
            for c in rotated(live, segment) if live else []:
                parts[c.name].append(run_contended(c, threads, seconds / segments,
                                                   key=f"{ns}:x{threads}"))
        out.runs += [merge(parts[c.name]) for c in live]
    return out


def _quietly(function: Callable[..., object], *args: object) -> None:
    with contextlib.suppress(Exception):
        function(*args)


def safe_url(url: str) -> str:
    """``url`` without a password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


def print_across(across: Across, backends: list[str], threads_list: tuple[int, ...],
                 plain: bool) -> None:
    columns = ["backend", "cycles/s", "p50", "p99", "vs redis"]
    for t in threads_list:
        columns += [f"{t} thr sections/s", f"{t} thr hand-off p50", f"{t} thr Jain", f"{t} thr vs redis"]
    table = Table("4. toolguard across backends", columns, plain=plain,
                  caption="vs redis: this backend / toolguard on Redis in this section (uncontended: "
                          "median of per-round rate ratios; contended: sections/s); > 1 is faster")
    base = across.uncontended.get("redis")
    by = {(r.name, r.threads): r for r in across.runs}
    for backend in backends:
        why = across.skipped.get(backend)
        result = across.uncontended.get(backend)
        if why is None and result is not None and result.error:
            why = f"failed: {result.error}"
        if why is not None:
            why = why if why.startswith("failed") else f"skipped: {why}"
            table.add_row(backend, why[:90], *["-"] * (len(columns) - 2))
            continue
        assert result is not None
        stats = summarize(result.latencies_s)
        versus = result.ratio_to(base) if base is not None else math.nan
        row: list[object] = [backend, fmt_rate(result.rate), fmt_s(stats.p50), fmt_s(stats.p99),
                             fmt_ratio(versus)]
        for t in threads_list:
            run, ref = by.get((backend, t)), by.get(("redis", t))
            if run is None:
                row += ["-"] * 4
                continue
            row += [fmt_rate(run.rate), fmt_s(summarize(run.handoffs_s).p50), f"{run.jain:.3f}",
                    fmt_ratio(ratio(run.rate, ref.rate) if ref else math.nan)]
        table.add_row(*row)
    table.print()
    for run in across.runs:
        problems = []
        if run.overlaps:
            problems.append(f"{run.overlaps} overlapping critical sections (mutual exclusion broken)")
        if run.hung:
            problems.append(f"{run.hung} threads still running after the deadline")
        if run.timeouts:
            problems.append(f"{run.timeouts} acquire timeouts")
        problems += run.errors[:3]
        if problems:
            print(f"  ! {run.name}, {run.threads} threads: " + "; ".join(problems))


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
    rp = uncontended.get(REDIS_PY)
    rp_ratio = tg.ratio_to(rp) if tg and rp else math.nan
    table.add_row(f"uncontended cycles/s vs {REDIS_PY}", fmt_ratio(rp_ratio), ">= 1.00x",
                  verdict(rp_ratio >= 1.0 if known(rp_ratio) else None))
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
        for rite in LAST_RITES:  # os._exit skips every finally: stop what we started
            with contextlib.suppress(Exception):
                rite()
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
    run_arguments(parser)
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"toolguard backends for section 4, comma-separated from {','.join(BACKENDS)} "
                             "(empty: skip the section)")
    parser.add_argument("--postgres-url", default=os.environ.get("TOOLGUARD_BENCH_POSTGRES_URL",
                                                                  DEFAULT_POSTGRES_URL))
    parser.add_argument("--etcd-url", default=os.environ.get("TOOLGUARD_BENCH_ETCD_URL"),
                        help="etcd://host:port[,host:port][/prefix] (default: start a private "
                             f"single-member etcd from {ETCD_BINARY} on loopback, stopped at the end)")
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    backends = [b for b in BACKENDS if b in backends]
    seconds = args.seconds if args.seconds is not None else (1.0 if args.quick else 3.0)
    cycles = args.cycles if args.cycles is not None else (1500 if args.quick else 5000)
    seconds = max(0.1, seconds)
    segments = max(1, round(seconds))  # ~1 s segments, interleaved like the uncontended rounds
    x_rounds, x_round_s = (3, 0.2) if args.quick else (X_ROUNDS, X_ROUND_S)
    x_seconds = min(seconds, 1.0 if args.quick else X_SECONDS)
    ns = f"tgbench-{uuid.uuid4().hex[:10]}"
    url = with_timeouts(args.redis_url)
    # Expected: uncontended ~1 ms per cycle at worst, contended seconds per run plus drain;
    # section 4: its rounds, runs and drains, plus starting etcd.
    start_watchdog(60 + 3 * (len(CONTENDERS) * (cycles / 1000 + len(THREADS) * (seconds + 2)))
                   + 30 + 3 * len(backends) * (x_rounds * x_round_s + len(X_THREADS) * (x_seconds + 2)))

    probe = redis.Redis.from_url(url)
    server: str | None = None
    try:
        server = server_info(probe)
    except redis.RedisError as error:
        print(f"cannot reach Redis at {args.redis_url}: {error}; sections 1-3 not measured")
    finally:
        probe.close()

    began = time.monotonic()
    contenders: list[Contender] = []
    for make in CONTENDERS if server else ():
        try:
            contenders.append(make(url, ns))
        except Exception as error:
            print(f"  ! {make.name} unavailable: {type(error).__name__}: {error}")

    print(f"toolguard lock benchmark  |  {server or 'Redis unreachable'}, redis-py {version('redis')}, "
          f"python-redis-lock {version('python-redis-lock')}, toolguard {version('toolguard')}  |  "
          f"Python {platform.python_version()}, {os.cpu_count()} CPUs  |  key namespace {ns}")
    print("Baselines: uncontended 'vs floor' = floor's time / this implementation's time for the same "
          f"cycles (> 1 is faster); contended 'vs prl' = sections/s / {PRL}'s sections/s at the same "
          "thread count.")
    print(f"Uncontended: {cycles} cycles each, in {ROUNDS} interleaved rounds; 'vs floor' is the median "
          f"of the per-round ratios.  Contended: {seconds:g} s per implementation and thread count, "
          f"in {segments} interleaved segment(s); TTL {TTL_S} s, acquire timeout {WAIT_S} s.")
    if backends:
        print(f"Section 4 (shorter segments): toolguard on {', '.join(backends)}; uncontended {x_rounds} "
              f"interleaved rounds of {x_round_s:g} s per backend, contended {x_seconds:g} s per backend "
              f"and thread count ({', '.join(map(str, X_THREADS))}) in {max(1, round(x_seconds))} "
              "interleaved segment(s); 'vs redis' = against toolguard on Redis in the same section.")
    for c in contenders:
        print(f"  {c.name:<18} {c.note}")
    print()

    with contextlib.ExitStack() as stack:
        try:
            if contenders:
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
                print()
        finally:
            for c in contenders:
                with contextlib.suppress(Exception):
                    c.close()
        if backends:
            try:
                across = run_across(
                    backends, redis_url=url if server else None,
                    redis_note=(f"{server} at {safe_url(args.redis_url)}" if server
                                else f"cannot reach Redis at {safe_url(args.redis_url)}"),
                    postgres_url=args.postgres_url, etcd_url=args.etcd_url, ns=ns,
                    rounds=x_rounds, round_s=x_round_s, seconds=x_seconds,
                    threads_list=X_THREADS, stack=stack)
            except Exception as error:  # a finding, not a crash
                print(f"  ! section 4 failed: {type(error).__name__}: {error}")
            else:
                for name, note in across.notes.items():
                    print(f"  {name:<10} {note}")
                print_across(across, backends, X_THREADS, args.plain)
    if server:
        with contextlib.suppress(Exception):
            cleanup(url, ns)
    print(f"\ntotal {time.monotonic() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
