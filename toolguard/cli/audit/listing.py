"""Reading the log: ``toolguard audit`` (the group), ``audit list`` and ``audit show ID``.

The newest entries as lines (``--rejected``: what was refused, and why), and
one entry in full with the policy rule of the version that decided. Separate
from ``stats`` (counting) and from the tamper-evidence commands (``chain``).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.table import Table
from rich.text import Text

from toolguard.cli._common import (
    EXIT_USAGE,
    SchemaOption,
    TimeoutOption,
    UrlOption,
    console,
    fail,
    failures,
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
    ShadowOpt,
    SinceOpt,
    ToolOpt,
    UntilOpt,
    WorkflowOpt,
    _filters,
    _format,
    _parent,
    _store,
)
from toolguard.store.audit_view import (
    DECISION_STYLE,
    REASONS,
    UNPROVEN_FIELDS,
    _csv,
    _jsonable,
    _when,
    _why,
    arguments,
    unproven,
    visible,
)

if TYPE_CHECKING:
    from toolguard.store import AuditEntry

__all__ = ["audit", "list_command", "show_command"]

LimitOpt = Annotated[int, typer.Option("--limit", "-n", min=0, metavar="N",
                                       help="Show at most this many (0: all).")]
OldestFirstOpt = Annotated[bool, typer.Option("--oldest-first", help="Oldest entries first.")]


# --- commands ------------------------------------------------------------------------------


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
    said = unproven(entry)  # what the request brought that no claim proved
    for name in ("agent", "tool", "intent_id", "idempotency_key", "workflow"):
        table.add_row(name.replace("_", " "), Text(visible(str(getattr(entry, name) or "-"))))
        _add_unproven(table, said, name)
    table.add_row("keys", Text(visible(", ".join(entry.keys)) or "-"))
    table.add_row("tokens", Text(visible(", ".join(f"{k}={v}" for k, v in entry.tokens.items()))
                                 or "-"))
    _add_unproven(table, said, "tokens")
    table.add_row("node attempt", str(entry.node_attempt or "-"))
    table.add_row("policy version", Text(visible(entry.policy_version or "-")))
    table.add_row("duration", f"{entry.duration_ms:.1f} ms" if entry.duration_ms is not None else "-")
    args = arguments(entry)
    table.add_row("args", Text(visible(json.dumps(args, indent=2, ensure_ascii=False),
                                       lines=True) if args is not None else "-"))
    table.add_row("detail", Text(visible(entry.detail or "-", lines=True)))
    out.print(table)
    _print_rules(out, entry, deciding, on_disk)


def _add_unproven(table: Table, said: dict[str, str], name: str) -> None:
    """A row ``NAME (unproven)`` under the column ``name`` when the request said another value."""
    if name in said:
        label = dict(UNPROVEN_FIELDS)[name]
        table.add_row(Text(f"{label} (unproven)", style="yellow"), Text(visible(said[name])))


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



# --- list ----------------------------------------------------------------------------------


def _entry_id(text: str) -> int:
    """``27`` or ``#27`` (as the list shows it); anything else is a usage error, said plainly."""
    cleaned = text.strip().removeprefix("#")
    if not cleaned.isascii() or not cleaned.isdigit() or int(cleaned) < 1:
        fail(f"{text!r} is not an audit entry id: give the number in the first column of "
             f"`toolguard audit`, e.g. `toolguard audit show 27`", EXIT_USAGE)
    return int(cleaned)


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
        claimed = unproven(entry).get("agent")
        if claimed is not None:
            line.append(visible(f" (unproven: {claimed})"), style="yellow")
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

