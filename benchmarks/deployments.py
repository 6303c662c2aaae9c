"""The guarded call on the two other deployments, each beside its own expert reference.

Run through ``benchmarks/guard.py --deployment sqlite|postgres|all`` (see its
docstring); the same mutation as there (add 1 to one of 1,000 leads' score,
``UPDATE lead SET score = score + %s WHERE id = %s RETURNING score``):

* ``sqlite``: toolguard with its locks and its store in one SQLite file
  (``connect("sqlite:///<file>")``, ``open_store("sqlite:///<file>")``, the
  embedded default) against ``benchmarks/expert_sqlite.py``, the same guarantees
  written by hand on the same file (a connection per thread, ``BEGIN
  IMMEDIATE``, a lease row with its token, one statement per step), and the bare
  ``BEGIN IMMEDIATE``/``UPDATE``/``COMMIT``. Everything runs in this process, so
  a call's time is nearly all client CPU.
* ``postgres``: toolguard with the PostgreSQL lock backend and the PostgreSQL
  store in one database (``connect(url, schema=...)``, ``open_store(url,
  schema=...)``) against ``benchmarks/expert_pg_locks.py`` (the lease row and
  its counter in PostgreSQL, the fenced transaction in pipeline mode, four round
  trips), the bare transaction, and DBOS Transact when it is installed
  (``benchmarks/dbos_peer.py``; ``--no-dbos`` leaves it out).

Each prints: 1. latency, one thread, the implementations alternating in rounds;
2. calls/s from 8 threads over the 1,000 leads, in interleaved segments; 3.
client CPU per call (thread CPU time, one thread); 4. toolguard / reference
ratios side by side (p50 and p99 one thread, calls/s at 8 threads, client CPU);
then the checks: the table's sum equals the increments made, the reference's
invariants (one intent with its result and one audit row per call, every chain
recomputes), toolguard's own (one applied intent and one accepted audit row per
guarded call, ``verify_audit``), and DBOS's (exactly once per call id).
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import sqlite3
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from _harness import AGENTS, LEADS, cpu_per_call, latency, lead_schema_pool, throughput_rounds
from _stats import Table, fmt_rate, fmt_ratio, fmt_s, ratio, summarize
from psycopg import sql

UPDATE = "UPDATE lead SET score = score + %s WHERE id = %s RETURNING score"
REFERENCE = "expert (reference)"
GUARDED = "guarded"
DBOS = "dbos"
WARM_UP = 50  # calls per implementation in ``latency``'s warm-up
CPU_CALLS = 300


def _guarded_tool(locks: Any, store: Any) -> Callable[..., Any]:
    """The benchmark's ``add_score`` tool under a ``ToolGuard`` on ``locks`` and ``store``."""
    from toolguard.adapters import guarded
    from toolguard.call.context import current
    from toolguard.guard import ToolGuard
    from toolguard.policies import Policy

    policy = Policy.from_dict({"version": 1, "tools": {"add_score": {
        "locks": ["lead:{lead_id}"], "agents": ["scorer"],
        "args": {"delta": {"ge": -100, "le": 100}}}}})
    guard = ToolGuard(policy, locks=locks, store=store)

    @guarded(guard, agent="scorer")
    def add_score(lead_id: str, delta: int) -> int:
        (score,) = current().tx.execute(UPDATE, (delta, lead_id)).fetchone()
        return int(score)

    return add_score


class _Guarded:
    """Calls the guarded tool with a stable identity, counting the calls that were accepted."""

    def __init__(self, tool: Callable[..., Any], run: str) -> None:
        self.tool = tool
        self.run = run
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.calls = 0

    def __call__(self, lead: str) -> None:
        decision = self.tool.run({"lead_id": lead, "delta": 1},  # type: ignore[attr-defined]
                                 call_id=f"call-{next(self.ids)}", thread_id=self.run)
        if not decision.ok:
            msg = f"guarded call refused: {decision.reason}: {decision.message}"
            raise RuntimeError(msg)
        with self.lock:
            self.calls += 1


