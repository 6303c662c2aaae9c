"""What each piece of the PostgreSQL store's schema costs a guarded call, measured by removal.

    python benchmarks/guard_costs.py [--redis-url URL] [--database-url URL] [--seconds S]
                                     [--quick] [--plain]

The guarded call of ``benchmarks/guard.py`` (Redis locks, PostgreSQL store, one
read-modify-write of a lead) runs against several copies of the store's schema,
each in a schema of its own, side by side with the expert's hand-written (d2)
(``benchmarks/expert.py``). Every copy but the first has one piece taken away,
so the difference from the full schema is what that piece costs:

* ``full``: the schema as ``toolguard db install`` leaves it.
* ``- intent keys GIN``: the partial GIN index on ``toolguard_intent.keys``
  (status = 'applied'), which ``after:`` ordering rules read; every applied
  call adds its keys to it.
* ``- audit keys GIN``: the GIN index on ``toolguard_audit.keys``, behind
  ``toolguard audit --key``.
* ``- audit btrees``: the four secondary B-tree indexes of the audit log
  (at; tool, at; idempotency_key; intent_id), behind the audit's filters.
* ``- row hash``: the BEFORE INSERT trigger that gives every audit row its
  SHA-256 (the tamper-evident log: ``toolguard audit verify``).
* ``- token publication``: ``toolguard_enter``'s shared advisory lock on the
  caller's token, by which a later holder of the key finds and ends the
  transaction of a paused holder that still holds the fence row.
* ``bare schema``: all of the above taken away together.

Every variant still fences, records the intent and its result and writes the
audit row; the ones without a piece lose what that piece gives (a query that
becomes a scan, or an unverifiable row), so they are never a configuration,
only a measurement. One thread, interleaved rounds (p50 / p99), then 8
threads in interleaved segments (calls/s); each against the full schema and
against (d2).

3. Then the server's side statement by statement, on the full schema: each
   statement of the fenced transaction (toolguard's and the expert's) sent on
   its own, timed from the client, p50 net of a ``SELECT 1`` round trip
   measured in the same loop.

Everything lives in the run's own schemas and key prefix, dropped at the end.
Always exits 0.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import AGENTS, latency, throughput_rounds
from _stats import Table, fmt_rate, fmt_ratio, fmt_s, ratio, summarize
from guard import Setup, guard_parser

#: ``toolguard_enter`` without the shared advisory lock that publishes the caller's token
#: (what lets a later holder end a paused holder's transaction that still holds the row).
_PUBLISH = "PERFORM pg_advisory_xact_lock_shared(toolguard_token_lock(p_tokens[1]));"
_UNPUBLISHED = f"""DO $$
DECLARE definition text := pg_get_functiondef('{{s}}.toolguard_enter'::regproc);
BEGIN
    IF position('{_PUBLISH}' IN definition) = 0 THEN
        RAISE EXCEPTION 'toolguard_enter no longer publishes the token as this script expects';
    END IF;
    EXECUTE replace(definition, '{_PUBLISH}', '');
