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
injection in ``toolguard.demo.harness`` and ``toolguard.demo.network``; this
module holds the model, the tools, the graph and the report.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypedDict
from urllib.parse import quote

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from toolguard.demo.harness import CALL, DemoEvent, Faults, Interleaving, StallingLocks
from toolguard.demo.scenario import (
    AGENTS,
    EMAIL_POINTS,
    FIELDS,
    LEADS,
    SCRIPT,
    TIER_INPUTS,
    WRITE_TOOLS,
    CrmRecord,
    LeadRecord,
    PlannedCall,
    expected_crm_records,
    expected_records,
    first_turn_call_id,
    fit_points,
    follow_up,
    tier_for,
)
from toolguard.store.base import AuditEntry, qmark

if TYPE_CHECKING:
    from toolguard.demo.crm import CrmPush
    from toolguard.demo.network import LateCopy

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
SCHEMA_PATH = HERE / "schema.sql"

LEADS_TABLE = "toolguard_demo_leads"
EVENTS_TABLE = "toolguard_demo_lead_events"

#: Refusals after which a model tries the same call again (a fresh tool-call id).
RETRYABLE = frozenset({"stale_fencing_token", "out_of_order", "lease_lost", "not_owned",
                       "lock_timeout"})
#: How a tool says that the same call may simply be sent again (a model reads it).
RETRY_HINT = "Send the same call again: its idempotency key makes that safe."

TASKS = {
    "lead_enricher": "Enrich this lead with firmographic data.",
    "intent_scorer": "Score this lead's buying intent from its recent signals.",
    "email_verifier": "Verify this lead's e-mail address.",
    "router": "Set this lead's sales tier.",
}

# --- what a run reports ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Finding:
    """One anomaly on one lead, in words."""

    lead_id: str
    #: lost_update | double_applied | tier_before_scoring | unchecked_write (the leads table);
    #: crm_double_push | crm_late_push (the CRM)
    kind: str
    detail: str


@dataclass(frozen=True)
class CrmReport:
    """What the CRM holds after a run, and what it decided (its own audit log, guard on)."""

    url: str
    store: str
    fenced: bool
    records: Mapping[str, CrmRecord]
    expected: Mapping[str, CrmRecord]
    pushes: tuple[CrmPush, ...] = ()  # one per push the CRM applied
    audit: tuple[AuditEntry, ...] = ()  # the CRM's audit rows of this run (guard on)
    late_copy: LateCopy | None = None  # what the CRM answered the push stuck in the network
    lost_answers: int = 0  # pushes the CRM applied whose answer the network lost

    @property
    def mismatches(self) -> list[tuple[str, str, Any, Any]]:
        """``(lead, field, expected, actual)`` for every CRM field that is not what it should be."""
        out = []
        for lead_id, want in self.expected.items():
            got = self.records.get(lead_id)
            for name in (*FIELDS, "pushes"):
                expected, actual = getattr(want, name), getattr(got, name, None)
                if expected != actual:
                    out.append((lead_id, name, expected, actual))
        return out

    def decisions(self) -> Counter[str]:
        return Counter(entry.decision for entry in self.audit)

    def of(self, decision: str, reason: str | None = None) -> list[AuditEntry]:
        return [e for e in self.audit
                if e.decision == decision and (reason is None or e.reason == reason)]

    def as_dict(self) -> dict[str, Any]:
        late = self.late_copy
        return {
            "url": self.url, "store": self.store, "fenced": self.fenced,
            "records": {k: asdict(v) for k, v in self.records.items()},
            "mismatches": [{"lead_id": lead, "field": name, "expected": want, "actual": got}
                           for lead, name, want, got in self.mismatches],
            "pushes": [asdict(p) for p in self.pushes],
            "decisions": dict(self.decisions()),
            "stale_rejections": [e.id for e in self.of("rejected", "stale_fencing_token")],
            "replays": [e.id for e in self.of("replayed")],
            "late_copy": None if late is None else {
                "lead_id": late.lead_id, "agent": late.agent, "status": late.status,
                "reason": late.reason, "replayed": late.replayed, "landed": late.landed},
            "lost_answers": self.lost_answers,
        }


