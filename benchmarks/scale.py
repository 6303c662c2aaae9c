"""Cost as the work grows: distinct resources 10^3 .. 10^6, agent processes 1 .. 16.

    python benchmarks/scale.py [--backends redis,postgres,etcd] [--step-s 4] [--plain]
        [--max-resources redis=1000000,postgres=100000,etcd=10000] [--counter-ttl-s 60]

Every backend runs on a private server started here (``redis-server``, PostgreSQL
from ``initdb``, a single-member ``etcd``, all on free loopback ports, removed at
the end), so the memory figures are the lock state's alone. Per step:

* resources: that many distinct resources are first touched once (acquire +
  release, through the backend's own scripts / functions, batched), which is the
  state a workload over that many resources leaves behind; then ``--step-s``
  seconds of agent processes each doing acquire + release of a random resource
  among them through ``toolguard.locks.connect``.
* calls/s: acquire + release cycles per second, all processes together;
  p50 / p99: the latency of one cycle.
* server: Redis ``used_memory`` and key count; PostgreSQL total size and rows of
  the ``toolguard_lock_*`` tables; etcd ``dbSize`` (and keys under the prefix).

The server is emptied between steps (FLUSHDB / TRUNCATE / compact + defragment),
so each row shows the state of its own step. At the end, the idle phase: Redis
with the counters' TTL shortened to ``--counter-ttl-s`` (the default is 7 days)
back to its baseline once it passes, PostgreSQL after ``sweep_postgres_locks``,
etcd after ``compact_etcd``. Figures are for this machine; read them as ratios
between rows (what is flat, what grows), not as absolutes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import multiprocessing
import os
import platform
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import Table, fmt_count, fmt_rate, fmt_s, summarize  # the sibling module

RESOURCES = (1_000, 10_000, 100_000, 1_000_000)
PROCESSES = (1, 2, 4, 8, 16)
RESOURCE_STEP_PROCESSES = 4
PROCESS_STEP_RESOURCES = 10_000
DEFAULT_MAX = {"redis": 1_000_000, "postgres": 100_000, "etcd": 10_000}
PG_BIN = Path(os.environ.get("TOOLGUARD_PG_BIN", "/usr/lib/postgresql/15/bin"))
LOCK_TTL_MS = 10_000
CLEANUP: list[Callable[[], None]] = []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _wait(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(Exception):
            if check():
                return
        if time.monotonic() > deadline:
            msg = f"{what} not within {timeout_s}s"
            raise RuntimeError(msg)
        time.sleep(0.05)


# --- private servers -------------------------------------------------------------------------


class Server(Protocol):
    """A private server for one backend: its URL, how to empty it, what it holds."""

    name: str
    url: str

    def prefill(self, prefix: str, count: int) -> None: ...

    def empty(self) -> None: ...

    def size(self) -> dict[str, float]: ...

    def idle(self) -> list[tuple[str, dict[str, float]]]: ...

    def stop(self) -> None: ...


class RedisServer:
    name = "redis"

    def __init__(self, counter_ttl_ms: int) -> None:
        import redis

        self.dir = tempfile.mkdtemp(prefix="tgscale-redis-")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.counter_ttl_ms = counter_ttl_ms
        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(self.port),
             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        CLEANUP.append(self.stop)
        self.client = redis.Redis(port=self.port, socket_timeout=30)
        _wait(self.client.ping, "redis-server answering")

    def prefill(self, prefix: str, count: int) -> None:
        """Acquire + release each resource once, through the backend's scripts, pipelined."""
        from toolguard.locks.redis import ACQUIRE, RELEASE, redis_keys

        acquire, release = self.client.register_script(ACQUIRE), self.client.register_script(RELEASE)
        for start in range(0, count, 2_000):
            with self.client.pipeline(transaction=False) as pipe:
                for i in range(start, min(count, start + 2_000)):
                    keys, signal_prefix = redis_keys(f"{prefix}:{i}")
                    owner = f"prefill{i}:{LOCK_TTL_MS}"
                    acquire(keys=keys, args=[owner, LOCK_TTL_MS, 2_000, self.counter_ttl_ms],
                            client=pipe)
                    release(keys=keys, args=[owner, signal_prefix, self.counter_ttl_ms],
                            client=pipe)
                pipe.execute()
        left = self.client.dbsize()
        if left != count:
            msg = f"redis prefill left {left} keys for {count} resources (script contract changed?)"
            raise RuntimeError(msg)

    def empty(self) -> None:
        self.client.flushdb()

    def size(self) -> dict[str, float]:
        return {"bytes": float(self.client.info("memory")["used_memory"]),
                "keys": float(self.client.dbsize())}

    def idle(self) -> list[tuple[str, dict[str, float]]]:
        seen = [("just after the step", self.size())]
        started = time.monotonic()
        deadline = started + self.counter_ttl_ms / 1000 + 60
        marks = [self.counter_ttl_ms / 1000 * f for f in (0.5, 1.0)]
        while time.monotonic() < deadline:
            waited = time.monotonic() - started
            if marks and waited >= marks[0]:
                seen.append((f"idle {marks.pop(0):.0f} s", self.size()))
            if not marks and self.client.dbsize() == 0:
                break
            time.sleep(0.25)
        seen.append((f"all counters expired ({time.monotonic() - started:.0f} s)", self.size()))
        return seen

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class PostgresServer:
    """``initdb`` + ``pg_ctl`` on a free port (as the postgres OS user when run as root)."""

    name = "postgres"

    def __init__(self, settings: Sequence[str] = ("fsync=off", "synchronous_commit=off")) -> None:
        """``settings``: ``name=value`` server settings besides the port and address."""
        self.dir = Path(tempfile.mkdtemp(prefix="tgscale-pg-"))
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.as_root = os.geteuid() == 0
        if self.as_root:
            pwd.getpwnam("postgres")
            shutil.chown(self.dir, user="postgres", group="postgres")
        self._pg("initdb", "-D", str(self.dir / "data"), "-U", "postgres", "--auth=trust",
                 "--no-sync", "--no-instructions")
        CLEANUP.append(self.stop)
        options = " ".join([f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1",
                            "-c max_connections=100", *(f"-c {item}" for item in settings)])
        self._pg("pg_ctl", "-D", str(self.dir / "data"), "-l", str(self.dir / "log"), "-o",
                 options, "-w", "-t", "30", "start")

    def _pg(self, tool: str, *args: str) -> None:
        command = [str(PG_BIN / tool), *args]
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, cwd=self.dir, timeout=120)

    def _sql(self, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            cursor = conn.execute(query, params)
            return cursor.fetchall() if cursor.description else []

    def prefill(self, prefix: str, count: int) -> None:
        """Acquire + release each resource once, server-side, in batches of 2,000.

        Between batches ANALYZE, as autovacuum would between steps of a real workload
        that grows: one statement of many calls on an empty-looking table would keep
        plans made for an empty table while it grows (a cost of this prefill only).
        """
        import psycopg

        from toolguard.locks import connect

        with connect(self.url) as locks:  # creates the lock schema
            locks.acquire(f"{prefix}:schema").release()
        with psycopg.connect(self.url, autocommit=True) as conn:
            for start in range(0, count, 2_000):
                conn.execute(
                    "SELECT count(toolguard_lock_release(k, 'prefill:10000')) FROM ("
                    " SELECT k, (toolguard_lock_acquire(k, 'prefill:10000', 10000, 2000, 'x'))"
                    ".token FROM (SELECT %s || ':' || i AS k"
                    "             FROM generate_series(%s::int, %s::int) i) ks) granted",
                    (prefix, start, min(count, start + 2_000) - 1))
                conn.execute("ANALYZE toolguard_lock_fence, toolguard_lock_holder")
                conn.execute("DISCARD PLANS")  # this session's cached plans predate the ANALYZE

    def empty(self) -> None:
        with contextlib.suppress(Exception):
            self._sql("TRUNCATE toolguard_lock_fence, toolguard_lock_holder, toolguard_lock_waiter")
            self._sql("VACUUM FULL toolguard_lock_fence")

    def size(self) -> dict[str, float]:
        rows = self._sql(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0), "
            " (SELECT count(*) FROM toolguard_lock_fence) FROM pg_class c "
            "WHERE c.relname LIKE 'toolguard_lock_%%' AND c.relkind = 'r'")
        return {"bytes": float(rows[0][0]), "keys": float(rows[0][1])}

    def idle(self) -> list[tuple[str, dict[str, float]]]:
        from toolguard.locks.upkeep import sweep_postgres_locks

        seen = [("just after the step", self.size())]
        swept = sweep_postgres_locks(self.url, idle_s=0)
        seen.append((f"after sweep_postgres_locks ({swept.fences} rows)", self.size()))
        self._sql("VACUUM toolguard_lock_fence")
        seen.append(("after VACUUM (space kept for reuse)", self.size()))
        return seen

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._pg("pg_ctl", "-D", str(self.dir / "data"), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


class EtcdServer:
    name = "etcd"

    def __init__(self) -> None:
        from etcd3gw.client import Etcd3Client

        self.dir = tempfile.mkdtemp(prefix="tgscale-etcd-")
        port, peer = free_port(), free_port()
        self.url = f"etcd://127.0.0.1:{port}"
        client, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
        self.proc = subprocess.Popen(
            [shutil.which("etcd") or "/usr/bin/etcd", "--name", "s", "--data-dir",
             f"{self.dir}/data", "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"s={peer_url}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        CLEANUP.append(self.stop)
        self.client = Etcd3Client(host="127.0.0.1", port=port, timeout=30)
        _wait(lambda: bool(self.client.status()), "etcd answering")

    def prefill(self, prefix: str, count: int) -> None:
        """Acquire + release each resource once through toolguard (etcd has no scripts)."""
        from toolguard.locks import connect

        with connect(self.url) as locks:
            keys = iter(range(count))
            lock = threading.Lock()

            def work() -> None:
                while True:
                    with lock:
                        i = next(keys, None)
                    if i is None:
                        return
                    locks.acquire(f"{prefix}:{i}", ttl_ms=LOCK_TTL_MS).release()

            threads = [threading.Thread(target=work) for _ in range(16)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

    def empty(self) -> None:
        from toolguard.locks.upkeep import compact_etcd

        compact_etcd(self.url, keep_revisions=0)

    def size(self) -> dict[str, float]:
        from toolguard.locks.etcd import DEFAULT_PREFIX

        status = self.client.status()
        keys = self.client.get_prefix(DEFAULT_PREFIX)
        return {"bytes": float(status["dbSize"]), "keys": float(len(keys))}

    def idle(self) -> list[tuple[str, dict[str, float]]]:
        from toolguard.locks.upkeep import compact_etcd

        seen = [("just after the step", self.size())]
        compact_etcd(self.url, keep_revisions=1_000)
        seen.append(("after compact_etcd (history kept: 1,000)", self.size()))
        return seen

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


# --- agents ----------------------------------------------------------------------------------


def agent(url: str, prefix: str, resources: int, options: dict[str, Any], ready: Any,
          go: Any, stop_at: Any, out: Any) -> None:
    """One agent process: acquire + release of a random resource until ``stop_at``."""
    from toolguard.locks import connect

    rng = random.Random()
    latencies: list[float] = []
    errors = 0
    with connect(url, ttl_ms=LOCK_TTL_MS, timeout_s=10, **options) as locks:
        locks.acquire(f"{prefix}:warm:{os.getpid()}").release()  # connected, scripts loaded
        ready.put(os.getpid())
        go.wait()
        perf = time.perf_counter
        until = stop_at.value
        while time.time() < until:
            key = f"{prefix}:{rng.randrange(resources)}"
            began = perf()
            try:
                locks.acquire(key).release()
            except Exception:  # counted, and the step says so
                errors += 1
                continue
            latencies.append(perf() - began)
    out.put((latencies, errors))


@dataclass
class Step:
    resources: int
    processes: int
    cycles: int
    seconds: float
    latencies: list[float]
    errors: int
    size: dict[str, float]
    prefill_s: float


def run_step(server: Server, options: dict[str, Any], resources: int, processes: int,
             seconds: float, prefix: str | None) -> tuple[Step, str]:
    """One step; ``prefix`` names resources already filled by the step before (same count)."""
    filled = time.monotonic()
    if prefix is None:
        prefix = f"tgscale:{uuid.uuid4().hex[:6]}"
        server.empty()
        server.prefill(prefix, resources)
    filled = time.monotonic() - filled
    context = multiprocessing.get_context("spawn")
    out, ready, go = context.Queue(), context.Queue(), context.Event()
    stop_at = context.Value("d", 0.0)
    workers = [context.Process(target=agent, args=(server.url, prefix, resources, options,
                                                   ready, go, stop_at, out), daemon=True)
               for _ in range(processes)]
    for worker in workers:
        worker.start()
    for _ in workers:  # every process imported, connected and warm before the clock starts
        ready.get(timeout=120)
    stop_at.value = time.time() + seconds
    go.set()
    latencies: list[float] = []
    errors = 0
    for _ in workers:
        got, failed = out.get(timeout=seconds + 120)
        latencies += got
        errors += failed
    for worker in workers:
        worker.join(10)
    step = Step(resources, processes, len(latencies), seconds, latencies, errors, server.size(),
                filled)
    return step, prefix


def fmt_bytes(value: float) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


SIZE_LABEL = {"redis": ("used_memory", "keys"), "postgres": ("lock tables", "fence rows"),
              "etcd": ("dbSize", "keys")}


def report(name: str, steps: list[Step], idle: list[tuple[str, dict[str, float]]],
           plain: bool) -> None:
    size_col, keys_col = SIZE_LABEL[name]
    table = Table(f"{name}: cost as resources and agent processes grow",
                  ["resources", "processes", "calls/s", "p50", "p99", "errors", size_col,
                   keys_col], plain=plain)
    for index, step in enumerate(steps):
        if index and steps[index - 1].processes == RESOURCE_STEP_PROCESSES \
                and step.processes != RESOURCE_STEP_PROCESSES:
            table.add_section()  # the resource steps above, the process steps below
        stats = summarize(step.latencies)
        table.add_row(fmt_count(step.resources), step.processes,
                      fmt_rate(step.cycles / step.seconds), fmt_s(stats.p50), fmt_s(stats.p99),
                      step.errors, fmt_bytes(step.size["bytes"]), fmt_count(step.size["keys"]))
    table.print()
    idle_table = Table(f"{name}: lock state once the resources go idle", ["when", size_col,
                                                                          keys_col], plain=plain)
    for when, size in idle:
        idle_table.add_row(when, fmt_bytes(size["bytes"]), fmt_count(size["keys"]))
    idle_table.print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="redis,postgres,etcd")
    parser.add_argument("--step-s", type=float, default=4.0)
    parser.add_argument("--counter-ttl-s", type=float, default=60.0)
    parser.add_argument("--max-resources", default="",
                        help="per backend, e.g. redis=1000000,postgres=100000,etcd=10000")
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args()
    limits = dict(DEFAULT_MAX)
    for part in filter(None, args.max_resources.split(",")):
        backend, _, value = part.partition("=")
        limits[backend] = int(float(value))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, load {load}, "
          f"python {platform.python_version()}")
    print(f"each step: {args.step_s:g} s of acquire+release by every process; "
          f"resource steps with {RESOURCE_STEP_PROCESSES} processes, process steps over "
          f"{PROCESS_STEP_RESOURCES:,} resources")
    try:
        for name in args.backends.split(","):
            options: dict[str, Any] = {}
            if name == "redis":
                counter_ttl_ms = int(args.counter_ttl_s * 1000)
                server: Server = RedisServer(counter_ttl_ms)
                options = {"counter_ttl_ms": counter_ttl_ms}
            elif name == "postgres":
                server = PostgresServer()
            elif name == "etcd":
                server = EtcdServer()
            else:
                parser.error(f"unknown backend {name!r}")
            began = time.monotonic()
            # Process steps first, resource steps last: the idle phase then starts from the
            # largest state of all.
            plan = [(PROCESS_STEP_RESOURCES, p) for p in PROCESSES
                    if p != RESOURCE_STEP_PROCESSES and limits[name] >= PROCESS_STEP_RESOURCES]
            plan += [(r, RESOURCE_STEP_PROCESSES) for r in RESOURCES if r <= limits[name]]
            steps: list[Step] = []
            prefix: str | None = None
            for resources, processes in plan:
                same = steps and steps[-1].resources == resources and processes != \
                    RESOURCE_STEP_PROCESSES
                step, prefix = run_step(server, options, resources, processes, args.step_s,
                                        prefix if same else None)
                steps.append(step)
                stats = summarize(step.latencies)
                print(f"  {name}: {resources:>9,} resources x {processes:>2} processes: "
                      f"{step.cycles / step.seconds:>8,.0f} calls/s, p50 {fmt_s(stats.p50)}, "
                      f"p99 {fmt_s(stats.p99)}, {fmt_bytes(step.size['bytes'])} "
                      f"(prefill {step.prefill_s:.1f} s)", flush=True)
            steps.sort(key=lambda s: (s.processes != RESOURCE_STEP_PROCESSES, s.processes,
                                      s.resources))
            idle = server.idle()
            report(name, steps, idle, args.plain)
            print(f"  ({name}: {time.monotonic() - began:.0f} s)\n", flush=True)
            server.stop()
    finally:
        for stop in reversed(CLEANUP):
            with contextlib.suppress(Exception):
                stop()


if __name__ == "__main__":
    main()
