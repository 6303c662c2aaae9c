"""The cost of FenceMiddleware per request, beside the same endpoint without it, in one run.

    python benchmarks/fences.py [--database-url URL | --sqlite] [--requests N] [--plain]

One uvicorn process (a child of this script) serves the same two endpoints twice:

* ``/plain/noop`` and ``/plain/write``: no middleware. ``noop`` answers "ok";
  ``write`` upserts one row in its own transaction (``BEGIN``, ``INSERT ... ON
  CONFLICT DO UPDATE``, ``COMMIT`` on a pooled connection of the same store).
* ``/fenced/noop`` and ``/fenced/write``: the same handlers behind
  ``FenceMiddleware``; every request carries a ``Fencing-Token`` and a fresh
  ``Idempotency-Key``, so each one does the whole service side: header parsing,
  the in-flight check (an advisory lock on PostgreSQL), the fenced transaction
  (fence check+advance, intent row), the handler (``write`` upserts its row in
  that transaction), the recorded response, the audit row, ``COMMIT``.

One client (httpx, keep-alive) sends the four kinds in alternating rounds, so
slow drifts of the machine hit all alike, and prints p50/p99 per request and
the fenced/plain ratio for each handler. Everything lives in a PostgreSQL
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import Table, fmt_rate, fmt_ratio, fmt_s, ratio, summarize

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

    from toolguard.fences import FenceMiddleware, fence_of
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
    return Starlette(routes=[Mount("/plain", app=plain), Mount("/fenced", app=fenced),
                             Route("/health", noop, methods=["GET", "POST"])])


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve(url: str, schema: str | None, port: int) -> subprocess.Popen[bytes]:
    here = Path(__file__).resolve()
    env = {**os.environ, "BENCH_STORE_URL": url, "BENCH_SCHEMA": schema or "",
           "PYTHONPATH": f"{here.parent}{os.pathsep}{here.parents[1]}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "fences:create_app", "--host",
         "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-access-log"],
        env=env, cwd=here.parent)
    import httpx

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            return process
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    msg = "the benchmark server did not start"
    raise SystemExit(msg)


def measure(base: str, requests: int) -> dict[str, list[float]]:
    import httpx

    from toolguard.fences.wire import Fences

    run = uuid.uuid4().hex[:8]
    token = time.time_ns() // 1000
    latencies: dict[str, list[float]] = {f"{side}/{kind}": [] for side in ("plain", "fenced")
                                         for kind in KINDS}
    with httpx.Client(base_url=base, timeout=30) as client:
        for warm in range(50):  # connections, pools, caches
            for kind in KINDS:
                client.post(f"/plain/{kind}")
                client.post(f"/fenced/{kind}", headers=Fences(
                    tokens={"bench:1": token}, idempotency_key=f"warm-{run}-{kind}-{warm}").headers())
        for number in range(requests):
            for kind in KINDS:
                headers = Fences(tokens={"bench:1": token}, idempotency_key=f"{run}-{kind}-{number}",
                                 agent="bench", intent_id=str(number)).headers()
                for side in ("plain", "fenced"):
                    started = time.perf_counter()
                    response = client.post(f"/{side}/{kind}",
                                           headers=headers if side == "fenced" else None)
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
    port = free_port()
    server = serve(url, schema, port)
    try:
        latencies = measure(f"http://127.0.0.1:{port}", args.requests)
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
                  ["handler", "plain p50", "fenced p50", "p50 ratio", "plain p99", "fenced p99",
                   "plain req/s", "fenced req/s"], plain=args.plain)
    for kind in KINDS:
        plain = summarize(latencies[f"plain/{kind}"])
        fenced = summarize(latencies[f"fenced/{kind}"])
        table.add_row(kind, fmt_s(plain.p50), fmt_s(fenced.p50),
                      fmt_ratio(ratio(fenced.p50, plain.p50)), fmt_s(plain.p99), fmt_s(fenced.p99),
                      fmt_rate(1 / plain.mean), fmt_rate(1 / fenced.mean))
    table.print()


if __name__ == "__main__":
    main()
