"""``toolguard policy diff``: recent audited intents replayed through two policies, no side effects."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from typer.testing import CliRunner

from toolguard.cli import app
from toolguard.policies import load_policy
from toolguard.policies.diff import ALLOWED, diff, verdict
from toolguard.store import AuditEntry, open_store

OLD = """\
version: 1
tools:
  transfer:
    locks: ["account:{from_id}"]
    agents: [payments, support]
    redact: [memo]
  lookup:
    read_only: true
"""
NEW = """\
version: 1
tools:
  transfer:
    locks: ["account:{from_id}", "account:{to_id}"]
    agents: [payments]
    args: {amount: {le: 1000}, memo: {max_length: 3}}
    redact: [memo]
    approval: {when: {amount: {gt: 500}}}
    quotas: [{calls: 10, window: 1m, per: agent}]
  lookup:
    read_only: true
    mode: shadow
"""


def rows() -> list[AuditEntry]:
    def row(decision: str, tool: str, agent: str, args: object) -> AuditEntry:
        return AuditEntry(decision=decision, reason="applied" if decision == "accepted" else "x",
                          tool=tool, agent=agent, args=args)

    return [
        row("accepted", "transfer", "payments", {"from_id": "a", "to_id": "b", "amount": 10,
                                                 "memo": "[redacted]"}),
        row("accepted", "transfer", "support", {"from_id": "a", "to_id": "b", "amount": 10}),
        row("accepted", "transfer", "payments", {"from_id": "a", "to_id": "b", "amount": 700}),
        row("accepted", "transfer", "payments", {"from_id": "a", "to_id": "b", "amount": 5000}),
        row("accepted", "lookup", "support", {"q": "x"}),
        row("rejected", "transfer", "payments", {"_unvalidated": {"from_id": "str[1]"}}),
        row("operator", "transfer", None, {"approval_id": "ap_1"}),
        row("rejected", "wire", "payments", {"to": "x"}),
    ]


def policies(tmp_path: Path):
    (tmp_path / "old.yml").write_text(textwrap.dedent(OLD), encoding="utf-8")
    (tmp_path / "new.yml").write_text(textwrap.dedent(NEW), encoding="utf-8")
    return load_policy(tmp_path / "old.yml"), load_policy(tmp_path / "new.yml")


def test_what_would_change(tmp_path: Path) -> None:
    old, new = policies(tmp_path)
    report = diff(old, new, rows())
    assert report.replayed == 6 and report.unchanged == 1 and report.redacted == 1
    assert [why for _, why in report.skipped] == [
        "its arguments never passed validation (only their shape was recorded)",
        "not an intent (decision operator)"]
    what = {(c.entry.agent, c.entry.args.get("amount"), c.entry.tool): c.what for c in report.changes}
    # the redacted memo is replayed as "[redacted]": over max_length 3, flagged as approximate
    first = report.changes[0]
    assert first.redacted and first.new.outcome == "invalid_arguments"
    assert what[("support", 10, "transfer")] == (
        "allowed -> refused not_authorized: agent 'support' may not call transfer (allowed: payments)",)
    assert what[("payments", 700, "transfer")] == (
        "keys account:a -> account:a account:b", "now needs approval (amount > 500)",
        "quotas +transfer/rate/60s/agent")
    assert what[("payments", 5000, "transfer")][0].startswith(
        "allowed -> refused invalid_arguments: args.amount: must be <= 1000")
    assert what[("support", None, "lookup")] == ("mode enforce -> shadow",)


def test_a_verdict_never_raises() -> None:
    from toolguard.policies import Policy

    policy = Policy.from_dict({"version": 1, "tools": {"t": {"locks": ["k:{id}"]}}})
    assert verdict(policy, "t", "a", {"id": 1}).outcome == ALLOWED
    assert verdict(policy, "t", None, {"id": 1}).outcome == "missing_identity"  # never guessed
    assert verdict(policy, "t", "a", {}).outcome == "invalid_arguments"  # no key could be rendered
    assert verdict(policy, "nope", "a", {}).outcome == "unknown_tool"
    assert verdict(policy, "t", "a", {"id": "x" * 10_000}).outcome == "invalid_arguments"  # limits


def test_cli(tmp_path: Path) -> None:
    policies(tmp_path)
    url = f"sqlite:///{tmp_path}/store.db"
    store = open_store(url, install=True)
    try:
        for row in rows():
            store.audit(row)
        before = len(store.query_audit(limit=None))
    finally:
        store.close()
    runner = CliRunner()
    args = ["policy", "diff", str(tmp_path / "old.yml"), str(tmp_path / "new.yml"), "--url", url]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Replayed 6 of the last 7 audited intents" in out  # the operator row is not read
    assert "5 would change, 1 unchanged, 1 could not be replayed." in out
    assert "allowed -> refused not_authorized" in out and "now needs approval" in out
    assert "1 replayed intent has redacted arguments" in out
    assert runner.invoke(app, [*args, "--check"]).exit_code == 1
    same = runner.invoke(app, ["policy", "diff", str(tmp_path / "old.yml"), str(tmp_path / "old.yml"),
                               "--url", url, "--check"])
    assert same.exit_code == 0 and "0 would change" in same.stdout
    assert "same policy" in same.stdout
    data = json.loads(runner.invoke(app, [*args, "--json", "--last", "3"]).stdout)
    assert data["replayed"] + len(data["skipped"]) == 3
    only = json.loads(runner.invoke(app, [*args, "--json", "--tool", "lookup"]).stdout)
    assert [c["what"] for c in only["changes"]] == [["mode enforce -> shadow"]]
    store = open_store(url)
    try:
        assert len(store.query_audit(limit=None)) == before  # nothing written
    finally:
        store.close()
