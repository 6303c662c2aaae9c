"""A FastMCP server behind FenceToolMiddleware, over streamable HTTP, called from guarded tools."""

from __future__ import annotations

import asyncio

import pytest
from fastmcp import Client
from mcp.shared.exceptions import MCPError

from toolguard import StaleFencingToken, UnknownToolWarning
from toolguard.adapters import guarded
from toolguard.fences import FencedSession, guarded_mcp_tools
from toolguard.fences.mcp_server import REPLAYED_META_KEY
from toolguard.fences.wire import Fences

from .conftest import leads, make_guard


def meta(tokens: dict[str, int], key: str | None = "k#1") -> dict[str, str]:
    return Fences(tokens=tokens, idempotency_key=key, agent="raw", intent_id="c").meta()


def audit(store):
    return store.query_audit(newest_first=False, limit=None)


async def call(url: str, name: str, args: dict, **kwargs):
    async with Client(url + "/mcp") as client:
        return await client.call_tool(name, args, **kwargs)


def test_a_guarded_tool_calls_the_mcp_tool_under_its_lease(mcp_service, mcp_store, redis_url,
                                                          tmp_path, unique):
    guard = make_guard(tmp_path, "a", redis_url, asynchronous=True)
    lead = f"{unique}-M"

    @guarded(guard, agent="intent_scorer")
    async def set_score(lead_id: str, score: int) -> dict:
        async with Client(mcp_service.url + "/mcp") as client:
            result = await FencedSession(client).call_tool("set_score",
                                                           {"lead_id": lead_id, "score": score})
        return result.structured_content

    decision = asyncio.run(set_score.arun({"lead_id": lead, "score": 70}, call_id="m-1",
                                          thread_id="tm"))
    assert decision.ok, decision.message
    assert decision.result["writes"] == 1
    assert leads(mcp_store)[lead] == (70, 1)
    key = f"lead:{lead}"
    assert mcp_store.high_water(key) == decision.tokens[key]
    (row,) = audit(mcp_store)
    assert (row.decision, row.tool, row.agent, row.intent_id) == ("accepted", "set_score",
                                                                 "intent_scorer", "m-1")


def test_replay_conflict_and_stale_over_mcp(mcp_service, mcp_store):
    url = mcp_service.url
    first = asyncio.run(call(url, "set_score", {"lead_id": "r", "score": 3},
                             meta=meta({"lead:r": 5}, "r#1")))
    again = asyncio.run(call(url, "set_score", {"lead_id": "r", "score": 3},
                             meta=meta({"lead:r": 5}, "r#1")))
    assert again.structured_content == first.structured_content
    assert again.meta[REPLAYED_META_KEY] is True
    assert REPLAYED_META_KEY not in (first.meta or {})
    with pytest.raises(MCPError) as conflict:
        asyncio.run(call(url, "set_score", {"lead_id": "r", "score": 4},
                         meta=meta({"lead:r": 5}, "r#1")))
    assert (conflict.value.error.code, conflict.value.error.data["reason"]) == (
        -32074, "idempotency_conflict")
    with pytest.raises(MCPError) as stale:
        asyncio.run(call(url, "set_score", {"lead_id": "r", "score": 4},
                         meta=meta({"lead:r": 4}, "r#2")))
    data = stale.value.error.data
    assert (stale.value.error.code, data["key"], data["token"], data["current"]) == (
        -32072, "lead:r", 4, 5)
    assert leads(mcp_store)["r"] == (3, 1)
    assert [r.reason for r in audit(mcp_store)] == ["applied", "duplicate",
                                                    "idempotency_conflict",
                                                    "stale_fencing_token"]


def test_a_replayed_call_advances_the_servers_fence(mcp_service, mcp_store):
    url = mcp_service.url
    asyncio.run(call(url, "set_score", {"lead_id": "rf", "score": 3},
                     meta=meta({"lead:rf": 10}, "rf#1")))
    again = asyncio.run(call(url, "set_score", {"lead_id": "rf", "score": 3},
                             meta=meta({"lead:rf": 20}, "rf#1")))
    assert again.meta[REPLAYED_META_KEY] is True
    assert mcp_store.high_water("lead:rf") == 20
    with pytest.raises(MCPError) as stale:
        asyncio.run(call(url, "set_score", {"lead_id": "rf", "score": 4},
                         meta=meta({"lead:rf": 15}, "rf#2")))
    data = stale.value.error.data
    assert (data["token"], data["current"]) == (15, 20)
    assert leads(mcp_store)["rf"] == (3, 1)
    assert [r.reason for r in audit(mcp_store)] == ["applied", "duplicate", "stale_fencing_token"]


