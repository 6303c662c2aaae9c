"""The model's text for every reason code, pinned; the operator's detail never in it.

Two audiences read about each decision (DESIGN 18): the model reads
``Decision.model_text()`` (what it may do next: change the arguments, wait,
try again later, tell the user) and the operator reads the detail (audit row,
CLI, review page: who paused a tool and why, the command that approves a
request). ``PINNED`` holds the exact text for every reason code toolguard's
source defines; a code added without a pinned text fails
``test_every_reason_code_has_a_pinned_model_text``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import toolguard
from toolguard.call.decision import (
    CALL_WORDS,
    MODEL_TEXTS,
    Decision,
    DecisionKind,
    ToolFailed,
    model_text_of,
    recorded_model_text,
    refusal,
)
from toolguard.call.intent import Intent
from toolguard.errors import ToolGuardError

SOURCE = Path(toolguard.__file__).parent

#: What an operator's detail may hold; none of it may reach the model's text (bar CALL_WORDS).
OPERATOR_DETAIL = ("tool 'transfer' is paused by alice: incident 42, page +1 555 0100; "
                   "`toolguard approve ap_0123` or `toolguard deny ap_0123`; redis://10.0.0.7:6379")
#: Words no fixed text may hold: commands, operators, people, where the detail is.
OPERATOR_WORDS = ("toolguard approve", "toolguard deny", "toolguard resume", "toolguard pause",
                  "alice", "incident", "operator", "--by", "redis://", "postgresql://", "ap_")

GENERIC = "toolguard could not complete this call. Try again later, or tell the user."
LEASE = ("the lock on this resource expired before the tool finished; nothing was written. "
         "Try again.")
UNKNOWN = ("was {what} before it finished, so whether it applied is not known yet. Send the same "
           "call again: it is applied at most once.")
R = "rejected by toolguard ({reason}): {text}"
F = "not completed ({reason}): {text}"
C = "completed ({reason}): {text}"
#: Stands for the decision's own message in a pinned text (toolguard's words about the call).
WORDS = "{words}"

#: reason code -> (the kind of decision it comes with, the exact text the model reads).
PINNED: dict[str, tuple[DecisionKind, str]] = {
    # toolguard's words about the call: what to change
    "invalid_intent": ("rejected", R.format(reason="invalid_intent", text=WORDS)),
    "invalid_arguments": ("rejected", R.format(reason="invalid_arguments", text=WORDS)),
    "not_authorized": ("rejected", R.format(reason="not_authorized", text=WORDS)),
    "unknown_tool": ("rejected", R.format(reason="unknown_tool", text=WORDS)),
    "out_of_order": ("rejected", R.format(reason="out_of_order", text=WORDS)),
    "lock_timeout": ("rejected", R.format(reason="lock_timeout", text=WORDS)),
    "quota_exceeded": ("rejected", R.format(reason="quota_exceeded", text=WORDS)),
    "rate_limited": ("rejected", R.format(reason="rate_limited", text=WORDS)),
    "in_flight_limited": ("rejected", R.format(reason="in_flight_limited", text=WORDS)),
    "budget_exceeded": ("rejected", R.format(reason="budget_exceeded", text=WORDS)),
    "tool_error": ("failed", F.format(reason="tool_error", text=WORDS)),
    # fixed texts: what the model may do next, nothing about who or which command
    "missing_identity": ("rejected", R.format(
        reason="missing_identity", text="toolguard cannot tell which agent made this call, so it "
        "was not run. Tell the user; retrying will not help.")),
    "missing_idempotency_key": ("rejected", R.format(
        reason="missing_idempotency_key", text="this call has no stable id, so a repeat of it "
        "could not be told apart from it; it was not run. Tell the user; retrying will not help.")),
    "paused": ("rejected", R.format(
        reason="paused", text="calls like this one are paused for now; nothing was run. Try again "
        "later, or tell the user that this action is paused.")),
    "approval_required": ("rejected", R.format(
        reason="approval_required", text="this call needs approval before it runs; nothing was "
        "run yet. Wait, then send the same call again, or tell the user it awaits approval.")),
    "approval_denied": ("rejected", R.format(
        reason="approval_denied", text="this call was reviewed and denied; nothing was run. Do "
        "not send it again; tell the user it was declined.")),
    "approval_expired": ("rejected", R.format(
        reason="approval_expired", text="the approval for this call expired; nothing was run. "
        "Tell the user: a new call asks for approval again.")),
    "approval_mismatch": ("rejected", R.format(
        reason="approval_mismatch", text="the approval on record was given for a different call "
        "(other arguments, agent or policy); nothing was run. A new call asks for approval "
        "again.")),
    "invalid_resume": ("rejected", R.format(
        reason="invalid_resume", text="the answer to this call's approval request could not be "
        "used; nothing was run. Tell the user.")),
    "lease_lost": ("rejected", R.format(reason="lease_lost", text=LEASE)),
    "not_owned": ("rejected", R.format(reason="not_owned", text=LEASE)),
    "hold_lost": ("rejected", R.format(
        reason="hold_lost", text="this call's hold on the record ended before it wrote (it was "
        "held too long, the turn ended, or another agent needed it); nothing was written. Read "
        "the record again, decide again from what it says now, then send the new call.")),
    "hold_deadlock": ("rejected", R.format(
        reason="hold_deadlock", text="another agent needs a record you were holding while you "
        "waited for one it holds; your holds were released and nothing was written. Read the "
        "records again, decide again, then send the new call.")),
    "stale_fencing_token": ("rejected", R.format(
        reason="stale_fencing_token", text="another call on this resource wrote first; nothing "
        "was written. Read the resource again before retrying.")),
    "stale_read": ("rejected", R.format(
        reason="stale_read", text="a record this decision rests on changed since it was read; "
        "nothing was written. Read it again, decide again from what it says now, then send the "
        "new call.")),
    "unread": ("rejected", R.format(
        reason="unread", text="this call writes a record without a current read of it; nothing "
        "was written. Read the record first, decide from what it says, then send the call.")),
    "read": ("accepted", C.format(reason="read", text="the call was read.")),
    "idempotency_conflict": ("rejected", R.format(
        reason="idempotency_conflict", text="this tool-call id was already used with other "
        "arguments; nothing was run.")),
    "backend_unavailable": ("failed", F.format(
        reason="backend_unavailable", text="a service toolguard needs is unavailable; try again "
        "later.")),
    "configuration": ("failed", F.format(reason="configuration",
                                          text="toolguard is not set up for this call.")),
    "error": ("failed", F.format(reason="error", text="the tool failed (RuntimeError); the "
                                                     "details are in toolguard's audit log.")),
    # outcomes: applied, answered from the record, not known yet
    "applied": ("accepted", C.format(reason="applied", text="the call was applied.")),
    "hold_ended": ("accepted", C.format(reason="hold_ended",
                                        text="the hold on the record ended.")),
    "duplicate": ("replayed", C.format(
        reason="duplicate", text="this call had already been applied; the result recorded then "
        "is returned and nothing ran again.")),
    "interrupted": ("unknown", F.format(reason="interrupted",
                                        text="the call " + UNKNOWN.format(what="interrupted"))),
    "cancelled": ("unknown", F.format(reason="cancelled",
                                      text="the call " + UNKNOWN.format(what="cancelled"))),
    # everything else: the generic text (the detail is the operator's: drivers, hosts, stores)
    **{code: (kind, (R if kind == "rejected" else F).format(reason=code, text=GENERIC))
       for kind, codes in (
           ("rejected", ("key_not_fenced", "lock_error", "read_check_failed", "rejected")),
           # a fenced service's claim refusals, key and reset errors, the gateway's upstream
           ("failed", ("claim_bad_signature", "claim_malformed", "claim_missing",
                       "claim_not_held", "claim_unknown_key", "fence_key", "fence_reset",
                       "fence_reset_refused", "no_identity", "upstream_error")),
           ("failed", ("approval_decided", "audit_append_only", "audit_tampered",
                       "backend_refused", "deadlock", "declined", "export_exists",
                       "export_invalid", "fenced_redirect", "fences_required",
                       "fences_unsupported", "in_flight", "invalid_audit",
                       "invalid_fence_header", "invalid_fencing_token", "invalid_policy",
                       "invalid_query", "lock_not_available", "missing_extra",
                       "no_context", "no_fence", "no_fences", "not_found", "not_json",
                       "nothing_to_export", "query_canceled", "request_incomplete",
                       "request_too_large", "schema_not_installed", "serialization_failure",
                       "statement_timeout", "store_error", "too_many_rows", "transaction_aborted",
                       "transaction_ended", "unknown_approval")))
       for code in codes},
}


def _strings(node: ast.AST) -> list[str]:
    """The codes an expression gives: a string constant, or either side of ``a if c else b``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _strings(node.body) + _strings(node.orelse)
    return []


