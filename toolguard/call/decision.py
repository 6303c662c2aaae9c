"""What the guard decided about one call, and the words the model reads about it.

Two audiences read about every decision. The operator reads ``message``: the
full detail, kept in the audit row, the log, the CLI and the review page (who
paused a tool and why, the command that approves a request, hosts and driver
errors). The model reads ``model_text()``: what happened to its call and what
it may do next (change the arguments, wait, try again later, tell the user),
never who, which command, which host. ``MODEL_TEXTS`` holds one entry per
reason code: toolguard's own words about the call where they help the model
fix it (``CALL_WORDS``: bad arguments, not allowed, out of order, a busy
resource, a quota), else a fixed text. A reason code with no entry reads the
generic text. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from toolguard.call.intent import Intent
from toolguard.errors import (
    IdempotencyConflict,
    IntentRejected,
    LockError,
    StaleFencingToken,
    ToolGuardError,
)
from toolguard.runtime.safe_text import safe_str, storable_text, text_of

__all__ = ["CALL_WORDS", "FAILURE_TEMPLATE", "MODEL_TEXTS", "REJECTION_TEMPLATE",
           "SUCCESS_TEMPLATE", "Decision", "DecisionKind", "ToolFailed", "model_text_of",
           "recorded_model_text"]

DecisionKind = Literal["accepted", "replayed", "rejected", "failed", "unknown"]

#: What the model reads when the guard refused its call (module constants: one wording).
REJECTION_TEMPLATE = "rejected by toolguard ({reason}): {message}"
#: What the model reads when the call could not be completed (an infrastructure or tool failure).
FAILURE_TEMPLATE = "not completed ({reason}): {message}"
#: What ``model_text()`` says of a call that applied, or was answered from its record.
SUCCESS_TEMPLATE = "completed ({reason}): {message}"

#: Characters of toolguard's words about the call the model reads (as the audit detail keeps).
MODEL_WORDS_LIMIT = 2_000

#: Stands in ``MODEL_TEXTS`` for "toolguard's own words about the call" (the decision's message).
CALL_WORDS = "<the decision's message>"

_TRY_AGAIN = "the lock on this resource expired before the tool finished; nothing was written. " \
             "Try again."

#: What the model reads, per reason code: a fixed text, or ``CALL_WORDS``. No entry: ``_GENERIC``.
MODEL_TEXTS: Mapping[str, str] = {
    # toolguard's own words about the call, which say what to change (no operator detail in them)
    "invalid_intent": CALL_WORDS,
    "invalid_arguments": CALL_WORDS,
    "not_authorized": CALL_WORDS,
    "unknown_tool": CALL_WORDS,
    "out_of_order": CALL_WORDS,
    "lock_timeout": CALL_WORDS,
    "quota_exceeded": CALL_WORDS,
    "rate_limited": CALL_WORDS,
    "in_flight_limited": CALL_WORDS,
    "budget_exceeded": CALL_WORDS,
    "tool_error": CALL_WORDS,  # the tool's own words to the model
    # fixed texts: the detail is the operator's (who, why, which command) or no help to a model
    "missing_identity": "toolguard cannot tell which agent made this call, so it was not run. "
                        "Tell the user; retrying will not help.",
    "missing_idempotency_key": "this call has no stable id, so a repeat of it could not be told "
                               "apart from it; it was not run. Tell the user; retrying will not "
                               "help.",
    "paused": "calls like this one are paused for now; nothing was run. Try again later, or tell "
              "the user that this action is paused.",
    "approval_required": "this call needs approval before it runs; nothing was run yet. Wait, "
                         "then send the same call again, or tell the user it awaits approval.",
    "approval_denied": "this call was reviewed and denied; nothing was run. Do not send it "
                       "again; tell the user it was declined.",
    "approval_expired": "the approval for this call expired; nothing was run. Tell the user: "
                        "a new call asks for approval again.",
    "approval_mismatch": "the approval on record was given for a different call (other "
                         "arguments, agent or policy); nothing was run. A new call asks for "
                         "approval again.",
    "invalid_resume": "the answer to this call's approval request could not be used; nothing "
                      "was run. Tell the user.",
    "lease_lost": _TRY_AGAIN,
    "not_owned": _TRY_AGAIN,
    "stale_read": "a record this decision rests on changed since it was read; nothing was "
                  "written. Read it again, decide again from what it says now, then send the "
                  "new call.",
    "unread": "this call writes a record without a current read of it; nothing was written. "
              "Read the record first, decide from what it says, then send the call.",
    "hold_lost": "this call's hold on the record ended before it wrote (it was held too long, "
                 "the turn ended, or another agent needed it); nothing was written. Read the "
                 "record again, decide again from what it says now, then send the new call.",
    "hold_deadlock": "another agent needs a record you were holding while you waited for one "
                     "it holds; your holds were released and nothing was written. Read the "
                     "records again, decide again, then send the new call.",
    "stale_fencing_token": "another call on this resource wrote first; nothing was written. "
                           "Read the resource again before retrying.",
    "idempotency_conflict": "this tool-call id was already used with other arguments; "
                            "nothing was run.",
    "backend_unavailable": "a service toolguard needs is unavailable; try again later.",
    "configuration": "toolguard is not set up for this call.",
    "interrupted": "the call was interrupted before it finished, so whether it applied is not "
                   "known yet. Send the same call again: it is applied at most once.",
    "cancelled": "the call was cancelled before it finished, so whether it applied is not "
                 "known yet. Send the same call again: it is applied at most once.",
    "applied": "the call was applied.",
    "read": "the call was read.",
    "hold_ended": "the hold on the record ended.",  # an audit row's, never a model's answer
    "duplicate": "this call had already been applied; the result recorded then is returned and "
                 "nothing ran again.",
}
_GENERIC = "toolguard could not complete this call. Try again later, or tell the user."


class ToolFailed(ToolGuardError):
    """The tool itself reported an error; its transaction was rolled back."""

    reason = "tool_error"


@dataclass(frozen=True, slots=True)
class Decision:
    """What the guard did with one intent.

    ``result``: for an accepted call the tool's result (in clear, as JSON gives
    it back); for a replay the result recorded the first time, with the values
    the policy redacts masked.
    """

    kind: DecisionKind
    reason: str
    intent: Intent
    result: Any = None
    message: str = ""
    keys: tuple[str, ...] = ()
    tokens: Mapping[str, int] = field(default_factory=dict)
    idempotency_key: str | None = None
    error: ToolGuardError | None = None

    @property
    def ok(self) -> bool:
        return self.kind in ("accepted", "replayed")

    @property
    def approval_id(self) -> str | None:
        """The approval request a refused ``approval_required`` call waits for (else None)."""
        value = getattr(self.error, "approval_id", None)
        return value if isinstance(value, str) and value else None

    @property
    def retry_after_s(self) -> float | None:
        """When a call refused by a quota may fit again, in seconds (None: not a quota refusal)."""
        value = getattr(self.error, "retry_after_s", None)
        return float(value) if isinstance(value, int | float) else None

    def model_text(self) -> str:
        """The short, safe text a model reads about this call: what happened, what it may do next.

        For a refused or failed call, the text the adapters answer with; for a
        call that applied (or was answered from its record), a line saying so.
        Never the operator's detail (``message``).
        """
        return model_text_of(self.kind, self.reason, self.message, self.error)

    def raise_for_rejection(self) -> Any:
        """Return the result, or raise the typed error (for plain Python callers)."""
        if self.ok:
            return self.result
        assert self.error is not None
        raise self.error


def _template(kind: str) -> str:
    if kind == "rejected":
        return REJECTION_TEMPLATE
    return SUCCESS_TEMPLATE if kind in ("accepted", "replayed") else FAILURE_TEMPLATE


def _words(kind: str, reason: str, message: str | None, error: BaseException | None) -> str:
    """The part of the model's text after the reason code."""
    fixed = MODEL_TEXTS.get(reason, _GENERIC)
    words = getattr(error, "model_words", None)
    if kind == "rejected" and isinstance(words, str) and words:  # the call's own, model-safe
        return storable_text(words, MODEL_WORDS_LIMIT) or fixed
    if kind not in ("rejected", "failed"):  # a success, or an outcome not known yet
        return _GENERIC if fixed == CALL_WORDS else fixed
    if fixed == CALL_WORDS and (kind == "rejected" or reason == ToolFailed.reason):
        return storable_text(message or "", MODEL_WORDS_LIMIT) or ""
    if reason == "error" and kind == "failed":
        cause = error.__cause__ if error is not None else None
        what = safe_str(type(cause).__name__, 80) if cause is not None else "an exception"
        return f"the tool failed ({what}); the details are in toolguard's audit log."
    return _GENERIC if fixed == CALL_WORDS else fixed


