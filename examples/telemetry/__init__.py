"""The lead-qualifier demo, traced: toolguard's spans and metrics of one guarded run.

    >>> from examples.telemetry import run
    >>> observed = run(home=Path("/tmp/tg"))
    >>> len(observed.calls()) == len(observed.report.audit)
    True

The demo of ``toolguard demo`` (four LangGraph agents on six leads, a stalled
enricher, a CRM over a faulty network) runs once, guarded, with the
OpenTelemetry SDK behind toolguard: an in-memory span exporter and an
in-memory metric reader (``--console`` also prints every span and the metrics
as the SDK's console exporters write them). ``python -m examples.telemetry``
prints a few calls as a tracing backend would show them (the stalled write the
fence refused, a call an ``after:`` rule held back, a replay...) and the
metrics next to the audit log they must agree with.

Each run uses a fresh folder of its own for the SQLite files (printed with the
report), never the demo's ``./.toolguard``: there, after ``toolguard demo``,
every call would be a replay of the demo's and the scenario would not show.
``--dir DIR`` picks the folder; a folder used before shows replays.

An application sets its providers once, globally (``trace.set_tracer_provider``,
``metrics.set_meter_provider``), and toolguard reports to them; this example
hands its providers to toolguard alone (``toolguard.runtime.telemetry.use_providers``)
so that it can run more than once in one process (its tests do).
"""

from __future__ import annotations

import logging
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    HistogramDataPoint,
    InMemoryMetricReader,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from toolguard.runtime import telemetry

__all__ = ["Observed", "run"]

#: The calls worth a look, by their decision and reason, in the order they are shown.
SHOWN = (("rejected", "stale_fencing_token"), ("rejected", "out_of_order"),
         ("replayed", "duplicate"), ("rejected", "not_authorized"), ("accepted", "applied"))


@dataclass
class Observed:
    """What the run sent to OpenTelemetry, and the demo's own report (with its audit rows)."""

    spans: list[ReadableSpan]
    points: list[tuple[str, dict[str, Any], Any]]
    report: Any = None
    console: list[str] = field(default_factory=list)
    #: The folder of the run's SQLite files (``toolguard audit --url sqlite:///HOME/store.db``).
    home: Path | None = None

    def calls(self) -> list[ReadableSpan]:
        """One ``execute_tool`` span per guarded call, in the order the calls ended."""
        return [s for s in self.spans if s.attributes.get("gen_ai.operation.name") ==
                "execute_tool"]

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        found = [s for s in self.spans if s.parent is not None and
                 s.parent.span_id == parent.context.span_id]
        return sorted(found, key=lambda s: s.start_time or 0)

    def counts(self, metric: str, *keys: str) -> Counter[tuple[Any, ...]]:
        """A counter's totals (a histogram's sample counts) by the attributes ``keys``."""
        totals: Counter[tuple[Any, ...]] = Counter()
        for name, attributes, point in self.points:
            if name == metric:
                value = point.count if isinstance(point, HistogramDataPoint) else point.value
                totals[tuple(attributes.get(k) for k in keys)] += value
        return totals

    def histogram(self, metric: str) -> tuple[int, float, float]:
        """``(count, sum, max)`` of a histogram over all its attribute sets."""
        points = [p for name, _, p in self.points if name == metric]
        return (sum(p.count for p in points), sum(p.sum for p in points),
                max((p.max for p in points), default=0.0))

    def audit_counts(self) -> Counter[tuple[Any, ...]]:
        """The audit rows of the run by tool, agent, decision and reason."""
        return Counter((e.tool, e.agent, e.decision, e.reason) for e in self.report.audit)


def _points(reader: MetricReader | InMemoryMetricReader) -> list[tuple[str, dict[str, Any], Any]]:
    data = reader.get_metrics_data()  # type: ignore[union-attr]
    out = []
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            if scope.scope.name == telemetry.SCOPE:
                for metric in scope.metrics:
                    out.extend((metric.name, dict(p.attributes), p)
                               for p in metric.data.data_points)
    return out


def fresh_home() -> Path:
    """A new folder for one run's SQLite files (the demo's own ``./.toolguard`` would replay)."""
    return Path(tempfile.mkdtemp(prefix="toolguard-telemetry-"))


def run(*, home: Path | None = None, console: bool = False) -> Observed:
    """One guarded run of the demo with in-memory exporters (and console ones with ``console``).

    ``home``: where the SQLite files go; by default a fresh folder (``fresh_home``).
    """
    from toolguard.config import Settings
    from toolguard.demo import run_pipeline

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    readers: list[MetricReader] = [reader]
    written: list[str] = []
    if console:
        tracer_provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(
            out=_Lines(written), formatter=lambda span: span.to_json(indent=None) + "\n")))
        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(out=_Lines(written)),
                                                     export_interval_millis=3_600_000))
    meter_provider = MeterProvider(metric_readers=readers)
    # An application would call trace.set_tracer_provider / metrics.set_meter_provider instead.
    telemetry.use_providers(tracer_provider=tracer_provider, meter_provider=meter_provider)
    try:
        settings = Settings(home=home if home is not None else fresh_home())
        settings.home.mkdir(parents=True, exist_ok=True)
        # The demo runs each lead's graph on a thread pool of its own (no context copied), so
        # every guarded call starts a trace; under a caller's span they would share its trace.
        report = run_pipeline(guarded=True, lock_url=settings.resolved_lock_url(),
                              store_url=settings.resolved_store_url())
        observed = Observed(list(exporter.get_finished_spans()), _points(reader), report, written,
                            settings.home)
        meter_provider.shutdown()  # flushes the console metric exporter
        tracer_provider.shutdown()
        return observed
    finally:
        telemetry.use_providers()


