"""The gateway over streamable HTTP (``--listen``), called by the MCP SDK's own client and raw JSON-RPC."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from .conftest import audit_rows, clean_env, counter, http_session, upstream_calls

#: Each test starts real processes (the gateway, its upstream): slow on a loaded machine.
pytestmark = pytest.mark.timeout(900)

ALICE = "alice:" + "a" * 24
BOB = "bob:" + "b" * 24


def test_two_clients_racing_on_one_counter_are_serialized(tmp_path: Path, start_gateway) -> None:
    gateway = start_gateway("--token", ALICE, "--token", BOB)

    async def one(token: str, by: int):
        async with http_session(gateway.url, token) as session:
            return await session.call_tool("bump", {"counter": "race", "by": by, "hold_s": 0.5})

    async def race():
        return await asyncio.gather(one("a" * 24, 1), one("b" * 24, 10), one("a" * 24, 100))

    answers = asyncio.run(race())
    assert all(not a.is_error for a in answers), [a.content for a in answers]
    assert counter(tmp_path, "race") == (111, 1)  # all applied, never two inside at once
    rows = audit_rows(tmp_path)
    assert sorted(r.agent for r in rows) == ["alice", "alice", "bob"]  # from the token, per call
    tokens = [r.tokens["counter:race"] for r in rows]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3  # each its own lease, in grant order


def test_ordering_refuses_close_before_attach_then_lets_it_through(tmp_path: Path,
                                                                  start_gateway) -> None:
    gateway = start_gateway("--token", ALICE, "--token", BOB)

    async def run():
        async with http_session(gateway.url, "b" * 24) as bob, \
                http_session(gateway.url, "a" * 24) as alice:
            early = await bob.call_tool("close", {"counter": "t"})
            attached = await alice.call_tool("attach", {"counter": "t", "note": "log"})
            closed = await bob.call_tool("close", {"counter": "t"})
            return early, attached, closed

    early, attached, closed = asyncio.run(run())
    assert early.is_error and (early.meta or {})["toolguard/reason"] == "out_of_order"
    assert not attached.is_error and not closed.is_error
    assert [tool for tool, _ in upstream_calls(tmp_path)] == ["attach", "close"]
    assert [(r.tool, r.agent, r.reason) for r in audit_rows(tmp_path)] == [
        ("close", "bob", "out_of_order"), ("attach", "alice", "applied"), ("close", "bob", "applied")]


def test_tokens_from_the_environment_stay_in_the_gateway(tmp_path: Path, start_gateway) -> None:
    """Tokens from the environment; the upstream never sees them (refusals: test_door.py)."""
    gateway = start_gateway(env=clean_env(tmp_path, TOOLGUARD_GATEWAY_TOKENS=ALICE))

    async def run():
        async with http_session(gateway.url, "a" * 24) as session:
            return await session.call_tool("peek_env", {"name": "TOOLGUARD_GATEWAY_TOKENS"})

    peek = asyncio.run(run())
    assert peek.structured_content == {"result": False}, peek.content
    assert upstream_calls(tmp_path) == []
    assert [(r.agent, r.reason) for r in audit_rows(tmp_path)] == [("alice", "applied")]


def _rpc(client: httpx.Client, url: str, body: dict, session: str | None) -> tuple[dict | None, str | None]:
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
               "Authorization": "Bearer " + "a" * 24}
    if session:
        headers["Mcp-Session-Id"] = session
    response = client.post(url, content=json.dumps(body), headers=headers)
    if response.status_code >= 400:
        return {"http_status": response.status_code}, session
    session = response.headers.get("mcp-session-id", session)
    if not response.content:
        return None, session
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        data = [line[5:].strip() for line in response.text.splitlines() if line.startswith("data:")]
        messages = [json.loads(d) for d in data if d]
        return next((m for m in messages if "id" in m), None), session
    return response.json(), session


def test_a_call_retried_with_the_same_request_id_replays(tmp_path: Path, start_gateway) -> None:
    gateway = start_gateway("--token", ALICE)
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
            "params": {"name": "bump", "arguments": {"counter": "rid", "by": 3}}}
    with httpx.Client(timeout=120) as client:
        _, session = _rpc(client, gateway.url, {
            "jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "raw", "version": "1"}}}, None)
        assert session, "a handshake-era HTTP client gets a session id"
        _rpc(client, gateway.url, {"jsonrpc": "2.0", "method": "notifications/initialized"}, session)
        first, _ = _rpc(client, gateway.url, call, session)
        again, _ = _rpc(client, gateway.url, call, session)
        lone = {**call, "id": 8}
        lone["params"] = {"name": "bump", "arguments": {"counter": "\ud800"}}
        hostile, _ = _rpc(client, gateway.url, lone, session)
        later, _ = _rpc(client, gateway.url, {**call, "id": 9, "params": {
            "name": "bump", "arguments": {"counter": "rid", "by": 1}}}, session)
    assert first is not None and again is not None
    assert first["result"]["structuredContent"] == {"counter": "rid", "value": 3}
    assert again["result"]["structuredContent"] == first["result"]["structuredContent"]
    assert again["result"]["_meta"]["toolguard/replayed"] is True
    assert counter(tmp_path, "rid")[0] == 4  # 3 once (not twice), then the later 1
    assert hostile is not None and "result" not in hostile  # a lone surrogate: refused
    assert later is not None and later["result"]["structuredContent"]["value"] == 4  # still serving
    reasons = [r.reason for r in audit_rows(tmp_path)]
    assert reasons == ["applied", "duplicate", "applied"]  # the refused surrogate never got in


def _wait_for(path: Path, timeout_s: float = 120.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written")


def test_an_upstream_killed_mid_call_leaves_one_unknown_row_and_the_next_call_works(
        tmp_path: Path, start_gateway) -> None:
    gateway = start_gateway("--token", ALICE)
    pid_file = tmp_path / "upstream.pid"

    async def run():
        async with http_session(gateway.url, "a" * 24) as session:
            call = asyncio.create_task(session.call_tool("slow", {"counter": "k"}))
            pid = await asyncio.to_thread(_wait_for, pid_file)
            os.kill(pid, signal.SIGKILL)
            lost = await call
            after = await session.call_tool("bump", {"counter": "k", "by": 1})
            return lost, after

    lost, after = asyncio.run(run())
    assert lost.is_error and (lost.meta or {})["toolguard/reason"] == "upstream_lost", lost.content
    assert not after.is_error, after.content      # the upstream was started again, the lease freed
    rows = audit_rows(tmp_path)
    assert [(r.tool, r.decision) for r in rows] == [("slow", "unknown"), ("bump", "accepted")]


def test_a_cancelled_call_leaves_one_unknown_row_and_frees_its_lease(tmp_path: Path,
                                                                    start_gateway) -> None:
    gateway = start_gateway("--token", ALICE)
    pid_file = tmp_path / "upstream.pid"

    async def run():
        async with http_session(gateway.url, "a" * 24) as session:
            call = asyncio.create_task(session.call_tool("slow", {"counter": "c"}))
            await asyncio.to_thread(_wait_for, pid_file)
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
        async with http_session(gateway.url, "a" * 24) as session:
            return await session.call_tool("bump", {"counter": "c", "by": 1})

    after = asyncio.run(run())
    assert not after.is_error, after.content
    rows = audit_rows(tmp_path)  # the unknown row may land just after the freed lease is taken
    assert sorted((r.tool, r.decision) for r in rows) == [("bump", "accepted"), ("slow", "unknown")]
