"""The production controls hold through the gateway: a rate limit runs out, a paused tool is refused.

Every ``tools/call`` goes through ``ToolGuard.arun``, so a quota in the policy and
``toolguard pause`` (the kill switch, in the gateway's own store) refuse calls
before they reach the upstream, each with one audit row, and the model reads
what it may do next, not who paused what.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from .conftest import POLICY, UPSTREAM, audit_rows, clean_env, stdio_session, toolguard, upstream_calls

#: Each test starts real processes (the gateway, its upstream): slow on a loaded machine.
pytestmark = pytest.mark.timeout(900)


def args_of(tool: str, n: int) -> dict:
    return {"counter": f"q{n}", "note": "n"} if tool == "attach" else {"counter": f"s{n}",
                                                                       "seconds": 0.1}


def test_a_quota_runs_out_and_a_paused_tool_is_refused_before_the_upstream(
        tmp_path: Path) -> None:
    policy = tmp_path / "policy.yml"
    policy.write_text(POLICY.read_text().replace(
        "  attach:\n    locks: [\"counter:{counter}\"]\n",
        "  attach:\n    locks: [\"counter:{counter}\"]\n"
        "    quotas: [{calls: 2, window: 1h, per: agent}]\n"))
    assert "quotas" in policy.read_text()
    env = clean_env(tmp_path)
    args = toolguard("mcp", "proxy", "--policy", str(policy), "--agent", "alice", "--",
                     *UPSTREAM)

    async def calls(tool: str, count: int) -> list:
        async with stdio_session(args, tmp_path, env) as session:
            return [await session.call_tool(tool, args_of(tool, n)) for n in range(count)]

    budgeted = asyncio.run(calls("attach", 3))
    assert [r.is_error for r in budgeted] == [False, False, True]
    assert dict(budgeted[2].meta or {})["toolguard/reason"] == "rate_limited"

    paused_by = "ops-oncall-7"
    subprocess.run(toolguard("pause", "slow", "--tool", "--reason", "incident INC-4711",
                             "--by", paused_by), cwd=tmp_path, env=env, check=True,
                   capture_output=True, timeout=120)
    (paused,) = asyncio.run(calls("slow", 1))
    assert paused.is_error and dict(paused.meta or {})["toolguard/reason"] == "paused"
    text = paused.content[0].text
    assert paused_by not in text and "INC-4711" not in text  # operator details stay out

    assert len(upstream_calls(tmp_path, "attach")) == 2  # the refused ones never reached it
    assert upstream_calls(tmp_path, "slow") == []
    rows = [(r.tool, r.decision, r.reason) for r in audit_rows(tmp_path) if r.tool]
    assert rows == [("attach", "accepted", "applied"), ("attach", "accepted", "applied"),
                    ("attach", "rejected", "rate_limited"),
                    ("slow", "operator", "paused"),  # the pause itself, with who and why
                    ("slow", "rejected", "paused")]
