"""``toolguard audit``: what the agents did, and what they tried that the guard refused.

``toolguard audit --rejected`` answers "what did the agents try that we refused,
and why" in one command; ``list`` filters, ``show ID`` prints one entry in full,
``stats`` counts by reason and tool (optionally per hour or day). ``--json`` and
``--csv`` give the same rows to other tools.

The log is tamper-evident: ``seal`` links the rows written so far into a chain
of seals, ``verify`` reports any row changed, deleted or inserted (and any seal
changed) by id, and prints the latest seal's hash to keep elsewhere
(``verify --anchor HASH`` then also catches a rewrite of the whole chain);
``export --before WHEN --out FILE [--drop]`` moves old sealed ranges to a file
that verifies on its own (``check-export FILE``).
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.table import Table
from rich.text import Text

from toolguard.cli._common import (
    EXIT_CODES_HELP,
    EXIT_FAILED,
    EXIT_USAGE,
    SchemaOption,
    TimeoutOption,
    UrlOption,
    console,
    fail,
    failures,
    open_cli_store,
    parse_moment,
    redact,
    resolve_store_url,
)

if TYPE_CHECKING:
    from toolguard.store import AuditEntry, AuditVerification, ExportCheck, GuardedStore

__all__ = ["AuditFilters", "audit_app", "visible"]

#: What a stored value must not send to a terminal (or a page) as it is: control characters
#: (escape sequences, C1 controls), bidi overrides and isolates, lone surrogates.
_HIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
                     "\ud800-\udfff]")
_HIDDEN_INLINE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f"
                            "\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str, *, lines: bool = False) -> str:
    """``text`` with every control character, bidi control and lone surrogate written as a
    visible escape (``\\x1b``, ``\\u202e``); ``lines=True`` keeps newlines and tabs."""
    return (_HIDDEN_INLINE if lines else _HIDDEN).sub(_escape_char, text)

DECISIONS = ("accepted", "replayed", "rejected", "failed", "unknown", "pending", "shadow",
             "operator")
DECISION_STYLE = {"accepted": "green", "replayed": "cyan", "rejected": "bold red",
                  "failed": "red", "unknown": "yellow", "pending": "magenta", "shadow": "blue",
                  "operator": "bold"}
#: One line per reason code, for people reading a refusal.
REASONS = {
    "statement_timeout": "PostgreSQL's statement_timeout ended a statement; nothing was committed, "
                         "a retry may run it",
    "query_canceled": "the statement was cancelled (pg_cancel_backend); nothing was committed",
    "deadlock": "PostgreSQL broke a deadlock by ending this transaction; nothing was committed",
    "serialization_failure": "the transaction could not be serialized; nothing was committed",
    "lock_not_available": "a lock was not granted within the session's lock_timeout; nothing was "
                          "committed",
    "applied": "the intent ran and its write committed",
    "duplicate": "already applied under this idempotency key: the recorded result was returned",
    "stale_fencing_token": "a newer lock holder had written: a stalled holder's late write was refused",
    "out_of_order": "an `after:` tool had not applied on this resource yet",
    "not_authorized": "this agent may not call this tool",
    "unknown_tool": "the tool is not in the policy (denied by default)",
    "invalid_arguments": "the arguments broke the tool's schema or a policy constraint",
    "lock_timeout": "the lock stayed busy past the wait timeout",
    "lease_lost": "the lease expired or was taken while the tool ran",
    "not_owned": "the lock server says another holder owns the lock",
    "idempotency_conflict": "the same idempotency key came with other arguments",
    "missing_idempotency_key": "an unfenced tool needs a stable idempotency key",
    "backend_unavailable": "the lock server or store could not be reached",
    "interrupted": "a LangGraph interrupt paused the call; resuming re-runs it",
    "cancelled": "the call was cancelled mid-flight; its outcome is reconciled on the next attempt",
    "tool_error": "the tool reported an error; its transaction was rolled back",
    "error": "the tool raised; its transaction was rolled back",
    "paused": "an operator paused this tool or agent (`toolguard pause`)",
    "resumed": "an operator lifted a pause (`toolguard resume`)",
    "rate_limited": "more calls in the window than the quota allows",
    "in_flight_limited": "as many calls as the quota allows were running already",
    "budget_exceeded": "the call would take the window's sum over the quota's budget",
    "approval_required": "the call waits for a person (`toolguard approve ID`)",
    "approval_denied": "a person denied the call",
    "approval_expired": "the approval (or its request) expired",
    "approval_mismatch": "the approval was given for other arguments, another call or policy",
    "invalid_resume": "the graph was resumed with a value that is not a decision on this call",
    "approved": "a person approved a call",
    "edited": "a person approved a call with changed arguments",
    "denied": "a person denied a call",
}
CSV_COLUMNS = ("id", "at", "decision", "reason", "agent", "tool", "keys", "intent_id",
               "idempotency_key", "workflow", "tokens", "args", "detail", "duration_ms",
               "node_attempt", "policy_version")
PAGE = 2000

audit_app = typer.Typer(
    name="audit",
    help="Review the audit log: every decision the guard took, accepted or refused.\n\n"
         "With no command it lists the newest entries: `toolguard audit --rejected` shows what "
         "the agents tried that was refused, and why. Filters given before a command apply to "
         "it (`toolguard audit --tool set_tier stats`). Times are UTC.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=False, invoke_without_command=True, pretty_exceptions_enable=False)


# --- filters -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AuditFilters:
    """The filters every audit command understands (merged: command over group)."""

    decision: tuple[str, ...] = ()
    reason: tuple[str, ...] = ()
    tool: tuple[str, ...] = ()
    agent: tuple[str, ...] = ()
    key: str | None = None
    workflow: str | None = None
    intent: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    url: str | None = None
    schema: str | None = None
    timeout: float = 5.0

    def merged(self, other: AuditFilters) -> AuditFilters:
        """``other``'s values where it has one, else ours."""
        values = {}
        for name in AuditFilters.__dataclass_fields__:
            mine, theirs = getattr(self, name), getattr(other, name)
            default = AuditFilters.__dataclass_fields__[name].default
            values[name] = theirs if theirs not in (None, (), default) else mine
        return AuditFilters(**values)

    def query(self) -> dict[str, Any]:
        """Keyword arguments for ``store.query_audit``."""
        out: dict[str, Any] = {}
        for name in ("decision", "reason", "tool", "agent"):
            if getattr(self, name):
                out[name] = list(getattr(self, name))
        for name, arg in (("key", "key"), ("workflow", "workflow"), ("intent", "intent_id"),
                          ("since", "since"), ("until", "until")):
            if getattr(self, name) is not None:
                out[arg] = getattr(self, name)
        return out

    def describe(self) -> str:
        parts = []
        for name in ("decision", "reason", "tool", "agent"):
            if getattr(self, name):
                parts.append(f"{name} {'|'.join(getattr(self, name))}")
        for name in ("key", "workflow", "intent"):
            if getattr(self, name):
                parts.append(f"{name} {getattr(self, name)}")
        if self.since:
            parts.append(f"since {_when(self.since)}")
        if self.until:
            parts.append(f"until {_when(self.until)}")
        return ", ".join(parts)


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


