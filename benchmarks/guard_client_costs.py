"""What each piece of a guarded call's client side costs, measured by removal.

    python benchmarks/guard_client_costs.py [--redis-url URL] [--database-url URL]
                                            [--calls N] [--rounds R] [--quick] [--plain]

The guarded call of ``benchmarks/guard.py`` (Redis locks, PostgreSQL store, one
read-modify-write of a lead) runs in one thread while one piece of toolguard's
client-side work at a time is replaced by nothing, in this process only, so the
CPU it saves is what that piece costs. Beside them the expert's hand-written
(d2) (``benchmarks/expert.py``), which has the same fencing, idempotency record
and hash-chained audit row, but no validation, policy, lease upkeep or telemetry.

* ``full``: the guarded call as shipped.
* ``- strict schema``: the tool's pydantic model is built without validation
  (``model_construct``): no type, enum or extra-field check of the arguments.
* ``- input limits``: no size, depth, length and JSON-ness check of the raw arguments.
* ``- envelope``: no check of the call's id, name, agent and workflow texts.
* ``- authorize + constraints``: no ``agents:`` check and no ``args:`` bounds.
* ``- args hash``: a fixed hash, so the same idempotency key with other
  arguments would no longer be refused as a conflict.
* ``- lease upkeep``: leases are not registered with the renewal loop, so a
  long call would lose its lock (and its fence) at the TTL.
* ``- local holds``: no in-process FIFO of a key's holders, so two threads of
  one process would rely on the server alone (which may have forgotten a lease).
* ``- telemetry``: the OpenTelemetry hooks as if the extra were not installed.
* ``all of the above``: every removal at once: what is left is the lock, the
  fenced transaction and the audit row, toolguard's side of what (d2) does.
* ``primitives, no guard``: the same write through toolguard's own primitives
  without ``ToolGuard``: ``locks.acquire`` and ``store.fenced`` with the intent
  (fence, intent row and result, audit row), as a program that checked its own
  input would call them. Beside ``all of the above`` it shows what the guard's
  steps around them cost (policy lookup, decisions, the audit entry, recovery).

Every variant still fences, records the intent and its result and writes the
audit row (the check at the end counts them); the ones without a piece lose what
it guards, so they are never a configuration, only a measurement. Rounds are
interleaved (each round runs every variant for ``--calls`` calls, starting one
variant further on than the round before), after a warm-up of 1,000 calls, and the
figure is the median over rounds of CPU time of the calling thread per call,
with the wall time beside it. Always exits 0.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import lead_of
from _stats import Table, fmt_ratio, fmt_s, ratio
from guard import Setup, guard_parser, open_setup

Removal = Callable[[Setup], contextlib.AbstractContextManager[None]]


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside the block, what it was after it."""
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def _no_schema(setup: Setup) -> contextlib.AbstractContextManager[None]:
    from toolguard.steps import validate

    return _replaced(validate, "validate_args", lambda model, args: model.model_construct(**args))


def _no_limits(setup: Setup) -> contextlib.AbstractContextManager[None]:
    from toolguard.steps import validate

    return _replaced(validate, "check_limits", lambda args, limits: None)


def _no_envelope(setup: Setup) -> contextlib.AbstractContextManager[None]:
    from toolguard.steps import validate

    return _replaced(validate, "envelope_problem", lambda intent: None)


@contextlib.contextmanager
def _no_policy_checks(setup: Setup) -> Iterator[None]:
    from toolguard.steps import validate

    with _replaced(validate, "authorize", lambda rule, agent: None), \
            _replaced(validate, "check_constraints", lambda rule, args: None):
        yield


def _no_args_hash(setup: Setup) -> contextlib.AbstractContextManager[None]:
    from toolguard.steps import validate

    return _replaced(validate, "args_hash", lambda args: "0" * 64)


class _NoHeartbeat:
    def add(self, lease: Any) -> None:
        return None

    def remove(self, lease: Any) -> None:
        return None


def _no_upkeep(setup: Setup) -> contextlib.AbstractContextManager[None]:
    from toolguard.locks import manager

    beat = _NoHeartbeat()
    return _replaced(manager, "heartbeat", lambda: beat)


@contextlib.contextmanager
def _no_holds(setup: Setup) -> Iterator[None]:
    holds = setup.guard.locks._holds  # type: ignore[union-attr]
    with _replaced(holds, "claim", lambda key, owner: True), \
            _replaced(holds, "held", lambda lease: None), \
            _replaced(holds, "free", lambda key, owner: None):
        yield


def _no_telemetry(setup: Setup) -> contextlib.AbstractContextManager[None]:
    from toolguard.runtime import telemetry

    return _replaced(telemetry, "_trace", None)


REMOVALS: dict[str, Removal] = {
    "- strict schema": _no_schema,
    "- input limits": _no_limits,
    "- envelope": _no_envelope,
    "- authorize + constraints": _no_policy_checks,
    "- args hash": _no_args_hash,
    "- lease upkeep": _no_upkeep,
    "- local holds": _no_holds,
    "- telemetry": _no_telemetry,
}


@contextlib.contextmanager
def _all_removed(setup: Setup) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for removal in REMOVALS.values():
            stack.enter_context(removal(setup))
        yield