def model_text_of(kind: str, reason: str, message: str | None = None,
                  error: BaseException | None = None) -> str:
    """The model's text for a decision of ``kind`` with ``reason`` (``Decision.model_text()``).

    ``message`` is used only where ``MODEL_TEXTS`` says ``CALL_WORDS``, bounded;
    ``error`` names the exception of a tool's failure (reason ``error``).
    """
    return _template(kind).format(reason=storable_text(reason, 64),
                                  message=_words(kind, reason, message, error))


#: Failures whose answer is not toolguard's: the tool's own exception or error answer, which
#: the adapters pass on unchanged, and configuration mistakes, which raise to the developer.
_NOT_TOOLGUARDS_TO_ANSWER = frozenset({"error", "tool_error", "configuration"})


def recorded_model_text(kind: str, reason: str, detail: str | None) -> str | None:
    """``Decision.model_text()`` of a decision as the audit log records it (kind, reason, detail).

    ``None`` where toolguard gave the model no text of its own: an accepted,
    replayed or interrupted call, a tool's own failure (the adapters pass on
    what the tool raised or answered), a configuration mistake (raised to the
    developer).
    """
    if kind == "rejected" or (kind == "failed" and reason not in _NOT_TOOLGUARDS_TO_ANSWER):
        return model_text_of(kind, reason, detail)
    return None


def refusal(intent: Intent, error: Exception, *, keys: tuple[str, ...] = (),
            idempotency_key: str | None = None, message: str | None = None) -> Decision:
    """The decision for a call that did not complete; ``error`` as the typed error."""
    if isinstance(error, ToolGuardError):
        typed = error
    else:  # a bug or an unexpected failure in the tool: refused, audited, never crashes the graph
        typed = ToolFailed(f"{safe_str(type(error).__name__, 80)}: {text_of(error)}",
                           reason="error")
        typed.__cause__ = error
    rejected = isinstance(typed, IntentRejected | LockError | StaleFencingToken |
                          IdempotencyConflict)
    kind: DecisionKind = "rejected" if rejected else "failed"
    return Decision(kind=kind, reason=typed.reason, intent=intent,
                    message=typed.message if message is None else message, keys=keys,
                    idempotency_key=idempotency_key, error=typed)