LimitOpt = Annotated[int, typer.Option("--limit", "-n", min=0, metavar="N",
                                       help="Show at most this many (0: all).")]
OldestFirstOpt = Annotated[bool, typer.Option("--oldest-first", help="Oldest entries first.")]


# --- commands ------------------------------------------------------------------------------


@audit_app.callback()
def audit(
    ctx: typer.Context,
    decision: DecisionOpt = None, rejected: RejectedOpt = False, reason: ReasonOpt = None,
    tool: ToolOpt = None, agent: AgentOpt = None, key: KeyOpt = None,
    workflow: WorkflowOpt = None, intent: IntentOpt = None,
    since: SinceOpt = None, until: UntilOpt = None,
    limit: LimitOpt = 50, oldest_first: OldestFirstOpt = False,
    json_out: JsonOpt = False, csv_out: CsvOpt = False,
    url: UrlOption = None, schema: SchemaOption = None, timeout: TimeoutOption = 5.0,
    shadow: ShadowOpt = False,
) -> None:
    """Review the audit log (with no command: list the newest entries)."""
    filters = _filters(decision, rejected, reason, tool, agent, key, workflow, intent, since, until,
                       url, schema, timeout, shadow)
    ctx.obj = filters
    if ctx.invoked_subcommand is None:
        _list(filters, limit=limit, oldest_first=oldest_first, fmt=_format(json_out, csv_out))


