"""The lead qualifier's tools and the leads table they read-modify-write.

Five tools on the leads table (``enrich_lead``, ``update_intent_score``,
``request_review``, ``verify_email``, ``set_tier``) and the CRM push
(``push_to_crm``). Every write reads the whole lead and writes it back whole,
with an event row (``Leads``): guarded, inside the call's fenced transaction;
unguarded, in plain autocommit, where the scenario's interleaving makes the
lost updates show. Separate from the agents (``toolguard.demo.agents``) and the
run (``toolguard.demo.lead_qualifier``): ``demo_tools`` checks a policy
against these tools' arguments without building a graph.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from toolguard.demo.harness import CALL, Interleaving
from toolguard.demo.scenario import EMAIL_POINTS, LEADS, TIER_INPUTS, LeadRecord, fit_points, tier_for
from toolguard.store.base import qmark

__all__ = [
    "EVENTS_TABLE",
    "LEADS_TABLE",
    "RETRY_HINT",
    "SCHEMA_PATH",
    "Leads",
    "demo_tools",
    "install_tables",
    "make_tools",
    "read_events",
    "read_records",
    "seed_leads",
]

SCHEMA_PATH = Path(__file__).resolve().parent / "schema.sql"

LEADS_TABLE = "toolguard_demo_leads"
EVENTS_TABLE = "toolguard_demo_lead_events"

#: How a tool says that the same call may simply be sent again (a model reads it).
RETRY_HINT = "Send the same call again: its idempotency key makes that safe."


# --- the leads table --------------------------------------------------------------------------


@dataclass(slots=True)
class _Draft:
    """A lead as a tool read it, changed in memory and written back whole."""

    lead_id: str
    company: str
    email: str
    employees: int | None
    industry: str | None
    email_status: str | None
    score: int
    tier: str | None
    version: int
    landed: frozenset[str] = frozenset()  # tools whose writes this read saw
    detail: dict[str, Any] = field(default_factory=dict)


Execute = Callable[[str, Sequence[Any]], Any]

_SELECT = (f"SELECT company, email, employees, industry, email_status, score, tier, version "
           f"FROM {LEADS_TABLE} WHERE pipeline = %s AND lead_id = %s")
_LANDED = f"SELECT DISTINCT tool FROM {EVENTS_TABLE} WHERE pipeline = %s AND lead_id = %s"
_UPDATE = (f"UPDATE {LEADS_TABLE} SET employees = %s, industry = %s, email_status = %s, score = %s, "
           f"tier = %s, version = %s WHERE pipeline = %s AND lead_id = %s")
_EVENT = (f"INSERT INTO {EVENTS_TABLE} (pipeline, lead_id, version, agent, tool, call_id, detail) "
          f"VALUES (%s, %s, %s, %s, %s, %s, %s)")


class Leads:
    """The tools' data access: the fenced transaction when guarded, plain autocommit otherwise."""

    def __init__(self, store: Any, pipeline: str, guarded: bool,
                 interleaving: Interleaving | None) -> None:
        self.store = store
        self.pipeline = pipeline
        self.guarded = guarded
        self.interleaving = interleaving

    @contextlib.contextmanager
    def _plain(self) -> Iterator[Execute]:
        with self.store.connection() as conn:
            if self.store.dialect == "sqlite":
                yield lambda sql, params: conn.execute(qmark(sql), tuple(params))
            else:
                yield lambda sql, params: conn.execute(sql, tuple(params))

    def _read(self, execute: Execute, lead_id: str) -> _Draft:
        row = execute(_SELECT, (self.pipeline, lead_id)).fetchone()
        if row is None:
            msg = f"no lead {lead_id!r} in pipeline {self.pipeline!r}"
            raise LookupError(msg)
        landed = frozenset(r[0] for r in execute(_LANDED, (self.pipeline, lead_id)).fetchall())
        company, email, employees, industry, status, score, tier, version = row
        return _Draft(lead_id, company, email, employees, industry, status, int(score), tier,
                      int(version), landed)

    def _write(self, execute: Execute, draft: _Draft, tool: str) -> None:
        call = CALL.get()
        execute(_UPDATE, (draft.employees, draft.industry, draft.email_status, draft.score,
                          draft.tier, draft.version + 1, self.pipeline, draft.lead_id))
        execute(_EVENT, (self.pipeline, draft.lead_id, draft.version + 1,
                         call.agent if call else "?", tool, call.call_id if call else "?",
                         json.dumps(draft.detail, sort_keys=True)))

    def snapshot(self, lead_id: str) -> dict[str, Any]:
        """The lead as it is now (guarded: read in the call's transaction, if it has one)."""
        tx = None
        if self.guarded:
            from toolguard.call.context import current

            tx = current().tx
        if tx is not None:
            draft = self._read(tx.execute, lead_id)
        else:
            with self._plain() as execute:
                draft = self._read(execute, lead_id)
        return {"company": draft.company, "email": draft.email, "employees": draft.employees,
                "industry": draft.industry, "email_status": draft.email_status,
                "score": draft.score, "tier": draft.tier}

    @contextlib.contextmanager
    def lead(self, lead_id: str, tool: str) -> Iterator[_Draft]:
        """Read the lead, let the tool change it, write it back (whole) with an event row."""
        if self.guarded:
            from toolguard.call.context import current

            tx = current().tx  # the reads that decide the write happen inside the fence
            draft = self._read(tx.execute, lead_id)
            yield draft
            self._write(tx.execute, draft, tool)
            return
        with self._plain() as execute:
            draft = self._read(execute, lead_id)
        yield draft
        if self.interleaving is not None:
            call = CALL.get()
            self.interleaving.before_write(lead_id, bool(call and call.stalled))
        with self._plain() as execute:
            self._write(execute, draft, tool)
        if self.interleaving is not None:
            self.interleaving.wrote(lead_id)


