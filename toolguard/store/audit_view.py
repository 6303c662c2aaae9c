"""The audit log as people read it: what a row means, which rows to show, how to print them.

The vocabulary (decisions, their styles, one line per reason code), the
filters every view applies (``AuditFilters``, times like ``30m`` or ``today``
through ``parse_moment``) and the formatting every view shares: stored text
made visible (``visible``), UTC times, the one-line "why", JSON and CSV rows.
It lives with the store, not in a surface, because the CLI's audit commands
and the review page both read the log through it, and neither imports the other.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from toolguard.store import AuditEntry

__all__ = ["CSV_COLUMNS", "DECISIONS", "DECISION_STYLE", "REASONS", "UNPROVEN", "UNPROVEN_FIELDS",
           "AuditFilters", "arguments", "parse_moment", "unproven", "visible"]

#: What a stored value must not send to a terminal (or a page) as it is: control characters
#: (escape sequences, C1 controls), bidi overrides and isolates, lone surrogates.
_HIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
                     "\ud800-\udfff]")
_HIDDEN_INLINE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f"
                            "\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str, *, lines: bool = False) -> str:
    """``text`` with every control character, bidi control and lone surrogate written as a
    visible escape (``\\x1b``, ``\\u202e``); ``lines=True`` keeps newlines and tabs."""
    return (_HIDDEN_INLINE if lines else _HIDDEN).sub(_escape_char, text)

DECISIONS = ("accepted", "replayed", "rejected", "failed", "unknown", "pending", "shadow",
             "operator", "hold")
DECISION_STYLE = {"accepted": "green", "replayed": "cyan", "rejected": "bold red",
                  "failed": "red", "unknown": "yellow", "pending": "magenta", "shadow": "blue",
                  "operator": "bold", "hold": "cyan"}
#: One line per reason code, for people reading a refusal.
REASONS = {
    "statement_timeout": "PostgreSQL's statement_timeout ended a statement; nothing was committed, "
                         "a retry may run it",
    "query_canceled": "the statement was cancelled (pg_cancel_backend); nothing was committed",
    "deadlock": "PostgreSQL broke a deadlock by ending this transaction; nothing was committed",
    "serialization_failure": "the transaction could not be serialized; nothing was committed",
    "lock_not_available": "a lock was not granted within the session's lock_timeout; nothing was "
                          "committed",
    "applied": "the intent ran and its write committed",
    "duplicate": "already applied under this idempotency key: the recorded result was returned",
    "stale_fencing_token": "a newer lock holder had written: a stalled holder's late write was refused",
    "out_of_order": "an `after:` tool had not applied on this resource yet",
    "read": "a read: the versions this caller saw of its keys were recorded",
    "stale_read": "a key this caller read (or decides on) was written by someone else since: the "
                  "decision rested on a stale read",
    "unread": "the write needs a current read of a key by this caller and had none",
    "not_authorized": "this agent may not call this tool",
    "unknown_tool": "the tool is not in the policy (denied by default)",
    "invalid_arguments": "the arguments broke the tool's schema or a policy constraint",
    "lock_timeout": "the lock stayed busy past the wait timeout",
    "hold_lost": "the caller's hold (hold: true) on the key had ended before this write; "
                 "nothing was written",
    "hold_deadlock": "this caller waited in a cycle of holds and was the youngest on it: its "
                     "wait ended and its holds were released",
    "hold_ended": "a hold (hold: true) ended otherwise than by its caller's write; the detail "
                  "says why",
    "lease_lost": "the lease expired or was taken while the tool ran",
    "not_owned": "the lock server says another holder owns the lock",
    "idempotency_conflict": "the same idempotency key came with other arguments",
    "missing_idempotency_key": "an unfenced tool needs a stable idempotency key",
    "backend_unavailable": "the lock server or store could not be reached",
    "interrupted": "a LangGraph interrupt paused the call; resuming re-runs it",
    "cancelled": "the call was cancelled mid-flight; its outcome is reconciled on the next attempt",
    "tool_error": "the tool reported an error; its transaction was rolled back",
    "error": "the tool raised; its transaction was rolled back",
    "paused": "an operator paused this tool or agent (`toolguard pause`)",
    "resumed": "an operator lifted a pause (`toolguard resume`)",
    "rate_limited": "more calls in the window than the quota allows",
    "in_flight_limited": "as many calls as the quota allows were running already",
    "budget_exceeded": "the call would take the window's sum over the quota's budget",
    "approval_required": "the call waits for a person (`toolguard approve ID`)",
    "approval_denied": "a person denied the call",
    "approval_expired": "the approval (or its request) expired",
    "approval_mismatch": "the approval was given for other arguments, another call or policy",
    "invalid_resume": "the graph was resumed with a value that is not a decision on this call",
    "approved": "a person approved a call",
    "edited": "a person approved a call with changed arguments",
    "denied": "a person denied a call",
}
CSV_COLUMNS = ("id", "at", "decision", "reason", "agent", "tool", "keys", "intent_id",
               "idempotency_key", "workflow", "tokens", "args", "detail", "duration_ms",
               "node_attempt", "policy_version")


def _why(entry: AuditEntry, width: int = 160) -> str:
    text = entry.detail or REASONS.get(entry.reason, "")
    if entry.decision == "accepted" and entry.reason == "applied" and not entry.detail:
        text = ""
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def _when(moment: datetime | None, *, short: bool = False) -> str:
    if moment is None:
        return "-"
    utc = moment.astimezone(UTC)
    if short:
        return utc.strftime("%Y-%m-%d %H:%M:%S")
    return utc.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _jsonable(entry: AuditEntry) -> dict[str, Any]:
    data = entry.as_dict()
    if entry.at is not None:
        data["at"] = _when(entry.at)
    return data


#: The ``args`` member where a signed service keeps what a request brought that no claim
#: proved (``toolguard.fences.proof``): never in a column, where it would read as proven.
UNPROVEN = "unproven"
#: The values it may hold, each with how the views name it (``agent (unproven)``).
UNPROVEN_FIELDS = (("agent", "agent"), ("intent_id", "intent id"),
                   ("idempotency_key", "idempotency key"), ("tokens", "tokens"))


def _marker(args: Any) -> dict[str, Any] | None:
    found = args.get(UNPROVEN) if isinstance(args, dict) and len(args) == 1 else None
    return found if isinstance(found, dict) else None


def unproven(entry: AuditEntry) -> dict[str, str]:
    """What the request brought that no claim proved, as text, by field name (``tokens`` as
    ``key=token, ...``); empty for a row that marks nothing."""
    found = _marker(entry.args) or {}
    out: dict[str, str] = {}
    for name, _ in UNPROVEN_FIELDS:
        value = found.get(name)
        if isinstance(value, dict) and value:
            out[name] = ", ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, str):
            out[name] = value
    return out


def arguments(entry: AuditEntry) -> Any:
    """The row's ``args`` as the call's arguments: None when they hold only the unproven marker."""
    return None if _marker(entry.args) is not None else entry.args


def _csv(entries: list[AuditEntry]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for entry in entries:
        data = _jsonable(entry)
        row = []
        for column in CSV_COLUMNS:
            value = data.get(column)
            if column == "keys":
                value = " ".join(entry.keys)
            elif column in ("tokens", "args"):
                value = "" if value in (None, {}) else json.dumps(value, ensure_ascii=False,
                                                                  sort_keys=True)
            row.append("" if value is None else value)
        writer.writerow(row)
    return buffer.getvalue()


# --- which rows to show -------------------------------------------------------------------

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|hr|d|day|days|w|wk)\s*(?:ago)?\s*$",
                       re.IGNORECASE)
_UNITS = {"s": "seconds", "sec": "seconds", "m": "minutes", "min": "minutes", "h": "hours",
          "hr": "hours", "d": "days", "day": "days", "days": "days", "w": "weeks", "wk": "weeks"}


def parse_moment(text: str, *, now: datetime | None = None) -> datetime:
    """``30m``, ``2h``, ``7d`` (that long ago), ``now``, ``today`` (00:00 UTC), or ISO 8601.

    A time without an offset is UTC, like everything the audit log shows.
    Raises ``ValueError`` with a readable message.
    """
    now = now or datetime.now(UTC)
    cleaned = text.strip()
    if cleaned.lower() == "now":
        return now
    if cleaned.lower() == "today":
        return now.replace(hour=0, minute=0, second=0, microsecond=0)
    match = _RELATIVE.match(cleaned)
    if match:
        amount, unit = float(match.group(1)), _UNITS[match.group(2).lower()]
        return now - timedelta(**{unit: amount})
    try:
        moment = datetime.fromisoformat(cleaned)
    except ValueError:
        msg = (f"{text!r} is not a time: use e.g. 30m, 2h, 7d, today, 2025-01-31 or "
               f"2025-01-31T14:00:00+02:00")
        raise ValueError(msg) from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


@dataclass(frozen=True, slots=True)
class AuditFilters:
    """The filters every audit command understands (merged: command over group)."""

    decision: tuple[str, ...] = ()
    reason: tuple[str, ...] = ()
    tool: tuple[str, ...] = ()
    agent: tuple[str, ...] = ()
    key: str | None = None
    workflow: str | None = None
    intent: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    url: str | None = None
    schema: str | None = None
    timeout: float = 5.0

    def merged(self, other: AuditFilters) -> AuditFilters:
        """``other``'s values where it has one, else ours."""
        values = {}
        for name in AuditFilters.__dataclass_fields__:
            mine, theirs = getattr(self, name), getattr(other, name)
            default = AuditFilters.__dataclass_fields__[name].default
            values[name] = theirs if theirs not in (None, (), default) else mine
        return AuditFilters(**values)

    def query(self) -> dict[str, Any]:
        """Keyword arguments for ``store.query_audit``."""
        out: dict[str, Any] = {}
        for name in ("decision", "reason", "tool", "agent"):
            if getattr(self, name):
                out[name] = list(getattr(self, name))
        for name, arg in (("key", "key"), ("workflow", "workflow"), ("intent", "intent_id"),
                          ("since", "since"), ("until", "until")):
            if getattr(self, name) is not None:
                out[arg] = getattr(self, name)
        return out

    def describe(self) -> str:
        parts = []
        for name in ("decision", "reason", "tool", "agent"):
            if getattr(self, name):
                parts.append(f"{name} {'|'.join(getattr(self, name))}")
        for name in ("key", "workflow", "intent"):
            if getattr(self, name):
                parts.append(f"{name} {getattr(self, name)}")
        if self.since:
            parts.append(f"since {_when(self.since)}")
        if self.until:
            parts.append(f"until {_when(self.until)}")
        return ", ".join(parts)
