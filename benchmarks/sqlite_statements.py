"""Where an embedded-SQLite guarded call's time goes: inside SQLite, statement by statement, and outside.

    python benchmarks/sqlite_statements.py [--calls N] [--rounds R] [--quick] [--plain]

On embedded SQLite the database's work is client CPU too, so the split that
``benchmarks/guard_server.py`` reads from a PostgreSQL server is read here from
the calling thread: every ``sqlite3`` connection this process opens (toolguard's
store and lock backend, its checkpointer, the expert's) is made with a
connection class whose ``execute`` is timed. The guarded call of
``benchmarks/deployments.py`` (locks and store in one SQLite file) and the
expert's hand-written reference with the same guarantees
(``benchmarks/expert_sqlite.py``) run in one thread, in interleaved rounds.

It prints, per call: wall time, the time spent inside ``execute`` (SQLite's
parse, plan, run and commit, and the Python functions SQLite calls back, such
as the audit row's hash), the rest (the Python around the statements), and
each statement's count and time; statements another thread ran meanwhile
(toolguard's WAL checkpointer) are listed apart and left out of the split.
Timing each ``execute`` adds about a microsecond per statement to both sides.
Always exits 0.
"""

from __future__ import annotations

import argparse
import collections
import random
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import lead_of, rotated, run_arguments
from _stats import Table, fmt_ratio, fmt_s, ratio

#: (executions, seconds) by statement text (whitespace folded, first 100 characters), the
#: ones another thread ran (toolguard's checkpointer, say) marked ``BACKGROUND``.
SPENT: collections.defaultdict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
BACKGROUND = "[another thread] "
CALLER = threading.get_ident()


class TimedConnection(sqlite3.Connection):
    """A connection whose ``execute`` adds its count and duration to ``SPENT``."""

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        started = time.perf_counter()
        try:
            return super().execute(sql, parameters)
        finally:
            text = " ".join(sql.split())[:100]
            entry = SPENT[text if threading.get_ident() == CALLER else BACKGROUND + text]
            entry[0] += 1
            entry[1] += time.perf_counter() - started


def time_every_connection() -> None:
    """From now on ``sqlite3.connect`` makes ``TimedConnection``s unless told otherwise."""
    connect = sqlite3.connect

    def timed(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        kwargs.setdefault("factory", TimedConnection)
        conn: sqlite3.Connection = connect(*args, **kwargs)
        return conn

    sqlite3.connect = timed  # type: ignore[assignment]


def measure(impls: dict[str, Callable[[str], None]], calls: int,
            rounds: int) -> dict[str, tuple[int, float, dict[str, list[float]]]]:
    """Per implementation: (calls, wall seconds, SPENT of its own calls), interleaved rounds."""
    rng = random.Random(11)
    totals: dict[str, tuple[int, float, dict[str, list[float]]]] = {
        name: (0, 0.0, {}) for name in impls}
    names = list(impls)
    for number in range(rounds):
        for name in rotated(names, number):
            leads = [lead_of(rng) for _ in range(calls)]
            SPENT.clear()
            started = time.perf_counter()
            for lead in leads:
                impls[name](lead)
            wall = time.perf_counter() - started
            done, spent, statements = totals[name]
            for text, (count, seconds) in SPENT.items():
                entry = statements.setdefault(text, [0, 0.0])
                entry[0] += count
                entry[1] += seconds
            totals[name] = (done + calls, spent + wall, statements)
    return totals


def _calling_thread(statements: dict[str, list[float]]) -> tuple[float, float]:
    """(executions, seconds) of the statements the calling thread ran."""
    mine = [entry for text, entry in statements.items() if not text.startswith(BACKGROUND)]
    return sum(count for count, _ in mine), sum(seconds for _, seconds in mine)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    run_arguments(parser)
    parser.add_argument("--calls", type=int, default=None,
                        help="calls per implementation per round (default 1,000, --quick 100)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds (default 6, --quick 2)")
    parser.add_argument("--top", type=int, default=14, help="statements listed per implementation")
    args = parser.parse_args(argv)
    calls = args.calls or (100 if args.quick else 1_000)
    rounds = args.rounds or (2 if args.quick else 6)
    time_every_connection()
    from deployments import REFERENCE, SqliteDeployment

    try:
        setup = SqliteDeployment(f"sqlstmt{random.randrange(10**6)}")
    except Exception as error:
        print(f"cannot set up the benchmark: {type(error).__name__}: {error}")
        return 0
    try:
        impls: dict[str, Callable[[str], None]] = {REFERENCE: setup.expert.call,
                                                   "guarded": setup.guarded}
        warm = random.Random(3)
        for call in impls.values():  # warm-up: connections, statement caches
            for _ in range(200):
                call(lead_of(warm))
        totals = measure(impls, calls, rounds)
        print(f"one SQLite file, one thread, {rounds} interleaved rounds of {calls:,} calls; "
              f"python {sys.version.split()[0]}, SQLite {sqlite3.sqlite_version}")
        reference = totals[REFERENCE]
        ref_inside = _calling_thread(reference[2])[1] / reference[0]
        ref_wall = reference[1] / reference[0]
        table = Table("1. per call: inside SQLite (every execute) and around it",
                      ["impl", "statements", "wall", "inside SQLite", "outside", "wall vs ref",
                       "inside vs ref", "outside vs ref"], plain=args.plain)
        for name, (done, wall, statements) in totals.items():
            count, inside = (total / done for total in _calling_thread(statements))
            table.add_row(name, f"{count:.2f}", fmt_s(wall / done), fmt_s(inside),
                          fmt_s(wall / done - inside), fmt_ratio(ratio(wall / done, ref_wall)),
                          fmt_ratio(ratio(inside, ref_inside)),
                          fmt_ratio(ratio(wall / done - inside, ref_wall - ref_inside)))
        table.print()
        for index, (name, (done, _, statements)) in enumerate(totals.items(), start=2):
            table = Table(f"{index}. {name}: statements by time inside SQLite, per call",
                          ["statement", "per call", "time per call", "per execute"],
                          plain=args.plain)
            ordered = sorted(statements.items(), key=lambda item: -item[1][1])
            for text, (count, seconds) in ordered[:args.top]:
                table.add_row(text, f"{count / done:.3f}", fmt_s(seconds / done),
                              fmt_s(seconds / count))
            table.print()
    finally:
        setup.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