def demo_tools() -> dict[str, Any]:
    """The demo's tools by name, to check a policy against their arguments before a run."""
    return {tool.name: tool for tool in make_tools(None, None)}  # type: ignore[arg-type]


def make_tools(leads: Leads, crm: Any) -> list[Any]:
    """The five tools on the leads table and the CRM push (``crm``: an httpx client)."""
    from langchain_core.tools import ToolException, tool
    from langgraph.types import interrupt

    @tool
    def enrich_lead(lead_id: str, source: str, employees: int, industry: str) -> str:
        """Store a lead's firmographics from an enrichment source and add its fit points."""
        points = fit_points(employees)
        with leads.lead(lead_id, "enrich_lead") as lead:
            lead.employees, lead.industry = employees, industry
            lead.score += points
            lead.detail = {"set": {"employees": employees, "industry": industry}, "delta": points}
        return f"{lead_id}: {employees} employees, {industry}; fit +{points}"

    @tool
    def update_intent_score(lead_id: str, signal_id: str, points: int) -> str:
        """Add the points of one buying-intent signal to a lead's score."""
        with leads.lead(lead_id, "update_intent_score") as lead:
            lead.score += points
            lead.detail = {"set": {}, "delta": points, "signal": signal_id}
            score = lead.score
        return f"{lead_id}: {signal_id} {points:+d}, score now {score}"

    @tool
    def request_review(lead_id: str, reason: str) -> str:
        """Ask a person to confirm a surprising score before the pipeline goes on."""
        answer = interrupt({"lead_id": lead_id, "question": reason})
        approved = isinstance(answer, Mapping) and answer.get("approved")
        return f"{lead_id}: review {'approved' if approved else 'declined'}"

    @tool
    def verify_email(lead_id: str, email: str, status: str) -> str:
        """Record whether a lead's e-mail address is deliverable and adjust the score."""
        points = EMAIL_POINTS.get(status, 0)
        with leads.lead(lead_id, "verify_email") as lead:
            if email.lower() != lead.email.lower():
                msg = f"{email} is not the address on file for {lead_id}"
                raise ValueError(msg)
            lead.email_status = status
            lead.score += points
            lead.detail = {"set": {"email_status": status}, "delta": points}
        return f"{lead_id}: e-mail {status} ({points:+d})"

    @tool
    def set_tier(lead_id: str) -> str:
        """Set a lead's sales tier from its score and e-mail check."""
        with leads.lead(lead_id, "set_tier") as lead:
            lead.tier = tier_for(lead.score, lead.email_status)
            lead.detail = {"set": {"tier": lead.tier}, "delta": 0, "score": lead.score,
                           "saw": sorted(lead.landed & set(TIER_INPUTS))}
            tier, score = lead.tier, lead.score
        return f"{lead_id}: tier {tier} (score {score})"

    @tool
    def push_to_crm(lead_id: str, stage: str) -> str:
        """Send a lead's whole record to the CRM (stage: enriched or qualified)."""
        import httpx

        call = CALL.get()
        body = {**leads.snapshot(lead_id), "stage": stage, "agent": call.agent if call else "?"}
        try:
            response = crm.put(f"/leads/{quote(lead_id, safe='')}", json=body)
        except httpx.TransportError as error:
            msg = (f"the CRM did not answer ({type(error).__name__}: {error}), so the push may "
                   f"or may not have landed. {RETRY_HINT}")
            raise ToolException(msg) from error
        if response.status_code >= 400:
            msg = f"the CRM refused the push: HTTP {response.status_code} {response.text[:200]}"
            raise ToolException(msg)
        answer = response.json()
        text = (f"{lead_id}: pushed to the CRM as {stage} (push {answer['push']}: score "
                f"{answer['score']}, tier {answer['tier'] or '-'})")
        if response.headers.get("idempotent-replayed") == "true":
            text += "; the CRM had applied it already and replayed its recorded answer"
            _note_on_audit_row("the CRM replayed its recorded answer (Idempotent-Replayed: true)")
        return text

    push_to_crm.handle_tool_error = True  # a CRM that does not answer is an error message, not a crash

    return [enrich_lead, update_intent_score, request_review, verify_email, set_tier, push_to_crm]