@audit_app.command("list")
def list_command(
    ctx: typer.Context,
    decision: DecisionOpt = None, rejected: RejectedOpt = False, reason: ReasonOpt = None,
    tool: ToolOpt = None, agent: AgentOpt = None, key: KeyOpt = None,
    workflow: WorkflowOpt = None, intent: IntentOpt = None,
    since: SinceOpt = None, until: UntilOpt = None,
    limit: LimitOpt = 50, oldest_first: OldestFirstOpt = False,
    json_out: JsonOpt = False, csv_out: CsvOpt = False,
    url: UrlOption = None, schema: SchemaOption = None, timeout: TimeoutOption = 5.0,
    shadow: ShadowOpt = False,
) -> None:
    """List audit entries, newest first, filtered (--rejected: what was refused, and why)."""
    own = _filters(decision, rejected, reason, tool, agent, key, workflow, intent, since, until,
                   url, schema, timeout, shadow)
    _list(_parent(ctx).merged(own), limit=limit, oldest_first=oldest_first,
          fmt=_format(json_out, csv_out))


@audit_app.command("show")
def show_command(
    ctx: typer.Context,
    entry_text: Annotated[str, typer.Argument(
        metavar="ID", help="The entry's id (the first column of `toolguard audit`, e.g. 27 or #27).",
        show_default=False)],
    policy: Annotated[list[Path] | None, typer.Option(
        "--policy", metavar="FILE", exists=True, readable=True,
        help="Compare the rule that decided with this policy file or folder (repeatable).",
        show_default=False)] = None,
    json_out: JsonOpt = False, csv_out: CsvOpt = False,
    url: UrlOption = None, schema: SchemaOption = None, timeout: TimeoutOption = 5.0,
) -> None:
    """Show one audit entry in full: keys, tokens, redacted arguments, the whole detail, and
    the policy rule of the version that decided (as the store keeps it)."""
    from toolguard.review.rules import PolicySource
    from toolguard.store.policy_versions import read_policy_text

    fmt = _format(json_out, csv_out)
    entry_id = _entry_id(entry_text)
    on_disk: PolicySource | None = None
    if policy:
        with failures("--policy"):
            on_disk = PolicySource(policy)
    filters = _parent(ctx).merged(AuditFilters(url=url, schema=schema, timeout=timeout))
    deciding: PolicySource | None = None
    with _store(filters) as store:
        found = store.query_audit(after_id=entry_id - 1, limit=1, newest_first=False)
        if found and found[0].id == entry_id and found[0].policy_version and fmt == "table":
            from toolguard.errors import ToolGuardError

            try:
                text = read_policy_text(store, found[0].policy_version)
            except ToolGuardError:  # a store without the table (schema before 7)
                text = None
            deciding = PolicySource.stored(text) if text is not None else None
    if not found or found[0].id != entry_id:
        fail(f"no audit entry with id {entry_id} in {redact(resolve_store_url(filters.url))}",
             EXIT_USAGE)
    entry = found[0]
    if fmt == "json":
        typer.echo(json.dumps(_jsonable(entry), indent=2, ensure_ascii=False))
        return
    if fmt == "csv":
        typer.echo(_csv([entry]), nl=False)
        return
    out = console()
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    table.add_row("id", str(entry.id))
    table.add_row("at", _when(entry.at))
    table.add_row("decision", Text(entry.decision, style=DECISION_STYLE.get(entry.decision, "")))
    reason = Text(visible(entry.reason))
    if entry.reason in REASONS:
        reason.append(f"  ({REASONS[entry.reason]})", style="dim")
    table.add_row("reason", reason)
    for name in ("agent", "tool", "intent_id", "idempotency_key", "workflow"):
        table.add_row(name.replace("_", " "), Text(visible(str(getattr(entry, name) or "-"))))
    table.add_row("keys", Text(visible(", ".join(entry.keys)) or "-"))
    table.add_row("tokens", Text(visible(", ".join(f"{k}={v}" for k, v in entry.tokens.items()))
                                 or "-"))
    table.add_row("node attempt", str(entry.node_attempt or "-"))
    table.add_row("policy version", Text(visible(entry.policy_version or "-")))
    table.add_row("duration", f"{entry.duration_ms:.1f} ms" if entry.duration_ms is not None else "-")
    table.add_row("args", Text(visible(json.dumps(entry.args, indent=2, ensure_ascii=False),
                                       lines=True) if entry.args is not None else "-"))
    table.add_row("detail", Text(visible(entry.detail or "-", lines=True)))
    out.print(table)
    _print_rules(out, entry, deciding, on_disk)