def _toolguard_problems(conn: Any, store: Any, calls: int) -> list[str]:
    """toolguard's own invariants after ``calls`` accepted guarded calls."""
    problems = []
    (applied,) = conn.execute("SELECT count(*) FROM toolguard_intent "
                              "WHERE status = 'applied' AND result IS NOT NULL").fetchone()
    (accepted,) = conn.execute("SELECT count(*) FROM toolguard_audit "
                               "WHERE decision = 'accepted'").fetchone()
    if not applied == accepted == calls:
        problems.append(f"{calls} guarded calls, {applied} applied intents, "
                        f"{accepted} accepted audit rows")
    verified = store.verify_audit()
    if not verified.ok:
        problems.append(f"verify_audit: {[str(p) for p in verified.problems][:3]}")
    return problems


class SqliteDeployment:
    """toolguard, the expert and bare on one SQLite file in a temporary folder."""

    name = "sqlite"
    title = "embedded SQLite (locks and store in one file)"

    def __init__(self, run: str, *, dbos: bool = False) -> None:
        from expert_sqlite import ExpertSqlite

        from toolguard.locks import connect
        from toolguard.store import open_store

        del dbos  # DBOS runs on PostgreSQL only
        self.folder = tempfile.mkdtemp(prefix=f"tg_bench_{run}_")
        self.path = str(Path(self.folder) / "toolguard.db")
        url = f"sqlite:///{self.path}"
        try:
            self.store = open_store(url, install=True)
            self.locks = connect(url)
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        with self.store.connection() as conn:
            conn.execute("CREATE TABLE lead (id TEXT PRIMARY KEY, score INTEGER NOT NULL)")
            conn.executemany("INSERT INTO lead VALUES (?, 0)",
                             [(f"lead-{i}",) for i in range(LEADS)])
        self.guarded = _Guarded(_guarded_tool(self.locks, self.store), run)
        self.expert = ExpertSqlite(self.path)
        self._local = threading.local()
        self._bare: list[sqlite3.Connection] = []
        self.peer = None
        self.round_trips = {REFERENCE: "in process", GUARDED: "in process", "bare": "in process"}

    def _conn(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=30, isolation_level=None,
                                 check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
            self._bare.append(db)
        return db

    def bare(self, lead: str) -> None:
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("UPDATE lead SET score = score + ? WHERE id = ? RETURNING score",
                       (1, lead)).fetchone()
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def total(self) -> int:
        (total,) = self._conn().execute("SELECT sum(score) FROM lead").fetchone()
        return int(total)

    def toolguard_problems(self) -> list[str]:
        return _toolguard_problems(self._conn(), self.store, self.guarded.calls)

    def close(self) -> None:
        for closing in (self.locks.close, self.store.close, self.expert.close):
            with contextlib.suppress(Exception):
                closing()
        for db in self._bare:
            with contextlib.suppress(Exception):
                db.close()
        shutil.rmtree(self.folder, ignore_errors=True)


class PostgresDeployment:
    """toolguard (PostgreSQL locks + store), the expert, bare and DBOS on one PostgreSQL."""

    name = "postgres"
    title = "PostgreSQL only (locks and store in one database)"

    def __init__(self, run: str, *, database_url: str, dbos: bool = True) -> None:
        self.database_url = database_url
        self.schema = f"tg_bench_{run}"
        self.peer: Any = None
        self.locks: Any = None
        self.store: Any = None
        self.pool: Any = None
        try:
            self._start(run, dbos)
        except BaseException:
            self.close()
            raise

    def _start(self, run: str, dbos: bool) -> None:
        from expert_pg_locks import ExpertPgLocks

        from toolguard.locks import connect
        from toolguard.store import open_store

        database_url = self.database_url
        size = AGENTS + 4
        self.pool = lead_schema_pool(database_url, self.schema)
        self.store = open_store(database_url, install=True, schema=self.schema,
                                min_size=size, max_size=size)
        self.locks = connect(database_url, schema=self.schema, min_size=size, max_size=size)
        self.guarded = _Guarded(_guarded_tool(self.locks, self.store), run)
        self.expert = ExpertPgLocks(self.pool)
        self.round_trips = {REFERENCE: "4 PG", GUARDED: "5 PG", "bare": "3 PG",
                            DBOS: "PG (DBOS's own)"}
        if dbos:
            from dbos_peer import DbosPeer

            try:
                self.peer = DbosPeer(database_url, run, pool_size=size)
            except Exception as error:
                print(f"DBOS Transact peer skipped: it could not start: "
                      f"{type(error).__name__}: {error}")

    def bare(self, lead: str) -> None:
        with self.pool.connection() as conn, conn.transaction():
            conn.execute(UPDATE, (1, lead)).fetchone()

    def total(self) -> int:
        with self.pool.connection() as conn:
            (total,) = conn.execute("SELECT sum(score) FROM lead").fetchone()
        return int(total)

    def toolguard_problems(self) -> list[str]:
        with self.pool.connection() as conn:
            return _toolguard_problems(conn, self.store, self.guarded.calls)

    def close(self) -> None:
        for part in (self.peer, self.locks, self.store, self.pool):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.close()
        with contextlib.suppress(Exception), psycopg.connect(self.database_url,
                                                             autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(self.schema)))


