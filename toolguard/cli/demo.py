"""``toolguard demo``: the lead qualifier, guard off then guard on, side by side."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from toolguard.cli._common import EXIT_FAILED, console, failures, invocation, redact
from toolguard.cli.db import is_postgres_url, probe_postgres
from toolguard.runtime.extras import require

if TYPE_CHECKING:
    from toolguard.demo import CrmReport, DemoEvent, Report
    from toolguard.demo.controls import ControlsReport
    from toolguard.demo.decisions import DecisionsReport

#: The demo's tools that write a lead or the CRM (request_review only asks a person).
WRITE_TOOLS = frozenset({"enrich_lead", "update_intent_score", "verify_email", "set_tier",
                         "push_to_crm"})

__all__ = ["check_policy", "demo", "next_commands", "require_demo"]

MEANING = {
    "stale_fencing_token": "the stalled enricher woke after its lease expired; a newer holder "
                           "had written, so the store refused its write",
    "out_of_order": "the router tried to set a tier before the lead was enriched/scored; it "
                    "retried once they had landed",
    "invalid_arguments": "the scorer sent 80 points; the policy caps a signal at 50 (it re-sent 5)",
    "not_authorized": "the router tried to bump a score: only intent_scorer may",
}

#: What the CRM decided that was not a plain "applied", in words (its own audit log).
CRM_MEANING = {
    "stale_fencing_token": "the enricher's push, stuck in the network, arrived after its retry "
                           "and the router's push: its lease's token was older than the retry's, "
                           "so the CRM refused it",
    "duplicate": "the router's push was applied, but its answer was lost; sent again with the "
                 "same Idempotency-Key, it got the recorded answer and was not applied twice",
}


def demo(
    directory: Annotated[Path | None, typer.Option(
        "--dir", metavar="DIR", file_okay=False, dir_okay=True, writable=True, resolve_path=True,
        help="Where the embedded SQLite files go (default ./.toolguard, like every command), "
             "the demo CRM's crm.db too. Servers are used instead when TOOLGUARD_REDIS_URL / "
             "TOOLGUARD_DATABASE_URL are set (the CRM's store is then the schema "
             "toolguard_demo_crm of that database).",
        show_default=False)] = None,
    policy: Annotated[Path | None, typer.Option(
        "--policy", metavar="FILE", exists=True, dir_okay=False, readable=True,
        help="Run with this policy instead of the demo's own (e.g. an edited copy).",
        show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print both reports as JSON, no "
                                                          "progress.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also show toolguard's log "
                                                                  "messages.")] = False,
) -> None:
    """Run the lead-qualifier demo: four parallel LangGraph agents on six leads, and a CRM.

    First without toolguard (lost updates, a double-applied retry, a tier set before
    scoring, a stalled worker's late write landing; in the CRM, a push applied twice and
    a stuck push landing last), then with it: the records come out right, the
    stalled write is refused by the fence, the CRM itself replays the push sent again and
    refuses the stuck one (409), and every decision is audited, the CRM's in its own
    store. Runs offline on the embedded SQLite default (the CRM on a loopback port);
    running it again replays every intent and changes nothing. Exit 1 if the guarded
    records are not the expected ones.
    """
    from toolguard.config import Settings

    settings = Settings(home=directory) if directory else Settings()
    folder = settings.home.absolute()
    lock_url = settings.resolved_lock_url()
    store_url = settings.resolved_store_url()
    out = console()
    with failures():
        require_demo()
        if policy is not None:
            check_policy(policy)  # a broken file fails here, before either phase runs
    for url in dict.fromkeys((store_url, lock_url)):
        if is_postgres_url(url):
            with failures(redact(url)):
                probe_postgres(url)  # a wrong database, role or sslmode: one line, at once
    with failures(), _quiet_logs(verbose, out):
        folder.mkdir(parents=True, exist_ok=True)
        _probe(lock_url)
        if json_out:
            unguarded, guarded = _run(lock_url, store_url, policy, None)
            controls = _controls(lock_url, store_url)
            decisions = _decisions(lock_url, store_url)
        else:
            out.print(Rule("toolguard demo: the lead qualifier", style="bold"))
            out.print(Text.assemble(
                "Four agents (lead_enricher, intent_scorer, email_verifier, router) work on six "
                "leads in parallel; each tool reads and rewrites the whole lead record, and the "
                "enricher and the router push each lead to a CRM (a REST service the demo "
                "serves on 127.0.0.1, with a store of its own).\n",
                ("locks ", "dim"), redact(lock_url), ("  ·  store ", "dim"), redact(store_url),
                ("  ·  CRM store ", "dim"), _crm_label(store_url)))
            unguarded, guarded = _run(lock_url, store_url, policy, out)
            controls = _controls(lock_url, store_url)
            decisions = _decisions(lock_url, store_url)
    if json_out:
        typer.echo(json.dumps({"ok": guarded.correct, "guard_off": unguarded.as_dict(),
                               "guard_on": guarded.as_dict(), "controls": controls.as_dict(),
                               "decisions": decisions.as_dict()},
                              indent=2, default=str))
    else:
        _summary(out, unguarded, guarded, store_url)
        _controls_summary(out, controls, store_url)
        _decisions_summary(out, decisions)
    if not guarded.correct or not decisions.checked.exact:
        raise typer.Exit(EXIT_FAILED)


def require_demo() -> None:
    """Raise ``MissingExtra`` unless the demo's agents (LangGraph) and its CRM can run.

    The CRM is a Starlette app on uvicorn, called with httpx: the install the
    quick start makes (``[langgraph]``) brings them.
    """
    from toolguard.runtime.extras import MissingExtra

    require("langgraph", "toolguard demo (four LangGraph agents)")
    missing = [name for name in ("httpx", "starlette", "uvicorn")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtra("langgraph", "toolguard demo (its CRM service)", missing)


def _crm_location(store_url: str) -> tuple[str, str | None]:
    """The demo CRM's store URL and PostgreSQL schema (None on SQLite), beside ``store_url``."""
    from toolguard.demo.crm import crm_store_for

    url, options = crm_store_for(store_url)
    return url, options.get("schema")


