"""The cost of a guarded tool call beside the same mutation locked by hand, and done bare.

    python benchmarks/guard.py [--redis-url URL] [--database-url URL] [--seconds S]
                               [--quick] [--plain] [--locks-url URL]
                               [--deployment redis-postgres|sqlite|postgres|all] [--no-dbos]
                               [--profile N [--top K] [--profile-only]]

One mutation: add ``delta`` to one lead's score (``UPDATE lead SET score =
score + %s WHERE id = %s RETURNING score``) in a table of 1,000 leads.

* bare: that statement in one PostgreSQL transaction on a pooled connection
  (``BEGIN``, ``UPDATE``, ``COMMIT``).
* hand-written: what a careful engineer writes without toolguard: a Redis
  ``SET lock:<lead> <random> NX PX 10000`` (retried after 0.5 ms while taken),
  the same transaction, then a compare-and-delete script by ``EVALSHA``. No
  fencing token, no idempotency record, no audit row, no validation.
* expert (d), expert (d2): what an expert writes by hand to get the *same*
  guarantees with the same servers (``benchmarks/expert.py``): a Lua lock that
  returns its fencing token, then one transaction in pipeline mode that checks
  and advances the fence, records the intent, runs the UPDATE, stores the
  result and writes a hash-chained audit row. (d) sends the UPDATE with the
  finishing statements (2 PostgreSQL round trips), (d2) on its own, as a tool
  body must be (3, as toolguard). Their guarantees are checked at the end.
* guarded: the same statement in a ``@guarded`` tool run through ``ToolGuard``
  with a stable identity (call id + thread id), so every call does the whole
  pipeline: strict validation, policy, a Redis lock with its fencing token,
  the fenced PostgreSQL transaction (fence check+advance and the idempotency
  record's intent row, the tool's ``UPDATE``, the recorded result, the audit
  row, ``COMMIT``), release.
* dbos: DBOS Transact 3.4, an optional peer (``benchmarks/dbos_peer.py``; ``pip
  install dbos==3.4.0`` into the benchmark's venv only, never a dependency): a
  workflow started under the call id with one datasource transaction doing the
  same UPDATE, exactly once per id, on the same PostgreSQL server (database
  ``bench_dbos``, created if missing). Not importable: one line says it was
  skipped and how to install it; ``--no-dbos`` leaves it out.

1. Latency, one thread: the three alternate in rounds, so slow drifts of the
   machine hit them alike. p50/p99 per call, against hand-written and bare.
2. Throughput, 8 threads (agents) over the 1,000 leads (each call picks a
   random lead, so two agents sometimes want the same lead), in interleaved
   segments: calls per second, p50/p99, against hand-written and bare.
3. Where a guarded call's time goes: each step's wall time split into client CPU
   and waiting (server and wire), and the same split for each reference.
4. The targets: guarded p50 at most 1.10x the expert's (d) (one thread), and
   calls/s at least 0.90x (d)'s (8 threads); beside them the earlier ones against
   the plain hand-written lock (1.25x, 0.8x). All measured in this run.

``--deployment`` picks what is measured (default ``redis-postgres``: everything
above). ``sqlite`` measures toolguard with its locks and store in one SQLite file
against its own expert reference (``benchmarks/expert_sqlite.py``), ``postgres``
toolguard with the PostgreSQL lock backend and store against its own
(``benchmarks/expert_pg_locks.py``) and DBOS, each with its ratios side by side
and the same invariant checks (``benchmarks/deployments.py``); ``all`` runs the
three one after the other (about 4 minutes at the default 12 s per phase;
``--quick`` shortens every part).

``--profile N`` also runs N guarded calls (default deployment) under cProfile (CPU time of the
calling thread) and prints the top ``--top`` functions by own and cumulative
time; ``--profile-only`` skips the measurements.

Everything lives in a PostgreSQL schema and Redis key prefix of the run's own,
dropped at the end. Bounded by time (about 2 minutes by default, with DBOS); always
exits 0: a miss is a finding, not a crash.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import itertools
import os
import pstats
import random
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    AGENTS,
    LEADS,
    cpu_per_call,
    latency,
    lead_of,
    lead_schema_pool,
    run_arguments,
    throughput_rounds,
)
from _stats import Table, fmt_rate, fmt_ratio, fmt_s, ratio, summarize, verdict

DEFAULT_REDIS = "redis://127.0.0.1:6379/14"
DEFAULT_DATABASE = "postgresql://postgres@127.0.0.1:5432/test"
#: The targets, against the expert's (d) and the plain hand-written lock, in the same run.
TARGET_EXPERT_P50 = 1.10
TARGET_EXPERT_RATE = 0.90
TARGET_P50 = 1.25
TARGET_RATE = 0.8
UPDATE = "UPDATE lead SET score = score + %s WHERE id = %s RETURNING score"
#: The hand-written release: delete the lock key only if it still holds our value.
CAD = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
LOCK_TTL_MS = 10_000
SPIN_S = 0.0005
DEPLOYMENTS = ("redis-postgres", "sqlite", "postgres", "all")


@dataclass
class Setup:
    """The run's schema, its 1,000 leads, a bare pool, and a guard on the same database."""

    database_url: str
    redis_url: str
    run: str
    #: The guard's lock backend (``toolguard.locks.connect`` URL); None: ``redis_url``.
    locks_url: str | None = None
    #: Connections of the lead pool (bare, hand-written, expert) and of the guard's store.
    pool_size: int = AGENTS + 4
    store_size: int = AGENTS + 4

    def __post_init__(self) -> None:
        from toolguard.adapters import guarded
        from toolguard.call.context import current
        from toolguard.guard import ToolGuard
        from toolguard.locks import connect
        from toolguard.policies import Policy
        from toolguard.store import open_store

        self.schema = f"tg_bench_{self.run}"
        self.pool: ConnectionPool[psycopg.Connection[Any]] = lead_schema_pool(
            self.database_url, self.schema, self.pool_size)
        self.store = open_store(self.database_url, install=True, schema=self.schema,
                                min_size=self.store_size, max_size=self.store_size)
        if self.locks_url is None:
            self.locks = connect(self.redis_url, prefix=f"tgbench:{self.run}")
        else:
            self.locks = connect(self.locks_url)
        policy = Policy.from_dict({"version": 1, "tools": {"add_score": {
            "locks": ["lead:{lead_id}"], "agents": ["scorer"],
            "args": {"delta": {"ge": -100, "le": 100}}}}})
        self.guard = ToolGuard(policy, locks=self.locks, store=self.store)

        @guarded(self.guard, agent="scorer")
        def add_score(lead_id: str, delta: int) -> int:
            (score,) = current().tx.execute(UPDATE, (delta, lead_id)).fetchone()
            return int(score)

        self.add_score = add_score
        self.calls = itertools.count()
        import redis

        self.redis = redis.Redis.from_url(self.redis_url)
        self.cad = self.redis.script_load(CAD)
        self.lock_prefix = f"tgbench:{self.run}:hand:"
        from expert import Expert

        self.expert = Expert(self.pool, self.redis, f"tgbench:{self.run}:expert:")

    def bare(self, lead: str) -> None:
        with self.pool.connection() as conn, conn.transaction():
            conn.execute(UPDATE, (1, lead)).fetchone()

    def hand(self, lead: str) -> None:
        """What a careful engineer writes by hand: ``SET NX PX`` (retried after a short
        sleep while taken), the same transaction, a compare-and-delete release by SHA."""
        name, value = self.lock_prefix + lead, uuid.uuid4().hex
        while not self.redis.set(name, value, nx=True, px=LOCK_TTL_MS):
            time.sleep(SPIN_S)
        try:
            with self.pool.connection() as conn, conn.transaction():
                conn.execute(UPDATE, (1, lead)).fetchone()
        finally:
            self.redis.evalsha(self.cad, 1, name, value)

    def guarded(self, lead: str) -> None:
        decision = self.add_score.run({"lead_id": lead, "delta": 1},
                                      call_id=f"call-{next(self.calls)}", thread_id=self.run)
        if not decision.ok:
            msg = f"guarded call refused: {decision.reason}: {decision.message}"
            raise RuntimeError(msg)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.locks.close()
        with contextlib.suppress(Exception):
            self.store.close()
        with contextlib.suppress(Exception):
            self.pool.close()
        with contextlib.suppress(Exception), psycopg.connect(self.database_url,
                                                             autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(self.schema)))
        with contextlib.suppress(Exception):
            for key in self.redis.scan_iter(match=f"tgbench:{self.run}*", count=1000):
                self.redis.delete(key)
            self.redis.close()


