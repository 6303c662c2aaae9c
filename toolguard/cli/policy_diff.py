"""``toolguard policy diff OLD NEW``: replay recent audited intents through two policies.

Nothing runs and nothing is written: the intents are read from the audit log
and decided by both policies' pure steps (see ``toolguard.policies.diff``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from toolguard.cli._common import (
    EXIT_FAILED,
    SchemaOption,
    TimeoutOption,
    UrlOption,
    console,
    failures,
    open_cli_store,
    redact,
    resolve_store_url,
)
from toolguard.policies.diff import Change, DiffReport, diff
from toolguard.policies.loader import load_policy

__all__ = ["policy_diff"]

def policy_diff(
    old: Annotated[Path, typer.Argument(
        metavar="OLD", help="The policy in force (a file or a folder of *.yml).", exists=True,
        readable=True, show_default=False)],
    new: Annotated[Path, typer.Argument(
        metavar="NEW", help="The policy to try.", exists=True, readable=True, show_default=False)],
    last: Annotated[int, typer.Option("--last", "-n", min=1, metavar="N",
                                      help="Replay the last N audited intents.")] = 200,
    tool: Annotated[list[str] | None, typer.Option(
        "--tool", "-t", metavar="TOOL", help="Only intents of this tool. Repeatable.",
        show_default=False)] = None,
    check: Annotated[bool, typer.Option(
        "--check", help="Exit 1 if any intent would be decided differently (for CI).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="JSON instead of text.")] = False,
    url: UrlOption = None, schema: SchemaOption = None, timeout: TimeoutOption = 5.0,
) -> None:
    """What NEW would decide differently from OLD on the last N audited intents (no side effects)."""
    resolved = resolve_store_url(url)
    with failures(redact(resolved)):
        before, after = load_policy(old), load_policy(new)
        store = open_cli_store(resolved, schema, timeout, create=False)
        try:
            filters: dict[str, Any] = {"tool": list(tool)} if tool else {}
            entries = store.query_audit(**filters, decision=["accepted", "replayed", "rejected",
                                                             "failed", "unknown", "pending"],
                                        limit=last)
        finally:
            store.close()
    report = diff(before, after, entries)
    if json_out:
        typer.echo(json.dumps(_jsonable(report, before.digest, after.digest), indent=2,
                              ensure_ascii=False))
    else:
        _render(report, before.digest, after.digest, len(entries), redact(resolved))
    if check and report.changes:
        raise typer.Exit(EXIT_FAILED)


def _render(report: DiffReport, old: str, new: str, read: int, where: str) -> None:
    out = console()
    out.print(Text.assemble(
        ("Replayed ", ""), (f"{report.replayed}", "bold"),
        f" of the last {read} audited intents in {where} through OLD ({old[:12]}) and NEW "
        f"({new[:12]}): "), soft_wrap=True)
    out.print(Text.assemble(
        (f"{len(report.changes)} would change", "bold yellow" if report.changes else "green"),
        f", {report.unchanged} unchanged, {len(report.skipped)} could not be replayed."),
        soft_wrap=True)
    if old == new:
        out.print("OLD and NEW are the same policy (same digest).", style="dim")
    for change in report.changes:
        out.print(_line(change), soft_wrap=True)
    if report.skipped:
        reasons: dict[str, int] = {}
        for _, why in report.skipped:
            reasons[why] = reasons.get(why, 0) + 1
        for why, count in sorted(reasons.items(), key=lambda item: -item[1]):
            out.print(f"  not replayed: {count} ({why})", style="dim", soft_wrap=True)
    if report.redacted:
        out.print(Text(
            f"note: {report.redacted} replayed intent{'s have' if report.redacted != 1 else ' has'} "
            f"redacted arguments: they were replayed with the text \"[redacted]\" in place of those "
            f"values, so a decision that depends on them may not be what NEW would decide.",
            style="yellow"), soft_wrap=True)
    out.print(Text("note: the tools' own schemas are not applied, and quotas and ordering are not "
                   "replayed (they depend on what else ran): only which quotas a call would draw "
                   "on is compared.", style="dim"), soft_wrap=True)


def _line(change: Change) -> Text:
    entry = change.entry
    line = Text()
    line.append(f"#{entry.id}", style="bold")
    when = entry.at.strftime("%Y-%m-%d %H:%M:%S") if entry.at else "-"
    line.append(f"  {when}  ", style="dim")
    line.append(entry.agent or "?", style="bold")
    line.append(" → ")
    line.append(entry.tool or "?", style="bold")
    if change.redacted:
        line.append("  (redacted args)", style="yellow")
    for what in change.what:
        line.append(f"\n    {what}")
    return line


def _jsonable(report: DiffReport, old: str, new: str) -> dict[str, Any]:
    def verdict(v: Any) -> dict[str, Any]:
        return {"outcome": v.outcome, "message": v.message, "keys": list(v.keys),
                "approval": v.approval, "mode": v.mode, "quotas": list(v.quotas)}

    return {
        "old": old, "new": new, "replayed": report.replayed, "unchanged": report.unchanged,
        "redacted": report.redacted,
        "changes": [{"id": c.entry.id, "tool": c.entry.tool, "agent": c.entry.agent,
                     "redacted": c.redacted, "what": list(c.what), "old": verdict(c.old),
                     "new": verdict(c.new)} for c in report.changes],
        "skipped": [{"id": e.id, "why": why} for e, why in report.skipped],
    }
