"""The server's side of a guarded call, inside the call: what PostgreSQL executes and writes.

    python benchmarks/guard_server.py [--redis-url URL] [--calls N] [--quick] [--plain]

``benchmarks/guard_costs.py`` times each statement from the client, on its own;
this script asks the server while the guarded call of ``benchmarks/guard.py``
runs as it does there (Redis locks, PostgreSQL store, one read-modify-write of
a lead), side by side with the expert's hand-written (d2) (``benchmarks/expert.py``):

* every statement's execution time per call, from ``pg_stat_statements`` with
  ``track = all``: the statements the client sends, and under them the ones
  toolguard's PL/pgSQL functions run (the audit row-hash trigger's work is
  part of the audit ``INSERT``);
* each PL/pgSQL function's total and own time per call (``track_functions``);
* WAL bytes per call (``pg_current_wal_lsn`` before and after);
* the server's CPU per call: user and system time of every process of the
  server (backends, WAL writer, checkpointer, autovacuum) from ``/proc``
  (Linux; 0 elsewhere), which the statement times leave out (protocol, commit,
  WAL writing);
* what each piece of the schema costs the server, by removal: the guarded
  call on copies of the schema with one piece taken away each (the variants of
  ``benchmarks/guard_costs.py``, which times the same copies from the client
  and says what each piece is for), in alternating rounds.

``pg_stat_statements`` has to be loaded when the server starts, so the run
starts a PostgreSQL of its own on a free loopback port (``initdb``, durable
settings as shipped: fsync and synchronous commit on), removed at the end.
Tracking every nested statement adds its own cost to the figures under a
function (a few microseconds each): compare rows, not this table with the
latencies of ``guard.py``. One thread, the two implementations alternating in
rounds of ``--calls`` calls; every figure is the mean over the rounds. Always
exits 0.
"""

from __future__ import annotations

import random
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from _harness import LEADS, lead_of  # the sibling modules
from _stats import Table
from guard import Setup, guard_parser
from guard_costs import VARIANTS, strip
from guard_cpu import children_cpu
from scale import PostgresServer

#: What the server is started with: the statistics this table reads, durable as shipped.
SETTINGS = ("shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track=all",
            "track_functions=pl")


def server_cpu(server: PostgresServer) -> Callable[[], float]:
    """CPU seconds (user + system) used so far by every process of ``server`` but the
    postmaster: its backends, WAL writer, checkpointer, autovacuum (``/proc``, Linux)."""
    postmaster = int((server.dir / "data" / "postmaster.pid").read_text().split()[0])
    return lambda: children_cpu(postmaster)


