"""The lead qualifier: parallel LangGraph agents on the same leads, with and without toolguard.

Four agents work on every lead at once: ``lead_enricher`` (firmographics and fit
points), ``intent_scorer`` (intent points), ``email_verifier`` (deliverability
points) and ``router`` (the sales tier, which depends on all of the above).
Each agent is a model node plus a real ``ToolNode``; the model is a small
deterministic stand-in (``ScriptedAgentModel``) so the demo runs offline, and
every tool does a read-modify-write of the whole lead record.

``run_pipeline(guarded=False)`` runs the same graph, tools and model without
the guard and shows what goes wrong; ``guarded=True`` puts ``GuardedToolCalls``
on every ``ToolNode`` and the final records come out right. The scenario holds
the faults production brings, on purpose and every run:

- every agent reads a lead before any of them writes it (the interleaving slow
  model and API calls produce; the unguarded run pins it, so it shows up every
  time instead of by luck): lost updates, and a tier set before scoring;
- ``L-102``: the scorer's worker dies after its write committed, before the
  step was checkpointed; the ``RetryPolicy`` re-runs the tool call;
- ``L-103``: the enricher stalls after taking the lock, past its 800 ms lease;
  the scorer and the verifier take the lock and write; the enricher's late
  write must be refused (``stale_fencing_token``) and audited;
- ``L-104``: the scorer asks a person to review a big jump (``interrupt()``);
  resuming re-runs its sibling tool call, which already applied;
- ``L-105`` / ``L-106``: a model over-scores a lead / the router tries to bump
  a score: the policy refuses both (``invalid_arguments``, ``not_authorized``).

Every lead also goes to a CRM, a small REST service the run starts on a free
loopback port (``toolguard.demo.crm``): the enricher pushes it once enriched,
the router once it has a tier (``push_to_crm``). Two pushes go wrong on the
way (``toolguard.demo.network``): on ``L-102`` the router's push is applied
but its answer is lost, and the router sends it again; on ``L-103`` the
enricher's push is stuck in the network, the enricher sends it again, and the
stuck copy arrives after that retry and the router's push. With the guard on,
the CRM checks the fences and idempotency keys itself (``FenceMiddleware``): it
replays the first and refuses the second with ``409``, and its own audit log
shows both.

The expected records are computed from the scenario alone (``expected_records``,
``expected_crm_records``), never from the database, and the ``Report``
compares. The scenario's data is in ``toolguard.demo.scenario``, the fault
injection in ``toolguard.demo.harness`` and ``toolguard.demo.network``, the
model and the graph in ``toolguard.demo.agents``, the tools and the leads table
in ``toolguard.demo.tools``, what a run reports in ``toolguard.demo.report``;
this module runs it (``run_pipeline``) and keeps every name the demo's users
import from it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from toolguard.demo.agents import ScriptedAgentModel, build_graph, run_lead
from toolguard.demo.harness import DemoEvent, Faults, Interleaving, StallingLocks
from toolguard.demo.report import CrmReport, Finding, Report, crm_findings, lead_findings
from toolguard.demo.scenario import (
    AGENTS,
    LEADS,
    SCRIPT,
    WRITE_TOOLS,
    CrmRecord,
    LeadRecord,
    PlannedCall,
    expected_crm_records,
    expected_records,
    fit_points,
    tier_for,
)
from toolguard.demo.tools import (
    RETRY_HINT,
    SCHEMA_PATH,
    Leads,
    demo_tools,
    install_tables,
    make_tools,
    read_events,
    read_records,
    seed_leads,
)
from toolguard.store.base import AuditEntry

__all__ = [
    "AGENTS",
    "LEADS",
    "POLICY_PATH",
    "RETRY_HINT",
    "SCHEMA_PATH",
    "CrmRecord",
    "CrmReport",
    "DemoEvent",
    "Finding",
    "LeadRecord",
    "PlannedCall",
    "Report",
    "ScriptedAgentModel",
    "demo_tools",
    "expected_crm_records",
    "expected_records",
    "fit_points",
    "run_pipeline",
    "tier_for",
]


HERE = Path(__file__).resolve().parent
POLICY_PATH = HERE / "policy.yml"


# --- running it ----------------------------------------------------------------------------------


def _label(url: str) -> str:
    from toolguard.runtime.connection_errors import redacted_url as redact

    return redact(url)


def _newest_audit_id(store: Any) -> int:
    newest = store.query_audit(limit=1)
    return int(newest[0].id) if newest and newest[0].id is not None else 0


def run_pipeline(
    *,
    guarded: bool,
    lock_url: str | None = None,
    store_url: str | None = None,
    store: Any = None,
    locks: Any = None,
    store_options: Mapping[str, Any] | None = None,
    lock_options: Mapping[str, Any] | None = None,
    crm_store_url: str | None = None,
    crm_store_options: Mapping[str, Any] | None = None,
    policy_path: str | Path = POLICY_PATH,
    schema_path: str | Path = SCHEMA_PATH,
    pipeline: str | None = None,
    reset: bool | None = None,
    on_event: Callable[[DemoEvent], None] | None = None,
) -> Report:
    """Run the lead qualifier once over the six leads and report what happened.

    ``guarded`` puts toolguard on every ``ToolNode`` (and ``FenceMiddleware`` on
    the CRM); without it the same graph, tools and CRM run without. Backends:
    pass open ``store``/``locks`` objects, or URLs (default: the settings, i.e.
    ``TOOLGUARD_DATABASE_URL`` / ``TOOLGUARD_REDIS_URL``, else the embedded
    SQLite file). The CRM keeps a store of its own: ``crm_store_url`` (default
    ``crm.db`` beside the agents' SQLite file, or the ``toolguard_demo_crm``
    schema of their PostgreSQL database) with ``crm_store_options``.
    ``pipeline`` names the rows and threads of this run (default
    ``lead-qualifier`` or ``lead-qualifier-unguarded``); the guarded pipeline
    keeps its rows between runs (``reset=False``), so running it again replays
    every intent and changes nothing; the unguarded one starts over each time.
    """
    from toolguard.demo.crm import CrmService, crm_store_for
    from toolguard.locks import connect
    from toolguard.store import open_store

    pipeline = pipeline or ("lead-qualifier" if guarded else "lead-qualifier-unguarded")
    reset = (not guarded) if reset is None else reset
    notify = on_event or (lambda _event: None)
    owned: list[Callable[[], None]] = []
    try:
        if store is None:
            if store_url is None:
                from toolguard.config import Settings

                store_url = Settings().resolved_store_url()
            options = dict(store_options or {})
            if store_url.startswith(("postgresql:", "postgres:")):
                options.setdefault("max_size", 20)
            store = open_store(store_url, install=True, **options)
            owned.append(store.close)
        store_label = _label(store_url) if store_url else repr(store)
        install_tables(store, Path(schema_path))
        seed_leads(store, pipeline, reset=reset)
        if crm_store_url is None:
            crm_store_url, default_options = crm_store_for(store_url, store)
            crm_store_options = {**default_options, **dict(crm_store_options or {})}
        crm = CrmService(crm_store_url, pipeline=pipeline, fenced=guarded,
                         store_options=crm_store_options, reset=reset).start()
        owned.append(crm.close)
        network, http = _crm_client(crm.url, guarded, notify)
        owned.append(http.close)
        lock_label = "-"
        interleaving = None
        if guarded:
            if locks is None:
                if lock_url is None:
                    from toolguard.config import Settings

                    lock_url = Settings().resolved_lock_url()
                locks = connect(lock_url, **dict(lock_options or {}))
                owned.append(locks.close)
            lock_label = _label(lock_url) if lock_url else type(locks.backend).__name__
            granted = threading.Event()
            inner = _guarded_calls(store, locks, Path(policy_path), notify, granted)
        else:
            parties = {lead.lead_id: sum(1 for agent in AGENTS for p in SCRIPT[agent].get(lead.lead_id, ())
                                         if p.tool in WRITE_TOOLS) for lead in LEADS}
            interleaving = Interleaving(parties)
            inner, granted = None, None
        faults = Faults(inner, notify, granted)
        tools = make_tools(Leads(store, pipeline, guarded, interleaving), http)
        graph = build_graph(tools, faults)
        start_id = _newest_audit_id(store) if guarded else 0
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(LEADS), thread_name_prefix="lead") as pool:
            interrupts = sum(pool.map(lambda lead: run_lead(graph, lead.lead_id, pipeline, notify),
                                      LEADS))
        network.finish()  # a push still stuck in the network arrives now, if it has not yet
        duration = time.monotonic() - started
        audit: tuple[AuditEntry, ...] = ()
        if guarded:
            prefix = f"{pipeline}/"
            audit = tuple(e for e in store.query_audit(after_id=start_id, limit=None,
                                                        newest_first=False)
                          if (e.workflow or "").startswith(prefix))
        records = read_records(store, pipeline)
        events = read_events(store, pipeline)
        crm_report = CrmReport(url=crm.url, store=crm.label, fenced=guarded,
                               records=crm.records(), expected=expected_crm_records(),
                               pushes=tuple(crm.pushes()), audit=crm.audit(),
                               late_copy=network.late_copy, lost_answers=network.lost_answers)
        findings = [*lead_findings(records, events), *crm_findings(crm_report)]
        return Report(guarded=guarded, pipeline=pipeline, locks=lock_label, store=store_label,
                      records=records, expected=expected_records(),
                      findings=tuple(findings), audit=audit,
                      interrupts=interrupts, crashes=faults.crashes, stalls=faults.stalls,
                      duration_s=duration, crm=crm_report)
    finally:
        for close in reversed(owned):
            with contextlib.suppress(Exception):
                close()


def _crm_client(url: str, guarded: bool, notify: Callable[[DemoEvent], None]) -> tuple[Any, Any]:
    """The agents' HTTP client to the CRM, over the scenario's faulty network.

    Guarded: a ``FencedClient``, so every push carries the lease's fences, the
    agent, the intent and an idempotency key. Unguarded: a plain httpx client.
    """
    import httpx

    from toolguard.demo.network import CrmNetwork

    network = CrmNetwork(notify)
    if guarded:
        from toolguard.fences import FencedClient

        return network, FencedClient(base_url=url, transport=network, timeout=10.0)
    return network, httpx.Client(base_url=url, transport=network, timeout=10.0)


def _guarded_calls(store: Any, locks: Any, policy_path: Path, notify: Callable[[DemoEvent], None],
                   granted: threading.Event) -> Callable[[str], Any]:
    from toolguard.adapters import GuardedToolCalls
    from toolguard.guard import ToolGuard
    from toolguard.policies import load_policy

    policy = load_policy(policy_path)
    guard = ToolGuard(policy, locks=StallingLocks(locks, store, notify, granted), store=store)  # type: ignore[arg-type]
    return lambda agent: GuardedToolCalls(guard, agent=agent)

