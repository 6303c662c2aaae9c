"""The production controls in the policy model: approval:, quotas:, mode: and the digest."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel

from toolguard.errors import PolicyProblems
from toolguard.policies import Policy, load_policy
from toolguard.policies.controls import DEFAULT_LEASE_S, QuotaRule, parse_duration

GOOD = """\
version: 1
defaults:
  mode: enforce
  quotas:
    - {name: agent-calls, calls: 600, window: 1m, per: agent}
tools:
  transfer:
    locks: ["account:{from_id}", "account:{to_id}"]
    mode: shadow
    approval:
      when: {amount: {gt: 1000}}
      expires: 30m
      reason: large transfer
    quotas:
      - {calls: 10, window: 1m, per: agent}
      - {in_flight: 2, per: key, lease: 2m}
      - {budget: 10000, arg: amount, window: 1d, per: [workflow, agent]}
  refund:
    locks: ["account:{account_id}"]
    approval: true
  search:
    read_only: true
"""


def write(folder: Path, text: str, name: str = "policy.yml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def problems(folder: Path, text: str) -> list[str]:
    with pytest.raises(PolicyProblems) as caught:
        load_policy(write(folder, text))
    return [str(problem).removeprefix(f"{folder}/") for problem in caught.value.problems]


def test_a_full_policy_loads_with_its_controls(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, GOOD))
    transfer, refund, search = (policy.tools[n] for n in ("transfer", "refund", "search"))
    assert transfer.mode == "shadow" and refund.mode == "enforce"
    assert transfer.approval is not None and transfer.approval.expires == 1800.0
    assert transfer.approval.reason == "large transfer" and not transfer.approval.always
    assert refund.approval is not None and refund.approval.always and search.approval is None
    # defaults.quotas come first, then the tool's own; a tool without quotas gets the defaults
    assert [q.kind for q in transfer.quotas] == ["rate", "rate", "in_flight", "budget"]
    assert [q.counter("search") for q in search.quotas] == ["agent-calls"]
    rate, _, flight, budget = (q.counter("transfer") for q in transfer.quotas)
    assert (rate, flight, budget) == ("agent-calls", "transfer/in_flight/120s/key",
                                      "transfer/budget/86400s/agent+workflow")
    assert transfer.quotas[3].per == ("agent", "workflow")  # canonical order
    assert transfer.quotas[2].ttl_s == 120.0 and transfer.quotas[2].limit == 2.0


def test_every_mistake_is_reported_with_its_line(tmp_path: Path) -> None:
    found = problems(tmp_path, """\
        version: 1
        defaults:
          mode: shadoww
        tools:
          transfer:
            locks: ["account:{from_id}"]
            approval:
              when: {amount: {gtt: 1000}}
              expires: 5 minutes
            quotas:
              - {calls: 10}
              - {in_flight: 2, window: 1m}
          refund:
            locks: ["account:{from_id}"]
            quotas:
              - {budget: 100, window: 1d}
              - {calls: 3, window: 1m, per: [user]}
              - {calls: 3, window: 1m, lease: 1s}
          pay:
            locks: ["account:{from_id}"]
            quotas: [{calls: 3, in_flight: 2, window: 1m}, {in_flight: 1, arg: amount}]
            mode: maybe
        """)
    expected = [
        ("policy.yml:3: defaults.mode:", "'enforce' or 'shadow'"),
        ("policy.yml:8: tools.transfer.approval.when[0].amount:", "'gtt' — did you mean 'gt'?"),
        ("policy.yml:9: tools.transfer.approval.expires:", "'5 minutes' is not a duration"),
        ("policy.yml:11: tools.transfer.quotas[0]:", "calls: needs a window"),
        ("policy.yml:12: tools.transfer.quotas[1]:", "takes a lease, not a window"),
        ("policy.yml:16: tools.refund.quotas[0]:", "budget: needs arg:"),
        ("policy.yml:17: tools.refund.quotas[1].per[0]:", "'agent', 'tool', 'key' or 'workflow'"),
        ("policy.yml:18: tools.refund.quotas[2]:", "lease applies to in_flight quotas only"),
        ("policy.yml:21: tools.pay.quotas[0]:", "exactly one of calls"),
        ("policy.yml:21: tools.pay.quotas[1]:", "arg applies to budget quotas only"),
        ("policy.yml:22: tools.pay.mode:", "'enforce' or 'shadow'"),
    ]
    for where, what in expected:
        assert any(p.startswith(where) and what in p for p in found), (where, what, found)
    assert len(found) == len(expected), found


def test_whole_policy_checks(tmp_path: Path) -> None:
    found = problems(tmp_path, """\
        version: 1
        defaults:
          quotas: [{name: shared, calls: 5, window: 1m}]
        tools:
          refund:
            locks: ["account:{id}"]
            quotas: [{name: shared, calls: 6, window: 1m}]
          search:
            read_only: true
            quotas: {calls: 1, window: 1s, per: key}
        """)
    assert len(found) == 2, found
    assert found[0].startswith("policy.yml:7: tools.refund.quotas[0]: quota 'shared' is defined "
                               "differently at ") and "policy.yml:3" in found[0]
    assert found[1].startswith("policy.yml:10: tools.search.quotas[0]: a per: key quota on 'search'")


def test_shared_quotas_must_agree_but_may_repeat(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, """\
        version: 1
        tools:
          transfer: {locks: ["a:{id}"], quotas: [{name: pay, budget: 5, arg: amount, window: 1h}]}
          refund: {locks: ["a:{id}"], quotas: [{name: pay, budget: 5.0, arg: amount, window: 3600}]}
        """))
    assert {q.counter(t) for t in policy.tools for q in policy.tools[t].quotas} == {"pay"}


def test_durations() -> None:
    assert [parse_duration(v) for v in (30, 2.5, "500ms", "30s", "5m", "2h", "1d", "1w")] == [
        30.0, 2.5, 0.5, 30.0, 300.0, 7200.0, 86400.0, 604800.0]
    for bad in (0, -1, "0s", "1y", "", "1 minute", True, None, float("inf"), "400d"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert QuotaRule(in_flight=1).ttl_s == DEFAULT_LEASE_S


def test_approval_false_or_null_means_none() -> None:
    for value in (False, None):
        policy = Policy.from_dict({"version": 1, "tools": {"t": {"read_only": True, "approval": value}}})
        assert policy.tools["t"].approval is None
    with pytest.raises(PolicyProblems, match="empty condition"):
        Policy.from_dict({"version": 1, "tools": {"t": {"read_only": True,
                                                       "approval": {"when": [{}]}}}})


def test_schema_checks_for_budget_and_approval_paths(tmp_path: Path) -> None:
    class Transfer(BaseModel):
        account_id: str
        amount: int
        memo: str

    policy = Policy.from_dict({"version": 1, "tools": {"transfer": {
        "locks": ["account:{account_id}"],
        "approval": {"when": [{"amount": {"gt": 5}}, {"memo": {"ge": 3}, "amonut": {"gt": 1}}]},
        "quotas": [{"budget": 10, "arg": "memo", "window": "1d"},
                   {"budget": 10, "arg": "amount", "window": "1d"},
                   {"budget": 10, "arg": "ammount", "window": "1d"}]}}})
    with pytest.raises(PolicyProblems) as caught:
        policy.check_against({"transfer": Transfer})
    found = [str(p) for p in caught.value.problems]
    assert len(found) == 4, found
    assert any("quotas[0].arg" in p and "'memo' is string: a budget sums numbers" in p for p in found)
    assert any("quotas[2].arg" in p and "did you mean 'amount'" in p for p in found)
    assert any("when[1].memo" in p and "number condition on an argument of type string" in p
               for p in found)
    assert any("when[1].amonut" in p and "did you mean 'amount'" in p for p in found)


def test_digest_is_the_meaning_not_the_text(tmp_path: Path) -> None:
    base = load_policy(write(tmp_path, GOOD))
    spelled_out = GOOD.replace("  mode: enforce\n", "  mode: enforce\n  ttl_ms: 10000\n"
                                                    "  on_unknown_tool: deny\n")
    reordered = "# a comment\n" + spelled_out.replace("expires: 30m", "expires: 1800")
    same = load_policy(write(tmp_path, reordered, "other.yml"))
    assert same.digest == base.digest and len(base.digest) == 64
    changed = load_policy(write(tmp_path, GOOD.replace("calls: 10,", "calls: 11,"), "changed.yml"))
    assert changed.digest != base.digest
    shadow = load_policy(write(tmp_path, GOOD.replace("mode: shadow", "mode: enforce"), "mode.yml"))
    assert shadow.digest != base.digest
    # the digest is cached, and a copy with another key_fn keeps the policy's identity
    assert base.with_key_fn(lambda intent: None).digest == base.digest