END $$"""

#: (variant, statements that take its piece away; {s} is the variant's schema).
VARIANTS: list[tuple[str, list[str]]] = [
    ("full", []),
    ("- intent keys GIN", ["DROP INDEX {s}.toolguard_intent_keys"]),
    ("- audit keys GIN", ["DROP INDEX {s}.toolguard_audit_keys"]),
    ("- audit btrees", ["DROP INDEX {s}.toolguard_audit_at", "DROP INDEX {s}.toolguard_audit_tool_at",
                        "DROP INDEX {s}.toolguard_audit_idempotency_key",
                        "DROP INDEX {s}.toolguard_audit_intent_id"]),
    ("- row hash", ["ALTER TABLE {s}.toolguard_audit DISABLE TRIGGER toolguard_audit_row_hash"]),
    ("- token publication", [_UNPUBLISHED]),
]


def strip(database_url: str, schema: str, statements: list[str]) -> None:
    """Run ``statements`` on ``schema`` (its name quoted as an identifier)."""
    name = sql.Identifier(schema).as_string()
    with psycopg.connect(database_url, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement.replace("{s}", name))


def main(argv: list[str] | None = None) -> int:
    parser = guard_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=None,
                        help="length of each measured phase (default 24, --quick 4)")
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (4.0 if args.quick else 24.0)
    variants = [*VARIANTS, ("bare schema", [s for _, each in VARIANTS for s in each])]
    setups: dict[str, Setup] = {}
    try:
        for name, statements in variants:
            # The guarded call uses only the store's pool: the lead pool serves (d2) alone.
            setup = Setup(args.database_url, args.redis_url, uuid.uuid4().hex[:10],
                          pool_size=AGENTS + 1 if not setups else 1, store_size=AGENTS + 1)
            setups[name] = setup
            strip(args.database_url, setup.schema, statements)
    except Exception as error:
        print(f"cannot set up the benchmark (PostgreSQL {args.database_url}, "
              f"Redis {args.redis_url}): {type(error).__name__}: {error}")
        for setup in setups.values():
            setup.close()
        return 0
    try:
        first = next(iter(setups.values()))
        impls: dict[str, Callable[[str], None]] = {"expert (d2)": first.expert.d2}
        impls.update({name: setup.guarded for name, setup in setups.items()})
        print(f"what each piece of the store's schema costs a guarded call (Redis locks, "
              f"PostgreSQL store); python {sys.version.split()[0]}; {seconds:g} s per phase")
        samples = latency(first, impls, seconds, rounds=10 if not args.quick else 4)
        lat = {name: summarize(values) for name, values in samples.items()}
        full, d2 = lat["full"], lat["expert (d2)"]
        table = Table("1. latency per call, one thread (interleaved rounds)",
                      ["variant", "calls", "p50", "p99", "p50 - full", "p50 vs full",
                       "p50 vs (d2)"], plain=args.plain)
        for name, s in lat.items():
            table.add_row(name, f"{s.count:,}", fmt_s(s.p50), fmt_s(s.p99),
                          fmt_s(s.p50 - full.p50) if name != "expert (d2)" else "-",
                          fmt_ratio(ratio(s.p50, full.p50)), fmt_ratio(ratio(s.p50, d2.p50)))
        table.print()
        loads = throughput_rounds(impls, seconds, segments=3 if not args.quick else 1)
        rates = {name: load.calls / load.elapsed for name, load in loads.items()}
        table = Table(f"2. throughput, {AGENTS} threads over the 1,000 leads (interleaved "
                      "segments)", ["variant", "calls", "calls/s", "p50", "calls/s vs full",
                                    "calls/s vs (d2)"], plain=args.plain)
        for name, load in loads.items():
            table.add_row(name, f"{load.calls:,}", fmt_rate(rates[name]),
                          fmt_s(summarize(load.latencies).p50),
                          fmt_ratio(ratio(rates[name], rates["full"])),
                          fmt_ratio(ratio(rates[name], rates["expert (d2)"])))
        table.print()
        check(setups)
        per_statement(args.database_url, first, 300 if args.quick else 1_500, plain=args.plain)
    finally:
        for setup in setups.values():
            with contextlib.suppress(Exception):
                setup.close()
    return 0


def check(setups: dict[str, Setup]) -> None:
    """Every variant kept the call's rows: one applied intent and one audit row per call."""
    for name, setup in setups.items():
        with setup.pool.connection() as conn:
            intents, audits, scores = conn.execute(
                "SELECT (SELECT count(*) FROM toolguard_intent WHERE status = 'applied'), "
                "(SELECT count(*) FROM toolguard_audit WHERE decision = 'accepted'), "
                "(SELECT coalesce(sum(score), 0) FROM lead)").fetchone() or (0, 0, 0)
        expert = setup.expert.calls if name == "full" else 0
        ok = intents == audits and scores == intents + expert
        print(f"check {name}: {intents:,} applied intents, {audits:,} accepted audit rows, "
              f"lead scores sum {scores:,} ({'matches' if ok else 'MISMATCH'})")


def per_statement(database_url: str, setup: Setup, calls: int, *, plain: bool) -> None:
    """Each statement of a fenced transaction on its own, toolguard's and the expert's (the
    same key and token), p50 net of a ``SELECT 1`` round trip timed in the same loop."""
    import expert as x

    from toolguard.store.postgres_sql import ENTER, FINISH

    spent: dict[str, list[float]] = {}
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(setup.schema)))

        def timed(name: str, query: str, params: object = None) -> None:
            started = time.perf_counter()
            conn.execute(query, params)  # type: ignore[call-overload]
            spent.setdefault(name, []).append(time.perf_counter() - started)

        for i in range(calls + 200):  # the first 200: warm-up, and each key's fence row made
            key, token, call = f"probe:{i % 100}", i + 1, uuid.uuid4().hex
            tokens, args = json.dumps({key: token}), json.dumps({"lead_id": key, "delta": 1})
            timed("round trip (SELECT 1)", "SELECT 1")
            timed("BEGIN", "BEGIN")
            timed("toolguard: toolguard_enter (fence + intent row)", ENTER,
                  ("{" + key + "}", "{" + str(token) + "}", call, "add_score", "scorer", "run",
                   "0" * 64, "{" + key + "}"))
            timed("toolguard: toolguard_finish (result + audit row, row-hash trigger)", FINISH,
                  (call, "1", tokens, "scorer", "add_score", call, call, "run", "accepted",
                   "applied", "{" + key + "}", tokens, args, None, 1.5, None, "probe"))
            timed("toolguard: COMMIT", "COMMIT")
            conn.execute("BEGIN")
            timed("expert: ENTER (fence upsert + intent insert)", x.ENTER,
                  {"key": key, "token": token, "id": call})
            timed("expert: FINISH (result + chain link + audit insert)", x.FINISH,
                  {"result": "1", "id": call, "entry": x.entry_text("scorer", "add_score", key,
                                                                    token, args),
                   "key": key, "agent": "scorer", "tool": "add_score", "token": token,
                   "args": args})
            timed("expert: COMMIT", "COMMIT")
    p50 = {name: summarize(values[200:]).p50 for name, values in spent.items()}
    trip = p50["round trip (SELECT 1)"]
    table = Table(f"3. the server's side, one statement at a time ({calls:,} each, full schema)",
                  ["statement", "p50", "net of a round trip"], plain=plain)
    for name, value in p50.items():
        table.add_row(name, fmt_s(value), fmt_s(max(value - trip, 0.0)) if name != "round trip "
                      "(SELECT 1)" else "-")
    table.print()


if __name__ == "__main__":
    raise SystemExit(main())
