"""Approvals through the gateway: MCP elicitation when the client can answer, else an id to approve."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import mcp_types
import pytest

from .conftest import POLICY, UPSTREAM, audit_rows, clean_env, counter, stdio_session, toolguard

#: Each test starts real processes (the gateway, its upstream): slow on a loaded machine.
pytestmark = pytest.mark.timeout(900)

BIG = {"counter": "big", "by": 5000}


def gateway_args(*extra: str) -> list[str]:
    return toolguard("mcp", "proxy", "--policy", str(POLICY), "--agent", "alice", *extra, "--",
                     *UPSTREAM)


def test_a_client_that_can_elicit_is_asked_and_its_answer_decides(tmp_path: Path) -> None:
    asked: list[str] = []

    async def answer(context, params) -> mcp_types.ElicitResult:
        asked.append(params.message)
        approve = len(asked) == 1  # the first is approved, the second declined
        return mcp_types.ElicitResult(action="accept" if approve else "decline",
                                      content={"value": True} if approve else None)

    async def run():
        async with stdio_session(gateway_args(), tmp_path, clean_env(tmp_path),
                                 elicitation_callback=answer) as session:
            approved = await session.call_tool("bump", BIG, meta={"toolguard/idempotency-key": "e1"})
            declined = await session.call_tool("bump", BIG, meta={"toolguard/idempotency-key": "e2"})
            return approved, declined

    approved, declined = asyncio.run(run())
    assert len(asked) == 2 and "a big bump" in asked[0]
    assert not approved.is_error, approved.content
    assert (declined.meta or {})["toolguard/reason"] == "approval_denied"
    assert counter(tmp_path, "big")[0] == 5000
    # each request audited when asked and when decided (by the elicitation), then the call
    assert [r.reason for r in audit_rows(tmp_path)] == [
        "approval_required", "approved", "applied", "approval_required", "denied",
        "approval_denied"]


def test_without_elicitation_the_call_waits_for_toolguard_approve(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    key = {"toolguard/idempotency-key": "a1"}

    async def ask():
        async with stdio_session(gateway_args("--no-elicit"), tmp_path, env) as session:
            return await session.call_tool("bump", BIG, meta=key)

    waiting = asyncio.run(ask())
    approval_id = (waiting.meta or {})["toolguard/approval-id"]
    assert (waiting.meta or {})["toolguard/reason"] == "approval_required"
    done = subprocess.run(toolguard("approve", approval_id, "--by", "ops"), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr

    async def again():
        async with stdio_session(gateway_args("--no-elicit"), tmp_path, env) as session:
            return await session.call_tool("bump", BIG, meta=key)

    applied = asyncio.run(again())
    assert not applied.is_error, applied.content
    assert counter(tmp_path, "big")[0] == 5000