# --- 3. where a guarded call's time goes ------------------------------------------------------

#: (step, server round trips, what happens), in the order a call runs them.
STEPS = [
    ("lock acquire", "1 Redis", "EVALSHA: grant + fencing token"),
    ("fenced enter", "1 PG", "BEGIN + toolguard_enter (fences, intent row), one message"),
    ("tool SQL", "1 PG", "the tool's UPDATE (what bare also runs)"),
    ("fenced finish", "1 PG + commit", "toolguard_finish (result + audit row) + COMMIT, one message"),
    ("lock release", "1 Redis", "EVALSHA: release / hand-off"),
]


def breakdown(setup: Setup, calls: int) -> tuple[dict[str, list[float]], list[float], list[float],
                                                 dict[str, list[float]]]:
    """Time each I/O step of ``calls`` guarded calls, in wall time and in CPU time of the
    calling thread (wall - CPU: waiting on the server and the wire); the rest of the call
    is CPU in guard, store and clients.

    Wraps the store's and lock backend's methods for the duration (benchmark
    instrumentation: it reaches into ``toolguard.store.postgres._Session``).
    """
    from toolguard.store import postgres

    spent: dict[str, list[float]] = {name: [] for name, _, _ in STEPS}
    spent_cpu: dict[str, list[float]] = {name: [] for name, _, _ in STEPS}
    current: dict[str, float] = {}
    current_cpu: dict[str, float] = {}

    def timed(owner: Any, attribute: str, step: str) -> Callable[[], None]:
        original = getattr(owner, attribute)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started, cpu_started = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                current[step] = current.get(step, 0.0) + time.perf_counter() - started
                current_cpu[step] = current_cpu.get(step, 0.0) + time.thread_time() - cpu_started

        setattr(owner, attribute, wrapper)
        return lambda: setattr(owner, attribute, original)

    undo = [timed(setup.locks.backend, "try_acquire", "lock acquire"),
            timed(setup.locks.backend, "release", "lock release"),
            timed(postgres._Session, "enter", "fenced enter"),
            timed(postgres._Session, "_execute", "tool SQL"),
            timed(postgres._Session, "finish", "fenced finish")]
    totals: list[float] = []
    cpu: list[float] = []
    rng = random.Random(5)
    try:
        for _ in range(calls):
            current.clear()
            current_cpu.clear()
            started, cpu_started = time.perf_counter(), time.thread_time()
            setup.guarded(lead_of(rng))
            totals.append(time.perf_counter() - started)
            cpu.append(time.thread_time() - cpu_started)
            for step in spent:
                spent[step].append(current.get(step, 0.0))
                spent_cpu[step].append(current_cpu.get(step, 0.0))
    finally:
        for restore in undo:
            restore()
    return spent, totals, cpu, spent_cpu


