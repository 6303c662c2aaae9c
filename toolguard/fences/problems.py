"""What a fenced service answers when it refuses a request, in one shape for HTTP and MCP.

A ``Problem`` is an RFC 9457 problem-details object. The ASGI middleware sends
it as ``application/problem+json`` with its ``status``; the MCP middleware sends
it as the ``data`` of a JSON-RPC error whose ``code`` is the one below for the
same ``reason``. The client turns it back into the typed toolguard error, so a
guarded tool that met a stale token is audited ``rejected stale_fencing_token``
on the agent's side too.

====================  ======  ==========  ===============================================
reason                HTTP    MCP code    when
====================  ======  ==========  ===============================================
invalid_fence_header  400     -32602      a fence header is malformed, oversized or repeated
fences_required       428     -32071      the route or tool needs fences and got none
key_not_fenced        428     -32077      the handler writes a key the request has no fence for
stale_fencing_token   409     -32072      the service has seen a newer token for a key
in_flight             409     -32073      a request with this idempotency key is still running
idempotency_conflict  422     -32074      the key was used for another request
request_too_large     413     -32602      the request body is over the middleware's bound
request_incomplete    400     -32602      the client left before the end of the request body
fences_unsupported    400     -32602      fences on a request that cannot be fenced (a websocket)
backend_unavailable   503     -32075      the service's fence store cannot be reached
store_error           500     -32076      the fence store refused (schema missing, ...)
claim_*               401     -32078      signed mode: no, malformed, unknown-key, badly
                                          signed or expired claim (``toolguard.fences.claims``)
claim_wrong_audience  403     -32079      a claim signed for another service
claim_mismatch        403     -32079      a claim whose token, agent or key is not the request's
====================  ======  ==========  ===============================================

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from toolguard.errors import (
    BackendUnavailable,
    IdempotencyConflict,
    IntentRejected,
    InvalidFencingToken,
    StaleFencingToken,
    StoreError,
    ToolGuardError,
)
from toolguard.fences.claims import ClaimRefused
from toolguard.fences.wire import WireError
from toolguard.runtime.safe_text import safe_str, text_of

__all__ = [
    "MCP_CODES",
    "FencesRequired",
    "InFlight",
    "KeyNotFenced",
    "Problem",
    "error_from_problem",
    "problem_from_error",
]

PROBLEM_TYPE = "urn:toolguard:problem:{reason}"
CONTENT_TYPE = "application/problem+json"

_STATUS: Mapping[str, tuple[int, str]] = {
    "invalid_fence_header": (400, "Malformed fence header"),
    "invalid_fencing_token": (400, "Invalid fencing token"),
    "fences_required": (428, "Fences required"),
    "key_not_fenced": (428, "Key not fenced"),
    "stale_fencing_token": (409, "Stale fencing token"),
    "in_flight": (409, "Request still in flight"),
    "idempotency_conflict": (422, "Idempotency key reused"),
    "request_too_large": (413, "Request too large"),
    "request_incomplete": (400, "Incomplete request"),
    "fences_unsupported": (400, "Request cannot be fenced"),
    "backend_unavailable": (503, "Fence store unavailable"),
    "store_error": (500, "Fence store error"),
    "claim_missing": (401, "Fence claim required"),
    "claim_malformed": (401, "Malformed fence claim"),
    "claim_unknown_key": (401, "Fence claim signed by an unknown key"),
    "claim_bad_signature": (401, "Fence claim signature invalid"),
    "claim_expired": (401, "Fence claim expired"),
    "claim_wrong_audience": (403, "Fence claim for another service"),
    "claim_mismatch": (403, "Fence claim does not match the request"),
}

#: JSON-RPC error code per reason (implementation-defined server errors, -32000..-32099;
#: malformed ``_meta`` is plain "invalid params").
MCP_CODES: Mapping[str, int] = {
    "invalid_fence_header": -32602,
    "invalid_fencing_token": -32602,
    "fences_required": -32071,
    "key_not_fenced": -32077,
    "stale_fencing_token": -32072,
    "in_flight": -32073,
    "idempotency_conflict": -32074,
    "request_too_large": -32602,
    "request_incomplete": -32602,
    "fences_unsupported": -32602,
    "backend_unavailable": -32075,
    "store_error": -32076,
    "claim_missing": -32078,
    "claim_malformed": -32078,
    "claim_unknown_key": -32078,
    "claim_bad_signature": -32078,
    "claim_expired": -32078,
    "claim_wrong_audience": -32079,
    "claim_mismatch": -32079,
}


class FencesRequired(ToolGuardError):
    """The route or tool needs fences (and an idempotency key) and the request lacked some."""

    reason = "fences_required"

    def __init__(self, message: str, *, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing


class KeyNotFenced(IntentRejected):
    """The handler writes a resource the request's lease does not hold a fence for.

    Raised by ``ServiceFence.require(key, ...)`` inside the fenced transaction:
    the request is rolled back (its fences too) and answered ``428``.
    """

    reason = "key_not_fenced"

    def __init__(self, message: str, *, keys: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.keys = keys


class InFlight(ToolGuardError):
    """A request with the same idempotency key is still running: retry after it finished."""

    reason = "in_flight"

    def __init__(self, message: str, *, idempotency_key: str | None = None) -> None:
        super().__init__(message)
        self.idempotency_key = idempotency_key


@dataclass(frozen=True, slots=True)
class Problem:
    """One refusal: ``reason`` (toolguard's stable code), ``detail`` (what and where), extras."""

    reason: str
    detail: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> int:
        return _STATUS.get(self.reason, (500, ""))[0]

    @property
    def title(self) -> str:
        return _STATUS.get(self.reason, (500, "Fence store error"))[1]

    @property
    def mcp_code(self) -> int:
        return MCP_CODES.get(self.reason, MCP_CODES["store_error"])

    def body(self) -> dict[str, Any]:
        """The RFC 9457 object: ``type``, ``title``, ``status``, ``detail``, then ``reason`` and extras."""
        return {"type": PROBLEM_TYPE.format(reason=self.reason), "title": self.title,
                "status": self.status, "detail": self.detail, "reason": self.reason,
                **self.extra}


def problem_from_error(error: ToolGuardError) -> Problem:
    """The problem a service answers for a toolguard error raised at its fence."""
    if isinstance(error, ClaimRefused):
        return Problem(error.reason, error.message, error.extras())
    if isinstance(error, StaleFencingToken):
        return Problem(error.reason, error.message,
                       {"key": error.key, "token": error.token, "current": error.current})
    if isinstance(error, WireError):
        return Problem(error.reason, error.message, {"field": error.field})
    if isinstance(error, FencesRequired):
        return Problem(error.reason, error.message, {"missing": list(error.missing)})
    if isinstance(error, KeyNotFenced):
        return Problem(error.reason, error.message, {"keys": list(error.keys)})
    if isinstance(error, InFlight | IdempotencyConflict):
        key = getattr(error, "idempotency_key", None)
        return Problem(error.reason, error.message, {"idempotency_key": key} if key else {})
    if isinstance(error, InvalidFencingToken):
        return Problem(error.reason, error.message)
    if isinstance(error, BackendUnavailable) or error.reason in _STATUS:
        return Problem(error.reason, error.message)
    return Problem("store_error", error.message, {"store_reason": error.reason})


def error_from_problem(body: Mapping[str, Any]) -> ToolGuardError | None:
    """The typed error for a problem a fenced service answered; None if it is not one of ours."""
    reason = body.get("reason")
    if not isinstance(reason, str) or reason not in _STATUS:
        return None
    detail = text_of(body.get("detail") or reason, 2_000)  # a service's JSON: bounded, never raises
    text = f"the service refused: {detail}"
    if reason == "stale_fencing_token":
        return StaleFencingToken(text, key=safe_str(body.get("key") or ""), token=_int(body.get("token")),
                                 current=_int(body.get("current")))
    if reason == "idempotency_conflict":
        return IdempotencyConflict(text)
    if reason == "in_flight":
        return InFlight(text, idempotency_key=_str(body.get("idempotency_key")))
    if reason == "fences_required":
        missing = body.get("missing")
        return FencesRequired(text, missing=tuple(safe_str(m) for m in missing)
                              if isinstance(missing, list) else ())
    if reason == "key_not_fenced":
        keys = body.get("keys")
        return KeyNotFenced(text, keys=tuple(safe_str(k) for k in keys)
                            if isinstance(keys, list) else ())
    if reason == "backend_unavailable":
        return BackendUnavailable(text)
    if reason.startswith("claim_"):
        return ClaimRefused(text, reason=reason, lock_key=_str(body.get("key")),
                            key_id=_str(body.get("key_id")), field=_str(body.get("field")))
    if reason in ("invalid_fence_header", "invalid_fencing_token"):
        return InvalidFencingToken(text, reason=reason)
    return StoreError(text)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None
