"""One hierarchy for every error toolguard raises.

Each error carries a stable ``reason`` code: the same string lands in the audit
log, in the ``ToolMessage`` the model reads, and in CLI exit summaries, so
scripts and people can match on it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

from toolguard.runtime.safe_text import EXCEPTION_LIMIT, safe_str

__all__ = [
    "ApprovalDenied",
    "ApprovalExpired",
    "ApprovalMismatch",
    "ApprovalRequired",
    "AuditAppendOnly",
    "BackendUnavailable",
    "BudgetExceeded",
    "ConfigurationError",
    "DuplicateIntent",
    "GuardMisconfigured",
    "HoldDeadlock",
    "HoldLost",
    "IdempotencyConflict",
    "InFlightLimited",
    "IntentRejected",
    "InvalidArguments",
    "InvalidFencingToken",
    "InvalidIntent",
    "LockError",
    "LockLost",
    "LockTimeout",
    "MissingIdentity",
    "NotAuthorized",
    "NotOwned",
    "OutOfOrder",
    "Paused",
    "PolicyError",
    "PolicyProblems",
    "QuotaExceeded",
    "RateLimited",
    "ReadCheckFailed",
    "RecordNotFound",
    "StaleFencingToken",
    "StaleRead",
    "StoreError",
    "TooManyRows",
    "ToolGuardError",
    "UnknownApproval",
    "UnknownTool",
    "UnknownToolWarning",
    "Unread",
    "is_control_flow",
]


class ToolGuardError(Exception):
    """Root of toolguard's errors; ``reason`` is a stable, machine-readable code."""

    reason: str = "error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason

    @property
    def message(self) -> str:
        """The operator's text (audit row, log, CLI); never raises, whatever ``args[0]`` holds."""
        if not self.args:
            return self.reason
        first = self.args[0]
        return first if type(first) is str else safe_str(first, EXCEPTION_LIMIT)


class ConfigurationError(ToolGuardError):
    """Settings or URLs that cannot work (unknown scheme, TTL too small...)."""

    reason = "configuration"


class GuardMisconfigured(ConfigurationError):
    """The guard, a tool or an adapter is wired wrongly (e.g. no asyncio backends on the
    async path, a sync tool body on the async path).

    The guard audits it and then raises it to the developer: it is never turned into
    a refusal the model reads, since no retry by the model can fix it.
    """


class UnknownToolWarning(UserWarning):
    """A tool was registered with a guard whose policy does not name it."""


class BackendUnavailable(ToolGuardError):
    """The lock server or the store could not be reached."""

    reason = "backend_unavailable"


# --- locks -------------------------------------------------------------------


class LockError(ToolGuardError):
    """A lock operation failed; ``keys`` names the lock keys involved."""

    reason = "lock_error"

    def __init__(self, message: str, *, keys: Iterable[str] = (), reason: str | None = None):
        super().__init__(message, reason=reason)
        self.keys: tuple[str, ...] = tuple(keys)


class LockTimeout(LockError):
    """The wait deadline passed before every key could be taken."""

    reason = "lock_timeout"


class LockLost(LockError):
    """A held lease expired or was taken away; the holder must stop writing."""

    reason = "lease_lost"


class NotOwned(LockLost):
    """The server says the lock belongs to someone else (or to no one)."""

    reason = "not_owned"


class HoldLost(LockError):
    """A write on a key its caller held (``hold: true``) after that hold ended: not applied."""

    reason = "hold_lost"


class HoldDeadlock(LockError):
    """This caller waited in a cycle of holds and was the youngest in it: it yields (its wait
    ends, every hold it has is released). Not PostgreSQL's ``deadlock`` (a transaction ended)."""

    reason = "hold_deadlock"


# --- store ---------------------------------------------------------------------


class StoreError(ToolGuardError):
    """The guarded store refused or failed an operation."""

    reason = "store_error"


class StaleFencingToken(StoreError):
    """The store has already seen a newer token for the key: the write is refused."""

    reason = "stale_fencing_token"

    def __init__(self, message: str, *, key: str = "", token: int | None = None,
                 current: int | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.token = token
        self.current = current


class IdempotencyConflict(StoreError):
    """The idempotency key was already used with different arguments."""

    reason = "idempotency_conflict"


class DuplicateIntent(StoreError):
    """The intent already ran; ``result`` holds what it recorded."""

    reason = "duplicate"

    def __init__(self, message: str, *, result: object = None) -> None:
        super().__init__(message)
        self.result = result


class InvalidFencingToken(StoreError):
    """A fenced write came with no usable token (NULL, not a positive integer) or no key."""

    reason = "invalid_fencing_token"


class RecordNotFound(StoreError):
    """A fenced mutation named a row that does not exist: an error, never a silent no-op.

    From ``tx.execute(..., expect_rows=n)``, ``expected`` is ``n`` and ``actual``
    the rows the statement matched (fewer); from the SQL functions (TG003) both are None.
    """

    reason = "not_found"

    def __init__(self, message: str, *, expected: int | None = None,
                 actual: int | None = None) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class TooManyRows(StoreError):
    """``tx.execute(..., expect_rows=n)`` matched more than ``n`` rows: refused, never committed."""

    reason = "too_many_rows"

    def __init__(self, message: str, *, expected: int | None = None,
                 actual: int | None = None) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class AuditAppendOnly(StoreError):
    """Something tried to change or delete audit rows; the database refused."""

    reason = "audit_append_only"


# --- policy and intents -----------------------------------------------------------


class PolicyError(ToolGuardError):
    """A policy file or object is invalid; the message names file, line and field."""

    reason = "invalid_policy"

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None):
        where = f"{file}:{line}: " if file and line else (f"{file}: " if file else "")
        super().__init__(f"{where}{message}")
        self.file = file
        self.line = line