def _print_rules(out: Any, entry: AuditEntry, deciding: Any, on_disk: Any) -> None:
    """The rule of the version that decided, and how the policy on disk compares."""
    version = entry.policy_version
    if deciding is not None:
        _print_rule(out, deciding.rule_for(entry),
                    f"policy version {visible(version or '')[:12]}, the one that decided")
    elif version:
        out.print(Text(f"policy rule  the store does not keep version {visible(version)[:12]} "
                       f"(it decided before the store kept versions, or another program wrote "
                       f"the entry)", style="dim"), soft_wrap=True)
    if on_disk is None:
        return
    if deciding is not None and on_disk.digest == deciding.digest:
        out.print(Text(f"on disk      {visible(on_disk.label)}: this same version", style="dim"),
                  soft_wrap=True)
        return
    _print_rule(out, on_disk.rule_for(entry),
                f"on disk: {on_disk.label}, version {on_disk.digest[:12]}"
                + (", another version" if version else ""))


def _print_rule(out: Any, rule: Any, origin: str) -> None:
    if rule is None:
        out.print(Text(f"policy rule  none: the entry names no tool ({visible(origin)})",
                       style="dim"), soft_wrap=True)
        return
    if rule.location is None:
        what = f"{visible(rule.tool)} has no rule in this policy version"
    else:
        where = f" at {visible(str(rule.location))}" if rule.location.file else ""
        what = (f"{rule.field or 'tools.' + rule.tool}{where}" if rule.known else
                f"{visible(rule.tool)} is not in the policy: {rule.field}{where}")
    out.print(Text.assemble(("policy rule  ", "bold"), visible(what), (f"  ({visible(origin)})",
                                                                      "dim")), soft_wrap=True)
    for line in rule.lines:
        mark = ">" if line.marked else " "
        out.print(Text(f"  {mark}{line.number:>5}  {visible(line.text)}",
                       style="bold" if line.marked else ""), soft_wrap=True)


@audit_app.command("stats")
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


# --- list ----------------------------------------------------------------------------------


def _entry_id(text: str) -> int:
    """``27`` or ``#27`` (as the list shows it); anything else is a usage error, said plainly."""
    cleaned = text.strip().removeprefix("#")
    if not cleaned.isascii() or not cleaned.isdigit() or int(cleaned) < 1:
        fail(f"{text!r} is not an audit entry id: give the number in the first column of "
             f"`toolguard audit`, e.g. `toolguard audit show 27`", EXIT_USAGE)
    return int(cleaned)


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