class _Lines:
    """A text stream that keeps what the console exporters write."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def write(self, text: str) -> int:
        self.lines.append(text)
        return len(text)

    def flush(self) -> None:
        return None


# --- printing -----------------------------------------------------------------------------


def _ms(span: ReadableSpan) -> str:
    return f"{((span.end_time or 0) - (span.start_time or 0)) / 1e6:8.2f} ms"


_SHOWN_ATTRIBUTES = ("toolguard.decision", "toolguard.reason", "error.type",
                     "toolguard.keys.count", "toolguard.fencing_tokens", "toolguard.replayed",
                     "toolguard.attempt", "gen_ai.agent.name", "gen_ai.tool.call.id")


def _describe(span: ReadableSpan) -> str:
    parts = []
    for key in _SHOWN_ATTRIBUTES:
        if key in span.attributes:
            value = span.attributes[key]
            shown = list(value) if isinstance(value, tuple) else value
            parts.append(f"{key.removeprefix('toolguard.')}={shown}")
    parts.extend(f"event:{event.name}" for event in span.events)
    return "  ".join(parts)


def print_tree(observed: Observed, root: ReadableSpan, out: TextIO, depth: int = 0) -> None:
    out.write(f"  {'  ' * depth}{root.name:<{44 - 2 * depth}} {_ms(root)}  {_describe(root)}\n")
    for child in observed.children(root):
        print_tree(observed, child, out, depth + 1)


def shown_calls(observed: Observed) -> Iterable[ReadableSpan]:
    """The first call of each interesting kind, and one an ``after:`` rule held back."""
    calls = observed.calls()
    for decision, reason in SHOWN:
        for call in calls:
            attributes = call.attributes
            if (attributes.get("toolguard.decision"), attributes.get("toolguard.reason")) == \
                    (decision, reason):
                yield call
                break
    waited = [c for c in calls if c.attributes.get("toolguard.decision") == "accepted" and
              any(s.name == telemetry.SPAN_ORDER_WAIT for s in observed.children(c))]
    if waited:
        yield max(waited, key=lambda c: (c.end_time or 0) - (c.start_time or 0))


def print_report(observed: Observed, out: TextIO = sys.stdout) -> None:
    calls = observed.calls()
    by_name = Counter(s.name if not s.name.startswith("execute_tool") else "execute_tool *"
                      for s in observed.spans)
    out.write(f"One guarded run of the lead qualifier: {len(calls)} execute_tool spans, "
              f"{len(observed.report.audit)} audit rows.\n")
    if observed.home is not None:
        out.write(f"Its SQLite files: {observed.home}\n")
    out.write("Spans by name: " + ", ".join(f"{n} {c}" for n, c in by_name.most_common()) + "\n\n")
    out.write("A few calls, as a tracing backend shows them:\n")
    for call in shown_calls(observed):
        print_tree(observed, call, out)
        out.write("\n")
    out.write("toolguard.decisions (tool, agent, decision, reason) beside the audit log:\n")
    decided = observed.counts("toolguard.decisions", "gen_ai.tool.name", "gen_ai.agent.name",
                              "toolguard.decision", "toolguard.reason")
    audited = observed.audit_counts()
    for key in sorted(set(decided) | set(audited), key=lambda k: tuple(map(str, k))):
        mark = "" if decided[key] == audited[key] else "   <- differs"
        out.write(f"  {' / '.join(map(str, key)):<62} metric {decided[key]:>3}  "
                  f"audit {audited[key]:>3}{mark}\n")
    out.write("\n")
    for metric in (telemetry.METRIC_LOCK_WAIT, telemetry.METRIC_LOCK_HOLD,
                   telemetry.METRIC_ORDER_WAIT):
        count, total, longest = observed.histogram(metric)
        mean = total / count if count else 0.0
        out.write(f"  {metric:<34} {count:>4} samples, mean {mean * 1e3:8.2f} ms, "
                  f"max {longest * 1e3:8.2f} ms\n")
    for metric in (telemetry.METRIC_STALE_TOKENS, telemetry.METRIC_LEASES_LOST,
                   telemetry.METRIC_REPLAYS, telemetry.METRIC_ORDER_WAITS):
        out.write(f"  {metric:<34} {sum(observed.counts(metric).values()):>4}\n")


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m examples.telemetry",
                                     description="The demo's spans and metrics.")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the SQLite files go (default: a fresh folder per run; "
                             "a folder used before shows replays)")
    parser.add_argument("--console", action="store_true",
                        help="also print every span and the metrics as the SDK's console "
                             "exporters write them (JSON)")
    args = parser.parse_args(argv)
    logger = logging.getLogger("toolguard")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the demo's faults are on purpose: no warnings about them
    try:
        observed = run(home=args.dir, console=args.console)
    finally:
        logger.setLevel(level)
    if args.console:
        sys.stdout.write("".join(observed.console) + "\n")
    print_report(observed)
    agree = observed.counts("toolguard.decisions", "gen_ai.tool.name", "gen_ai.agent.name",
                            "toolguard.decision", "toolguard.reason") == observed.audit_counts()
    return 0 if agree and len(observed.calls()) == len(observed.report.audit) else 1
