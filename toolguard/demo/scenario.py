"""The lead qualifier's scenario: six leads, what each agent sends, and the right answer.

Everything here is data and pure functions: ``expected_records()`` computes
the records a correct run must leave from the scenario alone, never from the
database or the tools, so the demo can compare.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "AGENTS",
    "CRASHES",
    "CRM_DELAYED",
    "CRM_LOST_ANSWER",
    "CRM_TOOL",
    "EMAIL_POINTS",
    "FIELDS",
    "LEADS",
    "SCRIPT",
    "STAGES",
    "STALLED",
    "TIER_INPUTS",
    "WRITE_TOOLS",
    "CrmRecord",
    "LeadRecord",
    "PlannedCall",
    "expected_crm_records",
    "expected_records",
    "first_turn_call_id",
    "fit_points",
    "follow_up",
    "tier_for",
]

AGENTS = ("lead_enricher", "intent_scorer", "email_verifier", "router")
WRITE_TOOLS = frozenset({"enrich_lead", "update_intent_score", "verify_email", "set_tier"})
#: What the router needs to have landed on a lead before it may set the tier.
TIER_INPUTS = ("enrich_lead", "update_intent_score", "verify_email")
#: The fields of a lead the agents set, compared with the expected records.
FIELDS = ("employees", "industry", "email_status", "score", "tier")
#: The tool that sends a lead to the CRM (it writes the CRM, not the leads table).
CRM_TOOL = "push_to_crm"
#: Who pushes a lead to the CRM, and when: the enricher once it has enriched the lead, the
#: router once it has set the tier. Each push sends the whole record as the agent reads it.
STAGES = {"enrich_lead": "enriched", "set_tier": "qualified"}


@dataclass(frozen=True, slots=True)
class LeadRecord:
    """One row of the leads table (``version`` counts the writes that landed)."""

    lead_id: str
    company: str
    email: str
    employees: int | None = None
    industry: str | None = None
    email_status: str | None = None
    score: int = 0
    tier: str | None = None
    version: int = 0


LEADS: tuple[LeadRecord, ...] = (
    LeadRecord("L-101", "Acme Robotics", "ana.ruiz@acme-robotics.example"),
    LeadRecord("L-102", "Brightwave Health", "j.okafor@brightwave.example"),
    LeadRecord("L-103", "Cobalt Logistics", "ops@cobalt-logistics.example"),
    LeadRecord("L-104", "Dunmore Foods", "priya@dunmorefoods.example"),
    LeadRecord("L-105", "Elm Street Bakery", "hello@elmstreetbakery.example"),
    LeadRecord("L-106", "Fjord Analytics", "lars@fjord-analytics.example"),
)

EMAIL_POINTS = {"valid": 10, "risky": 0, "invalid": -20}


def fit_points(employees: int) -> int:
    """Firmographic fit: bigger companies buy bigger plans."""
    if employees >= 1000:
        return 30
    if employees >= 250:
        return 20
    if employees >= 50:
        return 10
    return 0


def tier_for(score: int, email_status: str | None) -> str:
    """The sales tier: an undeliverable address disqualifies, else the score decides."""
    if email_status == "invalid":
        return "disqualified"
    if score >= 70:
        return "A"
    if score >= 40:
        return "B"
    return "C"


@dataclass(frozen=True, slots=True)
class PlannedCall:
    """A tool call the scripted model emits on its first turn for one lead.

    ``refused`` is the reason the policy refuses it (None: it applies);
    ``fallback`` is what the model sends instead after an ``invalid_arguments``.
    """

    tool: str
    args: Mapping[str, Any]
    refused: str | None = None
    fallback: Mapping[str, Any] | None = None


_FIRMOGRAPHICS = {"L-101": (1200, "manufacturing"), "L-102": (350, "healthcare"),
                  "L-103": (80, "logistics"), "L-104": (2500, "food and beverage"),
                  "L-105": (12, "retail"), "L-106": (600, "software")}
_SIGNALS = {"L-101": ("pricing-page", 30), "L-102": ("webinar", 20), "L-103": ("demo-request", 35),
            "L-104": ("trial-signup", 40), "L-105": ("newsletter", 80), "L-106": ("pricing-page", 30)}
_EMAIL_CHECKS = {"L-101": "valid", "L-102": "valid", "L-103": "risky", "L-104": "valid",
                 "L-105": "invalid", "L-106": "valid"}


def _script() -> dict[str, dict[str, tuple[PlannedCall, ...]]]:
    script: dict[str, dict[str, tuple[PlannedCall, ...]]] = {agent: {} for agent in AGENTS}
    for lead in LEADS:
        lid = lead.lead_id
        employees, industry = _FIRMOGRAPHICS[lid]
        script["lead_enricher"][lid] = (PlannedCall("enrich_lead", {
            "lead_id": lid, "source": "firmographics-api", "employees": employees,
            "industry": industry}),)
        signal, points = _SIGNALS[lid]
        score = {"lead_id": lid, "signal_id": signal, "points": points}
        if points > 50:  # the model over-weights one newsletter sign-up; the policy caps it
            scoring = [PlannedCall("update_intent_score", score, refused="invalid_arguments",
                                   fallback={**score, "points": 5})]
        else:
            scoring = [PlannedCall("update_intent_score", score)]
        if lid == "L-104":  # a big jump: ask a person first (LangGraph interrupt)
            scoring.append(PlannedCall("request_review", {
                "lead_id": lid, "reason": "intent score +40 from a single trial sign-up"}))
        script["intent_scorer"][lid] = tuple(scoring)
        script["email_verifier"][lid] = (PlannedCall("verify_email", {
            "lead_id": lid, "email": lead.email, "status": _EMAIL_CHECKS[lid]}),)
        routing = [PlannedCall("set_tier", {"lead_id": lid})]
        if lid == "L-106":  # the router likes this one and tries to help: not its tool
            routing.append(PlannedCall("update_intent_score", {
                "lead_id": lid, "signal_id": "router-hunch", "points": 25},
                refused="not_authorized"))
        script["router"][lid] = tuple(routing)
    return script


SCRIPT = _script()

#: (tool, lead): the call whose worker stalls past its lease after taking the lock.
STALLED = ("enrich_lead", "L-103")
#: (tool, lead): the call whose worker dies after the commit, before the checkpoint.
CRASHES = ("update_intent_score", "L-102")
#: (agent, lead): the CRM push whose connection drops after the CRM applied it: the answer
#: is lost, so the agent cannot tell whether it landed and sends it again.
CRM_LOST_ANSWER = ("router", "L-102")
#: (agent, lead): the CRM push stuck in the network: the connection drops before the CRM
#: sees it, the agent sends it again, and the stuck copy arrives after that retry and the
#: router's push.
CRM_DELAYED = ("lead_enricher", "L-103")


@dataclass(frozen=True, slots=True)
class CrmRecord:
    """One lead as the CRM holds it: the last push it applied, and how many it applied."""

    lead_id: str
    company: str
    email: str
    employees: int | None = None
    industry: str | None = None
    email_status: str | None = None
    score: int = 0
    tier: str | None = None
    pushes: int = 0


def follow_up(tool: str, lead_id: str) -> PlannedCall | None:
    """What an agent sends after ``tool`` succeeded on ``lead_id``: its CRM push, if any."""
    stage = STAGES.get(tool)
    if stage is None:
        return None
    return PlannedCall(CRM_TOOL, {"lead_id": lead_id, "stage": stage})


def expected_records(leads: Sequence[LeadRecord] = LEADS) -> dict[str, LeadRecord]:
    """The right final records, from the scenario alone (no database, no tools)."""
    out: dict[str, LeadRecord] = {}
    for lead in leads:
        applied = []
        for agent in AGENTS:
            for planned in SCRIPT[agent].get(lead.lead_id, ()):
                if planned.refused is None:
                    applied.append((planned.tool, planned.args))
                elif planned.fallback is not None:
                    applied.append((planned.tool, planned.fallback))
        record = lead
        score = 0
        for tool, args in applied:
            if tool == "enrich_lead":
                record = replace(record, employees=args["employees"], industry=args["industry"])
                score += fit_points(args["employees"])
            elif tool == "update_intent_score":
                score += args["points"]
            elif tool == "verify_email":
                record = replace(record, email_status=args["status"])
                score += EMAIL_POINTS[args["status"]]
        writes = sum(1 for tool, _ in applied if tool in WRITE_TOOLS)
        out[lead.lead_id] = replace(record, score=score, tier=tier_for(score, record.email_status),
                                    version=writes)
    return out


def first_turn_call_id(agent: str, lead_id: str, index: int) -> str:
    """The scripted model's tool-call ids: ``agent:lead:turn:index``, stable across runs."""
    return f"{agent}:{lead_id}:1:{index}"


def expected_crm_records(leads: Sequence[LeadRecord] = LEADS) -> dict[str, CrmRecord]:
    """What the CRM must hold after a correct run: each lead's final record, pushed once per stage."""
    return {lead_id: CrmRecord(lead_id, r.company, r.email, r.employees, r.industry,
                               r.email_status, r.score, r.tier, pushes=len(STAGES))
            for lead_id, r in expected_records(leads).items()}