def _list(filters: AuditFilters, *, limit: int, oldest_first: bool,
          fmt: Literal["table", "json", "csv"]) -> None:
    with _store(filters) as store:
        entries = store.query_audit(**filters.query(), limit=limit or None,
                                    newest_first=not oldest_first)
    if fmt == "json":
        typer.echo(json.dumps([_jsonable(e) for e in entries], indent=2, ensure_ascii=False))
        return
    if fmt == "csv":
        typer.echo(_csv(entries), nl=False)
        return
    _render_list(entries, filters, limit=limit, oldest_first=oldest_first)


def _render_list(entries: list[AuditEntry], filters: AuditFilters, *, limit: int,
                 oldest_first: bool) -> None:
    out = console()
    where = redact(resolve_store_url(filters.url))
    refused_only = filters.decision in (("rejected",), ("shadow",))
    what = (replace(filters, decision=()) if refused_only else filters).describe()
    noun = ("audit entr" if not refused_only else
            "shadow refusal" if filters.decision == ("shadow",) else "refused intent")
    plural = ("s" if len(entries) != 1 else "") if refused_only else ("ies" if len(entries) != 1
                                                                      else "y")
    if not entries:
        out.print(Text(f"No {noun}{'s' if refused_only else 'ies'} in {where}"
                       f"{f' matching {what}' if what else ''}."))
        return
    order = "oldest first" if oldest_first else "newest first"
    out.print(Text.assemble((f"{len(entries)} {noun}{plural}", "bold"),
                            visible(f" ({order}{', ' + what if what else ''}) in {where}")))
    out.print()
    id_width = max(len(str(e.id)) for e in entries)
    reason_width = max(len(visible(e.reason)) for e in entries)
    for entry in entries:
        line = Text()
        line.append(f"#{entry.id:<{id_width}}", style="bold")
        line.append(f"  {_when(entry.at, short=True)}  ", style="dim")
        line.append(f"{entry.decision:<8}", style=DECISION_STYLE.get(entry.decision, ""))
        line.append(f"  {visible(entry.reason):<{reason_width}}  ")
        line.append(visible(entry.agent or "?"), style="bold")
        line.append(" → ")
        line.append(visible(entry.tool or "?"), style="bold")
        if entry.keys:
            line.append(visible(f"  {' '.join(entry.keys)}"), style="cyan")
        out.print(line, soft_wrap=True)
        why = _why(entry, width=400)
        if why:
            out.print(Text(" " * (id_width + 3) + visible(why), style="dim"), soft_wrap=True)
    out.print()
    hints = ["`toolguard audit show ID` prints one entry in full"]
    if limit and len(entries) >= limit:
        hints.insert(0, f"showing {limit}; --limit 0 shows all")
    out.print(Text("; ".join(hints) + ".", style="dim"))


def _why(entry: AuditEntry, width: int = 160) -> str:
    text = entry.detail or REASONS.get(entry.reason, "")
    if entry.decision == "accepted" and entry.reason == "applied" and not entry.detail:
        text = ""
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def _when(moment: datetime | None, *, short: bool = False) -> str:
    if moment is None:
        return "-"
    utc = moment.astimezone(UTC)
    if short:
        return utc.strftime("%Y-%m-%d %H:%M:%S")
    return utc.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _jsonable(entry: AuditEntry) -> dict[str, Any]:
    data = entry.as_dict()
    if entry.at is not None:
        data["at"] = _when(entry.at)
    return data


