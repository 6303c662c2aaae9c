"""Cancellation as a property: every fenced call cancelled at each of its await points in turn.

``cancel_harness`` counts the await points of one fenced call on a first run, then stops
the next calls at the 1st, 2nd, ... n-th and cancels them there, the way production
cancels them: over real uvicorn, the REST client hangs up mid-handler (an ASGI layer
cancels the request's anyio scope on ``http.disconnect``); over MCP, the FastMCP client
cancels its call (``notifications/cancelled``: the SDK cancels the request's scope);
client side, a guarded tool that calls the service through ``AsyncFencedClient`` or
``FencedSession`` is cancelled by its caller (``task.cancel()``, with the awaited
operation in flight). After each: the service's pool connections are idle (and the
in-flight markers' turns free), the loop reported no exception, the call has exactly one
audit row, its retry applies it once in all, and the next 20 calls succeed. Both stores.

Each test prints the number of await points it exercised (``-s`` shows them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastmcp import Client

from toolguard.fences.scope import scoped_key
from toolguard.fences.wire import Fences
from toolguard.store import GuardedStore, open_store

from .conftest import ServiceProcess, leads, logged_service

POOL_WARNINGS = ("closing returned connection", "Bad file descriptor", "is used by transport",
                 "Task exception was never retrieved", "query cancellation", "never awaited")
#: After the client hung up, the longest a paused point may go on hearing nothing before it is
#: let go (a point no cancellation reaches: the body's own reads); never a pass/fail measure.
UNHEARD_S = 5.0
#: How long a cancelled call's connection may take to be back in its pool.
SETTLE_S = 5.0


@pytest.fixture
def harness_service(request, service_store_url, tmp_path) -> Iterator[ServiceProcess]:
    yield from logged_service(f"fences.cancel_app:{request.param}", service_store_url, tmp_path)


def store_of(service: ServiceProcess) -> GuardedStore:
    return open_store(service.store_url, **({"schema": service.schema} if service.schema else {}))


class Control:
    def __init__(self, service: ServiceProcess) -> None:
        self.http = httpx.Client(base_url=service.url, timeout=60)

    def arm(self, n: int) -> None:
        self.http.post("/_harness/arm", params={"n": n}).raise_for_status()

    def state(self) -> dict[str, Any]:
        answer: dict[str, Any] = self.http.get("/_harness/state").json()
        return answer

    def wait(self, *, paused: bool = False) -> dict[str, Any]:
        """The state once the call paused at its armed point (``paused``) or ended."""
        while True:
            state = self.state()
            if state["ended"] not in (None, "none") or (paused and state["paused"]):
                return state
            time.sleep(0.02)

    def release(self) -> None:
        self.http.post("/_harness/release").raise_for_status()


def check_settled(control: Control, store: GuardedStore, key: str, where: str) -> None:
    """The property after one cancelled call (see the module docstring), but the retry.

    The pool is read until it is idle, for at most ``SETTLE_S``: a SQLite connection goes
    back on its worker thread, which a loaded machine may run a moment after the call
    ended. A connection that never comes back fails the check."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        state = control.state()
        pool = state["pool"]
        if (pool["idle"] == pool["size"] and pool["waiting"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert pool["idle"] == pool["size"] and pool["waiting"] == 0, (where, pool)
    assert pool.get("in_transaction", 0) == 0, (where, pool)
    if pool["markers"] is not None:
        assert pool["marker_turns_free"] == pool["markers"], (where, pool)
    assert state["loop_errors"] == [], (where, state["loop_errors"])
    # the service keeps its record under the key scoped to itself and the agent (scope.py)
    rows = [*store.query_audit(idempotency_key=key, limit=None),
            *store.query_audit(idempotency_key=scoped_key(key, audience=None, agent="a"),
                               limit=None)]
    assert len(rows) == 1, (where, [(r.decision, r.reason) for r in rows])


class Patience:
    """How long a paused point is given to hear its cancellation before it is let go: ten
    times the slowest cancellation heard so far in the test, within [0.5 s, ``UNHEARD_S``].
    A loaded machine waits longer; an idle one does not sit out ``UNHEARD_S`` at every point
    no cancellation reaches."""

    def __init__(self) -> None:
        self.slowest_s = 0.0

    def deadline(self, hung_up: float) -> float:
        return hung_up + min(UNHEARD_S, max(0.5, 10 * self.slowest_s))

    def heard(self, hung_up: float) -> None:
        self.slowest_s = max(self.slowest_s, time.monotonic() - hung_up)


def report(path: str, total: int, cancelled: int, unheard: int) -> None:
    print(f"\n{path}: {total} await points, {cancelled} cancelled there, "
          f"{unheard} where no cancellation arrives")


# --- REST: FenceMiddleware behind uvicorn, the client hangs up mid-handler -------------------


def rest_request(lead: str, key: str, score: int = 1) -> bytes:
    body = json.dumps({"score": score}).encode()
    headers = Fences(tokens={f"lead:{lead}": 7}, idempotency_key=key, agent="a",
                     intent_id=key).headers()
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return (f"POST /leads/{lead}/score HTTP/1.1\r\nHost: svc\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n{head}\r\n").encode() + body


def status_of(http: httpx.Client, lead: str, key: str, score: int = 1) -> int:
    headers = Fences(tokens={f"lead:{lead}": 7}, idempotency_key=key, agent="a",
                     intent_id=key).headers()
    body = json.dumps({"score": score}).encode()  # the bytes rest_request sends
    return http.post(f"/leads/{lead}/score", content=body,
                     headers={**headers, "content-type": "application/json"}).status_code


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("harness_service", ["create_app"], indirect=True)
def test_fence_middleware_cancelled_at_every_await_point(harness_service):
    service = harness_service
    control = Control(service)
    http = httpx.Client(base_url=service.url, timeout=60)
    assert status_of(http, "warm", "warm#1") == 201  # the first call also checks the schema
    control.arm(0)
    assert status_of(http, "count", "count#1") == 201
    total = control.wait()["count"]
    assert total > 0
    cancelled = unheard = 0
    patience = Patience()
    with store_of(service) as store:
        for n in range(1, total + 1):
            lead, key = f"c{n}", f"c{n}#1"
            control.arm(n)
            host, port = service.url.removeprefix("http://").split(":")
            sock = socket.create_connection((host, int(port)), timeout=60)
            sock.sendall(rest_request(lead, key))
            state = control.wait(paused=True)
            sock.close()  # the client hangs up while the call stands at point n
            hung_up = time.monotonic()
            if state["ended"] in (None, "none"):
                deadline = patience.deadline(hung_up)
                while control.state()["ended"] in (None, "none"):
                    if time.monotonic() > deadline:
                        control.release()
                        unheard += 1
                        break
                    time.sleep(0.02)
                else:
                    patience.heard(hung_up)
                state = control.wait()
            cancelled += state["ended"] == "CancelledError"
            check_settled(control, store, key, f"point {n}: {state['ended']}")
            assert status_of(http, lead, key) in (200, 201)  # the retry: applied or replayed
            assert leads(store)[lead][1] == 1, f"point {n}: applied twice"
            for i in range(20):
                assert status_of(http, f"{lead}-{i}", f"{lead}-{i}#1") == 201
        control.arm(0)
    report(f"FenceMiddleware [{service.store_url.split(':')[0]}]", total, cancelled, unheard)
    assert cancelled > 0
    log = service.log_text()
    assert not [w for w in POOL_WARNINGS if w in log], log[-4000:]


# --- MCP: FenceToolMiddleware, the client cancels (notifications/cancelled) ------------------


def mcp_meta(lead: str, key: str) -> dict[str, str]:
    return Fences(tokens={f"lead:{lead}": 7}, idempotency_key=key, agent="a",
                  intent_id=key).meta()


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("harness_service", ["create_mcp_app"], indirect=True)
def test_fence_tool_middleware_cancelled_at_every_await_point(harness_service):
    service = harness_service
    control = Control(service)

    async def run() -> tuple[int, int, int]:
        async with Client(service.url + "/mcp") as client:
            async def call(lead: str, key: str) -> Any:
                return await client.call_tool("set_score", {"lead_id": lead, "score": 1},
                                              meta=mcp_meta(lead, key))

            await call("warm", "warm#1")  # the first call also checks the schema
            control.arm(0)
            await call("count", "count#1")
            total = control.wait()["count"]
            cancelled = unheard = 0
            patience = Patience()
            store = await asyncio.to_thread(store_of, service)  # opened and closed off the loop
            try:
                for n in range(1, total + 1):
                    lead, key = f"m{n}", f"m{n}#1"
                    control.arm(n)
                    task = asyncio.create_task(call(lead, key))
                    while True:
                        state = await asyncio.to_thread(control.state)
                        if state["paused"] or state["ended"] not in (None, "none"):
                            break
                        await asyncio.sleep(0.02)
                    task.cancel()  # the SDK sends notifications/cancelled
                    hung_up = time.monotonic()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                    deadline = patience.deadline(hung_up)
                    while (await asyncio.to_thread(control.state))["ended"] in (None, "none"):
                        if time.monotonic() > deadline:
                            control.release()
                            unheard += 1
                            break
                        await asyncio.sleep(0.02)
                    else:
                        patience.heard(hung_up)
                    state = await asyncio.to_thread(control.wait)
                    cancelled += state["ended"] == "CancelledError"
                    await asyncio.to_thread(check_settled, control, store, key,
                                            f"point {n}: {state['ended']}")
                    again = await call(lead, key)  # the retry on the same session
                    assert again.structured_content["writes"] == 1, f"point {n}: applied twice"
                    for i in range(20):
                        result = await call(f"{lead}-{i}", f"{lead}-{i}#1")
                        assert result.structured_content["writes"] == 1
                control.arm(0)
            finally:
                await asyncio.to_thread(store.close)
            return total, cancelled, unheard

    total, cancelled, unheard = asyncio.run(run())
    report(f"FenceToolMiddleware [{service.store_url.split(':')[0]}]", total, cancelled, unheard)
    assert cancelled > 0
    log = service.log_text()
    assert not [w for w in POOL_WARNINGS if w in log], log[-4000:]


# --- client side: a guarded tool calling the service, cancelled by its caller ----------------


def _client_path(kind: str, url: str) -> Any:
    """A guarded tool body that calls the service through ``AsyncFencedClient`` or
    ``FencedSession`` (one FastMCP client session for the whole test), and what opens and
    closes that connection."""
    if kind == "rest":
        from toolguard.fences import AsyncFencedClient

        http = AsyncFencedClient(base_url=url, timeout=60)

        async def rest_call(lead_id: str, score: int) -> dict:
            response = await http.post(f"/leads/{lead_id}/score", json={"score": score})
            return dict(response.json())

        return rest_call, contextlib.AsyncExitStack(), http.aclose

    from toolguard.fences import FencedSession

    client = Client(url + "/mcp")
    session = FencedSession(client)

    async def mcp_call(lead_id: str, score: int) -> dict:
        result = await session.call_tool("set_score", {"lead_id": lead_id, "score": score})
        return dict(result.structured_content)

    async def nothing() -> None:
        return None

    return mcp_call, client, nothing


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("kind", ["rest", "mcp"])
def test_a_guarded_call_through_the_fenced_clients_cancelled_at_every_await_point(
        kind, request, service_store_url, tmp_path):
    from toolguard.adapters import guarded

    from .cancel_harness import Harness
    from .conftest import make_guard

    fixture = "service" if kind == "rest" else "mcp_service"
    service: ServiceProcess = request.getfixturevalue(fixture)
    guard = make_guard(tmp_path, "c", f"sqlite:///{tmp_path}/locks.db", asynchronous=True)
    body, connection, close = _client_path(kind, service.url)
    set_score = guarded(guard, name="set_score", agent="scorer")(body)

    async def attempt(harness: Harness | None, lead: str, call_id: str) -> Any:
        call = set_score.arun({"lead_id": lead, "score": 1}, call_id=call_id, thread_id="t")
        task = asyncio.create_task(harness.run(call) if harness is not None else call)
        await asyncio.wait({task})
        return task

    agent_extra: list[Any] = []

    async def run() -> tuple[int, int]:
        async with connection:
            return await points()

    async def points() -> tuple[int, int]:
        harness = Harness()
        assert (await attempt(None, "warm", "warm")).result().ok
        harness.arm(None)
        assert (await attempt(harness, "count", "count")).result().ok
        total, cancelled = harness.count, 0
        store = await asyncio.to_thread(store_of, service)  # opened and closed off the loop
        agent = await asyncio.to_thread(open_store, f"sqlite:///{tmp_path}/agent-c.db")
        try:
            for n in range(1, total + 1):
                lead = f"g{n}"
                harness.arm(n, "cancel")
                first = await attempt(harness, lead, lead)
                cancelled += first.cancelled()
                if not first.cancelled():
                    first.result()
                retry = (await attempt(None, lead, lead)).result()
                waited = 0
                for _ in range(100):  # the service may still be ending the cancelled request
                    if retry.reason != "in_flight":
                        break
                    waited += 1
                    await asyncio.sleep(0.05)
                    retry = (await attempt(None, lead, lead)).result()
                assert retry.ok, (n, retry.message)
                # the checks' own sync reads run off the loop (blockbuster watches it)
                assert (await asyncio.to_thread(leads, store))[lead][1] == 1, \
                    f"point {n}: applied twice"
                attempts = await asyncio.to_thread(agent.query_audit, intent_id=lead, limit=None)
                if len(attempts) != 2 + waited:  # one row per attempt (the agent's guard)
                    agent_extra.append((n, [(r.decision, r.reason) for r in attempts]))
                served = [r for r in await asyncio.to_thread(store.query_audit, limit=None)
                          if r.intent_id == lead]
                # each attempt its one row: the cancelled one (if it reached the service: it may
                # arrive late, while the retry runs, and be refused ``in_flight`` itself), the
                # retries refused ``in_flight`` while it ended, and the one that applied
                shown = [(r.decision, r.reason) for r in served]
                ended = [row for row in shown if row != ("rejected", "in_flight")]
                assert len(shown) - (waited + 1) in (0, 1), (n, waited, shown)
                assert 1 <= len(ended) <= 2, (n, shown)
                assert ended.count(("accepted", "applied")) == 1, (n, shown)
                assert shown.count(("rejected", "in_flight")) in (waited, waited + 1), (
                    n, waited, shown)
                for i in range(20):
                    assert (await attempt(None, f"{lead}-{i}", f"{lead}-{i}")).result().ok
        finally:
            await asyncio.to_thread(store.close)
            await asyncio.to_thread(agent.close)
        await close()
        return total, cancelled

    total, cancelled = asyncio.run(run())
    report(f"guarded call through {'AsyncFencedClient' if kind == 'rest' else 'FencedSession'}"
           f" [{service.store_url.split(':')[0]}]", total, cancelled, 0)
    assert cancelled > 0
    assert not agent_extra, f"the agent's guard audited an attempt other than once: {agent_extra}"