# --- 4. profile -----------------------------------------------------------------------------


def profile(setup: Setup, calls: int, top: int = 25) -> str:
    """cProfile of ``calls`` guarded calls, timed in CPU time of the calling thread."""
    rng = random.Random(11)
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    for _ in range(calls):
        setup.guarded(lead_of(rng))
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


# --- main -------------------------------------------------------------------------------------


def open_setup(database_url: str, redis_url: str) -> Setup | None:
    """A ``Setup`` of the run's own, or None (and why, printed) when the servers are not there."""
    try:
        return Setup(database_url, redis_url, uuid.uuid4().hex[:10])
    except Exception as error:
        print(f"cannot set up the benchmark (PostgreSQL {database_url}, Redis {redis_url}): "
              f"{type(error).__name__}: {error}")
        return None


def server_arguments(parser: argparse.ArgumentParser) -> None:
    """``--redis-url`` and ``--database-url``, defaulting to the environment, then loopback."""
    parser.add_argument("--redis-url", default=os.environ.get("TOOLGUARD_BENCH_REDIS_URL",
                                                              DEFAULT_REDIS))
    parser.add_argument("--database-url", default=os.environ.get("TOOLGUARD_BENCH_DATABASE_URL",
                                                                 DEFAULT_DATABASE))


def guard_parser(doc: str | None) -> argparse.ArgumentParser:
    """The parser of a guarded-call script: its docstring's first paragraph as description,
    the servers (``server_arguments``), ``--quick`` and ``--plain``; the script adds its own."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    server_arguments(parser)
    run_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = guard_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=None,
                        help="length of each measured phase (default 12, --quick 2)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile N guarded calls with cProfile")
    parser.add_argument("--top", type=int, default=25, metavar="K",
                        help="rows of each profile listing (default 25)")
    parser.add_argument("--locks-url", default=None, metavar="URL",
                        help="the guard's lock backend instead of --redis-url, e.g. the "
                             "PostgreSQL URL for a PostgreSQL-only setup (the hand-written "
                             "baseline keeps its Redis lock)")
    parser.add_argument("--profile-only", action="store_true",
                        help="skip the measurements: only the profile (with --profile N)")
    parser.add_argument("--deployment", choices=DEPLOYMENTS, default="redis-postgres",
                        help="redis-postgres (default: Redis locks + PostgreSQL store), "
                             "sqlite (locks and store in one SQLite file), postgres (locks and "
                             "store in PostgreSQL), or all three one after the other")
    parser.add_argument("--no-dbos", action="store_true",
                        help="leave out the DBOS Transact peer even when dbos is installed")
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (2.0 if args.quick else 12.0)
    dbos = not args.no_dbos and not args.profile_only
    if dbos and args.deployment != "sqlite":
        from dbos_peer import INSTALL, available

        missing = available()
        if missing is not None:
            print(f"DBOS Transact peer skipped: dbos is not importable ({missing}); to include "
                  f"it: {INSTALL}")
            dbos = False
    if args.deployment in ("redis-postgres", "all"):
        redis_postgres(args, seconds, dbos=dbos)
    if args.deployment in ("sqlite", "postgres", "all") and not args.profile_only:
        import deployments

        for name in ("sqlite", "postgres"):
            if args.deployment in (name, "all"):
                deployments.run(name, database_url=args.database_url,
                                run_id=uuid.uuid4().hex[:10], seconds=seconds,
                                quick=args.quick, plain=args.plain, dbos=dbos)
    return 0


def redis_postgres(args: argparse.Namespace, seconds: float, *, dbos: bool) -> None:
    """The default deployment: Redis locks + PostgreSQL store, against (a), (b), (d), (d2)
    and DBOS."""
    run = uuid.uuid4().hex[:10]
    try:
        setup = Setup(args.database_url, args.redis_url, run, args.locks_url)
    except Exception as error:
        print(f"cannot set up the benchmark (PostgreSQL {args.database_url}, "
              f"Redis {args.redis_url}): {error}")
        return
    peer: Any = None
    if dbos:
        from dbos_peer import DbosPeer

        try:
            peer = DbosPeer(args.database_url, run, pool_size=AGENTS + 4)
        except Exception as error:
            print(f"DBOS Transact peer skipped: it could not start: {type(error).__name__}: "
                  f"{error}")
    try:
        if args.profile_only:
            for _ in range(200):  # warm-up: pools, scripts, caches
                setup.guarded(lead_of(random.Random(3)))
            print(profile(setup, max(args.profile, 1), args.top))
            return
        print(f"toolguard guarded call vs a hand-written Redis lock + transaction and the bare "
              f"transaction; {LEADS:,} leads; python {sys.version.split()[0]}; "
              f"{seconds:g} s per phase; guard's locks: "
              f"{setup.locks.backend.info.name}")
        impls: dict[str, Callable[[str], None]] = {
            "bare": setup.bare, "hand-written": setup.hand, "expert (d)": setup.expert.d,
            "expert (d2)": setup.expert.d2, "guarded": setup.guarded}
        if peer is not None:
            impls["dbos"] = peer.call
        samples = latency(setup, impls, seconds, rounds=10 if not args.quick else 4)
        lat = {name: summarize(values) for name, values in samples.items()}
        hand, bare = lat["hand-written"], lat["bare"]
        expert = lat["expert (d)"]
        table = Table("1. latency per call, one thread (interleaved rounds)",
                      ["impl", "calls", "p50", "p99", "mean", "p50 vs (d)", "p99 vs (d)",
                       "p50 vs hand", "p50 vs bare"], plain=args.plain)
        for name, s in lat.items():
            table.add_row(name, f"{s.count:,}", fmt_s(s.p50), fmt_s(s.p99), fmt_s(s.mean),
                          fmt_ratio(ratio(s.p50, expert.p50)), fmt_ratio(ratio(s.p99, expert.p99)),
                          fmt_ratio(ratio(s.p50, hand.p50)), fmt_ratio(ratio(s.p50, bare.p50)))
        table.print()

        loads = throughput_rounds(impls, seconds, segments=3 if not args.quick else 1)
        table = Table(f"2. throughput, {AGENTS} agents (threads) over {LEADS:,} leads "
                      "(interleaved segments)",
                      ["impl", "calls", "calls/s", "p50", "p99", "calls/s vs (d)",
                       "calls/s vs hand", "calls/s vs bare"], plain=args.plain)
        rates = {name: load.calls / load.elapsed for name, load in loads.items()}
        for name, load in loads.items():
            s = summarize(load.latencies)
            table.add_row(name, f"{load.calls:,}", fmt_rate(rates[name]), fmt_s(s.p50),
                          fmt_s(s.p99), fmt_ratio(ratio(rates[name], rates["expert (d)"])),
                          fmt_ratio(ratio(rates[name], rates["hand-written"])),
                          fmt_ratio(ratio(rates[name], rates["bare"])))
        table.print()

        spent, totals, cpu, spent_cpu = breakdown(setup, 200 if args.quick else 1_000)
        whole = summarize(totals).p50
        table = Table("3. where a guarded call's time goes (one thread, p50 of each step)",
                      ["step", "round trips", "p50", "client CPU", "waiting", "of the call"],
                      plain=args.plain,
                      caption="waiting = the step's wall time - its client CPU (server and "
                              "wire); the whole call's client CPU includes the steps'")
        in_steps = 0.0
        for name, trips, what in STEPS:
            p50, step_cpu = summarize(spent[name]).p50, summarize(spent_cpu[name]).p50
            in_steps += step_cpu
            table.add_row(f"{name}: {what}", trips, fmt_s(p50), fmt_s(step_cpu),
                          fmt_s(max(p50 - step_cpu, 0.0)), f"{ratio(p50, whole):.0%}")
        table.add_section()
        cpu_p50 = summarize(cpu).p50
        table.add_row("client CPU: guard, store, psycopg, redis-py (calling thread)", "-",
                      fmt_s(cpu_p50), fmt_s(cpu_p50), "-", f"{ratio(cpu_p50, whole):.0%}")
        outside = max(cpu_p50 - in_steps, 0.0)
        table.add_row("  of it outside the steps: validation, policy, recovery, audit entry",
                      "-", fmt_s(outside), fmt_s(outside), "-", f"{ratio(outside, whole):.0%}")
        table.add_row("whole guarded call", "3 PG + 2 Redis", fmt_s(whole), "-", "-", "100%")

        def reference(label: str, trips: str, p50: float, call_cpu: float) -> float:
            """One reference's row, split the same way; its client CPU, for section 4."""
            table.add_row(label, trips, fmt_s(p50), fmt_s(call_cpu),
                          fmt_s(max(p50 - call_cpu, 0.0)), f"{ratio(p50, whole):.0%}")
            return call_cpu

        hand_cpu = reference("hand-written: SET NX PX, BEGIN, UPDATE, COMMIT, EVALSHA",
                             "3 PG + 2 Redis", hand.p50,
                             summarize(cpu_per_call(setup.hand, 300, 8)).p50)
        expert_cpu = reference("expert (d2): Lua lock+token, BEGIN+fence+intent, UPDATE, "
                               "result+chain+audit+COMMIT, EVALSHA", "3 PG + 2 Redis",
                               lat["expert (d2)"].p50,
                               summarize(cpu_per_call(setup.expert.d2, 300, 9)).p50)
        reference("bare: BEGIN, UPDATE, COMMIT", "3 PG", bare.p50,
                  summarize(cpu_per_call(setup.bare, 300, 6)).p50)
        if peer is not None:
            dbos_cpu = reference("dbos: workflow under the call id, one datasource transaction",
                                 "PG (DBOS's own)", lat["dbos"].p50,
                                 summarize(cpu_per_call(peer.call, 300, 10)).p50)
        table.print()

        p50_ratio = ratio(lat["guarded"].p50, hand.p50)
        rate_ratio = ratio(rates["guarded"], rates["hand-written"])
        expert_p50 = ratio(lat["guarded"].p50, expert.p50)
        expert_rate = ratio(rates["guarded"], rates["expert (d)"])
        table = Table("4. targets (this run)", ["target", "measured", "goal", "verdict"],
                      plain=args.plain)

        def target(label: str, value: float, goal: float, *, at_most: bool) -> None:
            """One row held to its goal (NaN, not measured: n/a)."""
            met = None if value != value else (value <= goal if at_most else value >= goal)
            table.add_row(label, fmt_ratio(value), f"{'<=' if at_most else '>='} {goal:g}x",
                          verdict(met))

        target("guarded p50 vs expert (d), one thread", expert_p50, TARGET_EXPERT_P50,
               at_most=True)
        target(f"guarded calls/s vs expert (d), {AGENTS} threads", expert_rate,
               TARGET_EXPERT_RATE, at_most=False)
        table.add_row("guarded p50 vs expert (d2), one thread",
                      fmt_ratio(ratio(lat["guarded"].p50, lat["expert (d2)"].p50)), "-", "-")
        # The expert's own (d2) against the same goals: a tool body that runs as its own
        # round trip (as every guarded tool's does) pays that round trip whoever writes it.
        target("  expert (d2) p50 vs expert (d), one thread",
               ratio(lat["expert (d2)"].p50, expert.p50), TARGET_EXPERT_P50, at_most=True)
        target(f"  expert (d2) calls/s vs expert (d), {AGENTS} threads",
               ratio(rates["expert (d2)"], rates["expert (d)"]), TARGET_EXPERT_RATE,
               at_most=False)
        table.add_row("client CPU per call vs expert (d2)", fmt_ratio(ratio(cpu_p50, expert_cpu)),
                      "-", "-")
        # calls/s x CPU seconds per call: the share of one core the calling threads use. Near
        # 1.00 they are bound by one interpreter lock; below it, the servers' CPU on the same
        # cores caps the calls per second too.
        for name, cpu_s in (("guarded", cpu_p50), ("expert (d2)", expert_cpu)):
            table.add_row(f"  {name}: {AGENTS}-thread calls/s x one-thread client CPU per call",
                          f"{rates[name] * cpu_s:.2f}", "-", "-")
        target("guarded p50 vs hand-written, one thread", p50_ratio, TARGET_P50, at_most=True)
        target(f"guarded calls/s vs hand-written, {AGENTS} threads", rate_ratio, TARGET_RATE,
               at_most=False)
        table.add_row("client CPU per call vs hand-written", fmt_ratio(ratio(cpu_p50, hand_cpu)),
                      "-", "-")
        if peer is not None:
            table.add_section()
            table.add_row("guarded p50 vs DBOS, one thread",
                          fmt_ratio(ratio(lat["guarded"].p50, lat["dbos"].p50)), "-", "-")
            table.add_row(f"guarded calls/s vs DBOS, {AGENTS} threads",
                          fmt_ratio(ratio(rates["guarded"], rates["dbos"])), "-", "-")
            table.add_row("client CPU per call vs DBOS", fmt_ratio(ratio(cpu_p50, dbos_cpu)),
                          "-", "-")
        table.print()
        made = {name: loads[name].calls + 50 + len(samples[name]) for name in impls
                if name != "dbos"}  # DBOS writes its own table, in its own database
        made["guarded"] += len(totals)
        made["hand-written"] += 300
        made["bare"] += 300
        made["expert (d2)"] += 300
        with setup.pool.connection() as conn:
            (final,) = conn.execute("SELECT sum(score) FROM lead").fetchone()
        expected = sum(made.values())
        print(f"check: {made['guarded']:,} guarded + {made['hand-written']:,} hand-written + "
              f"{made['expert (d)'] + made['expert (d2)']:,} expert + "
              f"{made['bare']:,} bare increments = {expected:,}; table sum {int(final):,} "
              f"({'matches' if int(final) == expected else 'MISMATCH'})")
        problems = setup.expert.check()
        print(f"check: the expert's {setup.expert.calls:,} calls: "
              + ("one intent with its result and one chained audit row each, every chain "
                 "recomputes" if not problems else "; ".join(problems)))
        if peer is not None:
            problems = peer.check()
            print(f"check: DBOS's {peer.calls:,} calls: "
                  + ("exactly once per call id (table sum, one successful workflow and one "
                     "recorded step each, re-runs return the recorded result)"
                     if not problems else "; ".join(problems)))
        if args.profile:
            print(profile(setup, args.profile, args.top))
    finally:
        if peer is not None:
            peer.close()
        setup.close()


if __name__ == "__main__":
    raise SystemExit(main())