def _csv(entries: list[AuditEntry]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for entry in entries:
        data = _jsonable(entry)
        row = []
        for column in CSV_COLUMNS:
            value = data.get(column)
            if column == "keys":
                value = " ".join(entry.keys)
            elif column in ("tokens", "args"):
                value = "" if value in (None, {}) else json.dumps(value, ensure_ascii=False,
                                                                  sort_keys=True)
            row.append("" if value is None else value)
        writer.writerow(row)
    return buffer.getvalue()


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


# --- tamper evidence: seal, verify, export ------------------------------------------------------

AnchorOpt = Annotated[list[str] | None, typer.Option(
    "--anchor", metavar="HASH",
    help="A seal hash kept outside the store (printed by verify and seal): it must still be in "
         "the chain, which catches a rewrite of the whole log. Repeatable.", show_default=False)]
ExportFileOpt = Annotated[list[str] | None, typer.Option(
    "--export", metavar="FILE",
    help="An export file of a dropped range: checked on its own, and that it is the range the "
         "store's log continues from. Repeatable.", show_default=False)]
WaitOpt = Annotated[float, typer.Option(
    "--wait", min=0.0, metavar="SECONDS",
    help="PostgreSQL: how long to wait for transactions still writing the log before leaving "
         "their range for the next seal.")]
#: Problems listed in the text output (``--json`` lists them all).
SHOWN_PROBLEMS = 200


def _link_opts(url: str | None, schema: str | None, timeout: float,
               ctx: typer.Context) -> AuditFilters:
    return _parent(ctx).merged(AuditFilters(url=url, schema=schema, timeout=timeout))


@audit_app.command("seal")
def seal_command(
    ctx: typer.Context, wait: WaitOpt = 5.0, json_out: JsonOpt = False,
    url: UrlOption = None, schema: SchemaOption = None, timeout: TimeoutOption = 5.0,
) -> None:
    """Seal the rows written since the last seal into the chain; prints the new anchor.

    Writers never wait for it; run it often (cron, a timer): rows not sealed yet are
    protected only by their own hash, which the table's owner could recompute.
    """
    filters = _link_opts(url, schema, timeout, ctx)
    with _store(filters) as store, failures(redact(resolve_store_url(filters.url))):
        result = store.seal_audit(wait_s=wait)
    head = result.head
    if json_out:
        typer.echo(json.dumps({"seals": result.seals, "rows": result.rows,
                               "head": {"seal": head.seq, "last_id": head.last_id,
                                        "hash": head.hash},
                               "deferred": result.deferred}, indent=2))
        return
    out = console()
    if result.rows:
        plural = "s" if result.seals != 1 else ""
        out.print(Text.assemble((f"sealed {result.rows:,} rows in {result.seals} seal{plural}",
                                 "bold"), f": the chain now ends with seal #{head.seq} "
                                          f"(ids up to {head.last_id})"))
    elif head.seq:
        out.print(f"nothing new to seal: the chain ends with seal #{head.seq} "
                  f"(ids up to {head.last_id})")
    else:
        out.print("nothing to seal: the audit log has no rows yet")
    if result.deferred:
        out.print(Text(result.deferred, style="yellow"))
    if head.seq:
        _print_anchor(out, head.hash, head.seq, head.last_id)


def _print_anchor(out: Any, hash_: str, seq: int, last_id: int) -> None:
    out.print(Text.assemble("  anchor  ", (hash_, "cyan"),
                            f"  (seal #{seq}, ids up to {last_id})"), soft_wrap=True)
    out.print(Text("          keep it outside the database: `toolguard audit verify --anchor "
                   "HASH` then also catches a rewrite of the whole chain", style="dim"),
              soft_wrap=True)


@audit_app.command("verify")
def verify_command(
    ctx: typer.Context, anchor: AnchorOpt = None, export: ExportFileOpt = None,
    seal_first: Annotated[bool, typer.Option(
        "--seal", help="Seal the rows not sealed yet first (needs write access).")] = False,
    json_out: JsonOpt = False,
    url: UrlOption = None, schema: SchemaOption = None, timeout: TimeoutOption = 5.0,
) -> None:
    """Check every audit row and seal: any row changed, deleted or inserted, and where.

    Exit 0 when the log verifies, 1 with a list of problems. Read-only unless --seal.
    """
    from toolguard.errors import ConfigurationError
    from toolguard.store.sealing import check_anchors

    try:
        anchors = check_anchors(anchor)
    except ConfigurationError as error:
        raise typer.BadParameter(str(error), param_hint="--anchor") from None
    for path in export or ():
        if not Path(path).is_file():
            raise typer.BadParameter(f"{path}: no such file", param_hint="--export")
    filters = _link_opts(url, schema, timeout, ctx)
    where = redact(resolve_store_url(filters.url))
    shown = where + (f" (schema {filters.schema})" if filters.schema else "")
    with _store(filters) as store, failures(where):
        if seal_first:
            store.seal_audit()
        report = store.verify_audit(anchor=anchors, exports=list(export or ()))
    if json_out:
        typer.echo(json.dumps(report.as_dict(), indent=2))
    else:
        _render_verification(report, shown)
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)


