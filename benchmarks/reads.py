"""What remembering reads costs: a ``reads:`` tool and a checked write beside today's unchecked ones.

One thread, interleaved rounds (``_harness.latency``), on random rows of a
1,000-row table, all in one run on one store:

- ``bare SELECT``: the read alone, on a pooled connection of the store.
- ``read_only tool``: a guarded read as before ``reads:`` (no transaction of
  toolguard's; the tool reads on its own connection).
- ``reads: tool``: a read that records what its caller saw (versions read,
  the tool's SELECT, observation and audit row, in one read transaction).
- ``write``: a fenced write under a policy without ``reads:`` (its keys'
  versions still advance).
- ``checked write``: the same write under ``requires_read: true`` (the read
  check in the fenced transaction, and the caller's observation of what it wrote).

Ratios are against ``read_only tool`` for the reads and ``write`` for the
writes; absolute times depend on the machine, the ratios less so.

    python benchmarks/reads.py                         # embedded SQLite (the default)
    python benchmarks/reads.py --deployment postgres   # Redis locks, PostgreSQL store
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import LEADS, latency, run_arguments
from _stats import Table, fmt_ratio, fmt_s, ratio, summarize

from toolguard import ToolGuard, connect, open_store
from toolguard.call.context import CallContext
from toolguard.call.intent import Intent, WorkflowIdentity
from toolguard.policies import Policy

PLAIN = {"version": 1, "tools": {
    "get_score": {"read_only": True},
    "set_score": {"locks": ["plain-lead:{lead_id}"]},  # other keys: the checked writer's stay its own
}}
CHECKED = {"version": 1, "tools": {
    "get_score": {"reads": ["lead:{lead_id}"]},
    "set_score": {"locks": ["lead:{lead_id}"], "requires_read": True},
}}
READ = "SELECT score FROM lead WHERE id = %s"
WRITE = "UPDATE lead SET score = score + 1 WHERE id = %s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deployment", choices=["sqlite", "postgres"], default="sqlite")
    run_arguments(parser)
    options = parser.parse_args()
    seconds = 4.0 if options.quick else 30.0
    folder = tempfile.mkdtemp(prefix="toolguard-bench-reads-")
    if options.deployment == "sqlite":
        store = open_store(f"sqlite:///{folder}/store.db", install=True)
        locks = connect(f"sqlite:///{folder}/locks.db")
    else:
        schema = f"tg_bench_reads_{uuid.uuid4().hex[:8]}"
        store = open_store(os.environ.get("TOOLGUARD_TEST_DATABASE_URL",
                                          "postgresql://postgres@127.0.0.1:5432/test"),
                           schema=schema, install=True)
        locks = connect(os.environ.get("TOOLGUARD_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
                        prefix=f"tgbench:{schema}")
    with store.connection() as conn:
        conn.execute("CREATE TABLE lead (id TEXT PRIMARY KEY, score BIGINT NOT NULL)")
        for i in range(LEADS):
            conn.execute(_q(store, "INSERT INTO lead VALUES (%s, 0)"), (f"lead-{i}",))
        if hasattr(conn, "commit"):
            conn.commit()
    plain = ToolGuard(Policy.from_dict(PLAIN), locks=locks, store=store)
    checked = ToolGuard(Policy.from_dict(CHECKED), locks=locks, store=store)
    ids = iter(range(1, 10**9))

    def intent(tool: str, lead: str) -> Intent:
        return Intent(tool=tool, args={"lead_id": lead}, call_id=f"c{next(ids)}", agent="bench",
                      workflow=WorkflowIdentity(thread_id="bench-thread"))

    def own_read(lead: str) -> Any:
        with store.connection() as conn:
            return conn.execute(_q(store, READ), (lead,)).fetchone()

    def read_in_tx(ctx: CallContext) -> Any:
        return ctx.tx.execute(READ, (ctx.args["lead_id"],)).fetchone()[0]

    def write_in_tx(ctx: CallContext) -> Any:
        ctx.tx.execute(WRITE, (ctx.args["lead_id"],))
        return 1

    def guarded(guard: ToolGuard, tool: str, body: Callable[[CallContext], Any]
                ) -> Callable[[str], None]:
        def call(lead: str) -> None:
            decision = guard.run(intent(tool, lead), body)
            if not decision.ok:
                raise RuntimeError(f"{tool}: {decision.reason}: {decision.message}")

        return call

    impls: dict[str, Callable[[str], None]] = {
        "bare SELECT": own_read,
        "read_only tool": guarded(plain, "get_score", lambda ctx: own_read(ctx.args["lead_id"])),
        "reads: tool": guarded(checked, "get_score", read_in_tx),
        "write": guarded(plain, "set_score", write_in_tx),
        "checked write": guarded(checked, "set_score", write_in_tx),
    }
    read_every = guarded(checked, "get_score", read_in_tx)
    for i in range(LEADS):  # the checked writer has read every row (then its writes count)
        read_every(f"lead-{i}")
    samples = latency(None, impls, seconds, rounds=6)
    table = Table(f"reads and checked writes ({options.deployment}, one thread, p50)",
                  ["impl", "calls", "p50", "p99", "ratio (p50)", "against"], plain=options.plain)
    against = {"bare SELECT": "read_only tool", "read_only tool": "read_only tool",
               "reads: tool": "read_only tool", "write": "write", "checked write": "write"}
    stats = {name: summarize(values) for name, values in samples.items()}
    for name, summary in stats.items():
        base = stats[against[name]]
        table.add_row(name, str(len(samples[name])), fmt_s(summary.p50), fmt_s(summary.p99),
                      fmt_ratio(ratio(summary.p50, base.p50)), against[name])
    table.print()
    store.close()
    locks.close()
    if options.deployment == "postgres":  # the run's own schema goes with it
        import psycopg

        with psycopg.connect(os.environ.get("TOOLGUARD_TEST_DATABASE_URL",
                                            "postgresql://postgres@127.0.0.1:5432/test"),
                             autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _q(store: Any, sql: str) -> str:
    from toolguard.store.base import qmark

    return qmark(sql) if type(store).__name__.startswith("Sqlite") else sql


if __name__ == "__main__":
    main()
