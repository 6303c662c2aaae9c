"""The cost of the gateway's HTTP door per request, as a ratio to no check, in one run.

    python benchmarks/gateway_door.py [--requests N]

Four gateways (``open_gateway`` in front of the bundled example server over
stdio, embedded SQLite store and locks, each in a process of its own on a
loopback port), differing only in their door:

* ``none``: FastMCP's streamable-HTTP app without Host/Origin guard or credentials
  (what ``toolguard mcp proxy --listen`` served before the door);
* ``host``: the door's Host/Origin guard and its refusal counter (``--agent``);
* ``tokens``: the same plus a static bearer token (``--token``);
* ``oauth``: the same plus an RS256 access token verified against a JWKS this
  script serves on loopback (``--jwks-url``), its key cached after the first.

Each round sends, to each gateway in turn (the order rotated every round, so
slow drifts of the machine hit all alike), one ``tools/list`` in an MCP session
(the request every client makes; it reaches the upstream, not the guard) and,
where the door refuses something, one refused request (a foreign ``Host``; no
credential). It prints p50/p99 per request and the ratio of each door's p50 to
``none``'s. Always exits 0: a slow figure is a finding, not a crash.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import rotated
from _stats import Table, fmt_ratio, fmt_s, ratio, summarize

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["none", "host", "tokens", "oauth"]
TOKEN = "b" * 32
AUDIENCE = "https://gateway.bench/mcp"
ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
INITIALIZE = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}}


# --- one gateway (a child process) -------------------------------------------------------------


def serve(variant: str, port: int, jwks_url: str, issuer: str) -> None:
    """Serve one gateway variant on ``port`` until killed."""
    import asyncio

    from toolguard.gateway import Identity, Upstream, open_gateway
    from toolguard.gateway.door import MCP_PATH, Door
    from toolguard.gateway.example import POLICY_PATH, SERVER_MODULE
    from toolguard.gateway.oauth import OAuthSettings
    from toolguard.guard import ToolGuard
    from toolguard.locks import connect_async
    from toolguard.policies import load_policy
    from toolguard.store import open_async_store

    identity = {"none": Identity(agent="bench"), "host": Identity(agent="bench"),
                "tokens": Identity(tokens={TOKEN: "bench"}),
                "oauth": Identity(oauth=OAuthSettings(jwks_url=jwks_url, issuer=issuer,
                                                      audience=AUDIENCE))}[variant]
    door = Door("127.0.0.1", port)
    guard = ToolGuard(load_policy(POLICY_PATH), async_locks=connect_async("sqlite:///locks.db"),
                      async_store=open_async_store("sqlite:///store.db", install=True))

    async def run() -> None:
        import uvicorn

        server = await open_gateway(guard, Upstream(command=(sys.executable, "-m", SERVER_MODULE)),
                                    identity=identity, resource_url=door.url)
        app: Any = (server.http_app(path=MCP_PATH, transport="http") if variant == "none"
                    else door.app(server))
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                lifespan="on")
        await uvicorn.Server(config).serve()

    asyncio.run(run())


# --- the issuer's JWKS and its token ------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Issuer:
    """An RSA key, its JWKS served on loopback, and one access token signed with it."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding, rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        numbers = key.public_key().public_numbers()

        def whole(n: int) -> str:
            return _b64(n.to_bytes((n.bit_length() + 7) // 8, "big"))

        body = json.dumps({"keys": [{"kty": "RSA", "kid": "k1", "alg": "RS256", "use": "sig",
                                     "n": whole(numbers.n), "e": whole(numbers.e)}]}).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        now = int(time.time())
        head = _b64(json.dumps({"alg": "RS256", "typ": "JWT", "kid": "k1"}).encode())
        claims = _b64(json.dumps({"iss": self.url, "aud": AUDIENCE, "sub": "bench", "iat": now,
                                  "exp": now + 3600}).encode())
        signature = key.sign(f"{head}.{claims}".encode(), padding.PKCS1v15(), hashes.SHA256())
        self.token = f"{head}.{claims}.{_b64(signature)}"


# --- the measuring parent ------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(variant: str, folder: Path, issuer: Issuer) -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    home = folder / variant
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGUARD_")}
    env.update({"PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}",
                "TOOLGUARD_EXAMPLE_DB": str(home / "board.db"), "FASTMCP_LOG_LEVEL": "ERROR"})
    log = (home / "gateway.log").open("wb")
    process = subprocess.Popen([sys.executable, __file__, "--serve", variant, "--port", str(port),
                                "--jwks-url", f"{issuer.url}/jwks.json", "--issuer", issuer.url],
                               cwd=home, env=env, stdout=log, stderr=log, start_new_session=True)
    return process, port


def _wait(client: Any, url: str, process: subprocess.Popen[bytes]) -> None:
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"a gateway exited {process.returncode}")
        try:
            client.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"no gateway listened on {url}")