@dataclass(frozen=True)
class Report:
    """What one pipeline run did to the leads, compared with the expected records."""

    guarded: bool
    pipeline: str
    locks: str
    store: str
    records: Mapping[str, LeadRecord]
    expected: Mapping[str, LeadRecord]
    findings: tuple[Finding, ...] = ()
    audit: tuple[AuditEntry, ...] = ()
    interrupts: int = 0
    crashes: int = 0
    stalls: int = 0
    duration_s: float = 0.0
    crm: CrmReport | None = None

    @property
    def mismatches(self) -> list[tuple[str, str, Any, Any]]:
        """``(lead, field, expected, actual)`` for every field that is not what it should be."""
        out = []
        for lead_id, want in self.expected.items():
            got = self.records.get(lead_id)
            for name in FIELDS:
                expected, actual = getattr(want, name), getattr(got, name, None)
                if expected != actual:
                    out.append((lead_id, name, expected, actual))
        return out

    @property
    def correct(self) -> bool:
        """Every record, in the leads table and in the CRM, is what the scenario says it must be."""
        return not self.mismatches and (self.crm is None or not self.crm.mismatches)

    def of_kind(self, kind: str) -> list[Finding]:
        return [finding for finding in self.findings if finding.kind == kind]

    def decisions(self) -> Counter[str]:
        """Audit rows of this run by decision (accepted, replayed, rejected, failed, unknown)."""
        return Counter(entry.decision for entry in self.audit)

    def rejected_by_reason(self) -> Counter[str]:
        return Counter(entry.reason for entry in self.audit if entry.decision == "rejected")

    @property
    def stale_rejections(self) -> list[AuditEntry]:
        return [e for e in self.audit if e.decision == "rejected" and e.reason == "stale_fencing_token"]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "guarded": self.guarded, "pipeline": self.pipeline, "locks": self.locks,
            "store": self.store, "correct": self.correct, "duration_s": round(self.duration_s, 3),
            "records": {k: asdict(v) for k, v in self.records.items()},
            "expected": {k: asdict(v) for k, v in self.expected.items()},
            "mismatches": [{"lead_id": lead, "field": name, "expected": want, "actual": got}
                           for lead, name, want, got in self.mismatches],
            "findings": [asdict(f) for f in self.findings],
            "decisions": dict(self.decisions()),
            "rejected_by_reason": dict(self.rejected_by_reason()),
            "stale_rejections": [e.id for e in self.stale_rejections],
            "interrupts": self.interrupts, "crashes": self.crashes, "stalls": self.stalls,
            "crm": None if self.crm is None else self.crm.as_dict(),
        }


# --- the scripted model ---------------------------------------------------------------------


_LEAD_IN_PROMPT = re.compile(r"lead_id=(\S+)")


