"""Small helpers shared by the benchmark scripts: summaries, fairness, ratios, tables.

Pure functions over plain numbers (seconds, counts), plus one ``Table`` that
prints with rich when it is installed and as aligned plain text otherwise, so
every benchmark reports the same way::

    stats = summarize(latencies_s)
    table = Table("uncontended", ["impl", "ops/s", "p50", "p99"])
    table.add_row("x", fmt_rate(n / elapsed), fmt_s(stats.p50), fmt_s(stats.p99))
    table.print()
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Summary",
    "Table",
    "fmt_count",
    "fmt_rate",
    "fmt_ratio",
    "fmt_s",
    "jain_index",
    "percentile",
    "ratio",
    "summarize",
    "verdict",
]


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, linear interpolation; NaN if empty."""
    if not ordered:
        return math.nan
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * min(max(q, 0.0), 100.0) / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


@dataclass(frozen=True, slots=True)
class Summary:
    """Count, mean and the usual percentiles of one sample (same unit as the input)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


def summarize(values: Iterable[float]) -> Summary:
    """Summary of ``values``; every field but ``count`` is NaN for an empty sample."""
    ordered = sorted(values)
    if not ordered:
        return Summary(0, math.nan, math.nan, math.nan, math.nan, math.nan)
    return Summary(
        count=len(ordered),
        mean=math.fsum(ordered) / len(ordered),
        p50=percentile(ordered, 50),
        p90=percentile(ordered, 90),
        p99=percentile(ordered, 99),
        max=float(ordered[-1]),
    )


def jain_index(counts: Sequence[float]) -> float:
    """Jain's fairness index: 1.0 when all shares are equal, 1/n when one takes everything."""
    if not counts:
        return math.nan
    total = math.fsum(counts)
    squares = math.fsum(c * c for c in counts)
    if squares == 0:
        return math.nan
    return total * total / (len(counts) * squares)


def ratio(value: float, baseline: float) -> float:
    """``value / baseline``, NaN when either is missing or the baseline is zero."""
    if baseline == 0 or math.isnan(baseline) or math.isnan(value):
        return math.nan
    return value / baseline


def verdict(ok: bool | None) -> str:
    """PASS / MISS, or n/a when the figure could not be measured."""
    if ok is None:
        return "n/a"
    return "PASS" if ok else "MISS"


# --- formatting -------------------------------------------------------------------


def fmt_rate(per_s: float) -> str:
    return "-" if math.isnan(per_s) else f"{per_s:,.0f}"


def fmt_count(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.0f}"


def fmt_s(seconds: float) -> str:
    """A duration with a unit chosen for readability (us below 1 ms, else ms, else s)."""
    if math.isnan(seconds):
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


# --- tables -----------------------------------------------------------------------


class Table:
    """Rows of strings printed with rich (if installed) or as aligned plain text."""

    def __init__(self, title: str, columns: Sequence[str], *, plain: bool = False,
                 caption: str | None = None) -> None:
        self.title = title
        self.columns = list(columns)
        self.rows: list[list[str]] = []
        self.sections: set[int] = set()
        self.caption = caption
        self.plain = plain

    def add_row(self, *cells: object) -> None:
        if len(cells) != len(self.columns):
            msg = f"row has {len(cells)} cells, table {self.title!r} has {len(self.columns)} columns"
            raise ValueError(msg)
        self.rows.append([str(cell) for cell in cells])

    def add_section(self) -> None:
        """A separator line before the next row."""
        self.sections.add(len(self.rows))

    def print(self) -> None:
        if not self.plain:
            try:
                self._print_rich()
                return
            except ImportError:
                pass
        print(self.render_plain())

    def render_plain(self) -> str:
        widths = [len(c) for c in self.columns]
        for row in self.rows:
            widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

        def line(cells: Sequence[str]) -> str:
            first, *rest = cells
            parts = [first.ljust(widths[0])]
            parts += [cell.rjust(w) for cell, w in zip(rest, widths[1:], strict=True)]
            return "  ".join(parts).rstrip()

        rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
        out = [self.title, rule, line(self.columns), rule]
        for index, row in enumerate(self.rows):
            if index in self.sections and index:
                out.append(rule)
            out.append(line(row))
        out.append(rule)
        if self.caption:
            out.append(self.caption)
        return "\n".join(out)

    def _print_rich(self) -> None:
        from rich import box
        from rich.console import Console
        from rich.table import Table as RichTable

        table = RichTable(title=self.title, caption=self.caption, box=box.SIMPLE_HEAVY,
                          title_justify="left", caption_justify="left")
        for index, column in enumerate(self.columns):
            table.add_column(column, justify="left" if index == 0 else "right", no_wrap=True)
        for index, row in enumerate(self.rows):
            table.add_row(*row, end_section=(index + 1) in self.sections)
        # Off a terminal rich assumes 80 columns and would fold the table; give it room.
        width = None if sys.stdout.isatty() else max(shutil.get_terminal_size().columns, 200)
        Console(width=width, no_color=bool(os.environ.get("NO_COLOR"))).print(table)