class PolicyProblems(PolicyError):
    """Several things are wrong with a policy; ``problems`` lists each with its file:line.

    The message lists them all, one a line, first problem first, each with
    its fix: the first line alone is the first thing to correct, and no fix
    hides behind a count.
    """

    def __init__(self, problems: Iterable[object]) -> None:
        found = tuple(problems)
        first = found[0] if found else "invalid policy"
        rest = "".join(f"\n{problem}" for problem in found[1:])
        super().__init__(f"{getattr(first, 'message', first)}{rest}",
                         file=getattr(first, "file", None), line=getattr(first, "line", None))
        self.problems = found


class IntentRejected(ToolGuardError):
    """The guard refused an intent before it touched anything."""

    reason = "rejected"


class InvalidIntent(IntentRejected):
    """The call's envelope (id, name, agent, workflow identity) breaks the envelope rules."""

    reason = "invalid_intent"


class InvalidArguments(IntentRejected):
    reason = "invalid_arguments"


class NotAuthorized(IntentRejected):
    reason = "not_authorized"


class MissingIdentity(NotAuthorized):
    """The call carries no agent identity: refused, never guessed."""

    reason = "missing_identity"


class UnknownTool(IntentRejected):
    reason = "unknown_tool"


class OutOfOrder(IntentRejected):
    reason = "out_of_order"


class ReadCheckFailed(IntentRejected):
    """A write whose decision rests on reads that are missing or out of date: nothing applied.

    ``keys`` are the keys at fault; ``model_words`` is what the model reads
    (which keys, and to read again and decide again: no versions, agents or
    intents), the message is the operator's (the versions and the write in between).
    """

    reason = "read_check_failed"

    def __init__(self, message: str, *, keys: tuple[str, ...] = (), model_words: str = "") -> None:
        super().__init__(message)
        self.keys = keys
        self.model_words = model_words


class StaleRead(ReadCheckFailed):
    """A key this caller read (or decides on) was written by someone else since it read it."""

    reason = "stale_read"


class Unread(ReadCheckFailed):
    """A write that needs a current read of a key (``requires_read``, ``decides_on``) has none."""

    reason = "unread"


# --- production controls: kill switch, quotas, approvals ---------------------------------


class Paused(IntentRejected):
    """An operator paused this tool or agent (``toolguard pause``): new calls are refused."""

    reason = "paused"


class QuotaExceeded(IntentRejected):
    """A quota refused the call; ``retry_after_s`` says when it may fit (None: never, as asked).

    ``quota`` names the counter (the rule's ``name``, else tool/kind/window/scope)
    and ``scope`` the value it was counted under (``agent=payments``).
    """

    reason = "quota_exceeded"

    def __init__(self, message: str, *, retry_after_s: float | None = None, quota: str = "",
                 scope: str = "", reason: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.retry_after_s = retry_after_s
        self.quota = quota
        self.scope = scope


class RateLimited(QuotaExceeded):
    """More calls in the window than the quota's ``calls:`` allows."""

    reason = "rate_limited"


class InFlightLimited(RateLimited):
    """As many calls as ``in_flight:`` allows are running already."""

    reason = "in_flight_limited"


class BudgetExceeded(QuotaExceeded):
    """The call's amount would take the window's sum over the quota's ``budget:``."""

    reason = "budget_exceeded"


class ApprovalRequired(IntentRejected):
    """The call waits for a person: ``approval_id`` names the request (``toolguard approve ID``).

    ``request`` is what the person needs to decide (the interrupt payload in
    LangGraph): tool, redacted arguments, keys, agent, why, expiry.
    """

    reason = "approval_required"

    def __init__(self, message: str, *, approval_id: str,
                 request: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.approval_id = approval_id
        self.request = request


class ApprovalDenied(IntentRejected):
    """A person denied the call."""

    reason = "approval_denied"


class ApprovalExpired(IntentRejected):
    """The approval (or the request waiting for one) passed its expiry."""

    reason = "approval_expired"


class ApprovalMismatch(IntentRejected):
    """The approval was given for another intent: other tool, arguments or policy version."""

    reason = "approval_mismatch"


class UnknownApproval(ToolGuardError):
    """No approval request with this id (or it cannot be decided any more)."""

    reason = "unknown_approval"


# --- control flow ------------------------------------------------------------------------


def _langgraph_errors() -> Any:
    """``langgraph.errors`` if something imported it already, else None (never imports it).

    A LangGraph control-flow exception can only exist once LangGraph is loaded:
    a plain-Python process never pays for importing it (most of a second).
    """
    return sys.modules.get("langgraph.errors")


def _control_flow_types() -> tuple[type[BaseException], ...]:
    errors = _langgraph_errors()
    bubble = getattr(errors, "GraphBubbleUp", None) if errors is not None else None
    return (bubble,) if isinstance(bubble, type) else ()


def _is_invalid_resume(error: BaseException) -> bool:
    errors = _langgraph_errors()
    check = getattr(errors, "is_invalid_resume", None) if errors is not None else None
    return bool(check(error)) if callable(check) else False  # before 1.2: never marked


def is_control_flow(error: BaseException) -> bool:
    """True for exceptions that must pass through untouched after locks are released.

    Cancellation, interpreter exit, LangGraph's ``GraphBubbleUp`` (an
    ``interrupt()`` or a parent-graph command), and a resume value that did not
    match its interrupt's ``response_schema`` (LangGraph marks that
    ``ValidationError`` with ``is_invalid_resume``: the run must fail so the
    interrupt can be answered again). The call's outcome is unknown until its
    idempotency key is seen again.
    """
    if not isinstance(error, Exception):
        return True
    return isinstance(error, _control_flow_types()) or _is_invalid_resume(error)