def primitives(setup: Setup) -> Callable[[str], None]:
    """The guarded call's write through ``locks.acquire`` and ``store.fenced`` alone."""
    from guard import UPDATE

    from toolguard.call.intent import args_hash
    from toolguard.store import IntentRecord

    numbers = itertools.count()

    def call(lead: str) -> None:
        number, key, args = next(numbers), f"lead:{lead}", {"lead_id": lead, "delta": 1}
        intent = IntentRecord(tool="add_score", idempotency_key=f"primitive-{number}",
                              args_hash=args_hash(args), agent="scorer", workflow=setup.run,
                              keys=(key,), intent_id=f"primitive-{number}", args=args)
        with setup.locks.acquire(key) as lease, setup.store.fenced(lease, intent) as tx:
            (score,) = tx.execute(UPDATE, (1, lead)).fetchone()
            tx.result = int(score)

    return call


def _round(call: Callable[[str], None], calls: int, seed: int) -> tuple[float, float]:
    """(CPU, wall) seconds per call over ``calls`` calls on random leads."""
    rng = random.Random(seed)
    leads = [lead_of(rng) for _ in range(calls)]
    wall, cpu = time.perf_counter(), time.thread_time()
    for lead in leads:
        call(lead)
    return (time.thread_time() - cpu) / calls, (time.perf_counter() - wall) / calls


def main(argv: list[str] | None = None) -> int:
    parser = guard_parser(__doc__)
    parser.add_argument("--calls", type=int, default=None,
                        help="calls per variant per round (default 400, --quick 60)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds (default 11, --quick 2; each starts at the next variant)")
    args = parser.parse_args(argv)
    calls = args.calls if args.calls is not None else (60 if args.quick else 400)
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 11)
    warm_up = 200 if args.quick else 1_000
    setup = open_setup(args.database_url, args.redis_url)
    if setup is None:
        return 0
    variants: dict[str, Removal | None] = {"full": None, **REMOVALS,
                                           "all of the above": _all_removed}
    try:
        print(f"what each piece of a guarded call's client side costs (Redis locks, PostgreSQL "
              f"store, one thread); python {sys.version.split()[0]}; {rounds} rounds of "
              f"{calls} calls per variant")
        # Warm-up: every pooled connection has prepared its statements (the pools hand their
        # connections out in turn), the caches are made.
        for number in range(warm_up):
            setup.guarded(f"lead-{number % 1000}")
            setup.expert.d2(f"lead-{number % 1000}")
        impls: dict[str, tuple[Callable[[str], None], Removal | None]] = {
            name: (setup.guarded, removal) for name, removal in variants.items()}
        impls["primitives, no guard"] = (primitives(setup), None)
        impls["expert (d2)"] = (setup.expert.d2, None)
        cpu: dict[str, list[float]] = {name: [] for name in impls}
        wall: dict[str, list[float]] = {name: [] for name in impls}
        order = list(impls)
        for number in range(rounds):
            for name in order[number % len(order):] + order[:number % len(order)]:
                call, removal = impls[name]
                with removal(setup) if removal is not None else contextlib.nullcontext():
                    spent, took = _round(call, calls, number)
                cpu[name].append(spent)
                wall[name].append(took)
        median = {name: statistics.median(values) for name, values in cpu.items()}
        walls = {name: statistics.median(values) for name, values in wall.items()}
        full, d2 = median["full"], median["expert (d2)"]
        table = Table("client CPU per call by removal (median of the rounds)",
                      ["variant", "CPU/call", "saved vs full", "share of full",
                       "CPU vs (d2)", "wall/call", "wall vs (d2)"], plain=args.plain)
        for name, value in median.items():
            saved = full - value
            table.add_row(name, fmt_s(value),
                          fmt_s(saved) if name in variants and name != "full" else "-",
                          f"{100 * saved / full:.1f}%" if name in variants and name != "full"
                          else "-",
                          fmt_ratio(ratio(value, d2)), fmt_s(walls[name]),
                          fmt_ratio(ratio(walls[name], walls["expert (d2)"])))
        table.print()
        summed = sum(full - median[name] for name in REMOVALS)
        print(f"the removals one at a time save {fmt_s(summed)} together; all at once "
              f"{fmt_s(full - median['all of the above'])} (rounds differ by "
              f"{fmt_s(statistics.pstdev(cpu['full']))} for the full call)")
        check(setup, warm_up + (len(variants) + 1) * rounds * calls)
    finally:
        setup.close()
    return 0


def check(setup: Setup, guarded: int) -> None:
    """Every call of every variant (and of the primitives) kept its rows: one applied intent
    and one audit row each."""
    with setup.pool.connection() as conn:
        intents, audits = conn.execute(
            "SELECT (SELECT count(*) FROM toolguard_intent WHERE status = 'applied'), "
            "(SELECT count(*) FROM toolguard_audit WHERE decision = 'accepted')").fetchone() \
            or (0, 0)
    problems = setup.expert.check()
    ok = intents == audits == guarded and not problems
    print(f"check: {intents:,} applied intents and {audits:,} accepted audit rows for "
          f"{guarded:,} guarded calls; the expert's rows {problems if problems else 'check'}"
          f" ({'matches' if ok else 'MISMATCH'})")


if __name__ == "__main__":
    raise SystemExit(main())