class ScriptedAgentModel(BaseChatModel):
    """A deterministic stand-in for an LLM: the scenario's calls, then follow-ups.

    Turn 1 emits the planned calls for the lead named in the prompt
    (``lead_id=...``); later turns read the tool results: a retryable refusal
    (a stale token, out of order...) or a tool error that says to send the
    same call again (``RETRY_HINT``) sends it again under a new id, an
    ``invalid_arguments`` refusal sends the planned fallback, a success sends
    the agent's next step (its CRM push, see ``follow_up``), anything else ends
    the turn. Call ids are ``agent:lead:turn:index``: stable across runs.
    """

    agent: str
    plan: Any  # lead id -> tuple[PlannedCall, ...]
    max_turns: int = 6

    @property
    def _llm_type(self) -> str:
        return "toolguard-scripted"

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedAgentModel:
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        prompt = next((m for m in messages if isinstance(m, HumanMessage)), None)
        match = _LEAD_IN_PROMPT.search(str(prompt.content) if prompt else "")
        lead_id = match.group(1) if match else ""
        turn = 1 + sum(isinstance(m, AIMessage) for m in messages)
        if turn == 1:
            calls = [(p.tool, dict(p.args)) for p in self.plan.get(lead_id, ())]
        elif turn <= self.max_turns:
            calls = self._follow_up(messages, lead_id)
        else:
            calls = []
        if not calls:
            reply = AIMessage(content=f"{self.agent}: done with {lead_id}")
        else:
            reply = AIMessage(content="", tool_calls=[
                {"name": name, "args": args, "id": f"{self.agent}:{lead_id}:{turn}:{index}",
                 "type": "tool_call"} for index, (name, args) in enumerate(calls)])
        return ChatResult(generations=[ChatGeneration(message=reply)])

    def _follow_up(self, messages: list[BaseMessage], lead_id: str) -> list[tuple[str, dict[str, Any]]]:
        last = next(m for m in reversed(messages) if isinstance(m, AIMessage))
        results: dict[str | None, ToolMessage] = {m.tool_call_id: m for m in messages
                                                  if isinstance(m, ToolMessage)}
        calls = []
        for call in last.tool_calls:
            result = results.get(call["id"])
            if result is None:
                continue
            if result.status != "error":
                step = follow_up(call["name"], lead_id)
                if step is not None:
                    calls.append((step.tool, dict(step.args)))
                continue
            reason = (result.response_metadata.get("toolguard") or {}).get("reason")
            if reason in RETRYABLE or RETRY_HINT in str(result.content):
                calls.append((call["name"], dict(call["args"])))
            elif reason == "invalid_arguments":
                for planned in self.plan.get(lead_id, ()):
                    if (planned.tool, dict(planned.args)) == (call["name"], call["args"]) \
                            and planned.fallback is not None:
                        calls.append((planned.tool, dict(planned.fallback)))
        return calls


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


class _Leads:
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
            from toolguard.context import current

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
            from toolguard.context import current

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
    return {tool.name: tool for tool in _make_tools(None, None)}  # type: ignore[arg-type]


def _make_tools(leads: _Leads, crm: Any) -> list[Any]:
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
    from toolguard.context import current_or_none

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


# --- the graph ---------------------------------------------------------------------------------


def _build_graph(tools: list[Any], faults: Faults) -> Any:
    from langchain_core.messages import AnyMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph
    from langgraph.graph.message import add_messages
    from langgraph.prebuilt import ToolNode
    from langgraph.types import RetryPolicy

    messages = Annotated[list[AnyMessage], add_messages]
    # one message list per agent: a schema computed at run time, which type checkers cannot read
    schema: Any = TypedDict
    state = schema("LeadState", {"lead_id": str, **{agent: messages for agent in AGENTS}})
    graph = StateGraph(state)
    retry = RetryPolicy(max_attempts=3, initial_interval=0.01, jitter=False, retry_on=ConnectionError)
    for agent in AGENTS:
        model = ScriptedAgentModel(agent=agent, plan=SCRIPT[agent])

        def think(values: Mapping[str, Any], agent: str = agent, model: Any = model) -> dict[str, Any]:
            history = list(values.get(agent) or [])
            new = [] if history else [HumanMessage(f"{TASKS[agent]} lead_id={values['lead_id']}")]
            return {agent: [*new, model.invoke(history + new)]}

        def route(values: Mapping[str, Any], agent: str = agent) -> str:
            return f"{agent}_tools" if values[agent][-1].tool_calls else END

        # langgraph's add_node overloads solve the node's input type to Never under mypy, so
        # no plain function matches them (not even one taking a class TypedDict state)
        graph.add_node(agent, think)  # type: ignore[call-overload]
        graph.add_node(f"{agent}_tools", ToolNode(tools, messages_key=agent,
                                                  wrap_tool_call=faults.wrap(agent)),
                       retry_policy=retry)
        graph.add_edge(START, agent)
        graph.add_conditional_edges(agent, route, [f"{agent}_tools", END])
        graph.add_edge(f"{agent}_tools", agent)
    return graph.compile(checkpointer=InMemorySaver())


