"""What tracing and metrics cost a guarded call: off (no package, no provider) against on (SDK).

    python benchmarks/telemetry.py [--seconds S] [--redis-url URL --database-url URL] [--plain]

One guarded call: ``add_score`` adds 1 to one of 100 leads' scores in its
fenced transaction, with a fresh call id each time (every call runs the whole
pipeline: validation, policy, lock + token, fenced write with the intent row
and the audit row, release). Embedded SQLite by default (a temporary folder);
Redis locks + a PostgreSQL schema of the run's own with both URLs.

The telemetry setups, measured in rounds that rotate through them so slow
drifts of the machine hit all alike, and compared with the first (the ratio):

* package missing: what a guard costs when ``opentelemetry`` cannot be
  imported (toolguard.runtime.telemetry's own "not installed" branch, switched on in
  this process: the very code that runs when the import failed).
* no provider: the API installed, no tracer or meter provider configured.
* SDK, no processor: spans are made and dropped, metrics aggregated.
* SDK, in-memory: spans exported synchronously to the SDK's in-memory exporter
  (cleared between batches), metrics to an in-memory reader.
* SDK, batch + drop: the production shape, a ``BatchSpanProcessor`` in front of
  an exporter that drops everything (an OTLP exporter minus the network).

A second table times the hooks alone (``start_call``, the steps, ``decided``,
``start_fenced``) without any I/O, per call. Bounded by time (about a minute
by default); always exits 0: a miss is a finding, not a crash.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import Table, fmt_ratio, fmt_s, ratio, summarize

LEADS = 100
BATCH = 20
TARGET = 1.05  # "negligible" when off: p50 within 5% of the package-missing guard

Setup = Callable[[], Callable[[], None]]  # activate a mode, return its "between batches" hook


def modes() -> dict[str, Setup]:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SimpleSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from toolguard.runtime import telemetry

    real_trace = telemetry._trace

    class Drop(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    bare_tracer, bare_meter = TracerProvider(), MeterProvider(metric_readers=[InMemoryMetricReader()])
    memory = InMemorySpanExporter()
    memory_tracer = TracerProvider()
    memory_tracer.add_span_processor(SimpleSpanProcessor(memory))
    memory_meter = MeterProvider(metric_readers=[InMemoryMetricReader()])
    batch_tracer = TracerProvider()
    batch_tracer.add_span_processor(BatchSpanProcessor(Drop()))
    batch_meter = MeterProvider(metric_readers=[InMemoryMetricReader()])

    def nothing() -> None:
        return None

    def missing() -> Callable[[], None]:
        telemetry.use_providers()
        telemetry._trace = None  # the branch taken when ``import opentelemetry`` failed
        return nothing

    def provider(tracer: Any, meter: Any, between: Callable[[], None] = nothing) -> Setup:
        def activate() -> Callable[[], None]:
            telemetry._trace = real_trace
            telemetry.use_providers(tracer_provider=tracer, meter_provider=meter)
            return between

        return activate

    def none() -> Callable[[], None]:
        telemetry._trace = real_trace
        telemetry.use_providers()
        return nothing

    return {
        "package missing": missing,
        "no provider": none,
        "SDK, no processor": provider(bare_tracer, bare_meter),
        "SDK, in-memory": provider(memory_tracer, memory_meter, memory.clear),
        "SDK, batch + drop": provider(batch_tracer, batch_meter),
    }


@contextlib.contextmanager
def guarded_call(redis_url: str | None, database_url: str | None) -> Iterator[Callable[[], None]]:
    """A guarded ``add_score`` on the embedded default or on Redis + PostgreSQL."""
    from toolguard.adapters import guarded
    from toolguard.call.context import current
    from toolguard.guard import ToolGuard
    from toolguard.locks import connect
    from toolguard.policies import Policy
    from toolguard.store import open_store
    from toolguard.store.base import qmark

    run = uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory(prefix="tg-telemetry-") as folder:
        if redis_url and database_url:
            schema = f"tg_bench_tel_{run}"
            store = open_store(database_url, install=True, schema=schema)
            locks = connect(redis_url, prefix=f"tgbenchtel:{run}")
            update = "UPDATE lead SET score = score + 1 WHERE id = %s"
        else:
            schema = None
            store = open_store(f"sqlite:///{folder}/store.db", install=True)
            locks = connect(f"sqlite:///{folder}/locks.db")
            update = qmark("UPDATE lead SET score = score + 1 WHERE id = %s")
        with store.connection() as conn:
            conn.execute("CREATE TABLE lead (id TEXT PRIMARY KEY, score BIGINT NOT NULL)")
            for i in range(LEADS):
                conn.execute(qmark("INSERT INTO lead VALUES (%s, 0)") if schema is None else
                             "INSERT INTO lead VALUES (%s, 0)", (f"lead-{i}",))
            conn.commit()
        policy = Policy.from_dict({"version": 1, "tools": {"add_score": {
            "locks": ["lead:{lead_id}"], "agents": ["scorer"]}}})
        guard = ToolGuard(policy, locks=locks, store=store)

        @guarded(guard, agent="scorer")
        def add_score(lead_id: str) -> None:
            current().tx.execute(update, (lead_id,))

        rng = random.Random(7)
        ids = itertools.count()

        def call() -> None:
            decision = add_score.run({"lead_id": f"lead-{rng.randrange(LEADS)}"},
                                     call_id=f"c{next(ids)}", thread_id=run)
            if not decision.ok:
                msg = f"guarded call refused: {decision.reason}: {decision.message}"
                raise RuntimeError(msg)

        try:
            yield call
        finally:
            with contextlib.suppress(Exception):
                locks.close()
            if schema is not None:
                with contextlib.suppress(Exception), store.connection() as conn:
                    conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
                    conn.commit()
            store.close()


def hooks_only() -> Callable[[], None]:
    """Every telemetry hook one fenced guarded call passes through, without the call."""
    from toolguard.call.decision import Decision
    from toolguard.call.intent import Intent
    from toolguard.runtime import telemetry
    from toolguard.store.base import IntentRecord

    intent = Intent(tool="add_score", args={"lead_id": "lead-1"}, call_id="c1", agent="scorer")
    record = IntentRecord(tool="add_score", idempotency_key="k", args_hash="h", keys=("lead:1",))
    decision = Decision(kind="accepted", reason="applied", intent=intent, keys=("lead:1",),
                        tokens={"lead:1": 7})
    tools = {"add_score": None}

    class Lease:
        tokens = {"lead:1": 7}

        def on_lost(self, callback: Any) -> None:
            return None

    lease = Lease()

    def call() -> None:
        with telemetry.start_call(intent, tools) as traced:
            with traced.step(telemetry.SPAN_VALIDATE):
                pass
            traced.prepared(("lead:1",), "k")
            fenced = telemetry.start_fenced(record)
            fenced.acquire(lambda: lease, ("lead:1",), 1)
            with fenced.transaction(lease, 1), traced.step(telemetry.SPAN_TOOL):
                pass
            fenced.released(time.monotonic())
            traced.decided(decision)

    return call


def measure(call: Callable[[], None], setups: dict[str, Setup], seconds: float,
            batch: int) -> dict[str, list[float]]:
    """Rounds of ``batch`` timed calls per setup, the setups' order rotating each round."""
    names = list(setups)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up: caches, instruments, the SDK's first spans
        setups[name]()
        for _ in range(batch):
            call()
    deadline = time.monotonic() + seconds
    for turn in itertools.count():
        if time.monotonic() >= deadline:
            break
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            between = setups[name]()
            for _ in range(batch):
                started = time.perf_counter()
                call()
                samples[name].append(time.perf_counter() - started)
            between()
    setups[names[1]]()  # leave the process with no provider
    return samples


