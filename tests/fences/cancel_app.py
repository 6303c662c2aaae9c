"""The fenced services of ``test_cancel_points.py``, with ``cancel_harness`` on every fenced call.

Started by ``uvicorn --factory fences.cancel_app:create_app`` (REST) or ``create_mcp_app``
(FastMCP, streamable HTTP), configured as ``fences.service_app`` is. Control routes, never
fenced: ``POST /_harness/arm?n=N`` (pause the next fenced call at its N-th await point;
``n=0``: count only), ``POST /_harness/release``, ``GET /_harness/state``: the points
counted, whether the armed one was reached and the call has ended (and how), the pool's
connections, and every exception the loop was left to report.

REST: an outermost ASGI layer cancels the request's anyio scope when the client hangs up
after its body (``http.disconnect``), as Starlette's streaming responses and many ASGI
stacks do; over MCP the SDK cancels the request on ``notifications/cancelled``.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fences.cancel_harness import Harness
from fences.service_app import _options, prepare, set_score
from toolguard.fences.asgi import FenceMiddleware
from toolguard.store import open_async_store

Scope = dict[str, Any]
ASGI = Callable[[Scope, Any, Any], Awaitable[None]]


class Control:
    """The harness of this process, the call it watches and what the loop reported."""

    def __init__(self, store: Any, middleware: Any) -> None:
        self.harness = Harness()
        self.store = store
        self.middleware = middleware
        self.ended: str | None = "none"  # how the last harnessed call ended
        self.loop_errors: list[str] = []
        self._handler_set = False

    def watch_loop(self) -> None:
        if self._handler_set:
            return
        self._handler_set = True

        def report(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            self.loop_errors.append(f"{context.get('message')}: {context.get('exception')!r}")
            loop.default_exception_handler(context)

        asyncio.get_running_loop().set_exception_handler(report)

    async def run(self, call: Awaitable[Any]) -> Any:
        self.watch_loop()
        if self.ended is not None and self.ended != "none":  # the armed call came and went
            return await call
        self.ended = None
        try:
            result = await self.harness.run(call)  # type: ignore[arg-type]
        except BaseException as error:
            self.ended = type(error).__name__
            raise
        self.ended = "returned"
        return result

    def pool(self) -> dict[str, Any]:
        """Connections in use and idle; an in-flight marker's turns."""
        store = self.store
        gate = self.middleware.gate
        turns = getattr(gate.inflight, "_turns", None)
        out: dict[str, Any] = {"marker_turns_free": turns._value if turns is not None else None,
                               "markers": getattr(gate.inflight, "markers", None)}
        if store.dialect == "postgresql":
            stats = store._pool.get_stats()
            out.update(size=stats.get("pool_size", 0), idle=stats.get("pool_available", 0),
                       waiting=stats.get("requests_waiting", 0))
        else:
            connections = store.sync._connections
            idle = list(connections._idle)
            out.update(size=len(connections._files), idle=len(idle), waiting=0,
                       in_transaction=sum(1 for c in idle if c.in_transaction))
        return out

    def routes(self) -> list[Route]:
        async def arm(request: Request) -> JSONResponse:
            target = int(request.query_params.get("n", "0"))
            self.harness.arm(target or None, "pause")
            self.ended = "none"
            return JSONResponse({"armed": target})

        async def release(request: Request) -> JSONResponse:
            self.harness.release()
            return JSONResponse({"released": True})

        async def state(request: Request) -> JSONResponse:
            gc.collect()  # a task left with an exception reports it when collected
            await asyncio.sleep(0)
            return JSONResponse({"count": self.harness.count, "reached": self.harness.reached,
                                 "paused": self.harness.paused.is_set(), "ended": self.ended,
                                 "pool": self.pool(), "loop_errors": self.loop_errors})

        return [Route("/_harness/arm", arm, methods=["POST"]),
                Route("/_harness/release", release, methods=["POST"]),
                Route("/_harness/state", state, methods=["GET"])]


def cancel_on_disconnect(app: ASGI) -> ASGI:
    """Cancel the request (its anyio scope) when the client hangs up after sending its body."""

    async def layer(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        heard: list[dict[str, Any]] = []
        watching = anyio.Event()
        started = False

        async with anyio.create_task_group() as group:
            async def watch() -> None:
                message = await receive()
                heard.append(message)
                watching.set()
                if message["type"] == "http.disconnect":
                    group.cancel_scope.cancel()

            async def inner_receive() -> dict[str, Any]:
                nonlocal started
                if started:  # only the watcher reads the channel now
                    await watching.wait()
                    return heard[-1]
                message: dict[str, Any] = await receive()
                if message["type"] == "http.request" and not message.get("more_body"):
                    started = True
                    group.start_soon(watch)
                return message

            async def serve() -> None:
                await app(scope, inner_receive, send)
                group.cancel_scope.cancel()  # answered: stop watching

            group.start_soon(serve)

    return layer


def create_app() -> Any:
    prepare()
    url, options = _options()
    store = open_async_store(url, **options)
    inner = Starlette(routes=[Route("/leads/{lead}/score", set_score, methods=["POST"])])
    fenced = FenceMiddleware(inner, store=store)
    control = Control(store, fenced)
    controls = Starlette(routes=control.routes())

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/leads/"):
            await control.run(fenced(scope, receive, send))
            return
        await controls(scope, receive, send)

    return cancel_on_disconnect(app)


def create_mcp_app() -> Any:
    from fastmcp import FastMCP
    from fastmcp.server.middleware import Middleware

    from toolguard.fences.gate import current_fence
    from toolguard.fences.mcp_server import FenceToolMiddleware

    prepare()
    url, options = _options()
    store = open_async_store(url, **options)
    fence = FenceToolMiddleware(store=store)
    control: Control

    class Harnessed(Middleware):
        async def on_call_tool(self, context: Any, call_next: Any) -> Any:
            return await control.run(call_next(context))

    mcp = FastMCP("crm", middleware=[Harnessed(), fence])
    control = Control(store, fence)

    @mcp.tool
    async def set_score(lead_id: str, score: int) -> dict:
        """Set a lead's score; returns how many writes it has had."""
        from fences.service_app import UPSERT

        current_fence().require(f"lead:{lead_id}")
        tx = current_fence().tx
        row = await (await tx.execute("SELECT writes FROM leads WHERE id = %s",
                                      (lead_id,))).fetchone()
        await tx.execute(UPSERT, (lead_id, score))
        return {"lead": lead_id, "writes": (row[0] if row else 0) + 1}

    for route in control.routes():
        mcp.custom_route(route.path, methods=sorted(route.methods or ()))(route.endpoint)
    return mcp.http_app(path="/mcp")
