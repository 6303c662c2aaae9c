"""The database's work of a guarded call alone: toolguard's SQL against the expert's, CPU on both sides.

    python benchmarks/guard_sql.py [--calls N] [--rounds N] [--quick] [--plain]

``benchmarks/guard_server.py`` measures the whole guarded call, whose server CPU
includes everything the guard sends. This script takes the guard away and
sends only the fenced transaction's statements, on one connection, one
thread, to a PostgreSQL of its own (``initdb`` on a free loopback port,
durable settings as shipped, no statistics extensions):

* toolguard: the two messages its PostgreSQL session sends (``BEGIN;
  SELECT ... toolguard_enter(...)`` and ``SELECT toolguard_finish(...);
  COMMIT``, through the session's own client-side-binding cursor), around the
  benchmark tool's ``UPDATE``; on the schema as installed, and on a copy with
  every optional piece taken away (``benchmarks/guard_costs.py``'s variants);
* the expert's (d2) transaction of ``benchmarks/expert.py`` (pipeline mode,
  prepared statements);
* the bare transaction: ``BEGIN``, the ``UPDATE``, ``COMMIT``;
* toolguard's and the expert's transactions again, each taking a connection of
  a pool of 12 for every transaction: psycopg_pool's own ``ConnectionPool``
  (it hands out the connection idle longest, so one thread goes round all
  twelve) and, for toolguard, the ``RecentFirstPool`` its store uses.

For each: the client thread's CPU (``thread_time``) and the server's CPU (every
server process, from ``/proc``) per transaction, medians over rounds in a
shuffled order. No locks are taken (tokens only grow), so the figures hold the
SQL and its protocol to account, not the guard's steps around them. Always
exits 0.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import expert  # the sibling modules
import psycopg
from _stats import Table, fmt_ratio, ratio
from guard import UPDATE, guard_parser
from guard_costs import VARIANTS, strip
from guard_server import server_cpu
from psycopg_pool import ConnectionPool
from scale import PostgresServer

from toolguard.runtime.postgres_pool import RecentFirstPool
from toolguard.store import open_store
from toolguard.store.postgres_literals import _hot_cursor
from toolguard.store.postgres_sql import ENTER_TX, FINISH_TX, text_array

LEADS = 1000
WARM_UP = 300
POOL = 12
ARGS = json.dumps({"delta": 1, "lead_id": "lead"}, separators=(",", ":"))


class Transactions:
    """One connection per schema on ``server``, and the transactions measured on them."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.pools: list[ConnectionPool[Any]] = []
        for schema in ("installed", "bare"):
            open_store(url, install=True, schema=schema, min_size=1, max_size=1).close()
        strip(url, "bare", [statement for _, each in VARIANTS for statement in each])
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("CREATE SCHEMA expert")
        self.conns = {schema: self._connect(url, schema)
                      for schema in ("installed", "bare", "expert")}
        self.conns["expert"].execute(expert.TABLES)
        self.token = 0

    @staticmethod
    def _connect(url: str, schema: str) -> psycopg.Connection[Any]:
        conn = psycopg.connect(url, autocommit=True, options=f"-c search_path={schema}")
        conn.execute("CREATE TABLE lead (id text PRIMARY KEY, score bigint NOT NULL)")
        conn.execute("INSERT INTO lead SELECT 'lead-' || g, 0 FROM generate_series(0, %s) g",
                     (LEADS - 1,))
        return conn

    def close(self) -> None:
        for pool in self.pools:
            pool.close()
        for conn in self.conns.values():
            conn.close()

    def pooled(self, schema: str, kind: type[ConnectionPool[Any]],
               transaction: Callable[[psycopg.Connection[Any], str], None]
               ) -> Callable[[str], None]:
        """``transaction`` on a connection of a pool of ``POOL`` for each call."""
        pool = kind(self.url, min_size=POOL, max_size=POOL, open=True,
                    kwargs={"autocommit": True, "options": f"-c search_path={schema}"})
        pool.wait()
        self.pools.append(pool)

        def call(lead: str) -> None:
            with pool.connection() as conn:
                transaction(conn, lead)
        return call

    def next_token(self) -> int:
        self.token += 1
        return self.token

    def toolguard(self, schema: str) -> Callable[[str], None]:
        return lambda lead: self.toolguard_on(self.conns[schema], lead)

    def toolguard_on(self, conn: psycopg.Connection[Any], lead: str) -> None:
        """toolguard's two messages around the tool's UPDATE, as its session sends them."""
        key, token, intent = f"lead:{lead}", self.next_token(), uuid.uuid4().hex
        keys, tokens = text_array([key]), json.dumps({key: token})
        enter = _hot_cursor(conn, "_toolguard_enter")
        enter.execute(ENTER_TX, (keys, f"{{{token}}}", intent, "add_score", "scorer", "run",
                                 "0" * 64, keys), prepare=False)
        enter.nextset()
        enter.fetchone()
        (score,) = conn.execute(UPDATE, (1, lead)).fetchone()  # type: ignore[misc]
        _hot_cursor(conn, "_toolguard_finish").execute(FINISH_TX, (
            intent, json.dumps(score), tokens, "scorer", "add_score", intent, intent, "run",
            "accepted", "applied", keys, tokens, ARGS, None, 1.5, 1, "v1"), prepare=False)

    def d2(self, lead: str) -> None:
        self.d2_on(self.conns["expert"], lead)

    def d2_on(self, conn: psycopg.Connection[Any], lead: str) -> None:
        """The expert's (d2) transaction (``expert.Expert._transaction``), without its lock."""
        key, token, intent = f"lead:{lead}", self.next_token(), uuid.uuid4().hex
        with conn.pipeline() as pipe:
            conn.execute("BEGIN")
            entered = conn.execute(expert.ENTER, {"key": key, "token": token, "id": intent})
            pipe.sync()
            entered.fetchone()
            (score,) = conn.execute(UPDATE, (1, lead)).fetchone()  # type: ignore[misc]
            pipe.sync()
            conn.execute(expert.FINISH, {
                "result": json.dumps(score), "id": intent, "key": key,
                "entry": expert.entry_text("scorer", "add_score", key, token, ARGS),
                "agent": "scorer", "tool": "add_score", "token": token, "args": ARGS})
            conn.execute("COMMIT")

    def bare(self, lead: str) -> None:
        with self.conns["expert"].transaction():
            self.conns["expert"].execute(UPDATE, (1, lead)).fetchone()


