"""``toolguard policy check`` warns about a write whose arguments look computed and nothing reads."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from toolguard.cli.policy import policy_app
from toolguard.policies import Policy
from toolguard.policies.advice import computed_write_warnings

POLICY = {"version": 1, "tools": {
    "set_balance": {"locks": ["account:{account_id}"], "args": {"balance": {"ge": 0}}},
    "deposit": {"locks": ["account:{account_id}"], "args": {"amount": {"gt": 0}}},
    "set_tier": {"locks": ["lead:{lead_id}"]},
}}


def test_a_computed_write_without_reads_is_warned_about() -> None:
    warnings = computed_write_warnings(Policy.from_dict(POLICY))
    assert [w.message.split(":")[0] for w in warnings] == ["tools.set_balance"]
    assert "values a model computed (balance)" in warnings[0].message
    # with the real tools' arguments, set_tier's `tier` is found too
    named = computed_write_warnings(Policy.from_dict(POLICY), {"set_tier": ["lead_id", "tier"]})
    assert [w.message.split(":")[0] for w in named] == ["tools.set_balance", "tools.set_tier"]


def test_declared_reads_or_requires_read_silence_it() -> None:
    read = {**POLICY["tools"], "get_balance": {"reads": ["account:{id}"]}}
    assert [w.message.split(":")[0] for w in computed_write_warnings(
        Policy.from_dict({"version": 1, "tools": read}))] == []


def test_the_cli_prints_it_and_exits_0(tmp_path: Path) -> None:
    path = tmp_path / "policy.yml"
    path.write_text("version: 1\ntools:\n  set_balance:\n    locks: ['account:{account_id}']\n"
                    "    args: {balance: {ge: 0}}\n", encoding="utf-8")
    result = CliRunner().invoke(policy_app, ["check", str(path)])
    assert result.exit_code == 0, result.output
    expected = f"{path}:3: warning: tools.set_balance: its arguments read as values a model"
    assert expected in result.output