def _crm_label(store_url: str) -> str:
    url, schema = _crm_location(store_url)
    return redact(url) + (f" (schema {schema})" if schema else "")


def check_policy(path: Path) -> None:
    """Load ``path`` and check it against the demo's tools; raise ``PolicyProblems`` listing all."""
    from toolguard.demo import demo_tools
    from toolguard.policies import load_policy

    load_policy(path).check_against(demo_tools(), missing_ok=False)


def _probe(lock_url: str) -> None:
    """Fail fast (exit 3) on an unreachable lock server instead of refusing every call."""
    from toolguard.locks import connect

    locks = connect(lock_url)
    try:
        with locks.acquire("toolguard-demo:probe", ttl_ms=1000, timeout_s=5):
            pass
    finally:
        locks.close()


@contextlib.contextmanager
def _quiet_logs(verbose: bool, out: Console) -> Iterator[None]:
    """The scenario loses a lease on purpose: keep toolguard's warnings out of the way."""
    logger = logging.getLogger("toolguard")
    handler: logging.Handler
    handler = _ConsoleHandler(out) if verbose else logging.NullHandler()
    saved = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = saved


class _ConsoleHandler(logging.Handler):
    def __init__(self, out: Console) -> None:
        super().__init__(logging.INFO)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        self.out.print(Text(f"  log {record.name}: {record.getMessage()}", style="dim"))


def _run(lock_url: str, store_url: str, policy: Path | None,
         out: Console | None) -> tuple[Report, Report]:
    from toolguard.demo import POLICY_PATH, run_pipeline

    options = {"timeout_s": 5.0} if store_url.startswith(("postgresql:", "postgres:")) else {}
    reports = []
    for guarded in (False, True):
        label = "guard on " if guarded else "guard off"
        with _progress(out, label) as notify:
            reports.append(run_pipeline(guarded=guarded, lock_url=lock_url, store_url=store_url,
                                        store_options=options, policy_path=policy or POLICY_PATH,
                                        on_event=notify))
    return reports[0], reports[1]


