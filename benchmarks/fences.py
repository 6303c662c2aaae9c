"""The cost of FenceMiddleware per request, beside the same endpoint without it, in one run.

    python benchmarks/fences.py [--database-url URL | --sqlite] [--requests N] [--plain]

One uvicorn process (a child of this script) serves the same two endpoints three times:

* ``/plain/noop`` and ``/plain/write``: no middleware. ``noop`` answers "ok";
  ``write`` upserts one row in its own transaction (``BEGIN``, ``INSERT ... ON
  CONFLICT DO UPDATE``, ``COMMIT`` on a pooled connection of the same store).
* ``/fenced/noop`` and ``/fenced/write``: the same handlers behind
  ``FenceMiddleware``; every request carries a ``Fencing-Token`` and a fresh
  ``Idempotency-Key``, so each one does the whole service side: header parsing,
  the in-flight check (an advisory lock on PostgreSQL), the fenced transaction
  (fence check+advance, intent row), the handler (``write`` upserts its row in
  that transaction), the recorded response, the audit row, ``COMMIT``.
* ``/signed/noop`` and ``/signed/write``: the same behind ``FenceMiddleware`` in
  signed mode (``claims=ClaimVerifier``, Ed25519); the client signs every
  request's claim with ``FenceSigner`` as it sends it (inside the timed part).

One client (httpx, keep-alive) sends the six kinds in alternating rounds, so
slow drifts of the machine hit all alike, and prints p50/p99 per request, the
fenced/plain ratio and the signed/unsigned ratio for each handler. A second
table times the CPU work alone, in this process: building a request's fence
headers unsigned against signed (Ed25519, HMAC-SHA256), and parsing them
against parsing and verifying. Everything lives in a PostgreSQL
schema of the run's own (dropped at the end) or a temporary SQLite file.
Always exits 0: a slow figure is a finding, not a crash.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import Table, fmt_rate, fmt_ratio, fmt_s, ratio, summarize

from toolguard.fences import ClaimVerifier, FenceSigner, Keyring, generate_signing_key

UPSERT = ("INSERT INTO bench_rows (id, n) VALUES (%s, 1) ON CONFLICT (id) "
          "DO UPDATE SET n = bench_rows.n + 1")
KINDS = ("noop", "write")


def create_app():  # pragma: no cover - runs in the server process
    """The ASGI app the server process serves (``uvicorn --factory``)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    from toolguard.fences import ClaimVerifier, FenceMiddleware, fence_of, load_keyring
    from toolguard.store import open_async_store, open_store

    url = os.environ["BENCH_STORE_URL"]
    options = {"schema": os.environ["BENCH_SCHEMA"]} if os.environ.get("BENCH_SCHEMA") else {}
    with open_store(url, install=True, **options) as sync, sync.connection() as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS bench_rows (id TEXT PRIMARY KEY, n BIGINT)")
    store = open_async_store(url, **options)

    async def noop(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def plain_write(request: Request) -> PlainTextResponse:
        async with store.connection() as conn:
            if store.dialect == "postgresql":
                async with conn.transaction():
                    await conn.execute(UPSERT, ("plain",))
            else:
                import asyncio

                from toolguard.store.base import qmark

                def write() -> None:
                    conn.execute("BEGIN IMMEDIATE")
                    conn.execute(qmark(UPSERT), ("plain",))
                    conn.execute("COMMIT")

                await asyncio.to_thread(write)
        return PlainTextResponse("ok")

    async def fenced_write(request: Request) -> PlainTextResponse:
        await fence_of(request).tx.execute(UPSERT, ("fenced",))
        return PlainTextResponse("ok")

    plain = Starlette(routes=[Route("/noop", noop, methods=["POST"]),
                              Route("/write", plain_write, methods=["POST"])])
    fenced = Starlette(routes=[Route("/noop", noop, methods=["POST"]),
                               Route("/write", fenced_write, methods=["POST"])],
                       middleware=[Middleware(FenceMiddleware, store=store)])
    verifier = ClaimVerifier(audience="bench", keys=load_keyring())
    signed = Starlette(routes=[Route("/noop", noop, methods=["POST"]),
                               Route("/write", fenced_write, methods=["POST"])],
                       middleware=[Middleware(FenceMiddleware, store=store, claims=verifier)])
    return Starlette(routes=[Mount("/plain", app=plain), Mount("/fenced", app=fenced),
                             Mount("/signed", app=signed),
                             Route("/health", noop, methods=["GET", "POST"])])


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _BenchLease:
    """A lease stand-in for signing (the benchmark holds no lock): its tokens, 30 s left."""

    def __init__(self, tokens: dict[str, int]) -> None:
        self.tokens = tokens

    def check(self) -> None:
        return None

    def remaining_s(self) -> float:
        return 30.0


def serve(url: str, schema: str | None, port: int, public_key: str) -> subprocess.Popen[bytes]:
    here = Path(__file__).resolve()
    env = {**os.environ, "BENCH_STORE_URL": url, "BENCH_SCHEMA": schema or "",
           "TOOLGUARD_FENCE_VERIFY_KEYS": public_key,
           "PYTHONPATH": f"{here.parent}{os.pathsep}{here.parents[1]}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "fences:create_app", "--host",
         "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-access-log"],
        env=env, cwd=here.parent)
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            return process
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    msg = "the benchmark server did not start"
    raise SystemExit(msg)


SIDES = ("plain", "fenced", "signed")


