"""Tamper evidence: ``audit seal``, ``audit verify`` and its report, ``export``, ``check-export``.

``seal`` links the rows written so far into the chain of seals; ``verify``
reports any row or seal changed, deleted or inserted, by id, and prints the
anchor to keep elsewhere; ``export`` moves old sealed ranges to a file that
``check-export`` verifies on its own. Separate from the listing: these commands
check and move the log, they do not read it for people.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

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
    redact,
    resolve_store_url,
)
from toolguard.cli.audit.filters import AuditFilters, JsonOpt, _moment, _parent, _store
from toolguard.store.audit_view import _when, visible

if TYPE_CHECKING:
    from toolguard.store import AuditVerification, ExportCheck

__all__ = ["check_export_command", "export_command", "seal_command", "verify_command"]

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
