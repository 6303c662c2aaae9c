"""Every decision the gateway makes is an ``execute_tool`` span (the gateway in-process here)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from fastmcp import Client
from telemetry.recorder import Recorder  # the telemetry suite's in-memory exporters

from toolguard import ToolGuard, telemetry
from toolguard.gateway import Identity, Upstream, open_gateway
from toolguard.locks import connect_async
from toolguard.policies import load_policy
from toolguard.store import open_async_store

from .conftest import POLICY, UPSTREAM, clean_env

#: Each test starts real processes (the gateway, its upstream): slow on a loaded machine.
pytestmark = pytest.mark.timeout(900)


def test_each_call_through_the_gateway_is_a_span_with_its_decision(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in clean_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    recorder = Recorder()
    telemetry.use_providers(tracer_provider=recorder.tracer_provider,
                            meter_provider=recorder.meter_provider)

    # built before the loop: reading the policy file is blocking I/O (blockbuster watches it)
    guard = ToolGuard(load_policy(POLICY),
                      async_locks=connect_async(f"sqlite:///{tmp_path}/locks.db"),
                      async_store=open_async_store(f"sqlite:///{tmp_path}/store.db",
                                                   install=True))

    async def run():
        server = await open_gateway(guard, Upstream(command=tuple(UPSTREAM), cwd=os.getcwd()),
                                    identity=Identity(agent="alice"))
        async with Client(server) as client:
            await client.call_tool("bump", {"counter": "s", "by": 1})
            await client.call_tool("forbidden", {"counter": "s"}, raise_on_error=False)

    try:
        asyncio.run(run())
    finally:
        telemetry.use_providers()
    calls = recorder.calls()
    assert [(s.attributes["gen_ai.tool.name"], s.attributes["toolguard.decision"]) for s in calls] \
        == [("bump", "accepted"), ("forbidden", "rejected")]
    assert recorder.spans("toolguard.tool")  # the upstream call ran inside the guarded span


def test_requests_refused_at_the_door_are_counted_not_audited(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    from toolguard.gateway import Door

    for name, value in clean_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    recorder = Recorder()
    telemetry.use_providers(tracer_provider=recorder.tracer_provider,
                            meter_provider=recorder.meter_provider)
    guard = ToolGuard(load_policy(POLICY),
                      async_locks=connect_async(f"sqlite:///{tmp_path}/locks.db"),
                      async_store=open_async_store(f"sqlite:///{tmp_path}/store.db",
                                                   install=True))
    door = Door("127.0.0.1", 8931)
    body = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    accept = {"Accept": "application/json, text/event-stream"}

    async def run() -> list[int]:
        server = await open_gateway(guard, Upstream(command=tuple(UPSTREAM), cwd=os.getcwd()),
                                    identity=Identity(tokens={"a" * 24: "alice"}),
                                    resource_url=door.url)
        transport = httpx.ASGITransport(app=door.app(server))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8931") as client:
            return [(await client.post("/mcp", json=body, headers={**accept, **extra})).status_code
                    for extra in ({"Host": "evil.example:8931"}, {"Origin": "http://evil.example"},
                                  {}, {"Authorization": "Bearer " + "z" * 24})]

    try:
        statuses = asyncio.run(run())
    finally:
        telemetry.use_providers()
    assert statuses == [421, 403, 401, 401]
    assert recorder.counts("toolguard.gateway.refused_requests", "toolguard.reason") == {
        ("host",): 1, ("origin",): 1, ("credential",): 2}
    assert recorder.calls() == []  # no guarded call, so no decision and no audit row
