"""A fenced service wired wrongly raises GuardMisconfigured to its developer, at startup.

No request is ever answered by a middleware that could not fence or audit it:
the constructor refuses a missing or sync store and bad options, and the ASGI
startup fails on a store whose schema is not installed. A request the
middleware cannot fence (a websocket) is refused when it carries fences, never
passed through as if they had been checked. All in-process, no server.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from toolguard.errors import GuardMisconfigured
from toolguard.fences import FenceMiddleware, FenceToolMiddleware
from toolguard.fences.wire import Fences
from toolguard.store import open_async_store, open_store


async def ok(request: Any) -> PlainTextResponse:
    return PlainTextResponse("ok")


def app(store: Any, **options: Any) -> Starlette:
    return Starlette(routes=[Route("/x", ok, methods=["POST"])],
                     middleware=[Middleware(FenceMiddleware, store=store, **options)])


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    url = f"sqlite:///{tmp_path}/service.db"
    open_store(url, install=True).close()
    return url


def build(starlette: Starlette) -> None:
    starlette.build_middleware_stack()


@pytest.mark.parametrize("store", [None, "sqlite:///x.db", object()])
def test_a_missing_or_foreign_store_is_refused_at_construction(store):
    with pytest.raises(GuardMisconfigured, match="open_async_store"):
        build(app(store))
    with pytest.raises(GuardMisconfigured, match="open_async_store"):
        FenceToolMiddleware(store=store)


def test_a_sync_store_is_refused_at_construction(sqlite_url):
    with open_store(sqlite_url) as sync_store:
        with pytest.raises(GuardMisconfigured, match="asyncio store"):
            build(app(sync_store))
        with pytest.raises(GuardMisconfigured, match="asyncio store"):
            FenceToolMiddleware(store=sync_store)


@pytest.mark.parametrize("options, match", [
    ({"require": "POST"}, "require must be a function"),
    ({"max_body_bytes": -1}, "max_body_bytes"),
    ({"max_body_bytes": "1MB"}, "max_body_bytes"),
    ({"inflight": object()}, "inflight must have hold"),
])
def test_bad_options_are_refused_at_construction(sqlite_url, options, match):
    store = open_async_store(sqlite_url)
    with pytest.raises(GuardMisconfigured, match=match):
        build(app(store, **options))


def test_a_postgresql_pool_too_small_for_a_marker_and_its_transaction_is_refused(postgres_url):
    store = open_async_store(postgres_url, max_size=1)  # the pool opens on first use: no I/O
    with pytest.raises(GuardMisconfigured, match="max_size >= 2"):
        build(app(store))


def lifespan_startup(asgi: Any) -> list[dict[str, Any]]:
    """Run the ASGI lifespan startup and return what the app sent."""
    sent: list[dict[str, Any]] = []
    inbox = [{"type": "lifespan.startup"}]

    async def receive() -> dict[str, Any]:
        if inbox:
            return inbox.pop()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def run() -> None:
        task = asyncio.create_task(asgi({"type": "lifespan", "asgi": {"version": "3.0"},
                                         "state": {}}, receive, send))
        while not sent and not task.done():
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(run())
    return sent


def test_a_store_without_the_schema_fails_the_services_startup(tmp_path):
    store = open_async_store(f"sqlite:///{tmp_path}/never-installed.db")
    (message,) = lifespan_startup(app(store))
    assert message["type"] == "lifespan.startup.failed"
    assert "toolguard db init" in message["message"]


def test_an_installed_store_starts_and_a_request_without_startup_raises_on_a_bare_store(
        sqlite_url, tmp_path):
    sent = lifespan_startup(app(open_async_store(sqlite_url)))
    assert sent[0]["type"] == "lifespan.startup.complete", sent
    # served without a lifespan (some test clients): the first request raises to the developer
    bare = app(open_async_store(f"sqlite:///{tmp_path}/never-installed.db"))

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=bare),
                                     base_url="http://svc") as client:
            return await client.post("/x", headers=Fences(tokens={"k": 1},
                                                          idempotency_key="k#1").headers())

    with pytest.raises(GuardMisconfigured, match="toolguard db init"):
        asyncio.run(post())


def test_a_websocket_that_carries_fences_is_refused_never_passed_through_unchecked(sqlite_url):
    """The middleware fences HTTP requests only: a websocket that sends fences (its caller
    believes it is fenced) is closed with 1008 and audited, and the app never sees it."""
    from starlette.routing import WebSocketRoute
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocket, WebSocketDisconnect

    opened: list[str] = []

    async def socket(websocket: WebSocket) -> None:
        opened.append(websocket.url.path)
        await websocket.accept()
        await websocket.send_text("hello")
        await websocket.close()

    store = open_async_store(sqlite_url)
    starlette = Starlette(routes=[WebSocketRoute("/ws", socket)],
                          middleware=[Middleware(FenceMiddleware, store=store)])
    headers = Fences(tokens={"lead:w": 3}, idempotency_key="w#1").headers()
    with TestClient(starlette) as client:
        with pytest.raises(WebSocketDisconnect) as closed, \
                client.websocket_connect("/ws", headers=headers) as ws:
            ws.receive_text()
        assert closed.value.code == 1008
        with client.websocket_connect("/ws") as ws:  # no fences: passes through as before
            assert ws.receive_text() == "hello"
    assert opened == ["/ws"]
    with open_store(sqlite_url) as sync_store:
        rows = sync_store.query_audit(limit=None)
    assert [(r.decision, r.reason, r.tool) for r in rows] == [
        ("rejected", "fences_unsupported", "WEBSOCKET /ws")]
