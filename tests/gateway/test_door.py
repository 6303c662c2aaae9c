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

from .conftest import POLICY, UPSTREAM, Gateway, clean_env, free_port, http_session, toolguard, upstream_calls
from .conftest import audit_rows as _audit_rows

#: Each test starts real processes (the gateway, its upstream): slow on a loaded machine.
pytestmark = pytest.mark.timeout(900)

ALICE = "alice:" + "a" * 24
INITIALIZE = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "page", "version": "1"}}}


def attack(url: str, tool: str, arguments: dict, *, host: str | None = None,
           origin: str | None = None, token: str | None = None) -> list[int]:
    """initialize, initialized, tools/call, tools/list as raw HTTP: the status of each."""
    headers: dict[str, str | bytes] = {"Accept": "application/json, text/event-stream",
                                       "Content-Type": "application/json"}
    if host:
        headers["Host"] = host
    if origin:
        headers["Origin"] = origin
    if token:
        headers["Authorization"] = f"Bearer {token}".encode("latin-1")  # as sent, not checked
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


# --- credentials: 401 before any MCP processing -------------------------------------------


def test_without_a_valid_token_nothing_gets_in(tmp_path: Path, start_gateway) -> None:
    """No token, a wrong one, another scheme: 401 for initialize, calls and tools/list alike;
    a burst of them is counted and summed up in a few log lines, never audited."""
    gateway = start_gateway("--token", ALICE, env=clean_env(tmp_path, FASTMCP_LOG_LEVEL="INFO"))
    for token in (None, "z" * 24, "a" * 23, "a" * 24 + "\u00e9"):
        statuses = attack(gateway.url, "bump", {"counter": "t", "by": 1}, token=token)
        assert statuses == [401] * 4, (token, statuses)
    with httpx.Client(timeout=120) as client:
        answer = client.post(gateway.url, content=json.dumps(INITIALIZE), headers={
            "Accept": "application/json, text/event-stream", "Content-Type": "application/json",
            "Authorization": "Basic " + "a" * 24})
        burst = {client.post(gateway.url, content=json.dumps(INITIALIZE), headers={
            "Accept": "application/json, text/event-stream",
            "Content-Type": "application/json"}).status_code for _ in range(200)}
    assert answer.status_code == 401 and answer.headers["www-authenticate"].startswith("Bearer")
    assert "tools" not in answer.text and "bump" not in answer.text
    assert burst == {401}
    assert upstream_calls(tmp_path) == [] and audit_rows(tmp_path) == []
    logged = gateway.output()  # 217 refusals: a summary line every 10 s, none per request
    assert 1 <= logged.count("refused at the door") < 20 and "Auth error" not in logged

    async def run():
        async with http_session(gateway.url, "a" * 24) as session:
            listed = await session.list_tools()
            called = await session.call_tool("bump", {"counter": "t", "by": 2})
            return listed, called

    listed, called = asyncio.run(run())
    assert "bump" in [tool.name for tool in listed.tools] and not called.is_error
    assert [(r.agent, r.reason) for r in audit_rows(tmp_path)] == [("alice", "applied")]
    assert upstream_calls(tmp_path) == [("bump", "t:2")]