def reason_codes() -> dict[str, str]:
    """Every reason code toolguard's source defines, with where: class ``reason = "..."``,
    ``reason = "..."`` assignments and ``reason="..."`` arguments (``Decision(reason=...)`` too)."""
    found: dict[str, str] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = str(path.relative_to(SOURCE.parent))
        for node in ast.walk(tree):
            values: list[str] = []
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "reason" for t in targets) \
                        and node.value is not None:
                    values = _strings(node.value)
            elif isinstance(node, ast.Call):
                values = [v for kw in node.keywords if kw.arg == "reason" for v in _strings(kw.value)]
            for value in values:
                found.setdefault(value, f"{where}:{getattr(node, 'lineno', 0)}")
    return found


def test_every_reason_code_has_a_pinned_model_text() -> None:
    codes = reason_codes()
    assert len(codes) > 50, codes  # the scan finds the codes (not an empty walk)
    missing = {code: where for code, where in codes.items() if code not in PINNED}
    assert not missing, f"reason codes with no pinned model text (add them to PINNED): {missing}"
    stale = set(PINNED) - set(codes)
    assert not stale, f"pinned codes toolguard no longer defines: {sorted(stale)}"


def test_every_reason_with_its_own_text_is_pinned_here() -> None:
    assert set(MODEL_TEXTS) <= set(PINNED)


