"""Decisions across calls through the gateway: a client's reads are checked when it writes.

The caller is the gateway's agent plus the conversation a client names in
``_meta["toolguard/thread"]`` (without it, the agent alone).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from .conftest import HERE, UPSTREAM, audit_rows, clean_env, stdio_session, toolguard, upstream_calls

pytestmark = pytest.mark.timeout(900)


def test_a_write_on_a_stale_read_through_the_gateway(tmp_path: Path) -> None:
    args = toolguard("mcp", "proxy", "--policy", str(HERE / "reads_policy.yml"), "--agent",
                     "alice", "--", *UPSTREAM)
    one, two = {"toolguard/thread": "t-1"}, {"toolguard/thread": "t-2"}

    async def run() -> list[tuple[bool, str | None]]:
        async with stdio_session(args, tmp_path, clean_env(tmp_path)) as session:
            async def call(tool: str, arguments: dict, meta: dict | None) -> tuple[bool, object]:
                result = await session.call_tool(tool, arguments, meta=meta)
                reason = dict(result.meta or {}).get("toolguard/reason")
                value = result.structured_content
                return result.is_error, reason if result.is_error else value

            seen_one = (await call("read_counter", {"counter": "c"}, one))[1]
            seen_two = (await call("read_counter", {"counter": "c"}, two))[1]
            outcomes = [
                await call("set_counter", {"counter": "c", "value": 5}, None),  # agent alone: unread
                await call("set_counter", {"counter": "c", "value": 5}, one),
                await call("set_counter", {"counter": "c", "value": 7}, two),  # read 0, now 5
            ]
            again = (await call("read_counter", {"counter": "c"}, two))[1]
            outcomes.append(await call("set_counter", {"counter": "c", "value": 12}, two))
            return [seen_one, seen_two, *outcomes, again]

    got = asyncio.run(run())
    assert got[0] == got[1] == {"result": 0}
    assert got[2] == (True, "unread")
    assert got[3][0] is False
    assert got[4] == (True, "stale_read")
    assert got[6] == {"result": 5}
    assert got[5][0] is False
    assert upstream_calls(tmp_path, "set_counter") == [("set_counter", "c:5"),
                                                      ("set_counter", "c:12")]
    reasons = [(r.tool, r.reason) for r in audit_rows(tmp_path)]
    assert reasons == [("read_counter", "read"), ("read_counter", "read"),
                       ("set_counter", "unread"), ("set_counter", "applied"),
                       ("set_counter", "stale_read"), ("read_counter", "read"),
                       ("set_counter", "applied")]


def test_a_hold_lasts_across_gateway_calls_until_the_write(tmp_path: Path) -> None:
    """``hold: true`` through the gateway: the conversation that read holds the counter across
    MCP calls (another conversation's read waits, here past its 1 s wait: ``lock_timeout``);
    its write runs under the hold and ends it."""
    args = toolguard("mcp", "proxy", "--policy", str(HERE / "holds_policy.yml"), "--agent",
                     "alice", "--", *UPSTREAM)
    one, two = {"toolguard/thread": "t-1"}, {"toolguard/thread": "t-2"}

    async def run() -> list[object]:
        async with stdio_session(args, tmp_path, clean_env(tmp_path)) as session:
            async def call(tool: str, arguments: dict, meta: dict | None) -> object:
                result = await session.call_tool(tool, arguments, meta=meta)
                reason = dict(result.meta or {}).get("toolguard/reason")
                return ("error", reason) if result.is_error else result.structured_content

            return [await call("read_counter", {"counter": "c"}, one),
                    await call("read_counter", {"counter": "c"}, two),  # t-1 holds it
                    await call("set_counter", {"counter": "c", "value": 5}, one),
                    await call("read_counter", {"counter": "c"}, two),
                    await call("set_counter", {"counter": "c", "value": 6}, two)]

    got = asyncio.run(run())
    assert got[0] == {"result": 0}
    assert got[1] == ("error", "lock_timeout")
    assert got[3] == {"result": 5}
    assert not isinstance(got[2], tuple) and not isinstance(got[4], tuple), got
    assert upstream_calls(tmp_path, "set_counter") == [("set_counter", "c:5"),
                                                      ("set_counter", "c:6")]