def main(argv: list[str] | None = None) -> int:
    parser = guard_parser(__doc__)
    parser.add_argument("--calls", type=int, default=None,
                        help="transactions per round (default 1,000, --quick 200)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of each (default 12, --quick 3)")
    args = parser.parse_args(argv)
    calls = args.calls or (200 if args.quick else 1000)
    rounds = args.rounds or (3 if args.quick else 12)
    try:
        server = PostgresServer(())
    except Exception as error:
        print(f"cannot start a PostgreSQL of this run's own: {type(error).__name__}: {error}")
        return 0
    try:
        transactions = Transactions(server.url)
        try:
            measure(transactions, server_cpu(server), calls, rounds, plain=args.plain)
        finally:
            transactions.close()
    except Exception as error:
        print(f"the run failed: {type(error).__name__}: {error}")
    finally:
        server.stop()
    return 0


def measure(transactions: Transactions, cpu: Callable[[], float], calls: int, rounds: int, *,
            plain: bool) -> None:
    impls: dict[str, Callable[[str], None]] = {
        "toolguard, schema as installed": transactions.toolguard("installed"),
        "toolguard, optional pieces removed": transactions.toolguard("bare"),
        "expert (d2)": transactions.d2,
        "bare transaction": transactions.bare,
        f"toolguard, pool of {POOL} (psycopg_pool's order)": transactions.pooled(
            "installed", ConnectionPool, transactions.toolguard_on),
        f"toolguard, pool of {POOL} (RecentFirstPool)": transactions.pooled(
            "installed", RecentFirstPool, transactions.toolguard_on),
        f"expert (d2), pool of {POOL} (psycopg_pool's order)": transactions.pooled(
            "expert", ConnectionPool, transactions.d2_on),
    }
    rng = random.Random(7)
    for call in impls.values():  # every lead's fence row exists before the measured rounds
        for n in range(LEADS):
            call(f"lead-{n}")
        for _ in range(WARM_UP):
            call(f"lead-{rng.randrange(LEADS)}")
    client: dict[str, list[float]] = {name: [] for name in impls}
    server: dict[str, list[float]] = {name: [] for name in impls}
    order = list(impls)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            call = impls[name]
            server_before, client_before = cpu(), time.thread_time()
            for _ in range(calls):
                call(f"lead-{rng.randrange(LEADS)}")
            client[name].append((time.thread_time() - client_before) / calls)
            server[name].append((cpu() - server_before) / calls)
    c = {name: statistics.median(values) for name, values in client.items()}
    s = {name: statistics.median(values) for name, values in server.items()}
    table = Table(f"the fenced transaction's SQL alone, per transaction ({rounds} rounds of "
                  f"{calls:,}, one connection, medians)",
                  ["transaction", "client CPU", "vs (d2)", "server CPU", "vs (d2)",
                   "server - (d2)", "client + server", "vs (d2)"], plain=plain)
    d2 = "expert (d2)"
    for name in impls:
        table.add_row(name, f"{c[name] * 1e6:.0f} us", fmt_ratio(ratio(c[name], c[d2])),
                      f"{s[name] * 1e6:.0f} us", fmt_ratio(ratio(s[name], s[d2])),
                      f"{(s[name] - s[d2]) * 1e6:+.0f} us", f"{(c[name] + s[name]) * 1e6:.0f} us",
                      fmt_ratio(ratio(c[name] + s[name], c[d2] + s[d2])))
    table.print()
    spread = {name: (min(values) * 1e6, max(values) * 1e6) for name, values in server.items()}
    print("server CPU per round, min to max: " + "; ".join(
        f"{name} {low:.0f}-{high:.0f} us" for name, (low, high) in spread.items()))


if __name__ == "__main__":
    raise SystemExit(main())