def _render_verification(report: AuditVerification, where: str) -> None:
    out = console()
    count = len(report.problems)
    verdict = Text("OK", style="bold green") if report.ok else Text(
        f"{count} PROBLEM{'S' if count != 1 else ''}", style="bold red")
    out.print(Text.assemble(("audit log ", "bold"), where, ": ", verdict), soft_wrap=True)
    for problem in report.problems[:SHOWN_PROBLEMS]:
        out.print(Text("  " + problem.message, style="red"), soft_wrap=True)
    if count > SHOWN_PROBLEMS:
        out.print(Text(f"  ... and {count - SHOWN_PROBLEMS} more (--json lists them all)",
                       style="red"))
    span = f" (ids {report.first_id}..{report.last_id})" if report.rows else ""
    seals = f"{report.seals} seal{'s' if report.seals != 1 else ''}"
    out.print(f"  rows    {report.rows:,}{span}: {report.sealed_rows:,} sealed in {seals}, "
              f"{report.unsealed:,} not sealed yet"
              + (" (`toolguard audit seal` seals them)" if report.unsealed else ""),
              soft_wrap=True)
    from toolguard.store.autoseal import DEFAULT_AUTOSEAL

    oldest = (f"; the oldest row not sealed yet was written {_when(report.oldest_unsealed)}"
              if report.oldest_unsealed else "")
    out.print(f"  sealing toolguard stores seal the rows they write {DEFAULT_AUTOSEAL.describe()} "
              f"(the default){oldest}", soft_wrap=True)
    start = ("the start of the log" if report.start.seq == 0 else
             f"the exported range's last seal #{report.start.seq} (ids up to "
             f"{report.start.last_id} exported)")
    if report.head.seq > report.start.seq:
        chain = (f"  chain   from {start} to seal #{report.head.seq} (ids up to "
                 f"{report.head.last_id})")
        out.print(chain + (": every link checks" if report.ok else ""), soft_wrap=True)
    if report.unhashed:
        out.print(f"  {report.unhashed:,} rows carry no row hash of their own (written before "
                  f"schema 5, or with the row-hash trigger off): a seal covers them once "
                  f"they are sealed, nothing before",
                  soft_wrap=True)
    for check in report.exports:
        state = "verifies" if check.ok else "does NOT verify"
        out.print(Text(visible(f"  export  {check.path}: seals #{check.start.seq + 1}.."
                               f"#{check.final.seq}, {check.rows:,} rows, {state}")),
                  soft_wrap=True)
    if report.anchors and not any(p.kind == "anchor_missing" for p in report.problems):
        out.print(f"  anchor  {len(report.anchors)} given, found in the chain", soft_wrap=True)
    for note in report.notes:
        out.print(Text("  " + note, style="dim"), soft_wrap=True)
    if report.head.seq and report.ok:
        _print_anchor(out, report.head.hash, report.head.seq, report.head.last_id)


