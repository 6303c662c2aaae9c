"""The fenced services the tests start: a Starlette REST app and a FastMCP server on one store.

Started by ``uvicorn --factory fences.service_app:create_app`` (or ``create_mcp_app``)
in a process of its own, configured by environment variables:
``FENCES_STORE_URL`` (the service's store), ``FENCES_SCHEMA`` (a PostgreSQL schema),
``FENCES_POOL`` (optional: ``max_size,timeout_s`` of a PostgreSQL store's pool; on
SQLite the timeout is the busy timeout).
The handlers read and write ``leads`` only through the fenced transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from toolguard.fences.asgi import FenceMiddleware, fence_of
from toolguard.store import open_async_store, open_store

LEADS = ("CREATE TABLE IF NOT EXISTS leads (id TEXT PRIMARY KEY, score BIGINT NOT NULL, "
         "writes BIGINT NOT NULL)")
UPSERT = ("INSERT INTO leads (id, score, writes) VALUES (%s, %s, 1) ON CONFLICT (id) "
          "DO UPDATE SET score = excluded.score, writes = leads.writes + 1")


def _options() -> tuple[str, dict[str, Any]]:
    url = os.environ["FENCES_STORE_URL"]
    schema = os.environ.get("FENCES_SCHEMA")
    return url, ({"schema": schema} if schema and url.startswith("postgres") else {})


def _pool_options(url: str) -> dict[str, Any]:
    pool = os.environ.get("FENCES_POOL")
    if not pool:
        return {}
    size, timeout = pool.split(",")
    if not url.startswith("postgres"):
        return {"busy_timeout_ms": int(float(timeout) * 1000)}
    return {"max_size": int(size), "timeout_s": float(timeout)}


def prepare() -> None:
    """Install the store and the service's own table (synchronously, before serving)."""
    url, options = _options()
    with open_store(url, install=True, **options) as store, store.connection() as conn:
        conn.execute(LEADS)


async def set_score(request: Request) -> JSONResponse:
    fence = fence_of(request)
    lead = request.path_params["lead"]
    fence.require(f"lead:{lead}")  # what this handler writes must be fenced by the request
    tx = fence.tx
    body = await request.json()
    delay = float(body.get("sleep", 0))
    row = await (await tx.execute("SELECT score, writes FROM leads WHERE id = %s", (lead,))).fetchone()
    if delay:
        await asyncio.sleep(delay)
    await tx.execute(UPSERT, (lead, int(body["score"])))
    return JSONResponse({"lead": lead, "old": row[0] if row else None, "score": body["score"],
                         "writes": (row[1] if row else 0) + 1}, status_code=201)


async def add_score(request: Request) -> JSONResponse:
    """Read-modify-write: the read happens inside the fence, so no update is ever lost."""
    fence = fence_of(request)
    lead = request.path_params["lead"]
    fence.require(f"lead:{lead}")
    tx = fence.tx
    delta = int((await request.json())["delta"])
    row = await (await tx.execute("SELECT score FROM leads WHERE id = %s", (lead,))).fetchone()
    score = (row[0] if row else 0) + delta
    await tx.execute(UPSERT, (lead, score))
    return JSONResponse({"lead": lead, "score": score})


async def note(request: Request) -> JSONResponse:
    """Stores the raw body's length as the lead's score: whatever bytes arrived."""
    body = await request.body()
    await fence_of(request).tx.execute(UPSERT, (request.path_params["lead"], len(body)))
    return JSONResponse({"bytes": len(body)})


async def fails_after_answering(request: Request) -> JSONResponse:
    """Writes and answers 201, then its background task raises (after the answer was written)."""
    await fence_of(request).tx.execute(UPSERT, (request.path_params["lead"], 5))

    async def fail() -> None:
        raise RuntimeError("the background task failed")

    return JSONResponse({"ok": True}, status_code=201, background=BackgroundTask(fail))


