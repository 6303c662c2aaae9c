"""What one lead-qualifier run reports: the records against the expected ones, and the anomalies.

``Report`` (the leads table) and ``CrmReport`` (the CRM) compare what a run
left behind with the records the scenario expects (computed from the scenario
alone, never from the database); ``lead_findings`` and ``crm_findings`` read
the event log and the CRM's push log for what should not have happened (lost
updates, double-applied retries, a tier set before scoring, a late push).
Separate from the run (``toolguard.demo.lead_qualifier``) because it is plain
data: the CLI renders it and the tests assert on it without LangGraph.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from toolguard.demo.scenario import (
    AGENTS,
    FIELDS,
    SCRIPT,
    TIER_INPUTS,
    CrmRecord,
    LeadRecord,
    first_turn_call_id,
)
from toolguard.store.base import AuditEntry

if TYPE_CHECKING:
    from toolguard.demo.crm import CrmPush
    from toolguard.demo.network import LateCopy

__all__ = ["CrmReport", "Finding", "Report", "crm_findings", "lead_findings"]



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


# --- what went wrong ----------------------------------------------------------------------


def lead_findings(records: Mapping[str, LeadRecord],
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


def crm_findings(crm: CrmReport) -> list[Finding]:
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
