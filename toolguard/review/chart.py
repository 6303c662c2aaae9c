"""Decisions over time by reason, as the geometry of a stacked bar chart (rendered as SVG).

Pure: entries in, rectangles and labels out; the template only draws them, so
the page needs no script and no charting library. The bucket width adapts to
the time span (a demo run of two seconds and a month of production both get a
readable number of bars).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from toolguard.store import AuditEntry

__all__ = ["PALETTE", "Chart", "Segment", "Series", "Tick", "decisions_chart", "step_for"]

#: Bucket widths in seconds, smallest first; the chart takes the first that fits.
STEPS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
           86400, 172800, 604800, 2592000, 7776000, 31536000)
MAX_BUCKETS = 48
#: Colour classes (``r0`` ... in review.css); reasons past the palette share ``r-other``.
PALETTE = 8
WIDTH, HEIGHT = 960, 240
LEFT, RIGHT, TOP, BOTTOM = 44, 12, 12, 30
MAX_BAR = 44.0
MAX_X_LABELS = 8


@dataclass(frozen=True, slots=True)
class Series:
    """One reason in the legend: its colour class, how often, under which decision."""

    reason: str | None  # None: the reasons past the palette, together
    decision: str
    count: int
    css: str

    @property
    def label(self) -> str:
        return self.reason if self.reason is not None else "other reasons"


@dataclass(frozen=True, slots=True)
class Segment:
    """One rectangle: ``count`` entries of one reason in one bucket ``[since, until)``."""

    x: float
    y: float
    width: float
    height: float
    series: Series
    count: int
    since: str
    until: str
    title: str


@dataclass(frozen=True, slots=True)
class Tick:
    position: float
    label: str


@dataclass(frozen=True, slots=True)
class Chart:
    width: int
    height: int
    segments: tuple[Segment, ...]
    series: tuple[Series, ...]
    x_ticks: tuple[Tick, ...]
    y_ticks: tuple[Tick, ...]
    step_label: str
    total: int
    left: float = LEFT
    right: float = WIDTH - RIGHT
    top: float = TOP
    bottom: float = HEIGHT - BOTTOM


def step_for(start: float, end: float) -> int:
    """The smallest bucket width (seconds) that covers ``[start, end]`` in at most MAX_BUCKETS bars."""
    for step in STEPS_S:
        if math.floor(end / step) - math.floor(start / step) + 1 <= MAX_BUCKETS:
            return step
    return STEPS_S[-1]


def decisions_chart(entries: Iterable[AuditEntry], *, start: datetime | None = None,
                    end: datetime | None = None) -> Chart | None:
    """The chart of ``entries`` between ``start`` and ``end`` (default: the entries' own span).

    None when there is nothing to draw.
    """
    dated = [e for e in entries if e.at is not None]
    if not dated:
        return None
    moments = [e.at.timestamp() for e in dated]  # type: ignore[union-attr]
    first = start.timestamp() if start else min(moments)
    last = end.timestamp() if end else max(moments)
    first, last = min(first, min(moments)), max(last, max(moments))
    step = step_for(first, last)
    base = math.floor(first / step)
    count = math.floor(last / step) - base + 1

    per_reason: Counter[str] = Counter(e.reason for e in dated)
    decision_of: dict[str, Counter[str]] = defaultdict(Counter)
    for entry in dated:
        decision_of[entry.reason][entry.decision] += 1
    ranked = [reason for reason, _ in per_reason.most_common()]
    series: dict[str, Series] = {}
    for index, reason in enumerate(ranked[:PALETTE - 1] if len(ranked) > PALETTE else ranked):
        series[reason] = Series(reason, decision_of[reason].most_common(1)[0][0],
                                per_reason[reason], f"r{index}")
    rest = [reason for reason in ranked if reason not in series]
    other = Series(None, "", sum(per_reason[r] for r in rest), "r-other") if rest else None

    buckets: dict[int, Counter[str]] = defaultdict(Counter)
    for entry, moment in zip(dated, moments, strict=True):
        buckets[math.floor(moment / step) - base][entry.reason] += 1
    peak = max(sum(c.values()) for c in buckets.values())
    tick_step = max(1, _nice(peak / 4))
    top_value = math.ceil(peak / tick_step) * tick_step

    plot_width = WIDTH - RIGHT - LEFT
    plot_height = HEIGHT - BOTTOM - TOP
    slot = plot_width / count
    bar = min(slot * 0.8, MAX_BAR)
    order = [*series.values(), *([other] if other else [])]
    segments: list[Segment] = []
    for index in sorted(buckets):
        bucket_start = (base + index) * step
        since, until = _iso(bucket_start), _iso(bucket_start + step)
        x = LEFT + index * slot + (slot - bar) / 2
        y = float(HEIGHT - BOTTOM)
        for item in order:
            reasons = [item.reason] if item.reason is not None else rest
            n = sum(buckets[index][r] for r in reasons)
            if not n:
                continue
            height = plot_height * n / top_value
            y -= height
            segments.append(Segment(round(x, 2), round(y, 2), round(bar, 2), round(height, 2),
                                    item, n, since, until,
                                    f"{_label(bucket_start, step, full=True)} UTC · {item.label}: {n}"))

    every = max(1, math.ceil(count / MAX_X_LABELS))
    x_ticks = tuple(Tick(round(LEFT + (i + 0.5) * slot, 2), _label((base + i) * step, step))
                    for i in range(0, count, every))
    y_ticks = tuple(Tick(round(HEIGHT - BOTTOM - plot_height * v / top_value, 2), str(v))
                    for v in range(0, top_value + 1, tick_step))
    return Chart(WIDTH, HEIGHT, tuple(segments), tuple(order), x_ticks, y_ticks,
                 _step_text(step), len(dated))


def _nice(value: float) -> int:
    """The smallest 1, 2 or 5 times a power of ten that is at least ``value``."""
    if value <= 1:
        return 1
    power = 10 ** math.floor(math.log10(value))
    for factor in (1, 2, 5, 10):
        if factor * power >= value:
            return int(factor * power)
    return int(10 * power)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _label(seconds: float, step: int, *, full: bool = False) -> str:
    moment = datetime.fromtimestamp(seconds, UTC)
    if step >= 86400:
        return moment.strftime("%Y-%m-%d")
    if full:
        return moment.strftime("%Y-%m-%d %H:%M:%S" if step < 60 else "%Y-%m-%d %H:%M")
    return moment.strftime("%H:%M:%S" if step < 60 else "%m-%d %H:%M")


def _step_text(step: int) -> str:
    for unit, size in (("day", 86400), ("h", 3600), ("min", 60)):
        if step >= size and step % size == 0:
            n = step // size
            return f"{n} {unit}{'s' if unit == 'day' and n > 1 else ''}"
    return f"{timedelta(seconds=step).seconds} s"
