"""``toolguard pause`` / ``toolguard resume``: the kill switch, for a tool, an agent or everything.

A pause is written to the store at once; running guards see it within their
pause cache (1 s by default) and refuse new calls as ``paused``. Every pause
and resume is audited with who did it (``--by``, default the OS user).
"""

from __future__ import annotations

import getpass
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from toolguard.cli._common import (
    EXIT_FAILED,
    EXIT_USAGE,
    SchemaOption,
    TimeoutOption,
    UrlOption,
    console,
    fail,
    failures,
    open_cli_store,
    redact,
    resolve_store_url,
)
from toolguard.controls.pause import ALL, PauseBoard

__all__ = ["operator_name", "pause", "resume"]

NameArg = Annotated[str | None, typer.Argument(
    metavar="NAME", help="The tool or agent (both, unless --tool or --agent says which).",
    show_default=False)]
ToolFlag = Annotated[bool, typer.Option("--tool", help="NAME is a tool (not an agent).")]
AgentFlag = Annotated[bool, typer.Option("--agent", help="NAME is an agent (not a tool).")]
AllFlag = Annotated[bool, typer.Option("--all", help="Every call, whatever its tool or agent.")]
ByOption = Annotated[str | None, typer.Option(
    "--by", metavar="NAME", help="Who decides, for the audit log. Default: the OS user.",
    show_default=False)]


def operator_name(by: str | None) -> str:
    """``--by``, else the OS user name, else "unknown"."""
    if by:
        return by
    try:
        return getpass.getuser()
    except Exception:  # no user name in this environment (a container without passwd)
        return "unknown"


def _targets(name: str | None, tool: bool, agent: bool, everything: bool) -> list[tuple[str, str]]:
    if everything:
        if name or tool or agent:
            fail("--all stands alone: give either NAME or --all", EXIT_USAGE)
        return [("all", ALL)]
    if name is None:
        return []
    if name == ALL:
        return [("all", ALL)]
    if tool and agent:
        fail("give --tool or --agent, not both (without either, NAME is both)", EXIT_USAGE)
    kinds = ["tool"] if tool else ["agent"] if agent else ["tool", "agent"]
    return [(kind, name) for kind in kinds]


@contextmanager
def _board(url: str | None, schema: str | None, timeout: float) -> Iterator[PauseBoard]:
    resolved = resolve_store_url(url)
    with failures(redact(resolved)):
        store = open_cli_store(resolved, schema, timeout, create=False)
        try:
            yield PauseBoard(store, cache_s=0)
        finally:
            store.close()


def pause(
    name: NameArg = None, tool: ToolFlag = False, agent: AgentFlag = False,
    everything: AllFlag = False,
    reason: Annotated[str | None, typer.Option(
        "--reason", metavar="TEXT", help="Why, for the audit log and the refused calls.",
        show_default=False)] = None,
    by: ByOption = None,
    url: UrlOption = None, schema: SchemaOption = None, timeout: TimeoutOption = 5.0,
) -> None:
    """Refuse new calls of a tool or by an agent (`paused`) until `toolguard resume`.

    Without NAME (and without --all), list what is paused.
    """
    targets = _targets(name, tool, agent, everything)
    out = console()
    with _board(url, schema, timeout) as board:
        if not targets:
            records = board.records()
            if not records:
                out.print("Nothing is paused.")
            for record in records:
                since = record.paused_at.isoformat(timespec="seconds") if record.paused_at else "-"
                out.print(f"{record.describe()} (since {since})", soft_wrap=True, markup=False)
            return
        for kind, target in targets:
            record = board.pause(kind, target, by=operator_name(by), reason=reason)
            out.print(record.describe(), soft_wrap=True, markup=False)
        if not any(board.known(kind, target) for kind, target in targets):
            what = " or ".join(kind for kind, _ in targets)
            console(stderr=True).print(
                f"warning: the audit log has no call of a {what} named {name!r}: check the "
                f"name (a typo stops nothing); the pause is in force", style="yellow",
                soft_wrap=True, markup=False)
    out.print("Running guards refuse new calls within their pause cache (1 s by default).",
              style="dim")


def resume(
    name: NameArg = None, tool: ToolFlag = False, agent: AgentFlag = False,
    everything: AllFlag = False, by: ByOption = None,
    url: UrlOption = None, schema: SchemaOption = None, timeout: TimeoutOption = 5.0,
) -> None:
    """Lift a pause (`--all` lifts the pause of every call, not the others)."""
    targets = _targets(name, tool, agent, everything)
    if not targets:
        fail("name the tool or agent to resume, or give --all", EXIT_USAGE)
    out = console()
    with _board(url, schema, timeout) as board:
        lifted = [(kind, target) for kind, target in targets
                  if board.resume(kind, target, by=operator_name(by))]
    if not lifted:
        fail(f"{name or 'everything'} was not paused", EXIT_FAILED)
    for kind, target in lifted:
        out.print("every call resumed" if kind == "all" else f"{kind} {target!r} resumed",
                  markup=False)