def run(deployment: str, *, database_url: str, run_id: str, seconds: float, quick: bool,
        plain: bool, dbos: bool) -> None:
    """Set up one deployment, measure it, print its tables and checks, tear it down."""
    try:
        setup: SqliteDeployment | PostgresDeployment
        if deployment == "sqlite":
            setup = SqliteDeployment(run_id)
        else:
            setup = PostgresDeployment(run_id, database_url=database_url, dbos=dbos)
    except Exception as error:
        print(f"cannot set up the {deployment} deployment: {type(error).__name__}: {error}")
        return
    try:
        measure(setup, seconds=seconds, quick=quick, plain=plain)
    finally:
        setup.close()


def measure(setup: SqliteDeployment | PostgresDeployment, *, seconds: float, quick: bool,
            plain: bool) -> None:
    impls: dict[str, Callable[[str], Any]] = {
        "bare": setup.bare, REFERENCE: setup.expert.call, GUARDED: setup.guarded}
    if setup.peer is not None:
        impls[DBOS] = setup.peer.call
    print(f"\n== deployment: {setup.title}; toolguard vs the expert's hand-written "
          f"reference with the same guarantees; {LEADS:,} leads; python "
          f"{sys.version.split()[0]}; {seconds:g} s per phase")

    samples = latency(setup, impls, seconds, rounds=10 if not quick else 4)
    lat = {name: summarize(values) for name, values in samples.items()}
    ref, bare = lat[REFERENCE], lat["bare"]
    table = Table(f"{setup.name} 1. latency per call, one thread (interleaved rounds)",
                  ["impl", "calls", "p50", "p99", "mean", "p50 vs ref", "p99 vs ref",
                   "p50 vs bare"], plain=plain)
    for name, s in lat.items():
        table.add_row(name, f"{s.count:,}", fmt_s(s.p50), fmt_s(s.p99), fmt_s(s.mean),
                      fmt_ratio(ratio(s.p50, ref.p50)), fmt_ratio(ratio(s.p99, ref.p99)),
                      fmt_ratio(ratio(s.p50, bare.p50)))
    table.print()

    loads = throughput_rounds(impls, seconds, segments=3 if not quick else 1)
    rates = {name: load.calls / load.elapsed for name, load in loads.items()}
    table = Table(f"{setup.name} 2. throughput, {AGENTS} agents (threads) over {LEADS:,} leads "
                  "(interleaved segments)",
                  ["impl", "calls", "calls/s", "p50", "p99", "calls/s vs ref",
                   "calls/s vs bare"], plain=plain)
    for name, load in loads.items():
        s = summarize(load.latencies)
        table.add_row(name, f"{load.calls:,}", fmt_rate(rates[name]), fmt_s(s.p50),
                      fmt_s(s.p99), fmt_ratio(ratio(rates[name], rates[REFERENCE])),
                      fmt_ratio(ratio(rates[name], rates["bare"])))
    table.print()

    cpu_calls = CPU_CALLS if not quick else 100
    cpu = {name: summarize(cpu_per_call(call, cpu_calls, seed)).p50
           for seed, (name, call) in enumerate(impls.items())}
    table = Table(f"{setup.name} 3. client CPU per call (p50 of {cpu_calls} calls, thread CPU "
                  "time, one thread)", ["impl", "round trips", "client CPU", "vs ref",
                                        "of its p50"], plain=plain,
                  caption=("embedded: the database's own work is client CPU too"
                           if setup.name == "sqlite" else None))
    for name in impls:
        table.add_row(name, setup.round_trips.get(name, "-"), fmt_s(cpu[name]),
                      fmt_ratio(ratio(cpu[name], cpu[REFERENCE])),
                      f"{ratio(cpu[name], lat[name].p50):.0%}")
    table.print()

    guarded = lat[GUARDED]
    rows = [("p50, 1 thread", guarded.p50, ref.p50, fmt_s),
            ("p99, 1 thread", guarded.p99, ref.p99, fmt_s),
            (f"calls/s, {AGENTS} threads", rates[GUARDED], rates[REFERENCE], fmt_rate),
            ("client CPU per call", cpu[GUARDED], cpu[REFERENCE], fmt_s)]
    columns = ["per call", "toolguard", "expert (reference)", "toolguard / reference"]
    if DBOS in impls:
        columns += ["dbos", "toolguard / dbos"]
        theirs = [lat[DBOS].p50, lat[DBOS].p99, rates[DBOS], cpu[DBOS]]
    table = Table(f"{setup.name} 4. toolguard vs the expert's reference (this run)", columns,
                  plain=plain, caption="calls/s: above 1.00x is faster; the rest: below "
                                       "1.00x is faster")
    for index, (label, ours, reference, fmt) in enumerate(rows):
        cells = [label, fmt(ours), fmt(reference), fmt_ratio(ratio(ours, reference))]
        if DBOS in impls:
            cells += [fmt(theirs[index]), fmt_ratio(ratio(ours, theirs[index]))]
        table.add_row(*cells)
    table.print()

    made = {name: loads[name].calls + WARM_UP + len(samples[name]) + cpu_calls
            for name in impls if name != DBOS}
    expected, final = sum(made.values()), setup.total()
    print(f"check: {made[GUARDED]:,} guarded + {made[REFERENCE]:,} expert + {made['bare']:,} "
          f"bare increments = {expected:,}; table sum {final:,} "
          f"({'matches' if final == expected else 'MISMATCH'})")
    problems = setup.expert.check()
    print(f"check: the expert's {setup.expert.calls:,} calls: "
          + ("one intent with its result and one chained audit row each, every chain "
             "recomputes" if not problems else "; ".join(problems)))
    problems = setup.toolguard_problems()
    print(f"check: toolguard's {setup.guarded.calls:,} calls: "
          + ("one applied intent with its result and one accepted audit row each, "
             "verify_audit ok" if not problems else "; ".join(problems)))
    if setup.peer is not None:
        problems = setup.peer.check()
        print(f"check: DBOS's {setup.peer.calls:,} calls: "
              + ("exactly once per call id (table sum, one successful workflow and one "
                 "recorded step each, re-runs return the recorded result)"
                 if not problems else "; ".join(problems)))