def measure(admin: Any, call: Callable[[str], None], calls: int, rng: random.Random,
            cpu: Callable[[], float]) -> Measured:
    """``calls`` calls of ``call`` after a warm-up, per call: µs by (top level, statement),
    (total, own) µs by function, WAL bytes, the server's CPU µs."""
    for _ in range(200):
        call(lead_of(rng))
    admin.execute("SELECT pg_stat_statements_reset(), pg_stat_reset()")
    start = admin.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    cpu_start = cpu()
    for _ in range(calls):
        call(lead_of(rng))
    cpu_used = cpu() - cpu_start
    wal = float(admin.execute("SELECT pg_current_wal_lsn() - %s::pg_lsn", (start,)).fetchone()[0])
    time.sleep(0.6)  # backends report function statistics when idle for 0.5 s
    statements = {
        (bool(top), " ".join(query.split())): exec_ms * 1000 / calls
        for top, query, exec_ms in admin.execute(
            "SELECT toplevel, query, total_exec_time FROM pg_stat_statements "
            "WHERE calls >= %s AND position('pg_stat' in query) = 0", (calls // 2,))}
    functions = {name: (total * 1000 / calls, own * 1000 / calls)
                 for name, total, own in admin.execute(
                     "SELECT funcname, total_time, self_time FROM pg_stat_user_functions")}
    return Measured(statements, functions, wal / calls, cpu_used * 1e6 / calls)


@dataclass(frozen=True)
class Measured:
    """One round of ``measure``, per call."""

    statements: dict[tuple[bool, str], float]
    functions: dict[str, tuple[float, float]]
    wal: float
    cpu_us: float

    @property
    def server_us(self) -> float:
        """Execution time of the statements the client sent."""
        return sum(value for (top, _), value in self.statements.items() if top)


def main(argv: list[str] | None = None) -> int:
    parser = guard_parser(__doc__)
    parser.add_argument("--calls", type=int, default=None,
                        help="calls per round (default 3,000, --quick 500)")
    args = parser.parse_args(argv)
    calls = args.calls or (500 if args.quick else 3000)
    rounds = 2
    try:
        server = PostgresServer(SETTINGS)
    except Exception as error:
        print(f"cannot start a PostgreSQL of this run's own: {type(error).__name__}: {error}")
        return 0
    try:
        import psycopg

        cpu = server_cpu(server)
        setup = Setup(server.url, args.redis_url, uuid.uuid4().hex[:10])
        try:
            with psycopg.connect(server.url, autocommit=True) as admin:
                admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                report(admin, setup, calls, rounds, cpu, plain=args.plain)
        finally:
            setup.close()
        # Shorter rounds, more of them: a checkpoint in one round moves its mean, not the median.
        removals(server.url, args.redis_url, max(calls // 4, 100), 4 * rounds, cpu,
                 plain=args.plain)
    except Exception as error:
        print(f"the run failed: {type(error).__name__}: {error}")
    finally:
        server.stop()
    return 0


def report(admin: Any, setup: Setup, calls: int, rounds: int, cpu: Callable[[], float], *,
           plain: bool) -> None:
    """Both implementations in alternating rounds; the means, side by side."""
    impls = {"toolguard": setup.guarded, "expert (d2)": setup.expert.d2}
    seen: dict[str, list[Measured]] = {name: [] for name in impls}
    rng = random.Random(7)
    for call in impls.values():  # every lead's fence row, intent pages and plans made first
        for _ in range(3 * LEADS):
            call(lead_of(rng))
    for _ in range(rounds):
        for name, call in impls.items():
            seen[name].append(measure(admin, call, calls, rng, cpu))

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    print(f"the server's side of one guarded call: {rounds} rounds of {calls:,} calls each, "
          f"one thread, a PostgreSQL of this run's own ({', '.join(SETTINGS)})")
    table = Table("1. execution time per call, by statement (pg_stat_statements)",
                  ["statement", "sent by", "toolguard", "expert (d2)"], plain=plain)
    keys = sorted({key for runs in seen.values() for run in runs for key in run.statements},
                  key=lambda key: (not key[0], key[1]))
    for top, query in keys:
        values = [mean([run.statements.get((top, query), 0.0) for run in seen[name]])
                  for name in impls]
        if max(values) >= 0.5:  # leave out what costs nothing (SET, the statistics' own reads)
            table.add_row(query[:100], "client" if top else "  a function",
                          *(f"{value:.1f} us" if value else "-" for value in values))
    table.add_row("all the client's statements", "-",
                  *(f"{mean([run.server_us for run in seen[n]]):.1f} us" for n in impls))
    table.print()
    functions = Table("2. PL/pgSQL functions per call (pg_stat_user_functions)",
                      ["function", "total", "own (without functions it calls)"], plain=plain)
    names = sorted({f for run in seen["toolguard"] for f in run.functions})
    for fn in names:
        total = mean([run.functions.get(fn, (0.0, 0.0))[0] for run in seen["toolguard"]])
        own = mean([run.functions.get(fn, (0.0, 0.0))[1] for run in seen["toolguard"]])
        if total:
            functions.add_row(fn, f"{total:.1f} us", f"{own:.1f} us")
    functions.print()
    table = Table("3. WAL written and the server's CPU, per call (CPU: every server process, "
                  "from /proc, statistics included)",
                  ["impl", "WAL bytes", "vs expert (d2)", "server CPU", "vs expert (d2)"],
                  plain=plain)
    expert_wal = mean([run.wal for run in seen["expert (d2)"]])
    expert_cpu = mean([run.cpu_us for run in seen["expert (d2)"]])
    for name in impls:
        wal, used = mean([run.wal for run in seen[name]]), mean([run.cpu_us for run in seen[name]])
        table.add_row(name, f"{wal:,.0f}", f"{wal / expert_wal:.2f}x" if expert_wal else "-",
                      f"{used:.0f} us", f"{used / expert_cpu:.2f}x" if expert_cpu else "-")
    table.print()


def removals(server_url: str, redis_url: str, calls: int, rounds: int,
             cpu: Callable[[], float], *, plain: bool) -> None:
    """Section 4: the guarded call on copies of the schema with one piece taken away each
    (``guard_costs.VARIANTS``), in alternating rounds; per call, the median over the rounds."""
    import psycopg

    variants = [*VARIANTS, ("all of them", [s for _, each in VARIANTS for s in each])]
    setups: dict[str, Setup] = {}
    try:
        for name, statements in variants:
            setups[name] = Setup(server_url, redis_url, uuid.uuid4().hex[:10], pool_size=1,
                                 store_size=2)
            strip(server_url, setups[name].schema, statements)
        seen: dict[str, list[Measured]] = {name: [] for name in setups}
        rng = random.Random(9)
        with psycopg.connect(server_url, autocommit=True) as admin:
            for setup in setups.values():
                for _ in range(3 * LEADS):  # every lead's fence row and plans made first
                    setup.guarded(lead_of(rng))
            for _ in range(rounds):
                for name, setup in setups.items():
                    seen[name].append(measure(admin, setup.guarded, calls, rng, cpu))
    finally:
        for setup in setups.values():
            setup.close()

    def median(name: str, figure: Callable[[Measured], float]) -> float:
        return statistics.median(figure(run) for run in seen[name])

    figures: tuple[tuple[str, Callable[[Measured], float], str], ...] = (
        ("statement time", lambda run: run.server_us, "{:.1f} us"),
        ("server CPU", lambda run: run.cpu_us, "{:.0f} us"),
        ("WAL bytes", lambda run: run.wal, "{:,.0f}"))
    table = Table("4. what each piece of the schema costs the server, by removal (the guarded "
                  "call, per call; benchmarks/guard_costs.py says what each piece is for)",
                  ["schema", *(c for name, _, _ in figures for c in (name, "saved"))],
                  plain=plain)
    for name in seen:
        cells: list[str] = []
        for _, figure, shown in figures:
            value, full = median(name, figure), median("full", figure)
            cells += [shown.format(value), "-" if name == "full" else shown.format(full - value)]
        table.add_row(name, *cells)
    table.print()


if __name__ == "__main__":
    raise SystemExit(main())