def _note_on_audit_row(text: str) -> None:
    """Put ``text`` on the accepted audit row of the guarded call running here (if any)."""
    from toolguard.call.context import current_or_none

    ctx = current_or_none()
    if ctx is not None and ctx.tx is not None:
        ctx.tx.detail = text


def install_tables(store: Any, schema_path: Path = SCHEMA_PATH) -> None:
    """Create the demo's tables (``schema.sql``) through the store's own connection."""
    script = schema_path.read_text(encoding="utf-8")
    statements = [s.strip() for s in _strip_comments(script).split(";") if s.strip()]
    with store.connection() as conn:
        for statement in statements:
            conn.execute(statement)


def _strip_comments(script: str) -> str:
    return "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("--"))


def seed_leads(store: Any, pipeline: str, *, reset: bool) -> None:
    """Insert the scenario's leads (``reset``: delete this pipeline's rows and events first)."""
    def run(conn: Any, sql: str, params: Sequence[Any] = ()) -> None:
        conn.execute(qmark(sql) if store.dialect == "sqlite" else sql, tuple(params))

    with store.connection() as conn:
        if reset:
            run(conn, f"DELETE FROM {EVENTS_TABLE} WHERE pipeline = %s", (pipeline,))
            run(conn, f"DELETE FROM {LEADS_TABLE} WHERE pipeline = %s", (pipeline,))
        for lead in LEADS:
            run(conn, f"INSERT INTO {LEADS_TABLE} (pipeline, lead_id, company, email) "
                      f"VALUES (%s, %s, %s, %s) ON CONFLICT (pipeline, lead_id) DO NOTHING",
                (pipeline, lead.lead_id, lead.company, lead.email))


def read_records(store: Any, pipeline: str) -> dict[str, LeadRecord]:
    sql = (f"SELECT lead_id, company, email, employees, industry, email_status, score, tier, "
           f"version FROM {LEADS_TABLE} WHERE pipeline = %s ORDER BY lead_id")
    with store.connection() as conn:
        rows = conn.execute(qmark(sql) if store.dialect == "sqlite" else sql, (pipeline,)).fetchall()
    return {row[0]: LeadRecord(row[0], row[1], row[2], row[3], row[4], row[5], score=int(row[6]),
                               tier=row[7], version=int(row[8]))
            for row in rows}


def read_events(store: Any, pipeline: str) -> list[tuple[str, int, str, str, str, dict[str, Any]]]:
    sql = (f"SELECT lead_id, version, agent, tool, call_id, detail FROM {EVENTS_TABLE} "
           f"WHERE pipeline = %s ORDER BY lead_id, version")
    with store.connection() as conn:
        rows = conn.execute(qmark(sql) if store.dialect == "sqlite" else sql, (pipeline,)).fetchall()
    return [(r[0], int(r[1]), r[2], r[3], r[4], json.loads(r[5])) for r in rows]