@audit_app.command("export")
def export_command(
    ctx: typer.Context,
    out_path: Annotated[Path, typer.Option(
        "--out", "-o", metavar="FILE", help="The file to write (JSON Lines); never overwritten.",
        show_default=False)],
    before: Annotated[str | None, typer.Option(
        "--before", metavar="WHEN",
        help="Export the whole sealed ranges all of whose rows are older than this: 90d, "
             "2025-01-01, ISO 8601.", show_default=False)] = None,
    through_seal: Annotated[int | None, typer.Option(
        "--through-seal", min=1, metavar="N", help="Export through seal #N instead.",
        show_default=False)] = None,
    drop: Annotated[bool, typer.Option(
        "--drop", help="Then delete the exported rows and seals from the store (PostgreSQL: "
                       "as the tables' owner). What remains still verifies.")] = False,
    json_out: JsonOpt = False,
    url: UrlOption = None, schema: SchemaOption = None, timeout: TimeoutOption = 5.0,
) -> None:
    """Export old sealed ranges to a file that verifies on its own; --drop removes them."""
    if (before is None) == (through_seal is None):
        raise typer.BadParameter("give --before WHEN or --through-seal N (one of them)",
                                 param_hint="--before")
    moment = _moment(before, "--before")
    if out_path.exists():
        raise typer.BadParameter(f"{out_path} exists: an export never overwrites a file",
                                 param_hint="--out")
    from toolguard.errors import StoreError

    filters = _link_opts(url, schema, timeout, ctx)
    where = redact(resolve_store_url(filters.url))
    with _store(filters) as store, failures(where):
        try:
            result = store.export_audit(out_path, before=moment, through_seq=through_seal,
                                        drop=drop)
        except StoreError as error:
            if error.reason in ("nothing_to_export", "export_exists"):
                fail(f"{where}: {error}", EXIT_USAGE)
            if error.reason == "audit_tampered":
                fail(f"{where}: {error}", EXIT_FAILED)
            raise
    if json_out:
        typer.echo(json.dumps({
            "path": result.path, "seals": result.seals, "rows": result.rows,
            "start": {"seal": result.start.seq, "after_id": result.start.last_id,
                      "hash": result.start.hash},
            "final": {"seal": result.final.seq, "last_id": result.final.last_id,
                      "hash": result.final.hash},
            "file_sha256": result.file_sha256, "dropped": result.dropped}, indent=2))
        return
    out = console()
    out.print(Text.assemble((f"exported {result.rows:,} rows in {result.seals} seals", "bold"),
                            f" (seals #{result.start.seq + 1}..#{result.final.seq}, ids "
                            f"{result.start.last_id + 1}..{result.final.last_id}) to "
                            f"{result.path}"), soft_wrap=True)
    out.print(f"  final hash  {result.final.hash}", soft_wrap=True)
    out.print(f"  file sha256 {result.file_sha256}", soft_wrap=True)
    if result.dropped:
        out.print("  dropped from the store: its log now continues from that final hash "
                  "(`toolguard audit verify --export FILE` checks the link)", soft_wrap=True)
    else:
        out.print(Text("  still in the store (--drop removes them)", style="dim"))


@audit_app.command("check-export")
def check_export_command(
    files: Annotated[list[Path], typer.Argument(
        metavar="FILE...", help="Export files written by `toolguard audit export`.",
        show_default=False)],
    json_out: JsonOpt = False,
) -> None:
    """Verify export files on their own (no store needed): every row, seal and link."""
    from toolguard.store import read_export

    checks: list[ExportCheck] = []
    for path in files:
        if not path.is_file():
            raise typer.BadParameter(f"{path}: no such file", param_hint="FILE")
        checks.append(read_export(path))
    if json_out:
        typer.echo(json.dumps([c.as_dict() for c in checks], indent=2))
    else:
        out = console()
        for check in checks:
            state = Text("verifies", style="bold green") if check.ok else Text(
                "does NOT verify", style="bold red")
            out.print(Text.assemble(f"{check.path}: seals #{check.start.seq + 1}.."
                                    f"#{check.final.seq}, {check.rows:,} rows, final hash "
                                    f"{check.final.hash}: ", state), soft_wrap=True)
            for problem in check.problems:
                out.print(Text("  " + problem.message, style="red"), soft_wrap=True)
    if not all(c.ok for c in checks):
        raise typer.Exit(EXIT_FAILED)
