"""Shadow mode through the guard: a would-be refusal is its own ``shadow`` row; the call runs.

What keeps data safe is never shadowed: the schema, input limits, keys and
locks refuse as always, and a call in shadow mode is still fenced.
"""

from __future__ import annotations

from typing import Any

from typer.testing import CliRunner

from controls.guarded import intent, write
from toolguard.cli import app
from toolguard.controls.approvals import ApprovalBook

POLICY: dict[str, Any] = {
    "version": 1,
    "defaults": {"mode": "shadow"},
    "agents": ["scorer", "other"],
    "tools": {
        "transfer": {"locks": ["lead:{lead_id}"], "agents": ["scorer"],
                     "args": {"amount": {"le": 100}},
                     "quotas": [{"calls": 1, "window": "1h", "per": "agent"}],
                     "approval": {"when": {"amount": {"gt": 50}}}},
        "refund": {"locks": ["lead:{lead_id}"], "agents": ["scorer"], "mode": "enforce"},
    },
}


def rows_of(h: Any, call_id: str) -> list[tuple[str, str]]:
    return h.decisions(call_id)


def test_would_be_refusals_are_audited_as_shadow_rows_and_the_calls_run(harness: Any) -> None:
    h = harness(POLICY)
    run = h.guard.run
    assert run(intent("transfer", {"lead_id": "l1", "amount": 1}, call_id="s-ok"), write).ok
    assert rows_of(h, "s-ok") == [("accepted", "applied")]
    cases = {
        "s-agent": (intent("transfer", {"lead_id": "l1", "amount": 1}, agent="other",
                           call_id="s-agent"), "not_authorized"),
        "s-args": (intent("transfer", {"lead_id": "l1", "amount": 500}, call_id="s-args"),
                   "invalid_arguments"),
        "s-approval": (intent("transfer", {"lead_id": "l1", "amount": 60}, call_id="s-approval"),
                       "approval_required"),
        "s-quota": (intent("transfer", {"lead_id": "l1", "amount": 2}, call_id="s-quota"),
                    "rate_limited"),
        "s-unknown": (intent("wire", {"lead_id": "l1"}, call_id="s-unknown"), "unknown_tool"),
    }
    for call_id, (call, reason) in cases.items():
        decision = run(call, write if call.tool == "transfer" else lambda ctx: "done")
        assert decision.ok, (call_id, decision)
        assert rows_of(h, call_id) == [("shadow", reason), ("accepted", "applied")], call_id
    assert len(h.effects("transfer")) == 5  # every shadowed call ran, fenced
    assert ApprovalBook(h.store).pending() == []  # shadow mode asks nobody
    shadow = h.audit(decision="shadow")
    assert all(r.policy_version == h.guard.policy.digest and r.detail.startswith("shadow (")
               for r in shadow)


def test_a_call_a_quota_would_refuse_is_not_counted(harness: Any) -> None:
    h = harness(POLICY)
    backend = h.guard.controls.quotas.backend
    run = h.guard.run
    for number in range(3):
        call_id = f"q{number}"
        assert run(intent("transfer", {"lead_id": "l1", "amount": 1}, call_id=call_id), write).ok
    scope = "transfer/rate/3600s/agent|agent=scorer"
    assert backend.usage(scope) == 1  # what enforcement would have counted: one call
    assert [r.reason for r in h.audit(decision="shadow")] == ["rate_limited", "rate_limited"]


def test_what_keeps_data_safe_is_never_shadowed(harness: Any) -> None:
    h = harness(POLICY)
    run = h.guard.run
    h.guard.register("transfer", {"type": "object", "properties": {
        "lead_id": {"type": "string"}, "amount": {"type": "integer"}},
        "required": ["lead_id", "amount"], "additionalProperties": False})
    schema = run(intent("transfer", {"lead_id": "l1", "amount": "x"}, call_id="n-schema"), write)
    huge = run(intent("transfer", {"lead_id": "l" * 10_000, "amount": 1}, call_id="n-limit"),
               write)
    enforced = run(intent("refund", {"lead_id": "l1"}, agent="other", call_id="n-enforce"), write)
    assert [d.reason for d in (schema, huge, enforced)] == [
        "invalid_arguments", "invalid_arguments", "not_authorized"]
    for call_id in ("n-schema", "n-limit", "n-enforce"):
        assert len(rows_of(h, call_id)) == 1 and rows_of(h, call_id)[0][0] == "rejected"
    assert h.effects() == []


def test_a_shadowed_call_refused_later_keeps_its_shadow_row(harness: Any) -> None:
    """Enforcement would have refused at authorize; the call then failed in its tool."""
    h = harness(POLICY)

    def boom(ctx: Any) -> None:
        raise RuntimeError("tool broke")

    decision = h.guard.run(intent("transfer", {"lead_id": "l1", "amount": 1}, agent="other",
                                  call_id="late"), boom)
    assert decision.kind == "failed"
    assert rows_of(h, "late") == [("shadow", "not_authorized"), ("failed", "error")]


def test_audit_shadow_lists_what_enforcement_would_have_refused(harness: Any) -> None:
    h = harness(POLICY)
    h.guard.run(intent("transfer", {"lead_id": "l1", "amount": 1}, agent="other",
                       call_id="cli-1"), write)
    url = h.backend.store_url
    options = ["--schema", h.backend.store_options["schema"]] if h.backend.kind == "postgresql" \
        else []
    result = CliRunner().invoke(app, ["audit", "--shadow", "--url", url, *options])
    assert result.exit_code == 0, result.output
    assert "not_authorized" in result.output
