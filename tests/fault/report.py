"""The session-wide table of fault scenarios x invariants, printed at the end of the run."""

from __future__ import annotations

from collections.abc import Mapping

from fault.workload import INVARIANTS, Cell

__all__ = ["RESULTS", "record", "table"]

#: scenario -> invariant -> cell, in the order the scenarios ran.
RESULTS: dict[str, dict[str, Cell]] = {}


def record(scenario: str, cells: Mapping[str, Cell]) -> None:
    RESULTS[scenario] = dict(cells)


def table(results: Mapping[str, Mapping[str, Cell]] | None = None, *,
          details: bool = False) -> list[str]:
    """Lines of a plain-text table: one row per scenario, one column per invariant."""
    results = RESULTS if results is None else results
    columns = [*INVARIANTS, *sorted({k for r in results.values() for k in r} - set(INVARIANTS))]
    width = max([len("scenario"), *(len(s) for s in results)])
    sizes = [max(len(c), 4) for c in columns]
    lines = ["  ".join(["scenario".ljust(width), *(c.ljust(n) for c, n in zip(columns, sizes,
                                                                            strict=True))])]
    lines.append("  ".join(["-" * width, *("-" * n for n in sizes)]))
    for scenario, cells in results.items():
        marks = [cells[c].mark if c in cells else "-" for c in columns]
        lines.append("  ".join([scenario.ljust(width),
                                *(m.ljust(n) for m, n in zip(marks, sizes, strict=True))]))
    failed = [(s, c, cell.detail) for s, cells in results.items() for c, cell in cells.items()
              if cell.ok is False or details]
    for scenario, column, detail in failed:
        lines.append(f"{results[scenario][column].mark} {scenario} / {column}: {detail}")
    return lines