def _run_lead(graph: Any, lead_id: str, pipeline: str,
              notify: Callable[[DemoEvent], None]) -> int:
    """Run one lead's thread to the end, answering every review; returns the interrupts seen."""
    from langgraph.types import Command

    config = {"configurable": {"thread_id": f"{pipeline}/{lead_id}"}, "recursion_limit": 50}
    result = graph.invoke({"lead_id": lead_id}, config)
    interrupts = 0
    while result.get("__interrupt__"):
        pending = result["__interrupt__"]
        interrupts += len(pending)
        for item in pending:
            question = item.value.get("question") if isinstance(item.value, Mapping) else item.value
            notify(DemoEvent("interrupt", lead_id, agent="intent_scorer",
                             detail=f"review requested: {question}"))
        answers = {item.id: {"approved": True, "by": "demo-reviewer"} for item in pending}
        notify(DemoEvent("resume", lead_id, detail="approved; resuming the thread"))
        result = graph.invoke(Command(resume=answers), config)
    notify(DemoEvent("lead_done", lead_id))
    return interrupts


# --- running it ----------------------------------------------------------------------------------


def _label(url: str) -> str:
    from toolguard.store.cli import redact

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
        tools = _make_tools(_Leads(store, pipeline, guarded, interleaving), http)
        graph = _build_graph(tools, faults)
        start_id = _newest_audit_id(store) if guarded else 0
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(LEADS), thread_name_prefix="lead") as pool:
            interrupts = sum(pool.map(lambda lead: _run_lead(graph, lead.lead_id, pipeline, notify),
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
        findings = [*_findings(records, events), *_crm_findings(crm_report)]
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


def _findings(records: Mapping[str, LeadRecord],
              events: Sequence[tuple[str, int, str, str, str, dict[str, Any]]]) -> list[Finding]:
    """What the event log says happened that should not have."""
    found: list[Finding] = []
    refused = {first_turn_call_id(agent, lead_id, index): (planned, agent)
               for agent in AGENTS for lead_id, plan in SCRIPT[agent].items()
               for index, planned in enumerate(plan) if planned.refused}
    applied = Counter((lead, tool, call_id) for lead, _, _, tool, call_id, _ in events)
    for (lead, tool, call_id), times in sorted(applied.items()):
        if times > 1:
            found.append(Finding(lead, "double_applied",
                                 f"{tool} applied {times}x for one tool call ({call_id})"))
    for lead, _, agent, tool, call_id, detail in events:
        if call_id in refused:
            planned, _ = refused[call_id]
            found.append(Finding(lead, "unchecked_write",
                                 f"{agent}'s {tool}({_args_text(planned.args)}) was applied; "
                                 f"the policy refuses it ({planned.refused})"))
        if tool == "set_tier":
            missing = [t for t in TIER_INPUTS if t not in detail.get("saw", [])]
            if missing:
                found.append(Finding(lead, "tier_before_scoring",
                                     f"tier {detail['set']['tier']} set from score "
                                     f"{detail.get('score')} before {', '.join(missing)} landed"))
    by_lead: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for lead, _, agent, tool, _, detail in events:
        by_lead.setdefault(lead, []).append((f"{agent}/{tool}", detail))
    for lead, writes in sorted(by_lead.items()):
        record = records.get(lead)
        if record is None:
            continue
        total = sum(int(detail.get("delta", 0)) for _, detail in writes)
        if record.score != total:
            found.append(Finding(lead, "lost_update",
                                 f"score is {record.score}, but the writes that landed add up to "
                                 f"{total}: {total - record.score:+d} points overwritten"))
        for who, detail in writes:
            for name, value in (detail.get("set") or {}).items():
                if getattr(record, name) != value:
                    found.append(Finding(lead, "lost_update",
                                         f"{who} set {name}={value!r}; the record says "
                                         f"{getattr(record, name)!r}"))
    return found


def _crm_findings(crm: CrmReport) -> list[Finding]:
    """What the CRM's push log says happened that should not have."""
    found = []
    applied = Counter((push.lead_id, push.stage) for push in crm.pushes)
    for (lead, stage), times in sorted(applied.items()):
        if times > 1:
            found.append(Finding(lead, "crm_double_push",
                                 f"the {stage} push was applied {times}x: the CRM got it again "
                                 f"after its answer was lost or the connection dropped"))
    late = crm.late_copy
    if late is not None and late.landed:
        found.append(Finding(late.lead_id, "crm_late_push",
                             f"{late.agent}'s push, stuck in the network, landed last, after its "
                             f"retry and the router's push: the CRM now holds the older copy"))
    return found


def _args_text(args: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items() if k != "lead_id")
