"""What the guard decided about one call, and the words the model reads about it.

A ``Decision`` carries the full detail (``message``: for the audit row, the
log and Python callers). The model gets ``model_text()``: toolguard's own
words about the call for refusals it can act on (bad arguments, not allowed,
out of order, a busy resource), and a short fixed text naming the reason code
for everything else, so hosts, ports and driver messages never reach it.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from toolguard.errors import (
    IdempotencyConflict,
    IntentRejected,
    LockError,
    LockTimeout,
    StaleFencingToken,
    ToolGuardError,
)
from toolguard.intent import Intent

__all__ = ["FAILURE_TEMPLATE", "REJECTION_TEMPLATE", "Decision", "DecisionKind", "ToolFailed",
           "recorded_model_text"]

DecisionKind = Literal["accepted", "replayed", "rejected", "failed", "unknown"]

#: What the model reads when the guard refused its call (module constants: one wording).
REJECTION_TEMPLATE = "rejected by toolguard ({reason}): {message}"
#: What the model reads when the call could not be completed (an infrastructure or tool failure).
FAILURE_TEMPLATE = "not completed ({reason}): {message}"

#: Fixed texts for reasons whose detail is not the model's business (hosts, drivers, tokens).
_MODEL_TEXTS: Mapping[str, str] = {
    "lease_lost": "the lock on this resource expired before the tool finished; nothing was "
                  "written. Try again.",
    "not_owned": "the lock on this resource expired before the tool finished; nothing was "
                 "written. Try again.",
    "stale_fencing_token": "another call on this resource wrote first; nothing was written. "
                           "Read the resource again before retrying.",
    "idempotency_conflict": "this tool-call id was already used with other arguments; "
                            "nothing was run.",
    "backend_unavailable": "a service toolguard needs is unavailable; try again later.",
    "configuration": "toolguard is not set up for this call.",
}
_GENERIC = "toolguard could not complete this call; the details are in its audit log."


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
        """The short, safe text a model reads for a refused or failed call."""
        if self.kind == "rejected":
            return REJECTION_TEMPLATE.format(reason=self.reason, message=self._safe_message())
        return FAILURE_TEMPLATE.format(reason=self.reason, message=self._safe_message())

    def _safe_message(self) -> str:
        error = self.error
        if isinstance(error, IntentRejected | LockTimeout) or (
                isinstance(error, ToolFailed) and error.reason == "tool_error"):
            return self.message  # toolguard's own words about the call, or the tool's to the model
        if self.reason in _MODEL_TEXTS:
            return _MODEL_TEXTS[self.reason]
        if isinstance(error, ToolFailed) and error.reason == "error":
            cause = error.__cause__
            kind = type(cause).__name__ if cause is not None else "an exception"
            return f"the tool failed ({kind}); the details are in toolguard's audit log."
        return _GENERIC

    def raise_for_rejection(self) -> Any:
        """Return the result, or raise the typed error (for plain Python callers)."""
        if self.ok:
            return self.result
        assert self.error is not None
        raise self.error


#: Failures whose answer is not toolguard's: the tool's own exception or error answer, which
#: the adapters pass on unchanged, and configuration mistakes, which raise to the developer.
_NOT_TOOLGUARDS_TO_ANSWER = frozenset({"error", "tool_error", "configuration"})


def recorded_model_text(kind: str, reason: str, detail: str | None) -> str | None:
    """``Decision.model_text()`` of a decision as the audit log records it (kind, reason, detail).

    ``None`` where toolguard gave the model no text of its own: an accepted,
    replayed or interrupted call, a tool's own failure (the adapters pass on
    what the tool raised or answered), a configuration mistake (raised to the
    developer). The detail is the model's to read only where it is toolguard's
    own words about the call; tokens, hosts and drivers never are.
    """
    if kind == "rejected":
        if reason in _MODEL_TEXTS:
            message = _MODEL_TEXTS[reason]
        elif reason == LockError.reason:
            message = _GENERIC
        else:
            message = detail or ""
        return REJECTION_TEMPLATE.format(reason=reason, message=message)
    if kind == "failed" and reason not in _NOT_TOOLGUARDS_TO_ANSWER:
        return FAILURE_TEMPLATE.format(reason=reason, message=_MODEL_TEXTS.get(reason, _GENERIC))
    return None


def refusal(intent: Intent, error: Exception, *, keys: tuple[str, ...] = (),
            idempotency_key: str | None = None, message: str | None = None) -> Decision:
    """The decision for a call that did not complete; ``error`` as the typed error."""
    if isinstance(error, ToolGuardError):
        typed = error
    else:  # a bug or an unexpected failure in the tool: refused, audited, never crashes the graph
        typed = ToolFailed(f"{type(error).__name__}: {error}", reason="error")
        typed.__cause__ = error
    rejected = isinstance(typed, IntentRejected | LockError | StaleFencingToken |
                          IdempotencyConflict)
    kind: DecisionKind = "rejected" if rejected else "failed"
    return Decision(kind=kind, reason=typed.reason, intent=intent,
                    message=typed.message if message is None else message, keys=keys,
                    idempotency_key=idempotency_key, error=typed)