async def broken(request: Request) -> JSONResponse:
    """Writes, then answers 404: the write must be rolled back."""
    await fence_of(request).tx.execute(UPSERT, (request.path_params["lead"], -1))
    return JSONResponse({"error": "no such thing"}, status_code=404)


async def read_lead(request: Request) -> JSONResponse:
    tx = fence_of(request).tx
    row = await (await tx.execute("SELECT score, writes FROM leads WHERE id = %s",
                                  (request.path_params["lead"],))).fetchone()
    return JSONResponse({"score": row[0] if row else None, "writes": row[1] if row else 0})


async def noop(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def write_one(request: Request) -> PlainTextResponse:
    await fence_of(request).tx.execute(UPSERT, ("bench", 1))
    return PlainTextResponse("ok")


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("up")


class InFlight:
    """The requests this process is still serving, at ``GET /inflight`` (the tests' barrier).

    A request the client or uvicorn cut off may still be running when its connection is gone;
    its one audit row is written before the app returns. Outermost, around the fenced app,
    it passes every message through untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.serving = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/inflight":
            await PlainTextResponse(str(self.serving))(scope, receive, send)
            return
        self.serving += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.serving -= 1


def create_app() -> InFlight:
    prepare()
    url, options = _options()
    store = open_async_store(url, **options, **_pool_options(url))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await store.close()

    routes = [Route("/leads/{lead}/score", set_score, methods=["POST"]),
              Route("/leads/{lead}/add", add_score, methods=["POST"]),
              Route("/leads/{lead}/broken", broken, methods=["POST"]),
              Route("/leads/{lead}/note", note, methods=["POST"]),
              Route("/leads/{lead}/after", fails_after_answering, methods=["POST"]),
              Route("/leads/{lead}", read_lead, methods=["GET"]),
              Route("/noop", noop, methods=["POST"]),
              Route("/write", write_one, methods=["POST"]),
              Route("/health", health, methods=["GET"])]
    return InFlight(Starlette(routes=routes, lifespan=lifespan,
                              middleware=[Middleware(FenceMiddleware, store=store,
                                                     require=lambda scope: scope["path"] != "/health")]))


def create_mcp_app() -> Any:
    """A FastMCP server over streamable HTTP at /mcp, fenced by ``FenceToolMiddleware``."""
    return mcp_server().http_app(path="/mcp")


def run_mcp_stdio() -> None:
    """The same server over stdio, read through toolguard's ``run_stdio_async``."""
    from toolguard.fences.mcp_stdio import run_stdio_async

    asyncio.run(run_stdio_async(mcp_server()))


def mcp_server() -> Any:
    """The fenced FastMCP server, its store installed."""
    from fastmcp import FastMCP

    from toolguard.fences.gate import current_fence
    from toolguard.fences.mcp_server import FenceToolMiddleware

    prepare()
    url, options = _options()
    store = open_async_store(url, **options)
    mcp = FastMCP("crm", middleware=[FenceToolMiddleware(store=store)])

    @mcp.tool
    async def set_score(lead_id: str, score: int, sleep: float = 0) -> dict:
        """Set a lead's score; returns the old one."""
        current_fence().require(f"lead:{lead_id}")
        tx = current_fence().tx
        row = await (await tx.execute("SELECT score, writes FROM leads WHERE id = %s",
                                      (lead_id,))).fetchone()
        if sleep:
            await asyncio.sleep(sleep)
        await tx.execute(UPSERT, (lead_id, score))
        return {"lead": lead_id, "old": row[0] if row else None, "writes": (row[1] if row else 0) + 1}

    @mcp.tool
    async def fail_after_write(lead_id: str) -> str:
        """Writes, then fails: the write must be rolled back."""
        await current_fence().tx.execute(UPSERT, (lead_id, -1))
        raise ValueError("the CRM refused")

    return mcp


if __name__ == "__main__":  # python -m fences.service_app: the MCP server over stdio
    run_mcp_stdio()
