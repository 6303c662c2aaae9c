"""Cancelled fenced calls, end to end: the MCP SDK's ``notifications/cancelled``, client hang-ups.

A cancelled call must leave the service as it found it for every other call: idle pooled
connections, no task exception left behind, nothing applied twice, and exactly one audit row
(``unknown``/``cancelled``) for the call itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from fastmcp import Client

from toolguard.fences.scope import scoped_key
from toolguard.fences.wire import Fences
from toolguard.store import GuardedStore, open_store

from .conftest import ServiceProcess, leads

#: What the server logs when a connection went back to its pool in a bad state, or a task's
#: exception was left for the garbage collector.
POOL_WARNINGS = ("closing returned connection", "Bad file descriptor", "is used by transport",
                 "Task exception was never retrieved", "Traceback", "query cancellation",
                 "never awaited")


def meta(lead: str, token: int, key: str) -> dict[str, str]:
    return Fences(tokens={f"lead:{lead}": token}, idempotency_key=key, agent="a",
                  intent_id=key).meta()


@pytest.fixture
def logged_mcp_service(service_store_url, tmp_path) -> Iterator[ServiceProcess]:
    from servers import free_port

    url, schema = service_store_url
    process = ServiceProcess("fences.service_app:create_mcp_app", url, schema, free_port(),
                             log=tmp_path / "server.log")
    try:
        yield process.start()
    finally:
        process.stop()


def service_store(service: ServiceProcess) -> GuardedStore:
    options = {"schema": service.schema} if service.schema else {}
    return open_store(service.store_url, **options)


@pytest.mark.timeout(900)
def test_a_cancelled_mcp_call_loses_no_other_call_and_leaves_one_audit_row(logged_mcp_service):
    """Issue 20, points 1 and 2: cancel a 1.5 s fenced tool at 0.4 s, then 5 ordinary calls on
    the same session, 20 rounds: every ordinary call answers and applies once."""
    service = logged_mcp_service

    async def rounds() -> None:
        async with Client(service.url + "/mcp") as client:
            for round_ in range(20):
                slow = asyncio.create_task(client.call_tool(
                    "set_score", {"lead_id": f"slow{round_}", "score": 1, "sleep": 1.5},
                    meta=meta(f"slow{round_}", 5, f"slow{round_}#1")))
                await asyncio.sleep(0.4)
                slow.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await slow
                for i in range(5):
                    result = await asyncio.wait_for(client.call_tool(
                        "set_score", {"lead_id": f"r{round_}-{i}", "score": i},
                        meta=meta(f"r{round_}-{i}", 5, f"r{round_}-{i}#1")), 30)
                    assert result.structured_content["writes"] == 1

    asyncio.run(rounds())
    with service_store(service) as store:
        rows = store.query_audit(newest_first=False, limit=None)
        by_key = {}
        for row in rows:
            # the service's records are scoped to it and the agent (toolguard.fences.scope)
            key = (row.idempotency_key or "").removeprefix(scoped_key("", audience=None, agent="a"))
            by_key.setdefault(key, []).append((row.decision, row.reason))
        for round_ in range(20):
            assert by_key[f"slow{round_}#1"] == [("unknown", "cancelled")], by_key
            for i in range(5):
                assert by_key[f"r{round_}-{i}#1"] == [("accepted", "applied")]
        assert len(rows) == 20 * 6
        applied = leads(store)
        assert not any(lead.startswith("slow") for lead in applied)
        assert len(applied) == 100
    log = service.log_text()
    assert not [w for w in POOL_WARNINGS if w in log], log[-4000:]


def test_a_request_cancelled_while_its_body_arrives_has_one_audit_row(tmp_path):
    """Cancelled before its body ended (an ASGI stack cancelling on disconnect): nothing ran,
    and the request has its one ``unknown``/``cancelled`` row all the same."""
    import anyio
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from toolguard.fences import FenceMiddleware
    from toolguard.store import open_async_store

    url = f"sqlite:///{tmp_path}/service.db"
    open_store(url, install=True).close()

    async def handler(request):
        return PlainTextResponse("ran")

    store = open_async_store(url)
    app = FenceMiddleware(Starlette(routes=[Route("/n", handler, methods=["POST"])]),
                          store=store)
    headers = [(k.lower().encode(), v.encode())
               for k, v in Fences(tokens={"note:n": 5}, idempotency_key="b#1").headers().items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "path": "/n", "raw_path": b"/n", "query_string": b"",
             "headers": headers, "scheme": "http", "server": ("svc", 80), "client": None,
             "root_path": ""}
    sent: list = []

    async def run() -> None:
        reading = anyio.Event()

        async def receive():
            if not reading.is_set():
                reading.set()
                return {"type": "http.request", "body": b"{", "more_body": True}
            await anyio.sleep_forever()

        async def send(message):
            sent.append(message)

        async with anyio.create_task_group() as group:  # cancels at every await, as anyio does
            group.start_soon(app, scope, receive, send)
            await reading.wait()
            await anyio.sleep(0.05)
            group.cancel_scope.cancel()
        await store.close()

    asyncio.run(run())
    assert sent == []
    with open_store(url) as check:
        assert [(r.decision, r.reason) for r in check.query_audit(limit=None)] == [
            ("unknown", "cancelled")]
