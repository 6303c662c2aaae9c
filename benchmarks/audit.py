"""What the tamper-evident audit log costs a guarded call: 8 agents, row hash and sealing.

    python benchmarks/audit.py [--threads N] [--seconds S] [--rounds R] [--quick] [--plain]
                               [--redis-url URL] [--database-url URL]

The workload is ``benchmarks/guard.py``'s (one ``UPDATE`` on one of 1,000 leads
in a ``@guarded`` tool, a Redis lock, the fenced PostgreSQL transaction with
its audit row) run by ``--threads`` threads (default 8), plus a refused call
(an agent the policy does not allow: the guard writes its audit row in a
statement of its own, so the row's cost is a larger share of the call).

Variants, interleaved in rounds (each round starting with another variant) so
that slow drifts of a shared machine, and the growing table, hit them alike:

* ``hash off``: the row-hash trigger disabled (``ALTER TABLE toolguard_audit
  DISABLE TRIGGER toolguard_audit_row_hash``) and no sealing: the audit row as
  it was before the log became tamper-evident (the ``policy_version`` column is
  there, NULL);
* ``hash on``: every audit row hashed by the trigger, no sealing;
* ``hash on + autoseal``: the shipped default: the store seals the rows it
  writes every 1,000 rows or 1 s (``toolguard.store.autoseal``);
* ``hash on + sealer``: row hashes, no autoseal, while a thread seals the log
  every ``--seal-every`` seconds (``store.seal_audit()``), as a cron job would.

Calls per second and p50/p99 per variant, the ratio to ``hash off``, and the
median over the rounds of each round's own ratio (robust to a noisy round). At the
end the whole log is sealed and verified (``store.verify_audit()``): rows
written by concurrent agents while the sealer ran must verify with no problem.
On a schema without the row hash (before migration 005) only ``hash off``
exists and is measured alone, so the same command gives the "before" figure.

Everything lives in a PostgreSQL schema and Redis key prefix of the run's own,
dropped at the end. Always exits 0: a miss is a finding, not a crash.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Load, run_arguments, throughput
from _stats import Table, fmt_rate, fmt_ratio, fmt_s, ratio, summarize
from guard import Setup, open_setup, server_arguments

TRIGGER = "toolguard_audit_row_hash"


def has_row_hash(setup: Setup) -> bool:
    with setup.pool.connection() as conn:
        row = conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname = %s AND "
                           "tgrelid = 'toolguard_audit'::regclass", (TRIGGER,)).fetchone()
    return bool(row and row[0])


def set_row_hash(setup: Setup, enabled: bool) -> None:
    verb = "ENABLE" if enabled else "DISABLE"
    with setup.pool.connection() as conn:
        conn.execute(f"ALTER TABLE toolguard_audit {verb} TRIGGER {TRIGGER}")


def refused_call(setup: Setup) -> Callable[[str], None]:
    """A call by an agent the policy does not allow: refused, audited in its own statement."""
    from toolguard.adapters import guarded
    from toolguard.call.context import current

    @guarded(setup.guard, agent="intruder", name="add_score")
    def add_score(lead_id: str, delta: int) -> int:
        (score,) = current().tx.execute("SELECT 1").fetchone()
        return int(score)

    calls = iter(range(10**12))

    def call(lead: str) -> None:
        decision = add_score.run({"lead_id": lead, "delta": 1}, call_id=f"no-{next(calls)}",
                                 thread_id=setup.run)
        if decision.ok or decision.reason != "not_authorized":
            msg = f"expected a not_authorized refusal, got {decision.reason}"
            raise RuntimeError(msg)

    return call


class Sealer:
    """A thread that seals the log every ``every`` seconds while a variant runs."""

    def __init__(self, setup: Setup, every: float) -> None:
        self.setup = setup
        self.every = every
        self.stop = threading.Event()
        self.runs = 0
        self.sealed = 0
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sealer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)

    def _loop(self) -> None:
        while True:  # at once, then every ``every`` seconds: a short phase still seals
            try:
                result = self.setup.store.seal_audit()  # type: ignore[attr-defined]
            except BaseException as error:  # reported after the run
                self.errors.append(error)
                return
            self.runs += 1
            self.sealed += result.rows
            if self.stop.wait(self.every):
                return


def set_autoseal(setup: Setup, on: bool) -> None:
    """Swap the store's sealer: the shipped default (``AutoSeal()``) or none."""
    from functools import partial

    from toolguard.store.autoseal import DEFAULT_AUTOSEAL, AutoSealer

    store: Any = setup.store
    store.sealer.close()
    every = DEFAULT_AUTOSEAL if on else None
    store.sealer = AutoSealer(partial(store.seal_audit, wait_s=DEFAULT_AUTOSEAL.wait_s), every)


