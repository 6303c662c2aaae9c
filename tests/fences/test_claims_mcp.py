"""A FastMCP server in signed mode (streamable HTTP, uvicorn): claims in ``_meta``, typed errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
from fastmcp import Client
from mcp.shared.exceptions import MCPError

from toolguard.adapters import guarded
from toolguard.fences import FencedSession, Fences, FenceSigner, guarded_mcp_tools
from toolguard.locks import connect
from toolguard.store import GuardedStore

from .conftest import ServiceProcess, leads, make_guard, opened_store
from .test_claims_rest import NEW, OLD, STRANGER, _start


@pytest.fixture
def signed_mcp(service_store_url) -> Iterator[ServiceProcess]:
    process = _start(service_store_url, OLD, NEW, factory="fences.claims_service:create_mcp_app")
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def store(signed_mcp: ServiceProcess) -> Iterator[GuardedStore]:
    with opened_store(signed_mcp) as opened:
        yield opened


async def call(url: str, args: dict, meta: dict) -> object:
    async with Client(url + "/mcp") as client:
        return await client.call_tool("set_score", args, meta=meta)


def test_a_genuine_holder_passes_and_forged_claims_are_typed_mcp_errors(signed_mcp, store,
                                                                       redis_url, tmp_path,
                                                                       unique):
    guard = make_guard(tmp_path, "a", redis_url, asynchronous=True)
    lead = f"{unique}-M"
    key = f"lead:{lead}"

    @guarded(guard, agent="intent_scorer")
    async def set_score(lead_id: str, score: int) -> dict:
        async with Client(signed_mcp.url + "/mcp") as client:
            session = FencedSession(client, signer=FenceSigner(NEW, audience="crm"))
            result = await session.call_tool("set_score", {"lead_id": lead_id, "score": score})
        return result.structured_content

    decision = asyncio.run(set_score.arun({"lead_id": lead, "score": 70}, call_id="m-1",
                                          thread_id="tm"))
    assert decision.ok, decision.message
    assert decision.result["signed_by"] == ["k2"]
    token = decision.tokens[key]
    assert store.high_water(key) == token

    args = {"lead_id": lead, "score": 1}
    inflated = Fences(tokens={key: 2**63 - 1}, idempotency_key="x#1", agent="intent_scorer")
    with pytest.raises(MCPError) as missing:
        asyncio.run(call(signed_mcp.url, args, inflated.meta()))
    assert (missing.value.error.code, missing.value.error.data["reason"]) == (-32078,
                                                                            "claim_missing")
    locks = connect(redis_url)
    lease = locks.acquire(key, ttl_ms=30_000)
    try:
        fences = Fences(tokens=dict(lease.tokens), idempotency_key="y#1", agent="intent_scorer",
                        intent_id="m-2")
        genuine = FenceSigner(OLD, audience="crm").sign(fences, lease)
        cases = [
            (FenceSigner(OLD, audience="billing").sign(fences, lease), -32079,
             "claim_wrong_audience"),
            (FenceSigner(OLD, audience="crm", clock=lambda: time.time() - 3600
                         ).sign(fences, lease), -32078, "claim_expired"),
            (replace(genuine, tokens={key: 2**63 - 1}), -32079, "claim_mismatch"),
            (FenceSigner(STRANGER, audience="crm").sign(fences, lease), -32078,
             "claim_unknown_key"),
            (replace(genuine, agent="lead_enricher"), -32079, "claim_mismatch"),
        ]
        for sent, code, reason in cases:
            with pytest.raises(MCPError) as refused:
                asyncio.run(call(signed_mcp.url, args, sent.meta()))
            assert (refused.value.error.code, refused.value.error.data["reason"]) == (
                code, reason)
        assert store.high_water(key) == token  # nothing forged moved the fence
        assert leads(store)[lead] == (70, 1)
        rejected = [r.reason for r in store.query_audit(decision="rejected", newest_first=False,
                                                        limit=None)]
        assert rejected == ["claim_missing", *(reason for *_, reason in cases)]
        result = asyncio.run(call(signed_mcp.url, args, genuine.meta()))
        assert result.structured_content["signed_by"] == ["k1"]  # the old key id still counts
    finally:
        lease.release()
        locks.close()


def test_guarded_mcp_tools_sign_and_a_refusal_reaches_the_model(signed_mcp, store, redis_url,
                                                                tmp_path, unique):
    guard = make_guard(tmp_path, "a", redis_url, asynchronous=True)
    lead = f"{unique}-G"

    async def run() -> tuple:
        async with Client(signed_mcp.url + "/mcp") as client:
            messages = []
            for signer, call_id, score in ((FenceSigner(OLD, audience="crm"), "g-1", 9),
                                           (FenceSigner(STRANGER, audience="crm"), "g-2", 10)):
                tools = await guarded_mcp_tools(guard, client, agent="intent_scorer",
                                                signer=signer)
                (tool,) = [t for t in tools if t.name == "set_score"]
                tool_call = {"name": "set_score", "args": {"lead_id": lead, "score": score},
                             "id": call_id, "type": "tool_call"}
                messages.append(await tool.ainvoke(tool_call,
                                                   {"configurable": {"thread_id": "tg"}}))
            return tuple(messages)

    applied, refused = asyncio.run(run())
    assert applied.status != "error", applied.content
    assert refused.status == "error" and "claim_unknown_key" in str(refused.content)
    assert leads(store)[lead] == (9, 1)
    (row,) = store.query_audit(decision="rejected", limit=None)
    # a key the service does not hold proves nothing: who the call said it was is kept unproven
    assert (row.reason, row.agent, row.intent_id) == ("claim_unknown_key", None, None)
    said = row.args["unproven"]
    assert (said["agent"], said["intent_id"]) == ("intent_scorer", "g-2")


def test_a_call_through_fenced_session_whose_lease_is_lost_is_not_sent(signed_mcp, store,
                                                                       redis_url, tmp_path,
                                                                       unique):
    from toolguard.call.context import current
    from toolguard.errors import LockLost

    guard = make_guard(tmp_path, "a", redis_url, asynchronous=True)
    lead = f"{unique}-X"

    @guarded(guard, agent="intent_scorer")
    async def set_score(lead_id: str, score: int) -> dict:
        lease = current().lease
        assert lease is not None
        lease.mark_lost(LockLost("taken over", keys=lease.keys))
        async with Client(signed_mcp.url + "/mcp") as client:
            session = FencedSession(client, signer=FenceSigner(NEW, audience="crm"))
            result = await session.call_tool("set_score", {"lead_id": lead_id, "score": score})
        return result.structured_content

    decision = asyncio.run(set_score.arun({"lead_id": lead, "score": 4}, call_id="x-1",
                                          thread_id="tx"))
    assert not decision.ok
    assert store.query_audit(limit=None) == []  # nothing reached the service
    assert lead not in leads(store)
