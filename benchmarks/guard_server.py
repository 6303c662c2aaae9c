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
* WAL bytes per call (``pg_current_wal_lsn`` before and after).

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
import time
import uuid
from collections.abc import Callable
from typing import Any

from _harness import LEADS, lead_of  # the sibling modules
from _stats import Table
from guard import Setup, guard_parser
from scale import PostgresServer

#: What the server is started with: the statistics this table reads, durable as shipped.
SETTINGS = ("shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track=all",
            "track_functions=pl")


def measure(admin: Any, call: Callable[[str], None], calls: int, rng: random.Random
            ) -> tuple[dict[tuple[bool, str], float], dict[str, tuple[float, float]], float]:
    """``calls`` calls of ``call`` after a warm-up: µs per call by (top level, statement),
    (total, own) µs per call by function, WAL bytes per call."""
    for _ in range(200):
        call(lead_of(rng))
    admin.execute("SELECT pg_stat_statements_reset(), pg_stat_reset()")
    start = admin.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    for _ in range(calls):
        call(lead_of(rng))
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
    return statements, functions, wal / calls


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

        setup = Setup(server.url, args.redis_url, uuid.uuid4().hex[:10])
        try:
            with psycopg.connect(server.url, autocommit=True) as admin:
                admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                report(admin, setup, calls, rounds, plain=args.plain)
        finally:
            setup.close()
    except Exception as error:
        print(f"the run failed: {type(error).__name__}: {error}")
    finally:
        server.stop()
    return 0


def report(admin: Any, setup: Setup, calls: int, rounds: int, *, plain: bool) -> None:
    """Both implementations in alternating rounds; the means, side by side."""
    impls = {"toolguard": setup.guarded, "expert (d2)": setup.expert.d2}
    seen: dict[str, list[tuple[dict[tuple[bool, str], float], dict[str, tuple[float, float]],
                               float]]] = {name: [] for name in impls}
    rng = random.Random(7)
    for call in impls.values():  # every lead's fence row, intent pages and plans made first
        for _ in range(3 * LEADS):
            call(lead_of(rng))
    for _ in range(rounds):
        for name, call in impls.items():
            seen[name].append(measure(admin, call, calls, rng))

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    print(f"the server's side of one guarded call: {rounds} rounds of {calls:,} calls each, "
          f"one thread, a PostgreSQL of this run's own ({', '.join(SETTINGS)})")
    table = Table("1. execution time per call, by statement (pg_stat_statements)",
                  ["statement", "sent by", "toolguard", "expert (d2)"], plain=plain)
    totals = {name: 0.0 for name in impls}
    keys = sorted({key for runs in seen.values() for statements, _, _ in runs for key in statements},
                  key=lambda key: (not key[0], key[1]))
    for top, query in keys:
        values = [mean([statements.get((top, query), 0.0) for statements, _, _ in seen[name]])
                  for name in impls]
        if top:
            for name, value in zip(impls, values, strict=True):
                totals[name] += value
        if max(values) >= 0.5:  # leave out what costs nothing (SET, the statistics' own reads)
            table.add_row(query[:100], "client" if top else "  a function",
                          *(f"{value:.1f} us" if value else "-" for value in values))
    table.add_row("all the client's statements", "-", *(f"{totals[n]:.1f} us" for n in impls))
    table.print()
    functions = Table("2. PL/pgSQL functions per call (pg_stat_user_functions)",
                      ["function", "total", "own (without functions it calls)"], plain=plain)
    names = sorted({f for _, fns, _ in seen["toolguard"] for f in fns})
    for fn in names:
        total = mean([fns.get(fn, (0.0, 0.0))[0] for _, fns, _ in seen["toolguard"]])
        own = mean([fns.get(fn, (0.0, 0.0))[1] for _, fns, _ in seen["toolguard"]])
        if total:
            functions.add_row(fn, f"{total:.1f} us", f"{own:.1f} us")
    functions.print()
    wal = Table("3. WAL written per call", ["impl", "bytes", "vs expert (d2)"], plain=plain)
    expert_wal = mean([w for _, _, w in seen["expert (d2)"]])
    for name in impls:
        value = mean([w for _, _, w in seen[name]])
        wal.add_row(name, f"{value:,.0f}", f"{value / expert_wal:.2f}x" if expert_wal else "-")
    wal.print()


if __name__ == "__main__":
    raise SystemExit(main())