def run_variant(setup: Setup, name: str, call: Callable[[str], None], seconds: float,
                threads: int, seal_every: float, hashed: bool) -> Load:
    if hashed:  # a schema without the row hash has the one variant, "hash off"
        set_row_hash(setup, name != "hash off")
    set_autoseal(setup, name.endswith("autoseal"))
    if name.endswith("sealer"):
        with Sealer(setup, seal_every) as sealer:
            load = throughput(call, seconds, threads)
        if sealer.errors:
            print(f"  ! the sealer failed: {sealer.errors[0]!r}")
        return load
    return throughput(call, seconds, threads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    server_arguments(parser)
    parser.add_argument("--threads", type=int, default=8, help="agents (threads), default 8")
    parser.add_argument("--seconds", type=float, default=None,
                        help="seconds per variant and workload in all, split over the rounds "
                             "(default 12, --quick 3)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    parser.add_argument("--seal-every", type=float, default=0.5, metavar="S",
                        help="the sealer's period in the `hash on + sealer` variant")
    run_arguments(parser)
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (3.0 if args.quick else 12.0)

    setup = open_setup(args.database_url, args.redis_url)
    if setup is None:
        return 0
    try:
        hashed = has_row_hash(setup)
        variants = (["hash off", "hash on", "hash on + autoseal", "hash on + sealer"] if hashed
                    else ["hash off"])
        print(f"toolguard audit log cost; {args.threads} threads; {seconds:g} s per variant in "
              f"{args.rounds} interleaved rounds; python {sys.version.split()[0]}"
              + ("" if hashed else "; this schema has no row hash (before migration 005)"))
        workloads: dict[str, Callable[[str], None]] = {"guarded call": setup.guarded,
                                                      "refused call": refused_call(setup)}
        for call in workloads.values():  # warm-up: pools, scripts, caches
            for lead in range(30):
                call(f"lead-{lead}")
        loads: dict[tuple[str, str], list[Load]] = {}
        per_phase = seconds / args.rounds
        for index in range(args.rounds):
            # Each round starts with another variant, so that neither the order nor the
            # table's growth favours one of them.
            order = variants[index % len(variants):] + variants[:index % len(variants)]
            for workload, call in workloads.items():
                for variant in order:
                    load = run_variant(setup, variant, call, per_phase, args.threads,
                                       args.seal_every, hashed)
                    loads.setdefault((workload, variant), []).append(load)
        if hashed:
            set_row_hash(setup, True)
        for workload in workloads:
            table = Table(f"{workload}, {args.threads} threads", [
                "variant", "calls", "calls/s", "p50", "p99", "calls/s vs hash off",
                "median of rounds"], plain=args.plain,
                caption="median of rounds: the calls/s ratio to `hash off` in each round "
                        "(the same round's phases), its median over the rounds")
            base_rate = float("nan")
            base_rounds = [p.calls / p.elapsed for p in loads[(workload, "hash off")]]
            for variant in variants:
                parts = loads[(workload, variant)]
                calls = sum(p.calls for p in parts)
                elapsed = sum(p.elapsed for p in parts)
                s = summarize([x for p in parts for x in p.latencies])
                rate = calls / elapsed
                if variant == "hash off":
                    base_rate = rate
                per_round = sorted(ratio(p.calls / p.elapsed, b)
                                   for p, b in zip(parts, base_rounds, strict=True))
                table.add_row(variant, f"{calls:,}", fmt_rate(rate), fmt_s(s.p50), fmt_s(s.p99),
                              fmt_ratio(ratio(rate, base_rate)),
                              fmt_ratio(per_round[len(per_round) // 2]))
            table.print()
        if hashed:
            check(setup)
    finally:
        setup.close()
    return 0


def check(setup: Setup) -> None:
    """Seal what is left, then verify the whole log: concurrent writers left no false alarm."""
    store: Any = setup.store
    started = time.perf_counter()
    store.seal_audit()
    sealed_in = time.perf_counter() - started
    started = time.perf_counter()
    report = store.verify_audit()
    verified_in = time.perf_counter() - started
    # Rows written while the trigger was disabled have no row hash of their own: the seal
    # covers them, so they verify; they are counted, not reported.
    print(f"verify: {report.rows:,} rows in {report.seals} seals, "
          f"{'no problem' if report.ok else f'{len(report.problems)} PROBLEM(S)'} "
          f"(seal {fmt_s(sealed_in)}, verify {fmt_s(verified_in)}); "
          f"{report.unhashed:,} rows written with the row hash off")
    for problem in report.problems[:10]:
        print(f"  ! {problem}")


if __name__ == "__main__":
    raise SystemExit(main())
