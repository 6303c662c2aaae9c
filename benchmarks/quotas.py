"""What the production controls cost per call, beside a bare round trip to the same backend.

    python benchmarks/quotas.py [--redis-url URL] [--postgres-url URL] [--rounds N] [--calls N]

For each backend (Redis, PostgreSQL, SQLite):

* floor: one bare round trip (Redis ``PING``; PostgreSQL ``SELECT 1`` on the store's pool;
  SQLite an empty ``BEGIN IMMEDIATE; COMMIT`` on the store's file, the least an admission
  must do there);
* admit 1 quota: ``Quotas.admit`` of a call under one rate quota (one script / one
  statement / one transaction);
* admit 3 quotas: rate per agent + in-flight per key + budget per key, all in one step;
* admit+finish: the same three, then ``finish`` (the in-flight slot's release: a second
  round trip).

Plus the kill switch's ``PauseBoard.check`` with its 1 s cache (no round trip but once a
second) and with ``cache_s=0`` (a read per call), on the store.

Each row is the median per-call latency over ``--rounds`` interleaved rounds of
``--calls`` calls; the ratio is against the floor measured in the same rounds.
Keys are random per run and every quota window is long, so nothing is refused;
Redis keys are deleted, the PostgreSQL schema dropped, the SQLite file removed at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import Table, fmt_ratio, fmt_s

from toolguard.call.facts import CallFacts
from toolguard.controls.pause import PauseBoard
from toolguard.controls.quotas import Quotas, quota_backend
from toolguard.policies import Policy
from toolguard.store import open_store

RULES = Policy.from_dict({"version": 1, "tools": {
    "one": {"locks": ["acct:{id}"], "quotas": [{"calls": 10**9, "window": "1d", "per": "agent"}]},
    "three": {"locks": ["acct:{id}"], "quotas": [
        {"calls": 10**9, "window": "1d", "per": "agent"},
        {"in_flight": 10**6, "per": "key"},
        {"budget": 10**12, "arg": "amount", "window": "1d", "per": "key"}]},
}})


def facts(tool: str, index: int) -> CallFacts:
    return CallFacts(tool=tool, agent="bench", args={"id": index % 50, "amount": 3},
                     idempotency_key=uuid.uuid4().hex, args_hash="h", attempt=uuid.uuid4().hex,
                     policy_digest=RULES.digest, keys=(f"acct:~i{index % 50}",))


def per_call(fn: Callable[[int], object], calls: int) -> float:
    started = time.perf_counter()
    for index in range(calls):
        fn(index)
    return (time.perf_counter() - started) / calls


def measure(rows: dict[str, Callable[[int], object]], rounds: int, calls: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for fn in rows.values():  # warm up: scripts loaded, pools filled
        per_call(fn, 20)
    for _ in range(rounds):
        for name, fn in rows.items():
            samples[name].append(per_call(fn, calls))
    return {name: statistics.median(values) for name, values in samples.items()}


def backend_rows(kind: str, target: object, floor: Callable[[int], object]
                 ) -> dict[str, Callable[[int], object]]:
    quotas = Quotas(quota_backend(target, prefix=f"bench-{uuid.uuid4().hex[:8]}")
                    if isinstance(target, str) else quota_backend(target))
    one, three = RULES.tools["one"], RULES.tools["three"]
    return {
        "floor": floor,
        "admit 1 quota": lambda i: quotas.admit(one, facts("one", i)),
        "admit 3 quotas": lambda i: quotas.admit(three, facts("three", i)),
        "admit+finish 3": lambda i: quotas.admit(three, facts("three", i)).finish(applied=True),
    }


def report(title: str, results: dict[str, float]) -> None:
    table = Table(title, ["step", "per call", "ratio"])
    floor = results["floor"]
    for name, value in results.items():
        table.add_row(name, fmt_s(value), fmt_ratio(value / floor) if name != "floor" else "1.00x")
    table.print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("TOOLGUARD_TEST_REDIS_URL",
                                                              "redis://127.0.0.1:6379/14"))
    parser.add_argument("--postgres-url", default=os.environ.get(
        "TOOLGUARD_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    options = parser.parse_args()

    try:
        import redis

        client = redis.Redis.from_url(options.redis_url)
        client.ping()
        prefix_rows = backend_rows("redis", options.redis_url, lambda i: client.ping())
        report("Redis", measure(prefix_rows, options.rounds, options.calls))
        for key in client.scan_iter(match="{bench-*"):
            client.delete(key)
    except Exception as error:  # a missing server is a finding, not a crash
        print(f"Redis: skipped: {error}")

    schema = f"bench_{uuid.uuid4().hex[:8]}"
    try:
        store = open_store(options.postgres_url, schema=schema, install=True)
        try:
            def select_one(_: int) -> None:
                with store.connection() as conn:
                    conn.execute("SELECT 1").fetchone()

            results = measure(backend_rows("postgresql", store, select_one), options.rounds,
                              options.calls)
            board = PauseBoard(store)
            uncached = PauseBoard(store, cache_s=0)
            results["pause check (1 s cache)"] = measure({"x": lambda i: board.check("one", "a")},
                                                         options.rounds, options.calls)["x"]
            results["pause check (no cache)"] = measure({"x": lambda i: uncached.check("one", "a")},
                                                        options.rounds, options.calls)["x"]
            report("PostgreSQL", results)
            with store.connection() as conn:
                conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        finally:
            store.close()
    except Exception as error:
        print(f"PostgreSQL: skipped: {error}")

    with tempfile.TemporaryDirectory() as folder:
        store = open_store(f"sqlite:///{folder}/store.db", install=True)
        try:
            def empty_transaction(_: int) -> None:
                with store.connection() as conn:
                    conn.execute("BEGIN IMMEDIATE")
                    conn.execute("COMMIT")

            results = measure(backend_rows("sqlite", store, empty_transaction), options.rounds,
                              options.calls)
            board = PauseBoard(store)
            results["pause check (1 s cache)"] = measure({"x": lambda i: board.check("one", "a")},
                                                         options.rounds, options.calls)["x"]
            report("SQLite", results)
        finally:
            store.close()


if __name__ == "__main__":
    main()