def fmt_us(seconds: float) -> str:
    """Sub-microsecond resolution, for the hooks alone."""
    return f"{seconds * 1e6:.2f} us"


def report(title: str, samples: dict[str, list[float]], plain: bool, *,
           target: float | None, fmt: Callable[[float], str] = fmt_s) -> None:
    baseline = summarize(samples[next(iter(samples))])
    table = Table(title, ["setup", "calls", "p50", "p90", "mean", "p50 ratio", "mean ratio",
                          "added p50"], plain=plain,
                  caption=None if target is None else
                  f"off setups target: p50 ratio <= {target:.2f}x the package-missing guard")
    for name, values in samples.items():
        stats = summarize(values)
        table.add_row(name, stats.count, fmt(stats.p50), fmt(stats.p90), fmt(stats.mean),
                      fmt_ratio(ratio(stats.p50, baseline.p50)),
                      fmt_ratio(ratio(stats.mean, baseline.mean)),
                      fmt(max(0.0, stats.p50 - baseline.p50)))
    table.print()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=45.0,
                        help="time for the guarded-call rounds (the hooks table takes a fifth)")
    parser.add_argument("--redis-url", help="Redis locks (with --database-url)")
    parser.add_argument("--database-url", help="a PostgreSQL store (with --redis-url)")
    parser.add_argument("--batch", type=int, default=BATCH, help="calls per setup per round")
    parser.add_argument("--plain", action="store_true", help="plain-text tables")
    args = parser.parse_args(argv)

    setups = modes()
    backend = "Redis + PostgreSQL" if args.redis_url and args.database_url else "embedded SQLite"
    with guarded_call(args.redis_url, args.database_url) as call:
        samples = measure(call, setups, args.seconds, args.batch)
    report(f"guarded call ({backend}), tracing and metrics off vs on", samples, args.plain,
           target=TARGET)
    hooks = measure(hooks_only(), setups, args.seconds / 5, 500)
    report("the telemetry hooks alone (per call, no I/O)", hooks, args.plain, target=None,
           fmt=fmt_us)
    no_provider = ratio(summarize(samples["no provider"]).p50,
                        summarize(samples["package missing"]).p50)
    print(f"off (no provider) vs package missing, guarded call p50: {fmt_ratio(no_provider)} "
          f"({'PASS' if no_provider <= TARGET else 'MISS'} against {TARGET:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