def _controls(lock_url: str, store_url: str) -> ControlsReport:
    from toolguard.demo.controls import run_controls

    options = {"timeout_s": 5.0} if store_url.startswith(("postgresql:", "postgres:")) else {}
    return run_controls(lock_url=lock_url, store_url=store_url, store_options=options)


def _decisions(lock_url: str, store_url: str) -> DecisionsReport:
    from toolguard.demo.decisions import run_decisions

    options = {"timeout_s": 5.0} if store_url.startswith(("postgresql:", "postgres:")) else {}
    return run_decisions(lock_url=lock_url, store_url=store_url, store_options=options)


def _decisions_summary(out: Console, report: DecisionsReport) -> None:
    """The epilogue's decisions across calls: three runs of two tellers on one balance."""
    from toolguard.demo.decisions import EXPECTED

    out.print()
    out.print(Rule("Decisions across calls: two tellers read 100, each writes what it computed "
                   "(+25, +30; demo/decisions.yml)", style="bold"))
    stale = next((agent for agent, reasons in report.checked.reasons.items()
                  if "stale_read" in reasons), "the later teller")
    why = {"guard off": "a deposit lost",
           "per-call guard": "each write fenced, and a decision on a stale read still lost one",
           "reads declared": f"{stale}'s write refused stale_read; it read again and decided "
                             f"again"}
    for run in (report.off, report.per_call, report.checked):
        style = "green" if run.exact else "red"
        out.print(Text.assemble(("  • ", style), (f"{run.name:<15}", "bold"),
                                (f"balance {run.balance}/{EXPECTED}", style), f"  ({why[run.name]})"
                                if run.exact == (run.name == "reads declared") else ""))


def _controls_summary(out: Console, report: ControlsReport, store_url: str) -> None:
    """The epilogue's story: an approval, then a budget refusal, each as the audit log has it."""
    from toolguard.demo.controls import MANAGER

    out.print()
    out.print(Rule("Production controls: an approval and a budget (demo/controls.yml)",
                   style="bold"))
    if report.approval_id is not None:
        out.print(Text.assemble(
            ("  • ", "yellow"), ("router ", "bold"), "asks grant_discount L-101 25% → waits: ",
            (f"{report.asked.reason}", "yellow"), f" (request {report.approval_id}, large "
            f"discount: percent > 20)"))
        out.print(Text.assemble(
            ("  • ", "green"), (f"{MANAGER} ", "bold"), f"approves {report.approval_id} "
            "(what `toolguard approve ID` records) → the router's same call runs: ",
            (report.approved.reason, "green")))
    else:
        out.print(Text.assemble(
            ("  • ", "green"), ("router ", "bold"), "grant_discount L-101 25% was approved in an "
            "earlier run: ", (report.approved.kind, "green"), " from its record"))
    retry = report.over_budget.retry_after_s
    when = f", retry in {retry / 3600:.0f}h" if retry is not None and retry >= 3600 else (
        f", retry in {retry:.0f}s" if retry is not None else "")
    out.print(Text.assemble(
        ("  • ", "red"), ("router ", "bold"), "asks grant_discount L-102 10% → refused ",
        (report.over_budget.reason, "red"), f": 25 + 10 points is over its 30 a day{when}"))
    where = next_commands(store_url, None)[0].split(" audit ")
    out.print(Text(f"  {where[0]} audit --tool grant_discount{where[1].removeprefix('--rejected')}"
                   f"      # the request, the decision, the runs", style="dim"))


@contextlib.contextmanager
def _progress(out: Console | None, label: str) -> Iterator[Any]:
    if out is None:
        yield lambda _event: None
        return
    mutex = threading.Lock()
    with Progress(SpinnerColumn(), TextColumn(f"[bold]{label}[/]"), BarColumn(),
                  MofNCompleteColumn(), TextColumn("leads"), console=out, transient=False) as bar:
        task = bar.add_task(label, total=6)

        def notify(event: DemoEvent) -> None:
            with mutex:
                if event.kind == "lead_done":
                    bar.advance(task)
                    return
                who = f"{event.agent} " if event.agent else ""
                style = "red" if event.kind == "rejected" else "yellow"
                bar.console.print(Text.assemble(("  • ", style), (f"{event.lead_id} ", "bold"),
                                                (f"{event.kind}: ", style), f"{who}{event.detail}"))

        yield notify