def _intent() -> Intent:
    return Intent(tool="transfer", args={"amount": 5}, call_id="call-1", agent="payments")


def _error(reason: str) -> ToolGuardError | None:
    if reason == "error":
        failed = ToolFailed("RuntimeError: secret host db-7", reason="error")
        failed.__cause__ = RuntimeError("secret host db-7")
        return failed
    return None


@pytest.mark.parametrize("reason", sorted(PINNED))
def test_the_model_text_of_each_reason(reason: str) -> None:
    kind, pinned = PINNED[reason]
    words = "args.amount: must be <= 3"  # toolguard's own words about the call
    uses_words = MODEL_TEXTS.get(reason) == CALL_WORDS
    detail = words if uses_words else OPERATOR_DETAIL
    decision = Decision(kind=kind, reason=reason, intent=_intent(), message=detail,
                        error=_error(reason))
    expected = pinned.format(words=words)
    assert decision.model_text() == expected
    assert model_text_of(kind, reason, detail, decision.error) == expected
    recorded = recorded_model_text(kind, reason, detail)
    if kind in ("rejected", "failed") and reason not in ("error", "tool_error", "configuration"):
        assert recorded == expected  # the review page shows what the model read
    else:
        assert recorded is None  # the model read the tool's answer, or nothing of toolguard's
    if not uses_words:
        lowered = expected.lower()
        assert not [w for w in OPERATOR_WORDS if w in lowered], expected


def test_refusals_built_from_each_error_class_read_their_pinned_text() -> None:
    """``refusal(intent, error)`` picks the kind; the text for that kind is the pinned one."""
    def classes(root: type[ToolGuardError]) -> list[type[ToolGuardError]]:
        out = [root]
        for sub in root.__subclasses__():
            out.extend(classes(sub))
        return out

    import toolguard.cli.db
    import toolguard.controls.approvals
    import toolguard.fences.gate
    import toolguard.fences.problems
    import toolguard.fences.wire
    import toolguard.runtime.extras
    import toolguard.store.postgres  # noqa: F401 - their error classes count too

    checked = 0
    for cls in classes(ToolGuardError):
        if cls.reason not in PINNED or cls.reason in ("applied", "duplicate", "error"):
            continue
        try:
            error = cls.__new__(cls)
            ToolGuardError.__init__(error, OPERATOR_DETAIL)
        except TypeError:
            continue
        decision = refusal(_intent(), error)
        kind, pinned = PINNED[cls.reason]
        assert decision.kind == kind, cls
        if MODEL_TEXTS.get(cls.reason) != CALL_WORDS:
            assert decision.model_text() == pinned, cls
        checked += 1
    assert checked > 30


@pytest.mark.parametrize("kind", ["accepted", "replayed"])
def test_a_call_that_completed_is_not_called_not_completed(kind: DecisionKind) -> None:
    """Issue 23.3: a success said "not completed ... could not complete this call"."""
    reason = "applied" if kind == "accepted" else "duplicate"
    text = Decision(kind=kind, reason=reason, intent=_intent(), result=7).model_text()
    assert text.startswith(f"completed ({reason}): ")
    assert "not completed" not in text and "could not complete" not in text


def test_a_tool_exception_whose_text_raises_is_refused_with_a_text() -> None:
    class Hostile(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text for you")

    decision = refusal(_intent(), Hostile())
    assert decision.kind == "failed" and decision.reason == "error"
    assert decision.message == "Hostile: Hostile()"  # its repr, since its text raises
    assert decision.model_text() == PINNED["error"][1].replace("RuntimeError", "Hostile")
