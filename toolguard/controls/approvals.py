"""Approvals bound to the intent: ``approval:`` pauses a call for a person before it locks.

A request is recorded in the store (``toolguard_approval``) for one intent: its
tool, agent, idempotency key, validated arguments' hash and the policy digest,
with an expiry. An approval therefore cannot be replayed onto another call: other
arguments, another tool or agent, or another policy version is ``approval_mismatch``;
after the expiry it is ``approval_expired``. The person approves, edits (the
edit replaces the top-level arguments it names, and the guard validates the
result again) or rejects, with ``toolguard approve ID`` / ``toolguard deny ID``
or, in LangGraph, through the value the graph is resumed with.

This module is the approval book: the records, their storage and the rules
that read one record (``bind``: does it approve this intent, now?) or the
policy's ``approval:`` block (``approval_reason``). The guard's decision on a
call (whether it waits for a person, what the guard answers, how the request
is audited, how a LangGraph resume value is matched to its request) is the
approval step's, ``toolguard.steps.approval``, which asks the book through
these methods (and ``get``) and never the other way round (this module
imports no step)::

    record, made = book.requested(facts, why, expires_s)  # the intent's request: found or made now
    approved = book.binding(record, facts)                # Approved, or the refusal the record means
    record = book.answered(facts, resume)                 # record a person's answer on its request
    record = book.apply(record, resume)                   # ... on a request already read

A caller without a guard asks ``check``, the same questions in one call::

    approved = book.check(rule, facts)           # None: no approval needed
    # raises ApprovalRequired(approval_id, request) the first time (and while pending),
    # ApprovalDenied, ApprovalExpired or ApprovalMismatch; returns Approved otherwise

and calls again with the same intent (same idempotency key) once someone
decided, or passes ``resume=parse_resume(value, approval_id=...)``.

Interrupt payload (``ApprovalRecord.payload()``)::

    {"type": "toolguard_approval", "approval_id": "ap_...", "tool_call_id": "...",
     "name": "transfer", "args": {...redacted...}, "keys": ["account:~i1"],
     "agent": "payments", "description": "large transfer (amount > 1000)",
     "policy_version": "<sha-256>", "expires_at": "2025-01-31T14:00:00+00:00",
     "allowed_decisions": ["approve", "edit", "reject"]}

Resume value (``parse_resume``), shaped like LangChain's HITL decisions::

    {"type": "approve", "by": "alice", "note": "checked with finance"}
    {"type": "edit", "args": {"amount": 900}, "by": "alice"}      # or "edited_action": {"args": ...}
    {"type": "reject", "message": "not today", "by": "alice"}
    "approve" / "reject"                                          # no name, no note
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from toolguard.call.facts import CallFacts
from toolguard.call.intent import args_hash, check_limits
from toolguard.call.recording import storable, storable_text
from toolguard.controls._rows import arows, rows
from toolguard.errors import (
    ApprovalDenied,
    ApprovalExpired,
    ApprovalMismatch,
    ApprovalRequired,
    IntentRejected,
    UnknownApproval,
)
from toolguard.policies.decisions import _violation
from toolguard.policies.model import ArgConstraint, ToolPolicy
from toolguard.policies.paths import MISSING, FieldPath
from toolguard.runtime.safe_text import safe_repr
from toolguard.store.base import AsyncGuardedStore, AuditEntry, GuardedStore, dump_json

__all__ = [
    "DECISIONS",
    "PAYLOAD_TYPE",
    "ApprovalBook",
    "ApprovalRecord",
    "Approved",
    "AsyncApprovalBook",
    "InvalidResume",
    "Resume",
    "approval_reason",
    "bind",
    "check_edit",
    "check_identity",
    "parse_resume",
    "request_refusal",
    "well_formed_id",
]

ApprovalStatus = Literal["pending", "approved", "denied"]
DecisionName = Literal["approve", "edit", "reject"]
DECISIONS: tuple[DecisionName, ...] = ("approve", "edit", "reject")
#: ``payload()["type"]``: how a client tells toolguard's interrupt from others.
PAYLOAD_TYPE = "toolguard_approval"
_STATUS = {"approve": "approved", "edit": "approved", "reject": "denied"}
_AUDIT_REASON = {"approve": "approved", "edit": "edited", "reject": "denied"}
_MAX_NAME, _MAX_NOTE = 200, 2000
#: How many unknown fields of a resume value an error names.
_MAX_LISTED = 5
#: What an approval id may look like: ``ap_`` + hex is what ``made`` writes; anything else
#: (NUL, a 5,000-character string, a number) names no request and never reaches the store.
_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")

COLUMNS = ("id", "tool", "agent", "workflow", "idempotency_key", "args_hash", "policy_version",
           "keys", "args", "why", "status", "requested_at", "expires_at", "decided_by",
           "decided_at", "note", "edited_args", "edited_args_hash")
SELECT = f"SELECT {', '.join(COLUMNS)} FROM toolguard_approval"
INSERT = (f"INSERT INTO toolguard_approval (id, tool, agent, workflow, idempotency_key, args_hash, "
          f"policy_version, keys, args, why, requested_at, expires_at) "
          f"VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
          f"ON CONFLICT (tool, idempotency_key) DO NOTHING RETURNING {', '.join(COLUMNS)}")
DECIDE = (f"UPDATE toolguard_approval SET status = %s, decided_by = %s, decided_at = %s, note = %s, "
          f"edited_args = %s, edited_args_hash = %s "
          f"WHERE id = %s AND status = 'pending' AND expires_at > %s RETURNING {', '.join(COLUMNS)}")


class InvalidResume(IntentRejected):
    """The value a graph was resumed with is not a decision on this call's request.

    A refusal of the call, not an exception for the host: LangGraph keeps the
    resume value of a failed step and would replay it on every retry, so an
    error would leave the thread stuck; refused, the model reads why.
    """

    reason = "invalid_resume"


# --- the records -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ApprovalRecord:
    """One approval request and, once a person decided, the decision."""

    id: str
    tool: str
    agent: str | None
    workflow: str | None
    idempotency_key: str
    args_hash: str
    policy_version: str
    keys: tuple[str, ...]
    args: Any
    why: str | None
    status: ApprovalStatus
    requested_at: datetime
    expires_at: datetime
    decided_by: str | None = None
    decided_at: datetime | None = None
    note: str | None = None
    edited_args: Mapping[str, Any] | None = None
    edited_args_hash: str | None = None

    def expired(self, now: datetime) -> bool:
        return now >= self.expires_at

    def payload(self, *, tool_call_id: str | None = None) -> dict[str, Any]:
        """What a person needs to decide: the LangGraph ``interrupt()`` value (JSON-ready)."""
        return {
            "type": PAYLOAD_TYPE, "approval_id": self.id, "tool_call_id": tool_call_id,
            "name": self.tool, "args": self.args, "keys": list(self.keys), "agent": self.agent,
            "description": self.why or "approval required", "policy_version": self.policy_version,
            "expires_at": self.expires_at.isoformat(), "allowed_decisions": list(DECISIONS),
        }


@dataclass(frozen=True, slots=True)
class Approved:
    """An approval that binds this intent; ``edited_args`` are the person's replacements."""

    record: ApprovalRecord

    @property
    def edited(self) -> bool:
        return self.record.edited_args is not None

    def args(self, original: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments to run: ``original`` with the edited top-level arguments replaced.

        The guard validates the result again (schema, constraints, keys) before it runs.
        """
        return {**original, **(self.record.edited_args or {})}


@dataclass(frozen=True, slots=True)
class Resume:
    """A person's decision on one request, as a LangGraph resume value carries it."""

    decision: DecisionName
    approval_id: str | None = None
    args: Mapping[str, Any] | None = None
    by: str | None = None
    note: str | None = None
    tool: str | None = None  # the tool an edit names (``edited_action.name``), if any

    def check_tool(self, record: ApprovalRecord) -> None:
        """``InvalidResume`` for an edit naming another tool than the request's: never run as this one."""
        if self.tool is not None and self.tool != record.tool:
            msg = (f"the edit names tool {self.tool!r}, and approval {record.id} is for "
                   f"{record.tool!r}: an edit changes arguments, never the tool")
            raise InvalidResume(msg)


# --- pure decisions ------------------------------------------------------------------------


def approval_reason(rule: ToolPolicy, args: Mapping[str, Any]) -> str | None:
    """Why this call needs approval (text for the person), or None when it needs none."""
    approval = rule.approval
    if approval is None:
        return None
    if approval.always:
        return approval.reason or "every call of this tool needs approval"
    for condition in approval.when:
        matched = [_matches(path, constraint, args) for path, constraint in condition.items()]
        if all(text is not None for text in matched):
            what = " and ".join(text for text in matched if text)
            return f"{approval.reason} ({what})" if approval.reason else what
    return None


def _matches(path: FieldPath, constraint: ArgConstraint, args: Mapping[str, Any]) -> str | None:
    """``"amount > 1000"`` when some value at ``path`` satisfies ``constraint``, else None.

    A value the condition cannot judge (``"5000"`` or ``true`` for ``gt: 1000``: a
    tool without a registered schema takes what the model sends) matches: a call
    is never spared its approval because its value has an unexpected type.
    """
    for where, value in path.resolve(args):
        if value is MISSING or value is None:
            continue
        shown = where.removeprefix("args.")
        odd = _unjudgeable(constraint, value)
        if odd is not None:
            return f"{shown} is {odd}, not comparable with {_described(constraint)}"
        if _violation(constraint, value) is None:
            return f"{shown} {_described(constraint)}"
    return None


def _unjudgeable(constraint: ArgConstraint, value: Any) -> str | None:
    """What ``value`` is, when it is not of a kind ``constraint`` compares (else None)."""
    kinds = constraint.kinds
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if "number" in kinds and not is_number:
        return f"not a number ({type(value).__name__})"
    if "number" in kinds and isinstance(value, float) and not math.isfinite(value):
        return "not a finite number"
    if "string" in kinds and not isinstance(value, str):
        return f"not text ({type(value).__name__})"
    if "collection" in kinds and not isinstance(value, list | tuple | Mapping):
        return f"not a list ({type(value).__name__})"
    return None


def _described(rule: ArgConstraint) -> str:
    parts = []
    for name, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if getattr(rule, name) is not None:
            parts.append(f"{symbol} {getattr(rule, name)}")
    if rule.enum is not None:
        parts.append(f"in {json.dumps(list(rule.enum))}")
    if rule.pattern is not None:
        parts.append(f"matches {rule.pattern!r}")
    for name in ("min_length", "max_length", "min_items", "max_items"):
        if getattr(rule, name) is not None:
            parts.append(f"{name} {getattr(rule, name)}")
    return " and ".join(parts)


def bind(record: ApprovalRecord, facts: CallFacts, now: datetime) -> Approved:
    """Check that ``record`` approves exactly this intent, now; else raise why not.

    ``ApprovalMismatch`` (other tool, intent, arguments or policy version) comes
    before ``ApprovalExpired``, which comes before the status:
    ``ApprovalRequired`` while pending, ``ApprovalDenied`` when denied.
    """
    check_identity(record, facts)
    if record.expired(now):
        msg = (f"approval {record.id} for {facts.tool} expired at "
               f"{record.expires_at.isoformat(timespec='seconds')}")
        raise ApprovalExpired(msg)
    if record.status == "pending":
        raise request_refusal(record)
    if record.status == "denied":
        who = f" by {record.decided_by}" if record.decided_by else ""
        why = f": {record.note}" if record.note else ""
        raise ApprovalDenied(f"{facts.tool} was denied{who}{why}")
    return Approved(record)


def check_identity(record: ApprovalRecord, facts: CallFacts) -> None:
    """``ApprovalMismatch`` unless ``record`` was asked for this very intent, by this agent,
    under this policy (a key template can make two agents' calls one intent)."""
    if record.tool != facts.tool or record.idempotency_key != facts.idempotency_key:
        msg = (f"approval {record.id} was given for another call ({record.tool}), not this "
               f"{facts.tool} call")
        raise ApprovalMismatch(msg)
    if record.agent != facts.agent:
        msg = (f"approval {record.id} was given for a call by agent {record.agent!r}, not by "
               f"{facts.agent!r}: a person approves one agent's call")
        raise ApprovalMismatch(msg)
    if record.args_hash != facts.args_hash:
        msg = (f"approval {record.id} was given for other arguments of {facts.tool}: an approval "
               f"cannot be carried over to changed arguments; ask again with a new call")
        raise ApprovalMismatch(msg)
    if record.policy_version != facts.policy_digest:
        msg = (f"approval {record.id} was asked under policy {record.policy_version[:12]}, and the "
               f"policy is now {facts.policy_digest[:12]}: ask again with a new call")
        raise ApprovalMismatch(msg)


def request_refusal(record: ApprovalRecord) -> ApprovalRequired:
    """The ``ApprovalRequired`` a call waiting on ``record`` is refused with."""
    msg = (f"{record.tool} needs approval ({record.why or 'required'}): "
           f"`toolguard approve {record.id}` or `toolguard deny {record.id}`, then call again")
    return ApprovalRequired(msg, approval_id=record.id, request=record.payload())


def well_formed_id(value: Any) -> bool:
    """True if ``value`` can be an approval id (text, 1 to 128 of ``A-Za-z0-9_.:-``)."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def parse_resume(value: Any, *, approval_id: str | None = None) -> Resume:
    """Read a resume value (see the module docstring); ``InvalidResume`` says what is wrong.

    Everything in it is untrusted: the id must look like one, an edit's arguments
    must be JSON within the default input limits (the guard validates them again
    against the tool), texts must be storable.
    """
    if isinstance(value, str) and value in DECISIONS and value != "edit":
        return Resume(decision=value, approval_id=approval_id)
    if not isinstance(value, Mapping):
        msg = (f"a resume value is 'approve', 'reject' or a mapping with type: approve|edit|reject, "
               f"got {type(value).__name__}")
        raise InvalidResume(msg)
    data = dict(value)
    decision = data.pop("type", None) or data.pop("decision", None)
    if not isinstance(decision, str) or decision not in DECISIONS:
        msg = f"type must be one of {', '.join(DECISIONS)}, got {_shown(decision)}"
        raise InvalidResume(msg)
    given_id = data.pop("approval_id", None)
    if given_id is not None and not well_formed_id(given_id):
        msg = f"approval_id is not an approval id: {_shown(given_id)}"
        raise InvalidResume(msg)
    if given_id is not None and approval_id is not None and given_id != approval_id:
        msg = f"the resume value answers approval {given_id!r}, not {approval_id!r}"
        raise InvalidResume(msg)
    args = data.pop("args", None)
    action = data.pop("edited_action", None)
    tool: str | None = None
    if action is not None:
        if not isinstance(action, Mapping) or args is not None or not set(action) <= {"name", "args"}:
            msg = "edited_action is a mapping with args (and name); give it or args, not both"
            raise InvalidResume(msg)
        args = action.get("args")
        tool = _text(action.get("name"), "edited_action.name", _MAX_NAME)
    if decision == "edit":
        check_edit(args)
    elif args is not None:
        msg = f"args only go with type: edit, not {decision}"
        raise InvalidResume(msg)
    by = _text(data.pop("by", None), "by", _MAX_NAME)
    note = _text(data.pop("note", None) or data.pop("message", None), "note", _MAX_NOTE)
    data.pop("tool_call_id", None)
    if data:
        names = sorted(map(_shown, list(data)[:_MAX_LISTED]))
        more = f" and {len(data) - _MAX_LISTED} more" if len(data) > _MAX_LISTED else ""
        msg = f"unknown field(s) in the resume value: {', '.join(names)}{more}"
        raise InvalidResume(msg)
    return Resume(decision=decision, approval_id=given_id or approval_id,
                  args=dict(args) if args is not None else None, by=by, note=note, tool=tool)


def check_edit(args: Any) -> None:
    """``InvalidResume`` unless ``args`` can be an edit: a non-empty mapping of JSON values
    within the default input limits, storable in every store (no NUL, valid Unicode).

    The person's edit is checked before it is stored as a decision; the guard then
    validates the edited call against the tool and the policy, as any call.
    """
    if not isinstance(args, Mapping) or not args or not all(isinstance(k, str) for k in args):
        msg = "an edit needs args: a non-empty mapping of the arguments it replaces"
        raise InvalidResume(msg)
    try:
        check_limits(args, root="the edit's args")
    except IntentRejected as error:
        raise InvalidResume(error.message) from None
    if storable(dict(args)) != args:
        msg = "the edit's args hold NUL or a lone surrogate, which no store keeps"
        raise InvalidResume(msg)


def _shown(value: Any) -> str:
    """A short, storable rendering of an untrusted value for an error message (never raises)."""
    return storable_text(safe_repr(value, 60)) or ""


def _text(value: Any, name: str, limit: int) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > limit or storable_text(value, limit) != value:
        msg = f"{name} is text of at most {limit} characters (no NUL, valid Unicode)"
        raise InvalidResume(msg)
    return value


# --- storage: statements and rows, shared by both books --------------------------------------


def _moment(value: Any) -> datetime | None:
    if value is None:
        return None
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _record(row: tuple[Any, ...]) -> ApprovalRecord:
    data = dict(zip(COLUMNS, row, strict=True))
    for name in ("requested_at", "expires_at", "decided_at"):
        data[name] = _moment(data[name])
    for name in ("keys", "args", "edited_args"):
        data[name] = _json(data[name])
    data["keys"] = tuple(data["keys"] or ())
    return ApprovalRecord(**data)


def _stored(value: datetime, dialect: str) -> Any:
    return value if dialect == "postgresql" else value.astimezone(UTC).isoformat(timespec="microseconds")


def _insert_params(facts: CallFacts, why: str, expires_s: float, now: datetime,
                   dialect: str) -> tuple[Any, ...]:
    keys: Any = list(facts.keys) if dialect == "postgresql" else dump_json(list(facts.keys), "keys")
    return (f"ap_{uuid.uuid4().hex}", facts.tool, facts.agent, facts.workflow, facts.idempotency_key,
            facts.args_hash, facts.policy_digest, keys,
            dump_json(facts.shown_args(), "approval args"), why, _stored(now, dialect),
            _stored(now + timedelta(seconds=expires_s), dialect))


def _decide_params(approval_id: str, decision: DecisionName, by: str | None, note: str | None,
                   args: Mapping[str, Any] | None, now: datetime, dialect: str) -> tuple[Any, ...]:
    if not well_formed_id(approval_id):
        raise UnknownApproval(f"no approval request {_shown(approval_id)}")
    if decision not in DECISIONS:
        msg = f"a decision is one of {', '.join(DECISIONS)}, got {decision!r}"
        raise InvalidResume(msg)
    if (decision == "edit") != (args is not None):
        msg = "an edit needs args, and only an edit takes them"
        raise InvalidResume(msg)
    if args is not None:
        check_edit(args)
    edited = dump_json(dict(args), "edited args") if args is not None else None
    edited_hash = args_hash(dict(args)) if args is not None else None
    return (_STATUS[decision], by, _stored(now, dialect), note, edited, edited_hash, approval_id,
            _stored(now, dialect))


def _not_decided(record: ApprovalRecord | None, approval_id: str, decision: DecisionName,
                 now: datetime) -> ApprovalRecord:
    """Why ``decide`` changed nothing: unknown, expired, or decided already (same: fine)."""
    if record is None:
        raise UnknownApproval(f"no approval request {approval_id!r}")
    if record.status == "pending" and record.expired(now):
        raise ApprovalExpired(f"approval request {approval_id} expired at "
                              f"{record.expires_at.isoformat(timespec='seconds')}")
    if record.status == _STATUS[decision] and decision != "edit" and record.edited_args is None:
        return record  # the same decision again (a retried command, a replayed resume)
    who = f" by {record.decided_by}" if record.decided_by else ""
    raise UnknownApproval(f"approval request {approval_id} was already {record.status}{who}",
                          reason="approval_decided")


def _audit(record: ApprovalRecord, decision: DecisionName, by: str | None) -> AuditEntry:
    who = f" by {by}" if by else ""
    edited = sorted(record.edited_args) if record.edited_args is not None else None
    changed = f" (changed: {', '.join(edited)})" if edited else ""
    return AuditEntry(
        decision="operator", reason=_AUDIT_REASON[decision], tool=record.tool, agent=record.agent,
        idempotency_key=record.idempotency_key, workflow=record.workflow, keys=record.keys,
        args={"approval_id": record.id, "by": by, "edited": edited},
        policy_version=record.policy_version,  # the policy the request was made (and bound) under
        detail=(f"approval {record.id} {_AUDIT_REASON[decision]}{who}"
                f"{changed}"
                f"{f': {record.note}' if record.note else ''}"))


def _utc_now() -> datetime:
    return datetime.now(UTC)


# --- the books ---------------------------------------------------------------------------------


class ApprovalBook:
    """Approval requests in a sync store: what the approval step asks, and ``check``."""

    def __init__(self, store: GuardedStore, *, clock: Callable[[], datetime] = _utc_now) -> None:
        self.store = store
        self.clock = clock

    def check(self, rule: ToolPolicy, facts: CallFacts, *, resume: Resume | None = None
              ) -> Approved | None:
        """None when ``rule`` needs no approval for ``facts``; else the binding approval or a refusal.

        Without ``resume``: the intent's request is found (or made) and bound.
        With ``resume`` (a person answered the interrupt): the decision is recorded
        on the request it names, then bound.
        """
        why = approval_reason(rule, facts.args)
        if why is None or rule.approval is None:
            return None
        if resume is not None:
            return self.binding(self.answered(facts, resume), facts)
        record, _ = self.requested(facts, why, rule.approval.expires)
        return self.binding(record, facts)

    def requested(self, facts: CallFacts, why: str, expires_s: float) -> tuple[ApprovalRecord, bool]:
        """The intent's request as it stands, and True when this call made it (else found it)."""
        record = self.find(facts.tool, facts.idempotency_key)
        if record is not None:
            return record, False
        return self.made(facts, why, expires_s)

    def binding(self, record: ApprovalRecord, facts: CallFacts) -> Approved:
        """``bind`` at the book's clock: ``Approved``, or the refusal ``record`` means for ``facts``."""
        return bind(record, facts, self.clock())

    def answered(self, facts: CallFacts, resume: Resume) -> ApprovalRecord:
        """Record a person's answer (``resume``) on the request of this call it names.

        ``ApprovalMismatch`` when it names none, or a request asked for another call
        (a resume meant for another call decides nothing); a request decided already
        is returned as it stands (``binding`` says what it means).
        """
        record = self.get(resume.approval_id) if resume.approval_id else None
        if record is None:
            msg = f"the resume value names no approval request of this call ({resume.approval_id!r})"
            raise ApprovalMismatch(msg)
        if record.status == "pending":
            check_identity(record, facts)
            record = self.apply(record, resume)
        return record

    def apply(self, record: ApprovalRecord, resume: Resume) -> ApprovalRecord:
        """Record ``resume`` on ``record``: ``InvalidResume`` for an edit naming another tool, else
        ``decide``."""
        resume.check_tool(record)
        return self.decide(record.id, resume.decision, by=resume.by, note=resume.note,
                           args=resume.args)

    def request(self, facts: CallFacts, why: str, expires_s: float) -> ApprovalRecord:
        """The intent's request: made now, or the one made before (one per tool and key)."""
        return self.made(facts, why, expires_s)[0]

    def made(self, facts: CallFacts, why: str, expires_s: float) -> tuple[ApprovalRecord, bool]:
        """``request``, and whether this call made it (True) or found it made before (False)."""
        params = _insert_params(facts, why, expires_s, self.clock(), self.store.dialect)
        made = rows(self.store, INSERT, params)
        if made:
            return _record(made[0]), True
        found = self.find(facts.tool, facts.idempotency_key)
        assert found is not None
        return found, False

    def get(self, approval_id: str) -> ApprovalRecord | None:
        """The request ``approval_id`` names; None for none (or for text no id looks like)."""
        if not well_formed_id(approval_id):
            return None
        found = rows(self.store, f"{SELECT} WHERE id = %s", (approval_id,))
        return _record(found[0]) if found else None

    def find(self, tool: str, idempotency_key: str) -> ApprovalRecord | None:
        found = rows(self.store, f"{SELECT} WHERE tool = %s AND idempotency_key = %s",
                     (tool, idempotency_key))
        return _record(found[0]) if found else None

    def pending(self, limit: int = 50) -> list[ApprovalRecord]:
        """Requests waiting for a decision (expired ones too, oldest first)."""
        found = rows(self.store, f"{SELECT} WHERE status = 'pending' ORDER BY requested_at, id "
                                 f"LIMIT %s", (limit,))
        return [_record(row) for row in found]

    def decide(self, approval_id: str, decision: DecisionName, *, by: str | None = None,
               note: str | None = None, args: Mapping[str, Any] | None = None) -> ApprovalRecord:
        """Record a person's decision on a pending, unexpired request; audited with who.

        The same decision twice returns the record; another decision on a decided
        request is ``UnknownApproval`` (reason ``approval_decided``).
        """
        now = self.clock()
        params = _decide_params(approval_id, decision, by, note, args, now, self.store.dialect)
        changed = rows(self.store, DECIDE, params)
        if not changed:
            return _not_decided(self.get(approval_id), approval_id, decision, now)
        record = _record(changed[0])
        self.store.audit(_audit(record, decision, by))
        return record


class AsyncApprovalBook:
    """The asyncio twin of ``ApprovalBook``."""

    def __init__(self, store: AsyncGuardedStore, *,
                 clock: Callable[[], datetime] = _utc_now) -> None:
        self.store = store
        self.clock = clock

    async def check(self, rule: ToolPolicy, facts: CallFacts, *, resume: Resume | None = None
                    ) -> Approved | None:
        why = approval_reason(rule, facts.args)
        if why is None or rule.approval is None:
            return None
        if resume is not None:
            return self.binding(await self.answered(facts, resume), facts)
        record, _ = await self.requested(facts, why, rule.approval.expires)
        return self.binding(record, facts)

    async def requested(self, facts: CallFacts, why: str,
                        expires_s: float) -> tuple[ApprovalRecord, bool]:
        record = await self.find(facts.tool, facts.idempotency_key)
        if record is not None:
            return record, False
        return await self.made(facts, why, expires_s)

    def binding(self, record: ApprovalRecord, facts: CallFacts) -> Approved:
        """No I/O, so not a coroutine: the same as ``ApprovalBook.binding``."""
        return bind(record, facts, self.clock())

    async def answered(self, facts: CallFacts, resume: Resume) -> ApprovalRecord:
        record = await self.get(resume.approval_id) if resume.approval_id else None
        if record is None:
            msg = f"the resume value names no approval request of this call ({resume.approval_id!r})"
            raise ApprovalMismatch(msg)
        if record.status == "pending":
            check_identity(record, facts)
            record = await self.apply(record, resume)
        return record

    async def apply(self, record: ApprovalRecord, resume: Resume) -> ApprovalRecord:
        resume.check_tool(record)
        return await self.decide(record.id, resume.decision, by=resume.by, note=resume.note,
                                 args=resume.args)

    async def request(self, facts: CallFacts, why: str, expires_s: float) -> ApprovalRecord:
        return (await self.made(facts, why, expires_s))[0]

    async def made(self, facts: CallFacts, why: str,
                   expires_s: float) -> tuple[ApprovalRecord, bool]:
        params = _insert_params(facts, why, expires_s, self.clock(), self.store.dialect)
        made = await arows(self.store, INSERT, params)
        if made:
            return _record(made[0]), True
        found = await self.find(facts.tool, facts.idempotency_key)
        assert found is not None
        return found, False

    async def get(self, approval_id: str) -> ApprovalRecord | None:
        if not well_formed_id(approval_id):
            return None
        found = await arows(self.store, f"{SELECT} WHERE id = %s", (approval_id,))
        return _record(found[0]) if found else None

    async def find(self, tool: str, idempotency_key: str) -> ApprovalRecord | None:
        found = await arows(self.store, f"{SELECT} WHERE tool = %s AND idempotency_key = %s",
                            (tool, idempotency_key))
        return _record(found[0]) if found else None

    async def pending(self, limit: int = 50) -> list[ApprovalRecord]:
        found = await arows(self.store, f"{SELECT} WHERE status = 'pending' ORDER BY requested_at, "
                                        f"id LIMIT %s", (limit,))
        return [_record(row) for row in found]

    async def decide(self, approval_id: str, decision: DecisionName, *, by: str | None = None,
                     note: str | None = None,
                     args: Mapping[str, Any] | None = None) -> ApprovalRecord:
        now = self.clock()
        params = _decide_params(approval_id, decision, by, note, args, now, self.store.dialect)
        changed = await arows(self.store, DECIDE, params)
        if not changed:
            return _not_decided(await self.get(approval_id), approval_id, decision, now)
        record = _record(changed[0])
        await self.store.audit(_audit(record, decision, by))
        return record