def measure(base: str, requests: int, signer: FenceSigner) -> dict[str, list[float]]:
    import httpx

    from toolguard.fences.wire import Fences

    run = uuid.uuid4().hex[:8]
    token = time.time_ns() // 1000
    lease = _BenchLease({"bench:1": token})
    latencies: dict[str, list[float]] = {f"{side}/{kind}": [] for side in SIDES
                                         for kind in KINDS}

    def headers_for(side: str, key: str, number: int) -> dict[str, str] | None:
        if side == "plain":
            return None
        fences = Fences(tokens=lease.tokens, idempotency_key=key, agent="bench",
                        intent_id=str(number))
        return (signer.sign(fences, lease) if side == "signed" else fences).headers()

    with httpx.Client(base_url=base, timeout=30) as client:
        for warm in range(50):  # connections, pools, caches
            for kind in KINDS:
                for side in SIDES:
                    client.post(f"/{side}/{kind}",
                                headers=headers_for(side, f"warm-{run}-{side}-{kind}-{warm}", warm))
        for number in range(requests):
            for kind in KINDS:
                for side in SIDES:
                    started = time.perf_counter()  # signing the claim is part of the request
                    response = client.post(f"/{side}/{kind}", headers=headers_for(
                        side, f"{run}-{side}-{kind}-{number}", number))
                    latencies[f"{side}/{kind}"].append(time.perf_counter() - started)
                    if response.status_code != 200:
                        msg = f"{side}/{kind}: {response.status_code} {response.text}"
                        raise SystemExit(msg)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get(
        "TOOLGUARD_DATABASE_URL", os.environ.get("TOOLGUARD_TEST_DATABASE_URL")))
    parser.add_argument("--sqlite", action="store_true", help="use a temporary SQLite store")
    parser.add_argument("--requests", type=int, default=1000, help="requests per kind")
    parser.add_argument("--plain", action="store_true", help="plain-text tables")
    args = parser.parse_args()

    schema = None
    folder = tempfile.TemporaryDirectory()
    if args.sqlite or not args.database_url:
        url = f"sqlite:///{folder.name}/bench.db"
    else:
        url, schema = args.database_url, f"bench_fences_{uuid.uuid4().hex[:8]}"
    key = generate_signing_key("bench")
    signer = FenceSigner(key, audience="bench")
    port = free_port()
    server = serve(url, schema, port, key.public().text())
    try:
        latencies = measure(f"http://127.0.0.1:{port}", args.requests, signer)
    finally:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=10)
        if schema is not None:
            import psycopg
            from psycopg import sql

            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    sql.Identifier(schema)))
        folder.cleanup()

    where = "PostgreSQL" if schema else "SQLite"
    table = Table(f"FenceMiddleware per request ({where} store, {args.requests} requests each, "
                  f"one keep-alive client)",
                  ["handler", "plain p50", "fenced p50", "signed p50", "fenced/plain",
                   "signed/unsigned", "plain p99", "fenced p99", "signed p99", "signed req/s"],
                  plain=args.plain)
    for kind in KINDS:
        plain = summarize(latencies[f"plain/{kind}"])
        fenced = summarize(latencies[f"fenced/{kind}"])
        signed = summarize(latencies[f"signed/{kind}"])
        table.add_row(kind, fmt_s(plain.p50), fmt_s(fenced.p50), fmt_s(signed.p50),
                      fmt_ratio(ratio(fenced.p50, plain.p50)),
                      fmt_ratio(ratio(signed.p50, fenced.p50)), fmt_s(plain.p99),
                      fmt_s(fenced.p99), fmt_s(signed.p99), fmt_rate(1 / signed.mean))
    table.print()
    cpu_table(args.requests, args.plain)


def cpu_table(requests: int, plain: bool) -> None:
    """Signing and verifying alone, per request, against the unsigned work they add to."""
    from toolguard.fences.wire import Fences, parse_headers

    rounds = max(requests, 200)
    lease = _BenchLease({"lead:L-7": time.time_ns() // 1000})
    base = Fences(tokens=lease.tokens, idempotency_key="thread:t-1//call-1#1",
                  agent="intent_scorer", intent_id="call-1")
    table = Table(f"Fence headers per request, CPU only ({rounds} rounds, one key)",
                  ["mode", "build headers p50", "ratio", "parse (+ verify) p50", "ratio"],
                  plain=plain)

    def timed(step: Callable[[], object]) -> float:
        samples = []
        for _ in range(rounds):
            started = time.perf_counter()
            step()
            samples.append(time.perf_counter() - started)
        return summarize(samples).p50

    def raw(fences: Fences) -> list[tuple[bytes, bytes]]:
        return [(k.lower().encode(), v.encode()) for k, v in fences.headers().items()]

    unsigned_build = timed(lambda: base.headers())
    unsigned_parse = timed(lambda: parse_headers(raw(base)))
    table.add_row("unsigned", fmt_s(unsigned_build), "1.0x", fmt_s(unsigned_parse), "1.0x")
    for algorithm in ("ed25519", "hmac-sha256"):
        key = generate_signing_key("k1", algorithm)  # type: ignore[arg-type]
        signer = FenceSigner(key, audience="crm")
        verifier = ClaimVerifier(audience="crm", keys=Keyring([key.public()]))
        wire = raw(signer.sign(base, lease))
        build = timed(lambda: signer.sign(base, lease).headers())  # noqa: B023
        check = timed(lambda: verifier.verify(parse_headers(wire)))  # noqa: B023
        table.add_row(f"signed, {algorithm}", fmt_s(build),
                      fmt_ratio(ratio(build, unsigned_build)), fmt_s(check),
                      fmt_ratio(ratio(check, unsigned_parse)))
    table.print()


if __name__ == "__main__":
    main()
