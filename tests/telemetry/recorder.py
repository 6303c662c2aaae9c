"""What toolguard sent to OpenTelemetry in one test: finished spans and metric points.

The SDK's in-memory exporters behind providers of the test's own, handed to
toolguard with ``use_providers`` (the global providers can be set only once per
process, and other tests must not see these).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

__all__ = ["Recorder"]


@dataclass
class Recorder:
    """Spans and metrics; ``tracer`` is the application's own (for a caller's span)."""

    exporter: InMemorySpanExporter = field(default_factory=InMemorySpanExporter)
    reader: InMemoryMetricReader = field(default_factory=InMemoryMetricReader)

    def __post_init__(self) -> None:
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.tracer = self.tracer_provider.get_tracer("the-application")

    # --- spans -------------------------------------------------------------------------

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        """Finished spans in the order they ended; ``name`` filters (a prefix ending in a space
        matches ``execute_tool `` and its tool)."""
        every = list(self.exporter.get_finished_spans())
        if name is None:
            return every
        return [s for s in every if s.name == name or (name.endswith(" ") and
                                                       s.name.startswith(name))]

    def calls(self) -> list[ReadableSpan]:
        """The ``execute_tool`` spans, in the order the calls ended."""
        return [s for s in self.spans() if s.attributes.get("gen_ai.operation.name") ==
                "execute_tool"]

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        """Direct children of ``parent``, in the order they started."""
        found = [s for s in self.spans() if s.parent is not None and
                 s.parent.span_id == parent.context.span_id]
        return sorted(found, key=lambda s: s.start_time or 0)

    def tree(self, root: ReadableSpan) -> list[tuple[int, str]]:
        """``(depth, name)`` of ``root`` and everything below it, depth first, by start time."""
        out = [(0, root.name)]
        for child in self.children(root):
            out.extend((depth + 1, name) for depth, name in self.tree(child))
        return out

    def every_attribute_value(self) -> Iterator[Any]:
        """Every value toolguard recorded: span attributes, event attributes, status texts,
        names, and metric point attributes."""
        for span in self.spans():
            yield span.name
            yield from span.attributes.values()
            yield span.status.description
            for event in span.events:
                yield event.name
                yield from event.attributes.values()
        for point in self.points():
            yield from point[1].values()

    # --- metrics -----------------------------------------------------------------------

    def points(self) -> list[tuple[str, Mapping[str, Any], Any]]:
        """``(metric, attributes, point)`` for every data point toolguard's meter recorded."""
        data = self.reader.get_metrics_data()
        out: list[tuple[str, Mapping[str, Any], Any]] = []
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                if scope.scope.name != "toolguard":
                    continue
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        out.append((metric.name, dict(point.attributes), point))
        return out

    def counts(self, metric: str, *keys: str) -> Counter[tuple[Any, ...]]:
        """A counter's (or a histogram's sample count's) totals by the attributes ``keys``."""
        totals: Counter[tuple[Any, ...]] = Counter()
        for name, attributes, point in self.points():
            if name != metric:
                continue
            value = point.count if isinstance(point, HistogramDataPoint) else point.value
            totals[tuple(attributes.get(k) for k in keys)] += value
        return totals

    def total(self, metric: str) -> int:
        return sum(self.counts(metric).values())