@pytest.fixture
def http_upstream(tmp_path: Path):
    """The tests' upstream serving streamable HTTP on a free loopback port."""
    import subprocess
    import time

    port = free_port()
    env = clean_env(tmp_path, UPSTREAM_HTTP_PORT=str(port))
    process = subprocess.Popen(UPSTREAM, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, "the HTTP upstream exited"
            try:
                httpx.get(url, timeout=1.0)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the HTTP upstream did not listen"
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_clients_token_never_reaches_an_http_upstream(tmp_path: Path, start_gateway,
                                                       http_upstream: str) -> None:
    gateway = start_gateway("--token", ALICE, "--upstream", http_upstream, upstream=[])

    async def run():
        async with http_session(gateway.url, "a" * 24) as session:
            return await session.call_tool("peek_header", {"name": "authorization"})

    seen = asyncio.run(run())
    assert not seen.is_error, seen.content
    assert seen.structured_content == {"result": None}, seen.structured_content
    assert [(r.agent, r.tool) for r in audit_rows(tmp_path)] == [("alice", "peek_header")]


# --- OAuth access tokens: a JWKS served by the test on loopback, keys the test made ---------

AUDIENCE = "https://gateway.test/mcp"


def _b64(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Issuer:
    """An authorization server's JWKS on loopback (its fetches counted) and its signing keys."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.keys: dict[str, object] = {}   # kid -> RSA private key, published
        self.fetches = 0
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                issuer.fetches += 1
                body = json.dumps({"keys": [issuer.jwk(kid) for kid in list(issuer.keys)]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.jwks_url = f"{self.url}/jwks.json"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def new_key() -> object:
        from cryptography.hazmat.primitives.asymmetric import rsa

        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def publish(self, kid: str) -> object:
        self.keys[kid] = key = self.new_key()
        return key

    def jwk(self, kid: str) -> dict[str, str]:
        numbers = self.keys[kid].public_key().public_numbers()  # type: ignore[attr-defined]

        def whole(n: int) -> str:
            return _b64(n.to_bytes((n.bit_length() + 7) // 8, "big"))

        return {"kty": "RSA", "kid": kid, "use": "sig", "alg": "RS256",
                "n": whole(numbers.n), "e": whole(numbers.e)}

    def claims(self, **changes: object) -> dict[str, object]:
        import time

        now = int(time.time())
        claims: dict[str, object] = {"iss": self.url, "aud": AUDIENCE, "sub": "alice",
                                     "iat": now, "exp": now + 600}
        claims.update(changes)
        return {k: v for k, v in claims.items() if v is not None}

    def token(self, kid: str, key: object | None = None, *, header: dict | None = None,
              **changes: object) -> str:
        """An RS256 token signed with ``key`` (default: the published key of ``kid``)."""
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        head = {"alg": "RS256", "typ": "JWT", "kid": kid, **(header or {})}
        signing_input = (f"{_b64(json.dumps(head).encode())}."
                         f"{_b64(json.dumps(self.claims(**changes)).encode())}")
        signer = key if key is not None else self.keys[kid]
        signature = signer.sign(signing_input.encode(), padding.PKCS1v15(),  # type: ignore[attr-defined]
                                hashes.SHA256())
        return f"{signing_input}.{_b64(signature)}"

    def unsigned(self, kid: str, alg: str, secret: bytes | None = None) -> str:
        """``alg: none`` (no signature), or an HMAC keyed with ``secret`` (key confusion)."""
        import hashlib
        import hmac

        head = {"alg": alg, "typ": "JWT", "kid": kid}
        signing_input = f"{_b64(json.dumps(head).encode())}.{_b64(json.dumps(self.claims()).encode())}"
        if secret is None:
            return f"{signing_input}."
        return f"{signing_input}.{_b64(hmac.new(secret, signing_input.encode(), hashlib.sha256).digest())}"

    def public_pem(self, kid: str) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self.keys[kid].public_key().public_bytes(  # type: ignore[attr-defined]
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.fixture
def issuer():
    made = Issuer()
    yield made
    made.server.shutdown()
    made.server.server_close()


def oauth_args(issuer: Issuer) -> list[str]:
    return ["--jwks-url", issuer.jwks_url, "--issuer", issuer.url, "--audience", AUDIENCE]


def test_forged_expired_misaddressed_and_unsigned_tokens_get_nothing(tmp_path: Path, start_gateway,
                                                                    issuer: Issuer) -> None:
    issuer.publish("k1")
    gateway = start_gateway(*oauth_args(issuer))
    port = gateway.port
    stranger = Issuer.new_key()
    bad = {
        "forged": issuer.token("k1", stranger),
        "expired": issuer.token("k1", exp=1_000_000_000),
        "no expiry": issuer.token("k1", exp=None),
        "not yet valid": issuer.token("k1", nbf=4_000_000_000),
        "wrong audience": issuer.token("k1", aud="https://other.test/mcp"),
        "wrong issuer": issuer.token("k1", iss="https://evil.example"),
        "unknown kid": issuer.token("k9", stranger),
        "alg none": issuer.unsigned("k1", "none"),
        "HS256 keyed with the public key": issuer.unsigned("k1", "HS256", issuer.public_pem("k1")),
        "HS256 keyed with the JWK": issuer.unsigned("k1", "HS256",
                                                    json.dumps(issuer.jwk("k1")).encode()),
        "no agent claim": issuer.token("k1", sub=None),
        "agent claim not a name": issuer.token("k1", sub=7),
        "tampered": issuer.token("k1")[:-8] + "AAAAAAAA",
    }
    for case, token in bad.items():
        statuses = attack(gateway.url, "bump", {"counter": "o", "by": 1}, token=token)
        assert statuses == [401] * 4, (case, statuses)
    assert upstream_calls(tmp_path) == [] and audit_rows(tmp_path) == []

    with httpx.Client(timeout=120) as client:
        refused = client.post(gateway.url, content=json.dumps(INITIALIZE), headers={
            "Accept": "application/json, text/event-stream", "Content-Type": "application/json"})
        metadata = [client.get(f"http://127.0.0.1:{port}{path}").json()
                    for path in ("/.well-known/oauth-protected-resource",
                                 "/.well-known/oauth-protected-resource/mcp")]
    challenge = refused.headers["www-authenticate"]
    assert refused.status_code == 401 and challenge.startswith("Bearer ")
    assert (f'resource_metadata="http://127.0.0.1:{port}/.well-known/oauth-protected-resource/mcp"'
            in challenge)
    for document in metadata:
        assert document["resource"] == gateway.url
        assert [url.rstrip("/") for url in document["authorization_servers"]] == [issuer.url]

    logged = gateway.output()
    assert all(token.split(".")[2][:16] not in logged for token in bad.values() if "." in token
               and token.split(".")[2])


def test_a_valid_tokens_agent_is_the_one_the_policy_authorizes(tmp_path: Path, start_gateway,
                                                              issuer: Issuer,
                                                              http_upstream: str) -> None:
    """The SDK's own client with a bearer token; the agent is the claim; the token stays here."""
    issuer.publish("k1")
    gateway = start_gateway(*oauth_args(issuer), "--agent-claim", "agent",
                            "--upstream", http_upstream, upstream=[])
    alice = issuer.token("k1", sub="someone", agent="alice")
    mallory = issuer.token("k1", sub="alice", agent="mallory")  # sub is not the agent claim here

    async def run(token: str):
        async with http_session(gateway.url, token) as session:
            bumped = await session.call_tool("bump", {"counter": "v", "by": 5})
            header = await session.call_tool("peek_header", {"name": "authorization"})
            claimed = await session.call_tool("bump", {"counter": "v", "by": 1},
                                              meta={"toolguard/agent": "alice"})
            return bumped, header, claimed

    bumped, header, claimed = asyncio.run(run(alice))
    assert not bumped.is_error and bumped.structured_content["value"] == 5
    assert header.structured_content == {"result": None}  # the token never went upstream
    assert (claimed.meta or {})["toolguard/reason"] == "invalid_intent"  # _meta names no one
    refused, _, _ = asyncio.run(run(mallory))
    assert (refused.meta or {})["toolguard/reason"] == "not_authorized"
    rows = audit_rows(tmp_path)
    assert [(r.agent, r.tool, r.reason) for r in rows[:5]] == [
        ("alice", "bump", "applied"), ("alice", "peek_header", "applied"),
        ("alice", "bump", "invalid_intent"),
        ("mallory", "bump", "not_authorized"), ("mallory", "peek_header", "not_authorized")]
    assert rows[5].agent == "mallory" and rows[5].decision == "rejected" and len(rows) == 6
    assert upstream_calls(tmp_path, "bump") == [("bump", "v:5")]
    for token in (alice, mallory):
        assert token not in gateway.output() and token not in str([r.args for r in rows])


def test_a_rotated_key_is_fetched_and_unknown_kids_cannot_make_it_fetch_often(
        tmp_path: Path, start_gateway, issuer: Issuer) -> None:
    issuer.publish("k1")
    rotating = start_gateway(*oauth_args(issuer),
                             env=clean_env(tmp_path, TOOLGUARD_GATEWAY_JWKS_REFRESH_S="0"))
    assert attack(rotating.url, "bump", {"counter": "k", "by": 1},
                  token=issuer.token("k1"))[:3] == [200, 202, 200]
    issuer.publish("k2")  # the issuer rotates: a key the gateway has not seen
    assert attack(rotating.url, "bump", {"counter": "k", "by": 1},
                  token=issuer.token("k2"))[:3] == [200, 202, 200]
    assert issuer.fetches == 2  # fetched again for the unknown kid, and only then
    rotating.stop()

    before = issuer.fetches
    steady = start_gateway(*oauth_args(issuer),
                           env=clean_env(tmp_path, TOOLGUARD_GATEWAY_JWKS_REFRESH_S="3600"))
    assert attack(steady.url, "bump", {"counter": "k", "by": 1},
                  token=issuer.token("k1"))[:3] == [200, 202, 200]
    stranger = Issuer.new_key()
    with httpx.Client(timeout=120) as client:
        statuses = {client.post(steady.url, content=json.dumps(INITIALIZE), headers={
            "Accept": "application/json, text/event-stream", "Content-Type": "application/json",
            "Authorization": f"Bearer {issuer.token(f'kid-{n}', stranger)}"}).status_code
            for n in range(50)}
    assert statuses == {401}
    assert issuer.fetches - before == 1  # one fetch at the first token; none for 50 unknown kids
    assert [r.reason for r in audit_rows(tmp_path)] == ["applied"] * 3


def test_oauth_settings_are_refused_at_start_up(tmp_path: Path, issuer: Issuer) -> None:
    import subprocess

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*toolguard("mcp", "proxy", "--policy", str(POLICY)), *args,
                               "--", *UPSTREAM],
                              capture_output=True, text=True, cwd=tmp_path,
                              env=clean_env(tmp_path), timeout=300)

    listen = ["--listen", f"127.0.0.1:{free_port()}"]
    for args, said in (
            ([*listen, "--jwks-url", issuer.jwks_url, "--issuer", issuer.url], "--audience"),
            ([*listen, *oauth_args(issuer), "--jwt-algorithm", "none"], "never none"),
            ([*listen, *oauth_args(issuer), "--jwt-algorithm", "HS256"], "never none"),
            ([*oauth_args(issuer)], "--listen"),
            ([*listen, "--issuer", issuer.url], "--jwks-url"),
            (["--listen", f"0.0.0.0:{free_port()}", *oauth_args(issuer)], "--resource-url")):
        done = run(*args)
        assert done.returncode == 2 and said in done.stderr, (args, done.stderr)


def test_a_session_belongs_to_the_credential_that_opened_it(tmp_path: Path, start_gateway) -> None:
    """Bob holding Alice's session id still calls as no one but himself: refused, not run."""
    gateway = start_gateway("--token", ALICE, "--token", "bob:" + "b" * 24)
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
               "Authorization": "Bearer " + "a" * 24}
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "bump", "arguments": {"counter": "s", "by": 1}}}
    with httpx.Client(timeout=120) as client:
        opened = client.post(gateway.url, content=json.dumps(INITIALIZE), headers=headers)
        session = opened.headers["mcp-session-id"]
        headers["Mcp-Session-Id"] = session
        client.post(gateway.url, content=json.dumps(
            {"jsonrpc": "2.0", "method": "notifications/initialized"}), headers=headers)
        taken = client.post(gateway.url, content=json.dumps(call),
                            headers={**headers, "Authorization": "Bearer " + "b" * 24})
    assert opened.status_code == 200 and 400 <= taken.status_code < 500, taken.status_code
    assert upstream_calls(tmp_path) == [] and audit_rows(tmp_path) == []