def measure(requests: int) -> None:
    import httpx

    issuer = Issuer()
    credential = {"none": None, "host": None, "tokens": TOKEN, "oauth": issuer.token}
    with tempfile.TemporaryDirectory() as tmp, httpx.Client(timeout=60) as client:
        started = {variant: _start(variant, Path(tmp), issuer) for variant in VARIANTS}
        try:
            headers: dict[str, dict[str, str]] = {}
            urls: dict[str, str] = {}
            for variant, (process, port) in started.items():
                urls[variant] = url = f"http://127.0.0.1:{port}/mcp"
                _wait(client, url, process)
                own = dict(ACCEPT)
                if credential[variant]:
                    own["Authorization"] = f"Bearer {credential[variant]}"
                answer = client.post(url, content=json.dumps(INITIALIZE), headers=own)
                if answer.status_code != 200:
                    raise SystemExit(f"{variant}: initialize answered {answer.status_code}")
                own["Mcp-Session-Id"] = answer.headers["mcp-session-id"]
                client.post(url, content=json.dumps({"jsonrpc": "2.0",
                                                     "method": "notifications/initialized"}),
                            headers=own)
                headers[variant] = own
            listing = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
            timings: dict[tuple[str, str], list[float]] = {}

            def timed(label: tuple[str, str], url: str, sent: dict[str, str], status: int) -> None:
                began = time.perf_counter()
                answer = client.post(url, content=listing, headers=sent)
                elapsed = time.perf_counter() - began
                if answer.status_code != status:
                    print(f"{label}: answered {answer.status_code}, not {status}", file=sys.stderr)
                timings.setdefault(label, []).append(elapsed)

            for round_ in range(requests + 20):  # the first 20 rounds warm every path up
                for variant in rotated(VARIANTS, round_):
                    url = urls[variant]
                    timed((variant, "tools/list"), url, headers[variant], 200)
                    if variant != "none":
                        timed((variant, "foreign Host: 421"), url,
                              {**headers[variant], "Host": "evil.example"}, 421)
                    if credential[variant]:
                        bare = {k: v for k, v in headers[variant].items() if k != "Authorization"}
                        timed((variant, "no credential: 401"), url, bare, 401)
                if round_ == 19:
                    timings.clear()
        finally:
            for process, _ in started.values():
                process.terminate()
            for process, _ in started.values():
                process.wait(timeout=30)
            issuer.server.shutdown()
    baseline = summarize(timings[("none", "tools/list")]).p50
    table = Table(f"The gateway's HTTP door, {requests} requests each (loopback HTTP, "
                  f"one session per gateway, rotated rounds)",
                  ["door", "request", "p50", "p99", "p50 / none's tools/list"])
    for (variant, request), values in timings.items():
        summary = summarize(values)
        table.add_row(variant, request, fmt_s(summary.p50), fmt_s(summary.p99),
                      fmt_ratio(ratio(summary.p50, baseline)))
    table.print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per door and kind")
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--jwks-url", help=argparse.SUPPRESS)
    parser.add_argument("--issuer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.jwks_url, args.issuer)
    else:
        measure(args.requests)


if __name__ == "__main__":
    main()