@pytest.mark.parametrize("sent, code, reason", [
    (None, -32071, "fences_required"),
    ({"toolguard/fencing-token": "lead%3Ax=1"}, -32071, "fences_required"),
    ({"toolguard/fencing-token": "lead:x=1", "toolguard/idempotency-key": "x#1"}, -32602,
     "invalid_fence_header"),
    ({"toolguard/fencing-token": 7, "toolguard/idempotency-key": "x#1"}, -32602,
     "invalid_fence_header"),
    # a null entry arrives as an absent one
    ({"toolguard/fencing-token": None, "toolguard/idempotency-key": "x#1"}, -32071,
     "fences_required"),
    # the exact key and a look-alike with another token: which one was meant is not a guess
    ({"toolguard/fencing-token": "lead%3Ax=9", "Toolguard/Fencing-Token": "lead%3Ax=1",
      "toolguard/idempotency-key": "x#1"}, -32602, "invalid_fence_header"),
])
def test_missing_or_malformed_meta_is_an_mcp_error_and_changes_nothing(mcp_service, mcp_store,
                                                                      sent, code, reason):
    with pytest.raises(MCPError) as raised:
        asyncio.run(call(mcp_service.url, "set_score", {"lead_id": "x", "score": 1}, meta=sent))
    assert (raised.value.error.code, raised.value.error.data["reason"]) == (code, reason)
    assert leads(mcp_store) == {}
    assert [r.reason for r in audit(mcp_store)] == [reason]


def test_a_failing_tool_has_its_writes_rolled_back(mcp_service, mcp_store):
    result = asyncio.run(call(mcp_service.url, "fail_after_write", {"lead_id": "f"},
                              meta=meta({"lead:f": 2}, "f#1"), raise_on_error=False))
    assert result.is_error
    assert leads(mcp_store) == {}
    assert mcp_store.high_water("lead:f") == 0
    (row,) = audit(mcp_store)
    assert row.decision == "failed"


def test_concurrent_calls_with_one_key_apply_once(mcp_service, mcp_store):
    args = {"lead_id": "cc", "score": 9, "sleep": 1.0}

    async def burst():
        first = asyncio.create_task(call(mcp_service.url, "set_score", args,
                                         meta=meta({"lead:cc": 3}, "cc#1")))
        await asyncio.sleep(0.4)
        others = await asyncio.gather(*[call(mcp_service.url, "set_score", args,
                                             meta=meta({"lead:cc": 3}, "cc#1"))
                                        for _ in range(3)], return_exceptions=True)
        return await first, others

    first, others = asyncio.run(burst())
    assert first.structured_content["writes"] == 1
    assert all(isinstance(e, MCPError) and e.error.data["reason"] == "in_flight" for e in others)
    assert leads(mcp_store)["cc"] == (9, 1)


def test_tools_loaded_through_the_mcp_sdk_are_guarded_and_forward_the_lease(
        mcp_service, mcp_store, redis_url, tmp_path, unique):
    """The official SDK's ClientSession, tools listed from the server, wrapped by the guard."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    from toolguard.fences.mcp_client import raise_for_refusal

    guard = make_guard(tmp_path, "a", redis_url, asynchronous=True)
    lead = f"{unique}-S"

    async def run() -> tuple[object, MCPError | None]:
        async with streamable_http_client(mcp_service.url + "/mcp") as streams, \
                ClientSession(streams[0], streams[1]) as session:
            await session.initialize()
            # the server also lists fail_after_write, which this guard's policy does not name
            with pytest.warns(UnknownToolWarning, match="'fail_after_write' is not in the policy"):
                listed = await guarded_mcp_tools(guard, session, agent="scorer")
            tools = {t.name: t for t in listed}
            tool_call = {"name": "set_score", "args": {"lead_id": lead, "score": 12}, "id": "sdk-1",
                         "type": "tool_call"}
            message = await tools["set_score"].ainvoke(tool_call,
                                                       {"configurable": {"thread_id": "ts"}})
            refused = None
            try:  # an older token straight through the SDK: the server refuses it
                await session.call_tool("set_score", {"lead_id": lead, "score": 1},
                                        meta=meta({f"lead:{lead}": 1}, "sdk-stale#1"))
            except MCPError as error:
                refused = error
            return message, refused

    message, refused = asyncio.run(run())
    assert message.status != "error", message.content
    assert leads(mcp_store)[lead] == (12, 1)
    assert refused is not None
    with pytest.raises(StaleFencingToken):
        raise_for_refusal(refused)
    rows = audit(mcp_store)
    assert [(r.reason, r.agent) for r in rows] == [("applied", "scorer"),
                                                   ("stale_fencing_token", "raw")]
    assert rows[0].intent_id == "sdk-1"
