"""The hostile-input contract of the fenced surfaces, as properties (docs/fences.md, "Hostile
input"): raw requests, not the polite clients, to a real uvicorn service and a real FastMCP
server, on both stores.

For every request: a typed refusal (a toolguard problem) or a normal answer; exactly one
audit row when the middleware saw it (none when the HTTP server or the MCP SDK refused it
first); a bounded response; no exception in the server's log; the server healthy after.
A few hundred examples per surface; ``-m nightly`` runs ten times as many.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolguard.fences.problems import MCP_CODES
from toolguard.store import GuardedStore, open_store

from .conftest import ServiceProcess, logged_service
from .hostile_json import any_json, meta_json, nasty_text, string_json
from .mcp_raw import RawMcp

#: The largest answer any of these requests may get (a refusal's detail is bounded).
MAX_ANSWER_BYTES = 64 * 1024
SERVER_ERRORS = ("Traceback", "Exception in ASGI application", "Task exception was never",
                 "closing returned connection")
DEFAULT_EXAMPLES = 300
NIGHTLY_EXAMPLES = 3000


@pytest.fixture
def logged(request, service_store_url, tmp_path) -> Iterator[ServiceProcess]:
    yield from logged_service(f"fences.service_app:{request.param}", service_store_url, tmp_path)


def audit_count(store: GuardedStore) -> int:
    with store.connection() as conn:
        return int(conn.execute("SELECT count(*) FROM toolguard_audit").fetchone()[0])


def settled_count(store: GuardedStore, service: ServiceProcess, *, most_s: float = 30.0) -> int:
    """The audit count once the service serves no request: one the client or the HTTP server
    cut off may still be running after the answer (or the reset) reached the test, and it
    writes its one row before it returns (the service's ``/inflight`` says when)."""
    deadline = time.monotonic() + most_s
    while (serving := int(httpx.get(service.url + "/inflight", timeout=30).text)) > 0:
        assert time.monotonic() < deadline, f"{serving} request(s) still served after {most_s} s"
        time.sleep(0.01)
    return audit_count(store)


def store_of(service: ServiceProcess) -> GuardedStore:
    return open_store(service.store_url, **({"schema": service.schema} if service.schema else {}))


# --- REST ------------------------------------------------------------------------------------

HEADER_NAMES = ["Fencing-Token", "Idempotency-Key", "Toolguard-Agent", "Toolguard-Intent"]
header_value = st.one_of(
    st.sampled_from([b"lead%3Ahp=3", b'"hp#1"', b'"a"', b'"c"', b"", b"lead:hp=3", b"%",
                     b'"\\x"', b'%"%ff"', b"\x00", b"\xff\xfe", b"a" * 9000, b"lead%3Ahp=0",
                     b'"hp#1"\r\nInjected: 1', b"lead%3Ahp=99999999999999999999"]),
    st.binary(max_size=30))


@st.composite
def rest_request(draw: st.DrawFn) -> bytes:
    """A raw HTTP/1.1 POST: hostile fence headers (absent, broken, repeated, after
    Transfer-Encoding), a hostile JSON body, sometimes a trailer."""
    lines: list[bytes] = []
    valid = [b"lead%3Ahp=3", b'"hp#1"', b'"a"', b'"c"']
    for name, good in zip(HEADER_NAMES, valid, strict=True):
        kind = draw(st.sampled_from(["valid", "valid", "absent", "hostile", "twice"]))
        if kind == "absent":
            continue
        value = good if kind == "valid" else draw(header_value)
        lines.append(name.encode() + b": " + value)
        if kind == "twice":
            lines.append(name.lower().encode() + b": " + good)
    lines = draw(st.permutations(lines))
    body = draw(any_json).encode("utf-8", "surrogatepass")
    if draw(st.integers(0, 4)) == 0:  # chunked, the fence fields perhaps as a trailer
        split = draw(st.integers(0, len(lines)))
        head, trailer = lines[:split], lines[split:]
        framing = [b"Transfer-Encoding: chunked"]
        payload = (f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n"
                   + b"".join(t + b"\r\n" for t in trailer) + b"\r\n") if body else (
            b"0\r\n" + b"".join(t + b"\r\n" for t in trailer) + b"\r\n")
    else:
        head, framing, payload = lines, [f"Content-Length: {len(body)}".encode()], body
    start = b"POST /leads/hp/note HTTP/1.1\r\nHost: svc\r\nContent-Type: application/json\r\n"
    return (start + b"".join(h + b"\r\n" for h in [*head, *framing])
            + b"Connection: close\r\n\r\n" + payload)


def exchange(service: ServiceProcess, data: bytes) -> tuple[int, bytes, bytes]:
    """Send ``data``; the status, the head and the body (read up to the bound and a byte)."""
    host, port = service.url.removeprefix("http://").split(":")
    answer = b""
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        # A server may answer (a refusal) and close before the whole body is sent.
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            sock.sendall(data)
        with contextlib.suppress(ConnectionResetError):
            while len(answer) <= MAX_ANSWER_BYTES + 4096:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    if not head:
        return 0, b"", b""  # hung up on: no answer to classify
    return int(head.split(b" ", 2)[1]), head.lower(), body


def check_rest(examples: int, service: ServiceProcess) -> None:
    with store_of(service) as store:
        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture,
                                         HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(rest_request())
        def check(data: bytes) -> None:
            before = audit_count(store)
            status, head, body = exchange(service, data)
            rows = audit_count(store) - before
            assert len(body) <= MAX_ANSWER_BYTES, (status, len(body))
            if status == 0:  # reset before an answer arrived: at most the one row
                assert settled_count(store, service) - before in (0, 1)
                return
            ours = b"content-type: application/problem+json" in head
            if ours:
                problem = json.loads(body)
                assert problem["status"] == status and isinstance(problem["reason"], str)
                assert status in (400, 409, 413, 422, 428), problem
            else:  # the handler's answer, or the HTTP server refused the bytes itself
                assert status in (200, 400), (status, body[:300])
            if ours or status == 200:  # the middleware answered: its one row
                assert rows == 1, (status, rows, body[:300])
            else:  # the HTTP server refused the bytes: before the app (no row), or while the
                # body was read (the middleware's request_incomplete row, its answer unsent)
                rows = settled_count(store, service) - before
                assert rows in (0, 1), (status, rows, body[:300])

        check()
    assert httpx.get(service.url + "/health", timeout=30).status_code == 200
    log = service.log_text()
    assert not [e for e in SERVER_ERRORS if e in log], log[-4000:]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("logged", ["create_app"], indirect=True)
def test_raw_hostile_requests_to_fence_middleware(logged):
    check_rest(DEFAULT_EXAMPLES, logged)


@pytest.mark.nightly
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("logged", ["create_app"], indirect=True)
def test_raw_hostile_requests_to_fence_middleware_nightly(logged):
    check_rest(NIGHTLY_EXAMPLES, logged)


# --- MCP -------------------------------------------------------------------------------------

OUR_CODES = set(MCP_CODES.values())


@st.composite
def tool_call_params(draw: st.DrawFn) -> str:
    """``params`` of a ``tools/call`` as raw JSON text: the name, the arguments and ``_meta``,
    each valid, hostile or of the wrong type; keys perhaps repeated."""
    pairs: list[tuple[str, str]] = []
    name = draw(st.sampled_from(["set_score", "set_score", "nope", "any", "nasty"]))
    pairs.append(("name", string_json(name) if name in ("set_score", "nope")
                  else draw(any_json) if name == "any" else string_json(draw(nasty_text))))
    arguments = draw(st.sampled_from(["valid", "valid", "any", "absent"]))
    if arguments == "valid":
        score = draw(st.sampled_from(["1", "1.5", '"1"', "9" * 5000, "null", "[1]"]))
        pairs.append(("arguments", '{"lead_id":"mp","score":' + score + "}"))
    elif arguments == "any":
        pairs.append(("arguments", draw(any_json)))
    if draw(st.integers(0, 5)) > 0:
        pairs.append(("_meta", draw(meta_json("mp"))))
    return "{" + ",".join(f'"{key}":{value}' for key, value in draw(st.permutations(pairs))) + "}"


def check_mcp(examples: int, service: ServiceProcess) -> None:
    raw = RawMcp(service.url)
    try:
        with store_of(service) as store:
            @settings(max_examples=examples, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture,
                                             HealthCheck.too_slow, HealthCheck.data_too_large])
            @given(tool_call_params())
            def check(params: str) -> None:
                before = audit_count(store)
                answer = raw.call(params)
                rows = audit_count(store) - before
                assert raw.last_size <= MAX_ANSWER_BYTES, raw.last_size
                assert "result" in answer or "error" in answer, answer
                error = answer.get("error")
                data = error.get("data") if isinstance(error, dict) else None
                ours = isinstance(data, dict) and isinstance(data.get("reason"), str)
                if ours:
                    assert error["code"] in OUR_CODES, answer
                # a result (the tool ran, or failed: rolled back) or a toolguard refusal is
                # audited once; what the SDK refused before any tool hook is not seen
                saw = ours or "result" in answer or (
                    isinstance(error, dict) and error.get("code") not in (-32700, -32602, -32600, -32601))
                assert rows == (1 if saw else 0), (rows, answer)

            check()
    finally:
        raw.close()
    health = RawMcp(service.url)
    try:
        listed = health.post(b'{"jsonrpc":"2.0","id":99,"method":"tools/list"}')
    finally:
        health.close()
    assert "result" in listed, listed
    log = service.log_text()
    assert not [e for e in SERVER_ERRORS if e in log], log[-4000:]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("logged", ["create_mcp_app"], indirect=True)
def test_raw_hostile_tool_calls_to_fence_tool_middleware(logged):
    check_mcp(DEFAULT_EXAMPLES, logged)


@pytest.mark.nightly
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("logged", ["create_mcp_app"], indirect=True)
def test_raw_hostile_tool_calls_to_fence_tool_middleware_nightly(logged):
    check_mcp(NIGHTLY_EXAMPLES, logged)
