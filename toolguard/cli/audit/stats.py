"""``toolguard audit stats``: counts by decision and reason, by tool, and per hour or day.

Reads every matching entry a page at a time (bounded memory) and counts; the
counts print as tables, JSON or long-form CSV. Separate from the listing: it
aggregates, it does not show rows.
"""

from __future__ import annotations

import csv
import io
import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from toolguard.cli._common import (
    SchemaOption,
    TimeoutOption,
    UrlOption,
    console,
    redact,
    resolve_store_url,
)
from toolguard.cli.audit.filters import (
    AgentOpt,
    AuditFilters,
    CsvOpt,
    DecisionOpt,
    IntentOpt,
    JsonOpt,
    KeyOpt,
    ReasonOpt,
    RejectedOpt,
    SinceOpt,
    ToolOpt,
    UntilOpt,
    WorkflowOpt,
    _filters,
    _format,
    _parent,
    _store,
)
from toolguard.store.audit_view import DECISION_STYLE, DECISIONS, REASONS, _when, visible

if TYPE_CHECKING:
    from toolguard.store import AuditEntry, GuardedStore

__all__ = ["stats_command"]

PAGE = 2000


def stats_command(
    ctx: typer.Context,
    by: Annotated[str | None, typer.Option(
        "--by", metavar="hour|day", help="Also count per hour or per day (UTC).",
        show_default=False)] = None,
    decision: DecisionOpt = None, rejected: RejectedOpt = False, reason: ReasonOpt = None,
    tool: ToolOpt = None, agent: AgentOpt = None, key: KeyOpt = None,
    workflow: WorkflowOpt = None, intent: IntentOpt = None,
    since: SinceOpt = None, until: UntilOpt = None,
    json_out: JsonOpt = False, csv_out: CsvOpt = False,
    url: UrlOption = None, schema: SchemaOption = None, timeout: TimeoutOption = 5.0,
) -> None:
    """Count entries by decision and reason, and by tool; --by hour|day adds a time series."""
    if by is not None and by not in ("hour", "day"):
        raise typer.BadParameter(f"{by!r}: choose hour or day", param_hint="--by")
    fmt = _format(json_out, csv_out)
    own = _filters(decision, rejected, reason, tool, agent, key, workflow, intent, since, until,
                   url, schema, timeout)
    filters = _parent(ctx).merged(own)
    stats = _Stats(by)
    with _store(filters) as store:
        for entry in _scan(store, filters):
            stats.add(entry)
    if fmt == "json":
        typer.echo(json.dumps(stats.as_dict(), indent=2))
    elif fmt == "csv":
        typer.echo(stats.as_csv(), nl=False)
    else:
        stats.render(filters)


# --- stats ---------------------------------------------------------------------------------


def _scan(store: GuardedStore, filters: AuditFilters) -> Iterator[AuditEntry]:
    """Every matching entry, oldest first, one page at a time (bounded memory)."""
    after: int | None = None
    query = filters.query()
    while True:
        page = store.query_audit(**query, after_id=after, limit=PAGE, newest_first=False)
        yield from page
        if len(page) < PAGE:
            return
        after = page[-1].id


def _bucket(moment: datetime | None, by: str) -> str:
    if moment is None:
        return "-"
    utc = moment.astimezone(UTC)
    start = utc.replace(minute=0, second=0, microsecond=0)
    if by == "day":
        start = start.replace(hour=0)
    return start.isoformat().replace("+00:00", "Z")


