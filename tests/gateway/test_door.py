"""The gateway's HTTP door, sent what a browser after DNS rebinding and an attacker send.

Each refused request must reach neither the guard (no audit row) nor the
upstream (its state unchanged); the requests the door lets through still work.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from toolguard.errors import StoreError

from .conftest import Gateway, clean_env, free_port, http_session, toolguard, upstream_calls
from .conftest import audit_rows as _audit_rows

#: Each test starts real processes (the gateway, its upstream): slow on a loaded machine.
pytestmark = pytest.mark.timeout(900)

ALICE = "alice:" + "a" * 24
INITIALIZE = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "page", "version": "1"}}}


def attack(url: str, tool: str, arguments: dict, *, host: str | None = None,
           origin: str | None = None, token: str | None = None) -> list[int]:
    """initialize, initialized, tools/call, tools/list as raw HTTP: the status of each."""
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    if host:
        headers["Host"] = host
    if origin:
        headers["Origin"] = origin
    if token:
        headers["Authorization"] = f"Bearer {token}"
    statuses = []
    with httpx.Client(timeout=120) as client:
        first = client.post(url, content=json.dumps(INITIALIZE), headers=headers)
        statuses.append(first.status_code)
        session = first.headers.get("mcp-session-id")
        if session:
            headers["Mcp-Session-Id"] = session
        for body in ({"jsonrpc": "2.0", "method": "notifications/initialized"},
                     {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                      "params": {"name": tool, "arguments": arguments}},
                     {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}):
            statuses.append(client.post(url, content=json.dumps(body), headers=headers).status_code)
    return statuses


def audit_rows(tmp_path: Path) -> list:
    """The gateway's audit rows; none when it never wrote one (its schema is made lazily)."""
    try:
        return _audit_rows(tmp_path)
    except StoreError as error:
        assert "schema is not installed" in str(error)
        return []


def tickets(tmp_path: Path) -> list[str]:
    """The titles on the example board (what reached the example server)."""
    path = tmp_path / "board.db"
    if not path.exists():
        return []
    with closing(sqlite3.connect(path)) as db:
        try:
            return [row[0] for row in db.execute("SELECT title FROM tickets")]
        except sqlite3.OperationalError:
            return []


def start_example(tmp_path: Path, gateways: list[Gateway], *args: str) -> Gateway:
    port = free_port()
    gateway = Gateway(toolguard("mcp", "example", "--listen", f"127.0.0.1:{port}", *args),
                      tmp_path, clean_env(tmp_path), port)
    gateways.append(gateway)
    return gateway.start()


# --- Host and Origin (DNS rebinding) ------------------------------------------------------


def test_a_rebinding_page_reaches_neither_the_guard_nor_the_upstream(tmp_path: Path,
                                                                     start_gateway) -> None:
    """Host and Origin of the attacker's name, then a good Host with a foreign Origin."""
    gateway = start_gateway("--agent", "alice")
    port = gateway.port
    rebound = attack(gateway.url, "bump", {"counter": "r", "by": 1},
                     host=f"evil.example:{port}", origin=f"http://evil.example:{port}")
    foreign_origin = attack(gateway.url, "bump", {"counter": "r", "by": 1},
                            host=f"127.0.0.1:{port}", origin=f"http://evil.example:{port}")
    assert rebound == [421] * 4, rebound
    assert foreign_origin == [403] * 4, foreign_origin
    assert upstream_calls(tmp_path) == []
    assert audit_rows(tmp_path) == []
    assert "refused at the door" in gateway.output()  # a log line, not an audit row
    # the gateway's own names still get in: loopback Host, and a loopback page's Origin
    for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
        assert attack(gateway.url, "bump", {"counter": "r", "by": 1}, host=host,
                      origin=f"http://{host}")[:3] == [200, 202, 200]
    assert [(r.agent, r.reason) for r in audit_rows(tmp_path)] == [("alice", "applied")] * 2


def test_the_example_gateway_refuses_a_rebinding_page(tmp_path: Path,
                                                     gateways: list[Gateway]) -> None:
    gateway = start_example(tmp_path, gateways)
    port = gateway.port
    statuses = attack(gateway.url, "open_ticket", {"title": "from evil"},
                      host=f"evil.example:{port}", origin=f"http://evil.example:{port}")
    assert statuses == [421] * 4
    assert tickets(tmp_path) == [] and audit_rows(tmp_path) == []

    async def run():
        async with http_session(gateway.url) as session:
            return await session.call_tool("open_ticket", {"title": "from the desk"})

    assert not asyncio.run(run()).is_error
    assert tickets(tmp_path) == ["from the desk"]


def test_names_and_origins_allowed_for_a_gateway_behind_a_proxy(tmp_path: Path,
                                                                start_gateway) -> None:
    gateway = start_gateway("--agent", "alice", "--allow-host", "gw.example.com",
                            env=clean_env(tmp_path,
                                          TOOLGUARD_GATEWAY_ALLOWED_ORIGINS="https://app.example.com"))
    behind = attack(gateway.url, "bump", {"counter": "p", "by": 1}, host="gw.example.com",
                    origin="https://app.example.com")
    other = attack(gateway.url, "bump", {"counter": "p", "by": 1}, host="gw.example.com",
                   origin="https://evil.example")
    unnamed = attack(gateway.url, "bump", {"counter": "p", "by": 1}, host="other.example.com")
    assert behind[:3] == [200, 202, 200], behind
    assert other == [403] * 4 and unnamed == [421] * 4
    assert [r.reason for r in audit_rows(tmp_path)] == ["applied"]
    assert upstream_calls(tmp_path) == [("bump", "p:1")]


def test_allow_host_needs_listen(tmp_path: Path) -> None:
    import subprocess

    done = subprocess.run([sys.executable, "-m", "toolguard", "mcp", "example", "--allow-host",
                           "gw.example.com"], capture_output=True, text=True, cwd=tmp_path,
                          env=clean_env(tmp_path), timeout=300)
    assert done.returncode == 2 and "--listen" in done.stderr
