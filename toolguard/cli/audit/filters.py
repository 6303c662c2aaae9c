"""What every ``toolguard audit`` command takes: filters, options, and the store they open.

``AuditFilters`` (merged: a command's own over the group's), the typer options
that fill it, the ``--json``/``--csv`` choice, and opening the store for one
command. Separate so the listing, ``stats`` and the tamper-evidence commands
share one definition of each option.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from toolguard.cli._common import (
    failures,
    open_cli_store,
    parse_moment,
    redact,
    resolve_store_url,
)
from toolguard.store.audit_view import DECISIONS, AuditFilters, _when, visible

if TYPE_CHECKING:
    from toolguard.store import GuardedStore

__all__ = ["AuditFilters"]

# --- filters -----------------------------------------------------------------------------


def _moment(value: str | None, option: str) -> datetime | None:
    if value is None:
        return None
    try:
        return parse_moment(value)
    except ValueError as error:
        raise typer.BadParameter(visible(str(error)), param_hint=option) from None
    except OverflowError:
        raise typer.BadParameter(f"{visible(value)!r} is too far back", param_hint=option) from None


def _decisions(values: list[str] | None, rejected: bool, shadow: bool = False) -> tuple[str, ...]:
    chosen = [v.strip().lower() for v in values or []]
    if "all" in chosen:  # as on the review page: every decision (() filters none)
        return ()
    for value in chosen:
        if value not in DECISIONS:
            msg = f"{value!r} is not a decision; choose from {', '.join(DECISIONS)} (or all)"
            raise typer.BadParameter(msg, param_hint="--decision")
    if rejected and "rejected" not in chosen:
        chosen.append("rejected")
    if shadow and "shadow" not in chosen:
        chosen.append("shadow")
    return tuple(chosen)


def _filters(decision: list[str] | None, rejected: bool, reason: list[str] | None,
             tool: list[str] | None, agent: list[str] | None, key: str | None,
             workflow: str | None, intent: str | None, since: str | None, until: str | None,
             url: str | None, schema: str | None, timeout: float,
             shadow: bool = False) -> AuditFilters:
    start, end = _moment(since, "--since"), _moment(until, "--until")
    if start and end and start >= end:
        raise typer.BadParameter(f"--since ({_when(start)}) is not before --until ({_when(end)})",
                                 param_hint="--since")
    return AuditFilters(decision=_decisions(decision, rejected, shadow), reason=tuple(reason or ()),
                        tool=tuple(tool or ()), agent=tuple(agent or ()), key=key,
                        workflow=workflow, intent=intent, since=start, until=end, url=url,
                        schema=schema, timeout=timeout)


DecisionOpt = Annotated[list[str] | None, typer.Option(
    "--decision", "-d", metavar="DECISION",
    help="Only this decision (accepted, replayed, rejected, failed, unknown). "
                             "Repeatable.", show_default=False)]
RejectedOpt = Annotated[bool, typer.Option(
    "--rejected", help="Everything the guard refused (same as --decision rejected).")]
ShadowOpt = Annotated[bool, typer.Option(
    "--shadow", help="What shadow mode would have refused (same as --decision shadow).")]
ReasonOpt = Annotated[list[str] | None, typer.Option(
    "--reason", "-r", metavar="REASON", help="Only this reason code, e.g. stale_fencing_token. Repeatable.",
    show_default=False)]
ToolOpt = Annotated[list[str] | None, typer.Option(
    "--tool", "-t", metavar="TOOL", help="Only calls of this tool. Repeatable.", show_default=False)]
AgentOpt = Annotated[list[str] | None, typer.Option(
    "--agent", "-a", metavar="AGENT", help="Only calls by this agent. Repeatable.", show_default=False)]
KeyOpt = Annotated[str | None, typer.Option(
    "--key", "-k", metavar="KEY", help="Only entries that locked this resource key, e.g. lead:L-103.",
    show_default=False)]
WorkflowOpt = Annotated[str | None, typer.Option(
    "--workflow", metavar="THREAD",
    help="Only this workflow (LangGraph thread id, else run id).", show_default=False)]
IntentOpt = Annotated[str | None, typer.Option(
    "--intent", metavar="CALL_ID", help="Only this intent (the tool-call id).", show_default=False)]
SinceOpt = Annotated[str | None, typer.Option(
    "--since", metavar="WHEN", help="From this time on: 30m, 2h, 7d (ago), today, or ISO 8601 (UTC unless it "
                    "has an offset).", show_default=False)]
UntilOpt = Annotated[str | None, typer.Option(
    "--until", metavar="WHEN", help="Before this time (same forms as --since).", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="JSON for other tools instead of a table.")]
CsvOpt = Annotated[bool, typer.Option("--csv", help="CSV for spreadsheets instead of a table.")]


def _format(json_out: bool, csv_out: bool) -> Literal["table", "json", "csv"]:
    if json_out and csv_out:
        raise typer.BadParameter("give --json or --csv, not both", param_hint="--json")
    return "json" if json_out else "csv" if csv_out else "table"


def _parent(ctx: typer.Context) -> AuditFilters:
    parent = ctx.parent.obj if ctx.parent is not None else None
    return parent if isinstance(parent, AuditFilters) else AuditFilters()


@contextmanager
def _store(filters: AuditFilters) -> Iterator[GuardedStore]:
    """Open the store for one command; expected failures exit with their code."""
    url = resolve_store_url(filters.url)
    with failures(redact(url)):
        store = open_cli_store(url, filters.schema, filters.timeout, create=False)
        try:
            yield store
        finally:
            store.close()