# --- the summary ---------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    return "—" if value is None else str(value)


def _summary(out: Console, unguarded: Report, guarded: Report, store_url: str) -> None:
    out.print()
    records = Table(title="Lead records with the guard on", title_justify="left",
                    caption="✓: equal to the expected record, computed from the scenario alone",
                    caption_justify="left", header_style="bold", show_edge=False)
    for column, justify in (("LEAD", "left"), ("COMPANY", "left"), ("EMPLOYEES", "right"),
                            ("INDUSTRY", "left"), ("E-MAIL", "left"), ("SCORE", "right"),
                            ("TIER", "left"), ("", "left")):
        records.add_column(column, justify=justify)  # type: ignore[arg-type]
    for lead_id, record in guarded.records.items():
        want = guarded.expected[lead_id]
        same = all(getattr(record, f) == getattr(want, f)
                   for f in ("employees", "industry", "email_status", "score", "tier"))
        records.add_row(lead_id, record.company, _cell(record.employees), _cell(record.industry),
                        _cell(record.email_status), str(record.score), _cell(record.tier),
                        Text("✓", style="green") if same else Text("✗ expected "
                                                                   f"{want.score}/{want.tier}",
                                                                   style="red"))
    out.print(records)

    out.print()
    writes = Counter(e.decision for e in guarded.audit if e.tool in WRITE_TOOLS)
    reviews = Counter(e.decision for e in guarded.audit if e.tool not in WRITE_TOOLS)
    line = Text("Write intents with the guard on (this run): ", style="bold")
    _counts(line, writes)
    out.print(line)
    if reviews:
        line = Text("  review requests (ask a person, write nothing): ", style="dim")
        _counts(line, reviews)
        out.print(line)
    if writes.get("unknown") or reviews.get("unknown"):
        out.print(Text("  unknown: a call paused by a LangGraph interrupt, reconciled when the "
                       "thread resumed", style="dim"))
    if writes.get("replayed"):
        out.print(Text("  replayed: a re-run call (RetryPolicy, resumed interrupt, or a second "
                       "demo run) returned its recorded result instead of writing again",
                       style="dim"))
    if writes.get("failed"):
        out.print(Text("  failed: a CRM push whose connection dropped (did it land?); the agent "
                       "sent it again, and the CRM sorted it out (below)", style="dim"))
    refused = guarded.rejected_by_reason()
    if refused:
        table = Table(title="Refused, by reason", title_justify="left", header_style="bold",
                      show_edge=False)
        table.add_column("REASON", style="red")
        table.add_column("COUNT", justify="right")
        table.add_column("WHAT HAPPENED", overflow="fold")
        for reason, count in refused.most_common():
            table.add_row(reason, str(count), MEANING.get(reason, ""))
        out.print(table)
    if guarded.crm is not None:
        out.print()
        _crm_summary(out, guarded.crm)

    out.print()
    out.print(_comparison(unguarded, guarded))
    out.print()
    out.print(_scores(unguarded, guarded))

    if writes.get("replayed") and not writes.get("accepted"):
        out.print(Text("A second run: every write applied in an earlier run was replayed from its "
                       "record, so no lead changed and no push reached the CRM; the refused calls "
                       "were checked and refused again (a refusal records no result). Delete the "
                       "demo's folder (or use --dir) to watch it from the start.", style="cyan"))
    out.print(Text("The guard-off column changes from run to run: without locks, who overwrites "
                   "whom depends on thread timing. The guard-on records are the same every run. "
                   "Guard off means no toolguard anywhere: the agents call the CRM with a plain "
                   "HTTP client, and the CRM, without FenceMiddleware, applies what arrives.",
                   style="dim"))
    out.print()
    out.print(Text("Next: what the agents tried that was refused, and what the CRM decided:",
                   style="bold"))
    stale = guarded.stale_rejections
    crm_url, crm_schema = _crm_location(store_url)
    for command in next_commands(store_url, stale[0].id if stale else None, crm_store=crm_url,
                                 crm_schema=crm_schema):
        out.print(f"  {command}")
    if redact(store_url) != store_url:
        out.print(Text("  (the password is shown as ***: put it back, or set TOOLGUARD_DATABASE_URL "
                       "and leave --url out)", style="dim"))


