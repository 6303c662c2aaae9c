"""Holds, stale-read refusals or neither: 8 agents depositing on 1, 10 and 100 records.

Each agent (its own thread and conversation) loops: pick a random record, read
its balance, "think" (a fixed delay standing in for the model), write balance
+ 1. Told ``stale_read`` (or ``hold_deadlock``) it reads and decides again.
Three policies, side by side in one run on one store:

- ``holds``: ``get_balance`` has ``hold: true``; the write runs under the read's lock.
- ``refusals``: ``reads:`` and ``requires_read``; a write on a stale read is refused.
- ``neither``: a ``read_only`` read and a plain fenced write; updates get lost.

Printed per cell: deposits applied per second, decisions thrown away (refused
and made again), and lost deposits (applied, then overwritten: the final sum
falls short of them). Absolute numbers depend on the machine; compare rows.

    python benchmarks/holds.py                         # embedded SQLite (the default)
    python benchmarks/holds.py --deployment postgres   # Redis locks, PostgreSQL store
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import run_arguments
from _stats import Table

from toolguard import ToolGuard, connect, open_store
from toolguard.call.context import CallContext
from toolguard.call.intent import Intent, WorkflowIdentity
from toolguard.policies import Policy

AGENTS = 8
DEFAULTS = {"wait_timeout_s": 60, "max_hold_s": 60}
POLICIES: dict[str, dict[str, Any]] = {
    "holds": {"version": 1, "defaults": DEFAULTS, "tools": {
        "get_balance": {"reads": ["account:{account_id}"], "hold": True},
        "set_balance": {"locks": ["account:{account_id}"], "requires_read": True}}},
    "refusals": {"version": 1, "defaults": DEFAULTS, "tools": {
        "get_balance": {"reads": ["account:{account_id}"]},
        "set_balance": {"locks": ["account:{account_id}"], "requires_read": True}}},
    "neither": {"version": 1, "defaults": DEFAULTS, "tools": {
        "get_balance": {"read_only": True},
        "set_balance": {"locks": ["account:{account_id}"]}}},
}
READ = "SELECT score FROM lead WHERE id = %s"
WRITE = "UPDATE lead SET score = %s WHERE id = %s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deployment", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--think-ms", type=float, default=20.0,
                        help="the model's fixed 'thinking' between read and write")
    run_arguments(parser)
    options = parser.parse_args()
    seconds = 2.0 if options.quick else 10.0
    folder = tempfile.mkdtemp(prefix="toolguard-bench-holds-")
    if options.deployment == "sqlite":
        store = open_store(f"sqlite:///{folder}/store.db", install=True)
        locks = connect(f"sqlite:///{folder}/locks.db")
    else:
        schema = f"tg_bench_holds_{uuid.uuid4().hex[:8]}"
        store = open_store(os.environ.get("TOOLGUARD_TEST_DATABASE_URL",
                                          "postgresql://postgres@127.0.0.1:5432/test"),
                           schema=schema, install=True)
        locks = connect(os.environ.get("TOOLGUARD_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
                        prefix=f"tgbench:{schema}")
    sqlite = type(store).__name__.startswith("Sqlite")

    def sql(query: str, params: tuple[Any, ...] = ()) -> list[Any]:
        from toolguard.store.base import qmark

        with store.connection() as conn:
            cursor = conn.execute(qmark(query) if sqlite else query, params)
            return list(cursor.fetchall()) if cursor.description else []

    sql("CREATE TABLE lead (id TEXT PRIMARY KEY, score BIGINT NOT NULL)")
    table = Table(f"{AGENTS} agents depositing ({options.deployment}, think "
                  f"{options.think_ms:g} ms, {seconds:g} s per cell)",
                  ["records", "policy", "deposits/s", "decisions redone", "lost deposits"],
                  plain=options.plain)
    for records in (1, 10, 100):
        for name, policy in POLICIES.items():
            sql("DELETE FROM lead")
            for i in range(records):
                sql("INSERT INTO lead VALUES (%s, 0)", (f"r{i}",))
            guard = ToolGuard(Policy.from_dict(policy), locks=locks, store=store)
            counts = _cell(guard, sql, records, options.think_ms / 1000, seconds, f"{name}{records}")
            total = sum(int(row[0]) for row in sql("SELECT score FROM lead"))
            table.add_row(str(records), name, f"{counts['applied'] / seconds:.1f}",
                          str(counts["redone"]), str(counts["applied"] - total))
        table.sections.add(len(table.rows))
    table.print()
    store.close()
    locks.close()


def _cell(guard: ToolGuard, sql: Any, records: int, think_s: float, seconds: float,
          tag: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    mutex = threading.Lock()
    deadline = time.monotonic() + seconds
    ids = iter(range(1, 10**9))

    def read(ctx: CallContext) -> int:
        if not ctx.keys:  # read_only: no transaction of toolguard's
            return int(sql(READ, (ctx.args["account_id"],))[0][0])
        return int(ctx.tx.execute(READ, (ctx.args["account_id"],)).fetchone()[0])

    def write(ctx: CallContext) -> int:
        ctx.tx.execute(WRITE, (ctx.args["balance"], ctx.args["account_id"]))
        return int(ctx.args["balance"])

    def agent(index: int) -> None:
        rng = random.Random(index)
        flow = WorkflowIdentity(thread_id=f"{tag}-{index}")
        mine: Counter[str] = Counter()

        def call(tool: str, body: Any, **args: Any) -> Any:
            return guard.run(Intent(tool=tool, args=args, call_id=f"{tag}-{next(ids)}",
                                    agent=f"agent-{index}", workflow=flow), body)

        while time.monotonic() < deadline:
            account = f"r{rng.randrange(records)}"
            seen = call("get_balance", read, account_id=account)
            if not seen.ok:
                mine["redone"] += 1
                continue
            time.sleep(think_s)
            done = call("set_balance", write, account_id=account, balance=seen.result + 1)
            mine["applied" if done.ok else "redone"] += 1
        with mutex:
            counts.update(mine)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(AGENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return counts


if __name__ == "__main__":
    main()
