"""The gateway over stdio, launched by the MCP SDK's own client as a desktop client would."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from .conftest import (
    POLICY,
    UPSTREAM,
    audit_rows,
    clean_env,
    counter,
    stdio_session,
    toolguard,
    upstream_calls,
)

#: Each test starts real processes (the gateway, its upstream): slow on a loaded machine.
pytestmark = pytest.mark.timeout(900)


def gateway_args(*extra: str) -> list[str]:
    return toolguard("mcp", "proxy", "--policy", str(POLICY), "--agent", "alice", *extra, "--",
                     *UPSTREAM)


def meta_of(result) -> dict:
    return dict(result.meta or {})


def test_calls_are_guarded_denied_tools_never_reach_the_upstream(tmp_path: Path) -> None:
    async def run():
        async with stdio_session(gateway_args(), tmp_path, clean_env(tmp_path)) as session:
            listed = await session.list_tools()
            applied = await session.call_tool("bump", {"counter": "c", "by": 2})
            denied = await session.call_tool("forbidden", {"counter": "c"})
            return listed, applied, denied

    listed, applied, denied = asyncio.run(run())
    assert "forbidden" in {tool.name for tool in listed.tools}  # listed: no --hide-unlisted
    assert not applied.is_error, applied.content
    assert applied.structured_content == {"counter": "c", "value": 2}
    assert denied.is_error
    assert meta_of(denied)["toolguard/reason"] == "not_authorized"
    assert "not_authorized" in denied.content[0].text
    assert upstream_calls(tmp_path, "forbidden") == []
    rows = audit_rows(tmp_path)
    assert [(r.tool, r.decision, r.reason, r.agent) for r in rows] == [
        ("bump", "accepted", "applied", "alice"), ("forbidden", "rejected", "not_authorized", "alice")]


def test_a_retried_call_is_applied_once_upstream(tmp_path: Path) -> None:
    key = {"toolguard/idempotency-key": "retry-1"}

    async def run():
        async with stdio_session(gateway_args(), tmp_path, clean_env(tmp_path)) as session:
            first = await session.call_tool("bump", {"counter": "r", "by": 5}, meta=key)
            again = await session.call_tool("bump", {"counter": "r", "by": 5}, meta=key)
            other = await session.call_tool("bump", {"counter": "r", "by": 6}, meta=key)
        async with stdio_session(gateway_args(), tmp_path, clean_env(tmp_path)) as session:
            later = await session.call_tool("bump", {"counter": "r", "by": 5}, meta=key)
        return first, again, other, later

    first, again, other, later = asyncio.run(run())
    assert first.structured_content == {"counter": "r", "value": 5}
    for replay in (again, later):  # the same key, another gateway process too: the recorded answer
        assert replay.structured_content == first.structured_content
        assert meta_of(replay)["toolguard/replayed"] is True
    assert other.is_error and meta_of(other)["toolguard/reason"] == "idempotency_conflict"
    assert counter(tmp_path, "r")[0] == 5
    assert len(upstream_calls(tmp_path, "bump")) == 1
    assert [r.decision for r in audit_rows(tmp_path)] == ["accepted", "replayed", "rejected",
                                                        "replayed"]


DEEP: list = []
for _ in range(50):  # deeper than toolguard allows (8); the SDK transport drops JSON past ~200
    DEEP = [DEEP]


def test_hostile_arguments_and_meta_get_a_typed_refusal_and_one_row_each(tmp_path: Path) -> None:
    hostile = [
        ("bump", {"counter": "h", "by": "5"}, None, "invalid_arguments"),         # no coercion
        ("bump", {"counter": "h", "extra": 1}, None, "invalid_arguments"),        # unknown field
        ("bump", {"counter": "x" * 300_000}, None, None),                         # oversized
        ("bump", {"counter": DEEP}, None, None),                                  # deep nesting
        ("bump", {"counter": "h"}, {"toolguard/fencing-token": "counter%3Ah=999"}, "invalid_intent"),
        ("bump", {"counter": "h"}, {"toolguard/agent": "root"}, "invalid_intent"),
        ("bump", {"counter": "h"}, {"toolguard/idempotency-key": 7}, "invalid_intent"),
        ("bump", {"counter": "h"}, {"toolguard/idempotency-key": "k" * 5000}, "invalid_intent"),
        ("bump", {"counter": "h"}, {"toolguard/whatever": True}, "invalid_intent"),
        ("no_such_tool", {}, None, "unknown_tool"),
    ]

    async def run():
        answers = []
        async with stdio_session(gateway_args(), tmp_path, clean_env(tmp_path)) as session:
            for tool, arguments, meta, _ in hostile:
                answers.append(await session.call_tool(tool, arguments, meta=meta))
            answers.append(await session.call_tool("bump", {"counter": "h"}))  # still serving
        return answers

    answers = asyncio.run(run())
    *refused, fine = answers
    assert not fine.is_error, fine.content
    for (tool, _, _, reason), answer in zip(hostile, refused, strict=True):
        assert answer.is_error, (tool, answer)
        if reason is not None:
            assert meta_of(answer)["toolguard/reason"] == reason, answer.content
    rows = audit_rows(tmp_path)
    assert len(rows) == len(hostile) + 1
    assert all(r.decision == "rejected" for r in rows[:-1])
    assert [tool for tool, _ in upstream_calls(tmp_path)] == ["bump"]  # only the good call
    assert counter(tmp_path, "h")[0] == 1


def test_tools_list_can_be_filtered_to_what_the_agent_may_call(tmp_path: Path) -> None:
    async def run():
        async with stdio_session(gateway_args("--hide-unlisted"), tmp_path,
                                 clean_env(tmp_path)) as session:
            return await session.list_tools()

    names = {tool.name for tool in asyncio.run(run()).tools}
    assert names == {"bump", "attach", "close", "slow", "progress", "fails",
                     "peek_env", "peek_header"}  # not forbidden


def test_upstream_error_results_and_progress_pass_through(tmp_path: Path) -> None:
    seen: list[float] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(progress)

    async def run():
        async with stdio_session(gateway_args(), tmp_path, clean_env(tmp_path)) as session:
            failed = await session.call_tool("fails", {"counter": "e"})
            progressed = await session.call_tool("progress", {"counter": "e"},
                                                  progress_callback=on_progress)
            return failed, progressed

    failed, progressed = asyncio.run(run())
    assert failed.is_error and failed.content[0].text == "upstream says no to e"
    assert "toolguard/reason" not in meta_of(failed)   # the upstream's own answer, unchanged
    assert not progressed.is_error
    assert seen == [1, 2, 3]
    rows = audit_rows(tmp_path)
    assert [(r.tool, r.decision, r.reason) for r in rows] == [("fails", "failed", "tool_error"),
                                                             ("progress", "accepted", "applied")]