def next_commands(store_url: str, stale_id: int | None, command: str | None = None, *,
                  crm_store: str | None = None, crm_schema: str | None = None) -> list[str]:
    """The commands to review this run, runnable as printed.

    ``command`` defaults to how toolguard was started (``.venv/bin/toolguard``
    after the quick start); ``--url`` is added for every store but the
    embedded default under ./.toolguard, so the hints work in another shell too.
    ``crm_store`` (and ``crm_schema`` on PostgreSQL) adds the commands that read
    the CRM's own audit log.
    """
    command = command or invocation()
    # the embedded default, as the settings name it (relative) or as a path from here
    defaults = {"sqlite:///.toolguard/store.db",
                f"sqlite:///{(Path.cwd() / '.toolguard' / 'store.db').absolute()}"}
    where = "" if store_url in defaults else f" --url '{redact(store_url)}'"
    lines = [f"{command} audit --rejected{where}"]
    if stale_id is not None:
        lines.append(f"{command} audit show {stale_id}{where}      # the stalled worker's write")
    if crm_store is not None:
        crm = f" --url '{redact(crm_store)}'" + (f" --schema {crm_schema}" if crm_schema else "")
        lines += [f"{command} audit --tool push_to_crm{where}      # the CRM pushes, as the agents "
                  f"saw them",
                  f"{command} audit --rejected{crm}      # the CRM's own log: its 409",
                  f"{command} audit --decision replayed{crm}      # ... and its replay"]
    lines.append(f"{command} audit stats{where}")
    return lines


def _crm_summary(out: Console, crm: CrmReport) -> None:
    """The CRM's side: its records, and what it decided that was not a plain 'applied'."""
    n = len(crm.expected)
    right = sum(1 for lead in crm.expected if not any(m[0] == lead for m in crm.mismatches))
    line = Text("The CRM with the guard on ", style="bold")
    line.append(f"({crm.store}; FenceMiddleware checks every push): ")
    line.append(f"{right}/{n} records equal to the expected ones",
                style="green" if right == n else "red")
    line.append(", each pushed once by the enricher and once by the router")
    out.print(line)
    decisions = crm.decisions()
    line = Text("  its own audit log (this run): ", style="dim")
    if decisions:
        _counts(line, decisions)
    else:
        line.append("no request reached the CRM (every push was replayed by the agents' store)")
    out.print(line)
    notable = [e for e in crm.audit if e.decision != "accepted"]
    if not notable:
        return
    table = Table(title="The CRM's own decisions", title_justify="left", header_style="bold",
                  show_edge=False)
    table.add_column("LEAD")
    table.add_column("DECISION")
    table.add_column("REASON")
    table.add_column("WHAT HAPPENED", overflow="fold")
    table.add_column("CRM AUDIT", justify="right")
    for entry in notable:
        lead = ", ".join(key.split(":", 1)[-1] for key in entry.keys) or "—"
        style = "red" if entry.decision == "rejected" else "cyan"
        table.add_row(lead, Text(entry.decision, style=style), entry.reason or "",
                      CRM_MEANING.get(entry.reason or "", entry.detail or ""), f"#{entry.id}")
    out.print(table)


def _counts(line: Text, counts: Counter[str]) -> None:
    for name, style in (("accepted", "green"), ("replayed", "cyan"), ("rejected", "red"),
                        ("unknown", "yellow"), ("failed", "red")):
        if counts.get(name):
            line.append(f"{counts[name]} {name}", style=style)
            line.append("  ")