class _Stats:
    def __init__(self, by: str | None) -> None:
        self.by = by
        self.total = 0
        self.by_decision: Counter[str] = Counter()
        self.by_reason: Counter[tuple[str, str]] = Counter()
        self.by_tool: dict[str, Counter[str]] = defaultdict(Counter)
        self.buckets: dict[str, Counter[tuple[str, str]]] = defaultdict(Counter)
        #: bucket x tool x decision x reason: the long form for CSV
        self.rows: Counter[tuple[str, str, str, str]] = Counter()
        self.first: datetime | None = None
        self.last: datetime | None = None

    def add(self, entry: AuditEntry) -> None:
        self.total += 1
        bucket = _bucket(entry.at, self.by) if self.by else ""
        self.rows[(bucket, entry.tool or "-", entry.decision, entry.reason)] += 1
        self.by_decision[entry.decision] += 1
        self.by_reason[(entry.decision, entry.reason)] += 1
        self.by_tool[entry.tool or "-"][entry.decision] += 1
        if self.by:
            self.buckets[_bucket(entry.at, self.by)][(entry.decision, entry.reason)] += 1
        if entry.at is not None:
            self.first = entry.at if self.first is None else min(self.first, entry.at)
            self.last = entry.at if self.last is None else max(self.last, entry.at)

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "first": _when(self.first) if self.first else None,
            "last": _when(self.last) if self.last else None,
            "by_decision": dict(self.by_decision),
            "by_reason": [{"decision": d, "reason": r, "count": n}
                          for (d, r), n in self.by_reason.most_common()],
            "by_tool": {tool: dict(counts) for tool, counts in sorted(self.by_tool.items())},
            "buckets": [{"start": start, "total": sum(counts.values()),
                         "by_decision": dict(_sum_by(counts, 0)),
                         "by_reason": dict(_sum_by(counts, 1))}
                        for start, counts in sorted(self.buckets.items())] if self.by else None,
        }

    def as_csv(self) -> str:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(("bucket", "tool", "decision", "reason", "count"))
        for (bucket, tool, decision, reason), count in sorted(self.rows.items()):
            writer.writerow((bucket, tool, decision, reason, count))
        return buffer.getvalue()

    def render(self, filters: AuditFilters) -> None:
        out = console()
        where = redact(resolve_store_url(filters.url))
        what = filters.describe()
        if not self.total:
            out.print(Text(visible(f"No audit entries in {where}"
                                   f"{f' matching {what}' if what else ''}.")))
            return
        span = f", {_when(self.first, short=True)} .. {_when(self.last, short=True)} UTC" \
            if self.first and self.last else ""
        out.print(Text.assemble((f"{self.total} audit entries", "bold"),
                                visible(f" in {where}{', ' + what if what else ''}{span}")))
        decisions = Table(title="By decision and reason", title_justify="left", show_edge=False,
                          header_style="bold")
        decisions.add_column("DECISION")
        decisions.add_column("REASON")
        decisions.add_column("COUNT", justify="right")
        decisions.add_column("MEANING", style="dim", overflow="fold")
        for (decision, reason), count in sorted(self.by_reason.items(),
                                                key=lambda item: (DECISIONS.index(item[0][0])
                                                                  if item[0][0] in DECISIONS else 9,
                                                                  -item[1])):
            decisions.add_row(Text(visible(decision), style=DECISION_STYLE.get(decision, "")),
                              Text(visible(reason)), str(count), REASONS.get(reason, ""))
        out.print(decisions)
        tools = Table(title="By tool", title_justify="left", show_edge=False, header_style="bold")
        tools.add_column("TOOL")
        present = [d for d in DECISIONS if self.by_decision.get(d)]
        for decision in present:
            tools.add_column(decision.upper(), justify="right")
        tools.add_column("TOTAL", justify="right")
        for tool, counts in sorted(self.by_tool.items(), key=lambda item: -sum(item[1].values())):
            tools.add_row(Text(visible(tool)), *(str(counts.get(d, 0)) for d in present),
                          str(sum(counts.values())))
        out.print(tools)
        if self.by:
            series = Table(title=f"Per {self.by} (UTC)", title_justify="left", show_edge=False,
                           header_style="bold")
            series.add_column(self.by.upper())
            for decision in present:
                series.add_column(decision.upper(), justify="right")
            series.add_column("TOP REFUSAL REASONS", overflow="fold")
            for start, pairs in sorted(self.buckets.items()):
                per_decision = _sum_by(pairs, 0)
                refused = Counter({r: n for (d, r), n in pairs.items() if d == "rejected"})
                top = ", ".join(f"{r} {n}" for r, n in refused.most_common(3))
                series.add_row(start.replace("T", " ").replace(":00:00Z", ":00"),
                               *(str(per_decision.get(d, 0)) for d in present),
                               Text(visible(top) or "-"))
            out.print(series)


def _sum_by(counts: Counter[tuple[str, str]], index: int) -> Counter[str]:
    out: Counter[str] = Counter()
    for key, count in counts.items():
        out[key[index]] += count
    return out
