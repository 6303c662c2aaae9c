"""Issue 21 point 3 over stdio: a ``_meta`` key named twice is refused, as over HTTP.

The MCP SDK's stdio reader parses each line into a dict (the last of two equal
keys wins) before any tool hook runs. The FastMCP server here is served with
``toolguard.fences.mcp_stdio.run_stdio_async``, which marks such a line for
``FenceToolMiddleware``; the test writes raw JSON-RPC lines to the server's
stdin, as a hostile client would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from servers import stop_process

from toolguard.fences.mcp_server import REPEATED_META_KEY
from toolguard.fences.mcp_stdio import mark_repeated

from .conftest import TESTS, audit, leads
from .service_app import prepare


class StdioServer:
    """The fenced FastMCP server as a child process, spoken to line by line."""

    def __init__(self, store_url: str, schema: str | None) -> None:
        env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "FENCES_STORE_URL": store_url, "FENCES_SCHEMA": schema or ""}
        self.process = subprocess.Popen([sys.executable, "-m", "fences.service_app"], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, cwd=TESTS)
        self.next_id = 1
        answer = self.request("initialize", {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "raw", "version": "1"}})
        assert "result" in answer, answer
        self.send('{"jsonrpc":"2.0","method":"notifications/initialized"}')

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()

    def answer(self, request_id: int) -> dict[str, Any]:
        assert self.process.stdout is not None
        while True:
            line = self.process.stdout.readline()
            assert line, "the server closed its stdout"
            message: dict[str, Any] = json.loads(line)
            if message.get("id") == request_id:
                return message

    def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        return self.call_raw(method, json.dumps(params))

    def call_raw(self, method: str, params: str) -> dict[str, Any]:
        request_id, self.next_id = self.next_id, self.next_id + 1
        self.send(f'{{"jsonrpc":"2.0","id":{request_id},"method":"{method}","params":{params}}}')
        return self.answer(request_id)

    def stop(self) -> None:
        stop_process(self.process, timeout_s=10)


@pytest.fixture
def stdio_server(service_store_url: tuple[str, str | None]) -> Iterator[tuple[StdioServer, Any]]:
    from toolguard.store import open_store

    url, schema = service_store_url
    os.environ["FENCES_STORE_URL"], os.environ["FENCES_SCHEMA"] = url, schema or ""
    try:
        prepare()  # installed before the child starts: it finds the store ready
    finally:
        del os.environ["FENCES_STORE_URL"], os.environ["FENCES_SCHEMA"]
    server = StdioServer(url, schema)
    try:
        with open_store(url, **({"schema": schema} if schema else {})) as store:
            yield server, store
    finally:
        server.stop()


def _meta(*pairs: tuple[str, str]) -> str:
    return "{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in pairs) + "}"


@pytest.mark.parametrize("first, second", [("lead%3Ads=5", "lead%3Ads=1"),
                                           ("lead%3Ads=5", "lead%3Ads=5")])
def test_a_repeated_meta_key_over_stdio_is_refused_and_audited_once(stdio_server, first, second):
    server, store = stdio_server
    token = "toolguard/fencing-token"
    call = '{"name":"set_score","arguments":{"lead_id":"ds","score":1},"_meta":%s}'
    key = "toolguard/idempotency-key"
    repeated = server.call_raw("tools/call",
                               call % _meta((token, first), (key, "ds#1"), (token, second)))
    error = repeated["error"]
    assert (error["data"]["reason"], error["data"]["field"]) == ("invalid_fence_header", token)
    assert leads(store) == {}
    # the same call with each key once is applied: the refusal is the repeat's alone
    once = server.call_raw("tools/call", call % _meta((token, first), (key, "ds#2")))
    assert "result" in once, once
    assert [(r.decision, r.reason) for r in audit(store)] == [
        ("rejected", "invalid_fence_header"), ("accepted", "applied")]
    assert leads(store) == {"ds": (1, 1)}


def test_a_client_cannot_send_the_mark_itself_to_pass(stdio_server):
    """The mark's key is toolguard's: sent by a client, the call is refused, never run."""
    server, store = stdio_server
    meta = _meta(("toolguard/fencing-token", "lead%3Amk=3"), ("toolguard/idempotency-key", "mk#1"),
                 (REPEATED_META_KEY, ""))
    answer = server.call_raw("tools/call", '{"name":"set_score","arguments":{"lead_id":"mk",'
                             f'"score":1}},"_meta":{meta}}}')
    assert answer["error"]["data"]["reason"] == "invalid_fence_header", answer
    assert leads(store) == {}
    assert [(r.decision, r.reason) for r in audit(store)] == [("rejected", "invalid_fence_header")]


def test_the_mark_keeps_every_other_byte_of_meaning() -> None:
    """Numbers are written back as they arrived (a 5,000-digit id too); lines without a
    repeat pass untouched; a request too deep to write back keeps its id and tool name."""
    plain = '{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"_meta":{"a":1}}}\n'
    assert mark_repeated(plain) is plain
    big = "9" * 5000
    line = (f'{{"jsonrpc":"2.0","id":{big},"method":"tools/call","params":{{"name":"t",'
            f'"arguments":{{"x":1.50,"y":-0e3}},"_meta":{{"k":"a","k":"b"}}}}}}')
    marked = mark_repeated(line)
    assert f'"id":{big},' in marked and '"x":1.50' in marked and '"y":-0e3' in marked
    assert f'"{REPEATED_META_KEY}":"k"' in marked and '"k":"b"' in marked
    deep = "[" * 900 + "]" * 900
    line = ('{"jsonrpc":"2.0","id":"q","method":"tools/call","params":{"name":"t",'
            f'"arguments":{{"x":{deep}}},"_meta":{{"k":"a","k":"b"}}}}}}')
    marked = mark_repeated(line)
    assert json.loads(marked)["params"]["_meta"][REPEATED_META_KEY] == "k"
    assert json.loads(marked)["id"] == "q"
