"""``toolguard approve ID`` / ``toolguard deny ID``: a person decides a call that waits.

Without ID, ``approve`` lists the requests waiting for a decision. The decision
is recorded in the store and audited with who decided (``--by``, default the OS
user); the call runs when its caller calls again (same intent), as long as the
request has not expired. ``--args`` approves an edit: a JSON object whose
top-level arguments replace the call's (validated again before it runs).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.text import Text

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
from toolguard.cli.pause import ByOption, operator_name
from toolguard.controls.approvals import (
    ApprovalBook,
    ApprovalRecord,
    DecisionName,
    InvalidResume,
    check_edit,
)
from toolguard.errors import ApprovalExpired, UnknownApproval

__all__ = ["approve", "deny"]

IdArg = Annotated[str | None, typer.Argument(
    metavar="ID", help="The request's id (ap_..., from the refusal or `toolguard approve`).",
    show_default=False)]
NoteOption = Annotated[str | None, typer.Option(
    "--note", metavar="TEXT", help="Why, for the audit log (and the model, on a denial).",
    show_default=False)]


@contextmanager
def _book(url: str | None, schema: str | None, timeout: float) -> Iterator[ApprovalBook]:
    resolved = resolve_store_url(url)
    with failures(redact(resolved)):
        store = open_cli_store(resolved, schema, timeout, create=False)
        try:
            yield ApprovalBook(store)
        finally:
            store.close()


def _summary(record: ApprovalRecord) -> Text:
    line = Text()
    line.append(record.id, style="bold")
    line.append(f"  {record.tool}", style="bold")
    line.append(f" by {record.agent or '?'}")
    if record.keys:
        line.append(f"  {' '.join(record.keys)}", style="cyan")
    line.append(f"\n    why: {record.why or '-'}")
    line.append(f"\n    args: {json.dumps(record.args, ensure_ascii=False, sort_keys=True)}")
    left = (record.expires_at - datetime.now(UTC)).total_seconds()
    line.append(f"\n    expires: {record.expires_at.isoformat(timespec='seconds')}"
                f"{' (expired)' if left <= 0 else f' (in {left / 60:.0f} min)'}", style="dim")
    return line


def _decide(book: ApprovalBook, approval_id: str, decision: DecisionName, by: str | None,
            note: str | None, args: dict[str, Any] | None) -> ApprovalRecord:
    try:
        return book.decide(approval_id, decision, by=operator_name(by), note=note, args=args)
    except UnknownApproval as error:
        fail(str(error), EXIT_USAGE if error.reason == "unknown_approval" else EXIT_FAILED)
    except ApprovalExpired as error:
        fail(f"{error}: the caller must make a new call", EXIT_FAILED)


def _edited(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise typer.BadParameter(f"not JSON: {error}", param_hint="--args") from None
    if not isinstance(value, dict) or not value:
        raise typer.BadParameter("a JSON object of the arguments to replace, e.g. "
                                 "'{\"amount\": 900}'", param_hint="--args")
    try:
        check_edit(value)
    except InvalidResume as error:
        raise typer.BadParameter(error.message, param_hint="--args") from None
    return value


def approve(
    approval_id: IdArg = None, by: ByOption = None, note: NoteOption = None,
    args: Annotated[str | None, typer.Option(
        "--args", metavar="JSON", help="Approve an edit: a JSON object of the arguments to replace.",
        show_default=False)] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, metavar="N",
                                       help="Without ID: list at most this many.")] = 50,
    url: UrlOption = None, schema: SchemaOption = None, timeout: TimeoutOption = 5.0,
) -> None:
    """Approve a call that waits for a person (without ID: list the waiting requests)."""
    edited = _edited(args)
    out = console()
    with _book(url, schema, timeout) as book:
        if approval_id is None:
            if edited is not None:
                fail("--args needs the ID of the request it edits", EXIT_USAGE)
            waiting = book.pending(limit)
            if not waiting:
                out.print("No call is waiting for approval.")
            for record in waiting:
                out.print(_summary(record), soft_wrap=True)
            return
        record = _decide(book, approval_id, "edit" if edited else "approve", by, note, edited)
    what = "approved with changes" if edited else "approved"
    out.print(Text.assemble((f"{what} ", "bold green"), _summary(record),
                            f"\n    decided by {record.decided_by}"), soft_wrap=True)
    out.print("The call runs when its caller calls again (the same intent).", style="dim")


def deny(
    approval_id: Annotated[str, typer.Argument(metavar="ID", help="The request's id (ap_...).",
                                               show_default=False)],
    by: ByOption = None, note: NoteOption = None,
    url: UrlOption = None, schema: SchemaOption = None, timeout: TimeoutOption = 5.0,
) -> None:
    """Deny a call that waits for a person: it is refused `approval_denied`."""
    out = console()
    with _book(url, schema, timeout) as book:
        record = _decide(book, approval_id, "reject", by, note, None)
    out.print(Text.assemble(("denied ", "bold red"), _summary(record),
                            f"\n    decided by {record.decided_by}"), soft_wrap=True)