def _comparison(unguarded: Report, guarded: Report) -> Table:
    table = Table(title="Guard off vs guard on", title_justify="left", header_style="bold",
                  show_edge=False)
    table.add_column("")
    table.add_column("GUARD OFF", justify="right")
    table.add_column("GUARD ON", justify="right")

    def count(report: Report, kind: str) -> Text:
        n = len(report.of_kind(kind))
        return Text(str(n), style="red" if n else "green")

    n = len(guarded.expected)
    right = [sum(1 for lead in r.expected if not any(m[0] == lead for m in r.mismatches))
             for r in (unguarded, guarded)]
    table.add_row("records equal to the expected ones",
                  *(Text(f"{k}/{n}", style="green" if k == n else "red") for k in right))
    table.add_row("lost updates (a write overwritten by a stale read)",
                  count(unguarded, "lost_update"), count(guarded, "lost_update"))
    table.add_row("double-applied retries (RetryPolicy, resumed interrupt)",
                  count(unguarded, "double_applied"), count(guarded, "double_applied"))
    table.add_row("tier set before enrichment/scoring landed",
                  count(unguarded, "tier_before_scoring"), count(guarded, "tier_before_scoring"))
    table.add_row("writes the policy refuses, applied",
                  count(unguarded, "unchecked_write"), count(guarded, "unchecked_write"))
    stale = guarded.stale_rejections
    table.add_row("stalled worker's late write (past its 800 ms lease)",
                  Text("landed", style="red") if unguarded.stalls else Text("—"),
                  Text(f"refused (audit #{stale[0].id})", style="green") if stale
                  else Text("replayed: applied in an earlier run", style="cyan")
                  if guarded.stalls else Text("—"))
    if unguarded.crm is not None and guarded.crm is not None:
        crm_right = [sum(1 for lead in r.expected if not any(m[0] == lead for m in r.mismatches))
                     for r in (unguarded.crm, guarded.crm)]
        m = len(guarded.crm.expected)
        table.add_row("CRM records equal to the expected ones",
                      *(Text(f"{k}/{m}", style="green" if k == m else "red") for k in crm_right))
        table.add_row("CRM pushes applied twice (sent again after a dropped connection)",
                      count(unguarded, "crm_double_push"), count(guarded, "crm_double_push"))
        table.add_row("CRM push stuck in the network, arriving last",
                      _late_cell(unguarded.crm), _late_cell(guarded.crm))
    table.add_row("time", f"{unguarded.duration_s:.1f} s", f"{guarded.duration_s:.1f} s")
    return table


def _late_cell(crm: CrmReport) -> Text:
    late = crm.late_copy
    if late is None:
        return Text("replayed: applied in an earlier run", style="cyan") if crm.fenced \
            else Text("—")
    if late.landed:
        return Text("landed", style="red")
    if late.replayed:
        return Text("replayed by the CRM: applied in an earlier run", style="cyan")
    if not late.status:
        return Text(f"never arrived ({late.detail})", style="yellow")
    refused = [e for e in crm.audit if e.reason == "stale_fencing_token"]
    where = f" (CRM audit #{refused[0].id})" if refused else ""
    return Text(f"refused by the CRM: {late.status}{where}", style="green")


def _scores(unguarded: Report, guarded: Report) -> Table:
    table = Table(title="Score / tier per lead", title_justify="left", header_style="bold",
                  show_edge=False)
    for column in ("LEAD", "EXPECTED", "GUARD OFF", "GUARD ON"):
        table.add_column(column, justify="left" if column == "LEAD" else "right")
    for lead_id, want in guarded.expected.items():
        cells = []
        for report in (unguarded, guarded):
            got = report.records.get(lead_id)
            text = f"{got.score} / {_cell(got.tier)}" if got else "—"
            ok = got is not None and (got.score, got.tier) == (want.score, want.tier)
            cells.append(Text(text, style="green" if ok else "red"))
        table.add_row(lead_id, f"{want.score} / {want.tier}", *cells)
    return table
