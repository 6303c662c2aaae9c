"""Shadow mode: decisions computed and audited as they would be, not enforced."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from controls.calls import call
from toolguard.cli import app
from toolguard.controls.approvals import approval_reason
from toolguard.controls.quotas import Quotas, quota_backend
from toolguard.controls.shadow import SHADOW_DECISION, Enforcement, lookup_in_mode, mode_of
from toolguard.errors import ApprovalRequired, NotAuthorized, OutOfOrder, UnknownTool
from toolguard.policies import Policy, authorize, check_constraints
from toolguard.store import AuditEntry, open_store

POLICY = {
    "version": 1,
    "defaults": {"mode": "shadow"},
    "agents": ["payments", "support"],
    "tools": {
        "transfer": {"locks": ["account:{from_id}"], "agents": ["payments"],
                     "args": {"amount": {"le": 10000}},
                     "quotas": [{"calls": 1, "window": "1h", "per": "agent"}],
                     "approval": {"when": {"amount": {"gt": 1000}}}},
        "refund": {"locks": ["account:{from_id}"], "agents": ["payments"], "mode": "enforce"},
    },
}


def run_call(policy: Policy, store, quotas: Quotas, tool: str, agent: str,
             args: dict) -> list[str]:
    """The policy steps of one call as the guard will run them; returns what happened."""
    enforcement = Enforcement(mode_of(policy, tool))
    rule = lookup_in_mode(policy, tool, enforcement)
    with enforcement.step("authorize"):
        authorize(rule, agent)
    with enforcement.step("constraints"):
        check_constraints(rule, args)
    facts = call(policy, "transfer", args, agent=agent) if tool == "transfer" else None
    with enforcement.step("approval"):
        why = approval_reason(rule, args)  # shadow mode: the pure check only, no request
        if why:
            raise ApprovalRequired(f"{tool} needs approval ({why})", approval_id="(shadow)")
    admission = None
    if facts is not None and enforcement.verdict is None:  # enforcement would not count it
        with enforcement.step("quotas"):
            admission = quotas.admit(rule, facts)
    row = AuditEntry(decision="accepted", reason="applied", tool=tool, agent=agent,
                     keys=facts.keys if facts else (), args=args)
    shadow_row = enforcement.entry(row)
    if shadow_row is not None:
        store.audit(shadow_row)
    store.audit(row)  # the call ran
    if admission is not None:
        admission.finish(applied=True)
    return [shadow_row.reason if shadow_row else "-", "ran"]


def test_shadow_decisions_are_audited_and_not_enforced(tmp_path) -> None:
    policy = Policy.from_dict(POLICY)
    url = f"sqlite:///{tmp_path}/store.db"
    store = open_store(url, install=True)
    quotas = Quotas(quota_backend(store))
    try:
        ok = {"from_id": "a1", "amount": 10}
        assert run_call(policy, store, quotas, "transfer", "payments", ok) == ["-", "ran"]
        assert run_call(policy, store, quotas, "transfer", "support", ok) == ["not_authorized", "ran"]
        assert run_call(policy, store, quotas, "transfer", "payments",
                        {"from_id": "a1", "amount": 20000}) == ["invalid_arguments", "ran"]
        assert run_call(policy, store, quotas, "transfer", "payments",
                        {"from_id": "a1", "amount": 5000}) == ["approval_required", "ran"]
        # the quota's one call per hour was used by the first call: the next would be refused
        assert run_call(policy, store, quotas, "transfer", "payments", ok) == ["rate_limited", "ran"]
        assert run_call(policy, store, quotas, "wire", "payments", ok) == ["unknown_tool", "ran"]
        with pytest.raises(NotAuthorized):  # refund enforces: its refusals are real
            run_call(policy, store, quotas, "refund", "support", ok)
        shadow = store.query_audit(decision=SHADOW_DECISION, newest_first=False)
        assert [r.reason for r in shadow] == ["not_authorized", "invalid_arguments",
                                              "approval_required", "rate_limited", "unknown_tool"]
        assert shadow[0].detail.startswith("shadow (authorize): would be refused not_authorized: "
                                           "agent 'support' may not call transfer")
        assert len(store.query_audit(decision="accepted")) == 6  # every shadowed call still ran
        listed = CliRunner().invoke(app, ["audit", "--shadow", "--url", url])
        assert listed.exit_code == 0, listed.output
        assert "5 shadow refusals" in listed.stdout and "not_authorized" in listed.stdout
        assert "applied" not in listed.stdout
        stats = CliRunner().invoke(app, ["audit", "--shadow", "--url", url, "stats"])
        assert stats.exit_code == 0 and "rate_limited" in stats.stdout
    finally:
        store.close()


def test_only_the_first_would_be_refusal_is_kept_and_safety_is_never_shadowed() -> None:
    enforcement = Enforcement("shadow")
    with enforcement.step("authorize"):
        raise NotAuthorized("first")
    with enforcement.step("lookup"):
        raise UnknownTool("second")
    assert enforcement.verdict is not None and enforcement.verdict.message == "first"
    with pytest.raises(OutOfOrder), enforcement.step("order"):
        raise OutOfOrder("ordering keeps data safe: never shadowed")
    enforcing = Enforcement("enforce")
    with pytest.raises(NotAuthorized), enforcing.step("authorize"):
        raise NotAuthorized("enforced")
    assert enforcing.entry(AuditEntry(decision="accepted", reason="applied")) is None


def test_modes_resolve_per_tool() -> None:
    policy = Policy.from_dict(POLICY)
    assert mode_of(policy, "transfer") == "shadow" and mode_of(policy, "refund") == "enforce"
    assert mode_of(policy, "not-in-the-policy") == "shadow"
    enforcing = Policy.from_dict({**POLICY, "defaults": {}})
    with pytest.raises(UnknownTool):
        lookup_in_mode(enforcing, "wire", Enforcement(mode_of(enforcing, "wire")))
