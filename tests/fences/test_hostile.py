"""Attacks and faults on fenced services: hostile envelopes, broken clients, a loaded pool.

Each test runs the service in a process of its own (``conftest.py``) and checks
what its store holds afterwards: nothing applied, exactly one audit row per
decision, the class of answer the same over REST and MCP.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from fastmcp import Client
from mcp.shared.exceptions import MCPError

from toolguard.fences.wire import Fences
from toolguard.store import GuardedStore, open_store

from .conftest import ServiceProcess, audit, drop_schema, leads


def fenced(tokens: dict[str, int], key: str | None = "k#1") -> dict[str, str]:
    return Fences(tokens=tokens, idempotency_key=key).headers()


def wait_for_audit(store: GuardedStore, rows: int, within_s: float = 20.0) -> list:
    """The audit rows once there are ``rows`` of them (the service decides asynchronously)."""
    deadline = time.monotonic() + within_s
    while True:
        found = audit(store)
        if len(found) >= rows or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.fixture
def small_pool_service(postgres_url, unique) -> Iterator[ServiceProcess]:
    """The REST service on PostgreSQL with a pool of 4 connections (3 s timeout)."""
    from servers import free_port

    schema = f"svc_{unique}"
    process = ServiceProcess("fences.service_app:create_app", postgres_url, schema, free_port(),
                             env={"FENCES_POOL": "4,3"})
    try:
        yield process.start()
    finally:
        process.stop()
        drop_schema(postgres_url, schema)


def test_more_concurrent_keys_than_the_pool_has_connections_all_apply(small_pool_service):
    """Each fenced request holds an in-flight marker; it must never starve its own transaction."""
    service = small_pool_service
    body = {"score": 1, "sleep": 0.5}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=service.url, timeout=60) as client:
            return await asyncio.gather(*[
                client.post(f"/leads/p{i}/score", json=body,
                            headers=fenced({f"lead:p{i}": 1}, f"p{i}#1")) for i in range(6)])

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [201] * 6, [r.text for r in responses]
    with open_store(service.store_url, schema=service.schema) as store:
        assert {lead: row for lead, row in leads(store).items()} == {
            f"p{i}": (1, 1) for i in range(6)}
        assert [r.reason for r in audit(store)] == ["applied"] * 6


def test_a_body_cut_off_by_a_disconnect_is_never_applied(service, service_store):
    """The client promised 100 bytes, sent 10 and hung up: the handler must not see 10."""
    host, port = service.url.removeprefix("http://").split(":")
    head = ("POST /leads/cut/note HTTP/1.1\r\nHost: svc\r\nContent-Type: text/plain\r\n"
            "Content-Length: 100\r\nFencing-Token: lead%3Acut=3\r\n"
            'Idempotency-Key: "cut#1"\r\n\r\n')
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode("ascii") + b"0123456789")
        time.sleep(0.3)  # let the service start reading the body before the hang-up
    rows = wait_for_audit(service_store, 1)
    assert "cut" not in leads(service_store)
    assert service_store.high_water("lead:cut") == 0
    assert [(r.decision, r.reason) for r in rows] == [("rejected", "request_incomplete")]


def mcp_meta(tokens: dict[str, int], key: str = "k#1") -> dict[str, str]:
    return Fences(tokens=tokens, idempotency_key=key, agent="raw", intent_id="c").meta()


async def mcp_call(url: str, name: str, args: dict, **kwargs):
    async with Client(url + "/mcp") as client:
        return await client.call_tool(name, args, **kwargs)


@pytest.mark.parametrize("name", ["set\x00score", "set\x1bscore", "x" * 5000, "nope"])
@pytest.mark.parametrize("with_fences", [True, False])
def test_a_hostile_or_unknown_tool_name_is_refused_with_one_audit_row(mcp_service, mcp_store,
                                                                      name, with_fences):
    sent = mcp_meta({"lead:h": 4}, "h#1") if with_fences else None
    with pytest.raises(Exception) as raised:
        asyncio.run(mcp_call(mcp_service.url, name, {"lead_id": "h", "score": 1}, meta=sent))
    if with_fences:  # fenced, then the tool is not found: rolled back, audited failed
        assert "unknown tool" in str(raised.value).lower(), raised.value
    else:
        assert isinstance(raised.value, MCPError)
        assert raised.value.error.data["reason"] == "fences_required"
    assert leads(mcp_store) == {}
    assert mcp_store.high_water("lead:h") == 0
    (row,) = audit(mcp_store)
    assert row.decision in ("rejected", "failed")
    assert row.tool is not None and "\x00" not in row.tool and len(row.tool) <= 200


def test_the_services_postgresql_restarted_is_a_503_then_fences_and_records_hold(
        private_postgres, unique):
    """While the store is down every request is a 503 problem, and nothing is applied;
    after the restart the recorded answer replays and the fence still refuses older tokens."""
    from servers import free_port

    schema = f"svc_{unique}"
    service = ServiceProcess("fences.service_app:create_app", private_postgres.url, schema,
                             free_port(), env={"FENCES_POOL": "4,2"}).start()
    try:
        post = lambda score, token, key: httpx.post(  # noqa: E731
            service.url + "/leads/d/score", json={"score": score}, timeout=30,
            headers=fenced({"lead:d": token}, key))
        first = post(1, 10, "d#1")
        assert first.status_code == 201
        private_postgres.stop()
        down = post(2, 11, "d#2")
        assert down.status_code == 503, down.text
        assert down.headers["content-type"] == "application/problem+json"
        assert down.json()["reason"] == "backend_unavailable"
        private_postgres.start()
        again = post(1, 10, "d#1")
        assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
        assert again.content == first.content
        stale = post(3, 9, "d#3")
        assert (stale.status_code, stale.json()["current"]) == (409, 10)
        retried = post(2, 11, "d#2")  # the request refused while the store was down, sent again
        assert retried.status_code == 201 and retried.json()["writes"] == 2
        with open_store(private_postgres.url, schema=schema) as store:
            assert leads(store) == {"d": (2, 2)}
            assert [r.reason for r in audit(store)] == ["applied", "duplicate",
                                                        "stale_fencing_token", "applied"]
    finally:
        service.stop()


def test_a_locked_sqlite_store_is_a_503_and_nothing_is_applied(tmp_path):
    """Another process holds the service's SQLite file locked past the busy timeout."""
    import sqlite3

    from servers import free_port

    url = f"sqlite:///{tmp_path}/service.db"
    service = ServiceProcess("fences.service_app:create_app", url, None, free_port(),
                             env={"FENCES_POOL": "1,0.5"}).start()
    try:
        blocker = sqlite3.connect(tmp_path / "service.db", isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            locked = httpx.post(service.url + "/leads/l/score", json={"score": 1}, timeout=30,
                                headers=fenced({"lead:l": 4}, "l#1"))
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert locked.status_code == 503, locked.text
        assert locked.json()["reason"] == "backend_unavailable"
        retry = httpx.post(service.url + "/leads/l/score", json={"score": 1}, timeout=30,
                           headers=fenced({"lead:l": 4}, "l#1"))
        assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
        with open_store(url) as store:
            assert leads(store) == {"l": (1, 1)}
            assert store.high_water("lead:l") == 4
    finally:
        service.stop()


def test_a_rest_request_fenced_on_another_key_is_refused_and_rolled_back(service,
                                                                         service_store):
    """A lease on lead:other proves nothing about lead:w: the handler's require() refuses."""
    response = httpx.post(service.url + "/leads/w/score", json={"score": 1},
                          headers=fenced({"lead:other": 7}, "w#1"))
    assert response.status_code == 428, response.text
    problem = response.json()
    assert (problem["reason"], problem["keys"]) == ("key_not_fenced", ["lead:w"])
    assert leads(service_store) == {}
    assert service_store.high_water("lead:other") == 0   # its fence advance rolled back too
    assert [(r.decision, r.reason) for r in audit(service_store)] == [
        ("rejected", "key_not_fenced")]


def test_an_mcp_call_fenced_on_another_key_is_refused_as_rest_refuses_it(mcp_service, mcp_store):
    with pytest.raises(MCPError) as raised:
        asyncio.run(mcp_call(mcp_service.url, "set_score", {"lead_id": "w", "score": 1},
                             meta=mcp_meta({"lead:other": 7}, "w#1")))
    error = raised.value.error
    assert (error.code, error.data["reason"], error.data["keys"]) == (
        -32077, "key_not_fenced", ["lead:w"])
    assert error.data["status"] == 428
    assert leads(mcp_store) == {}
    assert mcp_store.high_water("lead:other") == 0
    assert [(r.decision, r.reason) for r in audit(mcp_store)] == [("rejected", "key_not_fenced")]


def test_a_handler_that_raises_after_answering_applies_nothing(service, service_store):
    """The answer was written to the middleware's buffer, then the app raised: it never leaves."""
    headers = fenced({"lead:a": 2}, "a#1")
    response = httpx.post(service.url + "/leads/a/after", json={}, headers=headers)
    assert response.status_code == 500
    assert leads(service_store) == {}
    assert service_store.high_water("lead:a") == 0
    assert [(r.decision, r.reason) for r in audit(service_store)] == [("failed", "error")]
    again = httpx.post(service.url + "/leads/a/after", json={}, headers=headers)
    assert again.status_code == 500 and "idempotent-replayed" not in again.headers


def test_a_client_that_hangs_up_mid_handler_gets_the_recorded_answer_on_its_retry(
        service, service_store):
    """The answer is lost (the client gave up while the handler ran): the service still
    commits once, and the retry replays that answer instead of applying again."""
    headers = fenced({"lead:u": 6}, "u#1")
    body = {"score": 4, "sleep": 1.0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(service.url + "/leads/u/score", json=body, headers=headers, timeout=0.3)
    rows = wait_for_audit(service_store, 1)
    assert [r.reason for r in rows] == ["applied"]
    retry = httpx.post(service.url + "/leads/u/score", json=body, headers=headers, timeout=30)
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert retry.json()["writes"] == 1
    assert leads(service_store) == {"u": (4, 1)}
    assert [r.reason for r in audit(service_store)] == ["applied", "duplicate"]


@pytest.mark.parametrize("content", [b"not json", b'{"score": "high"}', b""])
def test_a_body_the_handler_cannot_read_changes_nothing(service, service_store, content):
    response = httpx.post(service.url + "/leads/j/score", content=content,
                          headers={**fenced({"lead:j": 3}, "j#1"),
                                   "content-type": "application/json"})
    assert response.status_code == 500
    assert leads(service_store) == {} and service_store.high_water("lead:j") == 0
    assert [(r.decision, r.reason) for r in audit(service_store)] == [("failed", "error")]


@pytest.mark.parametrize("args", [{"lead_id": "j", "score": "high"}, {"lead_id": "j"},
                                  {"lead_id": "j", "score": 1, "extra": {"deep": [1] * 50}}])
def test_arguments_the_tool_cannot_take_change_nothing_as_over_rest(mcp_service, mcp_store,
                                                                   args):
    with pytest.raises(Exception) as raised:
        asyncio.run(mcp_call(mcp_service.url, "set_score", args,
                             meta=mcp_meta({"lead:j": 3}, "j#1")))
    assert "set_score" in str(raised.value) or "validation" in str(raised.value).lower()
    assert leads(mcp_store) == {} and mcp_store.high_water("lead:j") == 0
    assert [r.decision for r in audit(mcp_store)] == ["failed"]


def test_a_lock_server_behind_the_services_fence_is_refused_then_reseeded_from_its_answer(
        service, service_store, redis_url, tmp_path, unique):
    """The service has seen a token the lock server never reached (it lost its data, its
    clock went back): the stale request is refused, never applied; the guard raises the
    lock's floor to the service's ``current`` and its one retry lands above it."""
    from toolguard.adapters import guarded
    from toolguard.fences import FencedClient

    from .conftest import make_guard

    lead = f"{unique}-R"
    key = f"lead:{lead}"
    ahead = 2**52  # above every hybrid-clock token until the year 2112
    assert httpx.post(f"{service.url}/leads/{lead}/score", json={"score": 1},
                      headers=fenced({key: ahead}, "ahead#1")).status_code == 201
    guard = make_guard(tmp_path, "a", redis_url, ttl_ms=3_000)  # the re-seed waits one TTL
    http = FencedClient(base_url=service.url)

    @guarded(guard, agent="scorer")
    def set_score(lead_id: str, score: int) -> dict:
        return http.post(f"/leads/{lead_id}/score", json={"score": score}).json()

    decision = set_score.run({"lead_id": lead, "score": 9}, call_id="r-1", thread_id="tr")
    assert decision.ok, decision.message
    rows = audit(service_store)
    assert rows[-1].tokens[key] > ahead, (rows[-1].tokens, decision.tokens)
    assert leads(service_store)[lead] == (9, 2)
    assert [r.reason for r in audit(service_store)] == ["applied", "stale_fencing_token",
                                                        "applied"]


def test_a_service_fence_past_exact_tokens_is_never_reseeded_from(service, service_store,
                                                                  redis_url, tmp_path, unique):
    """A high-water at 2^62 (a hostile or broken caller sent it): the lock server cannot mint
    tokens above it exactly, so the guard leaves its floor alone and the call stays refused."""
    from toolguard.adapters import guarded
    from toolguard.fences import FencedClient

    from .conftest import make_guard

    lead = f"{unique}-X"
    key = f"lead:{lead}"
    assert httpx.post(f"{service.url}/leads/{lead}/score", json={"score": 1},
                      headers=fenced({key: 2**62}, "far#1")).status_code == 201
    guard = make_guard(tmp_path, "a", redis_url, ttl_ms=3_000)  # the re-seed waits one TTL
    http = FencedClient(base_url=service.url)

    @guarded(guard, agent="scorer")
    def set_score(lead_id: str, score: int) -> dict:
        return http.post(f"/leads/{lead_id}/score", json={"score": score}).json()

    decision = set_score.run({"lead_id": lead, "score": 9}, call_id="x-1", thread_id="tx")
    assert (decision.kind, decision.reason) == ("rejected", "stale_fencing_token")
    assert leads(service_store)[lead] == (1, 1)
    assert [r.reason for r in audit(service_store)] == ["applied", "stale_fencing_token",
                                                        "stale_fencing_token"]


def test_oversized_mcp_arguments_are_refused_as_an_oversized_rest_body_is(mcp_service, service,
                                                                         service_store):
    big = "x" * (1 << 20)
    with pytest.raises(MCPError) as raised:
        asyncio.run(mcp_call(mcp_service.url, "set_score", {"lead_id": "big", "score": 1,
                                                            "pad": big},
                             meta=mcp_meta({"lead:big": 2}, "big#1")))
    assert (raised.value.error.code, raised.value.error.data["reason"]) == (
        -32602, "request_too_large")
    response = httpx.post(service.url + "/leads/big/score", content=big.encode() + b"xx",
                          headers=fenced({"lead:big": 2}, "big#1"))
    assert (response.status_code, response.json()["reason"]) == (413, "request_too_large")
    # both services run on the one service store: one refusal row each
    assert leads(service_store) == {} and service_store.high_water("lead:big") == 0
    assert [(r.decision, r.reason, r.tool) for r in audit(service_store)] == [
        ("rejected", "request_too_large", "set_score"),
        ("rejected", "request_too_large", "POST /leads/big/score")]


def test_one_key_sent_to_two_service_processes_at_once_applies_once(service, service_store):
    """Two processes of the service on one store: the second copy of an in-flight request
    is 409 in_flight (PostgreSQL: advisory locks span processes) or waits for the first and
    replays it (SQLite: the marker is per process, the store's write lock is not)."""
    from servers import free_port

    twin = ServiceProcess(service.factory, service.store_url, service.schema, free_port()).start()
    headers = fenced({"lead:two": 8}, "two#1")
    body = {"score": 6, "sleep": 1.0}
    try:
        async def both() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                first = asyncio.create_task(client.post(service.url + "/leads/two/score",
                                                        json=body, headers=headers))
                await asyncio.sleep(0.4)  # the first is inside its fenced transaction
                second = await client.post(twin.url + "/leads/two/score", json=body,
                                           headers=headers)
                return [await first, second]

        first, second = asyncio.run(both())
    finally:
        twin.stop()
    assert first.status_code == 201 and first.json()["writes"] == 1
    if service_store.dialect == "postgresql":
        assert (second.status_code, second.json()["reason"]) == (409, "in_flight")
    else:
        assert second.status_code == 201 and second.headers["idempotent-replayed"] == "true"
        assert second.content == first.content
    assert leads(service_store) == {"two": (6, 1)}
    assert sorted(r.reason for r in audit(service_store)) == sorted(
        ["applied", "in_flight" if service_store.dialect == "postgresql" else "duplicate"])


def test_a_fenced_client_following_redirects_keeps_its_fences_to_the_origin(redis_url,
                                                                            tmp_path, unique):
    """303 after a POST: the GET it leads to is a fenced read without the write's key (the
    service would refuse the key reused for a GET); a redirect to another origin is refused,
    and nothing reaches that origin."""
    from toolguard.adapters import guarded
    from toolguard.fences import FencedClient

    from .conftest import make_guard

    seen: list[tuple[str, str, dict[str, str]]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, str(request.url), dict(request.headers)))
        if request.url.path.endswith("/see-other"):
            return httpx.Response(303, headers={"location": "/leads/L"})
        if request.url.path.endswith("/elsewhere"):
            return httpx.Response(307, headers={"location": "http://other.example/take"})
        return httpx.Response(200, json={"ok": True})

    guard = make_guard(tmp_path, "a", redis_url)
    http = FencedClient(transport=httpx.MockTransport(answer), base_url="http://svc",
                        follow_redirects=True)

    @guarded(guard, agent="scorer")
    def set_score(lead_id: str, score: int) -> dict:
        return http.post(f"/leads/{lead_id}/{'see-other' if score else 'elsewhere'}",
                         json={"score": score}).json()

    ok = set_score.run({"lead_id": f"{unique}-a", "score": 1}, call_id="c-1", thread_id="t1")
    assert ok.ok, ok.message
    (post, post_url, post_headers), (get, get_url, get_headers) = seen
    assert (post, get, get_url) == ("POST", "GET", "http://svc/leads/L")
    assert post_url == f"http://svc/leads/{unique}-a/see-other"
    assert "idempotency-key" in post_headers and "idempotency-key" not in get_headers
    assert get_headers["fencing-token"] == post_headers["fencing-token"]
    seen.clear()
    refused = set_score.run({"lead_id": f"{unique}-b", "score": 0}, call_id="c-2",
                            thread_id="t2")
    assert not refused.ok and refused.reason == "fenced_redirect", refused
    assert [url for _, url, _ in seen] == [f"http://svc/leads/{unique}-b/elsewhere"]


def test_an_mcp_key_reused_for_another_tool_is_refused_never_replayed(mcp_service, mcp_store):
    asyncio.run(mcp_call(mcp_service.url, "set_score", {"lead_id": "t", "score": 2},
                         meta=mcp_meta({"lead:t": 3}, "t#1")))
    with pytest.raises(MCPError) as raised:
        asyncio.run(mcp_call(mcp_service.url, "fail_after_write", {"lead_id": "t"},
                             meta=mcp_meta({"lead:t": 3}, "t#1")))
    assert (raised.value.error.code, raised.value.error.data["reason"]) == (
        -32074, "idempotency_conflict")
    assert leads(mcp_store) == {"t": (2, 1)}
    assert [r.reason for r in audit(mcp_store)] == ["applied", "idempotency_conflict"]


def test_a_request_cancelled_mid_handler_is_recorded_unknown_and_applies_once_on_retry(tmp_path):
    """An ASGI server that cancels the app when its client goes away (in-process here):
    the handler's writes roll back, the outcome is audited unknown, and the retry applies."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from toolguard.fences import FenceMiddleware, fence_of
    from toolguard.store import open_async_store

    url = f"sqlite:///{tmp_path}/service.db"
    with open_store(url, install=True) as setup, setup.connection() as conn:
        conn.execute("CREATE TABLE notes (id TEXT PRIMARY KEY)")
    started = asyncio.Event()
    slow = [True, False]

    async def handler(request):
        await fence_of(request).tx.execute("INSERT INTO notes (id) VALUES (%s)", ("n",))
        started.set()
        if slow.pop(0):
            await asyncio.sleep(3600)
        return PlainTextResponse("ok", status_code=201)

    store = open_async_store(url)
    app = Starlette(routes=[Route("/n", handler, methods=["POST"])],
                    middleware=[Middleware(FenceMiddleware, store=store)])
    headers = [(k.lower().encode(), v.encode())
               for k, v in fenced({"note:n": 5}, "n#1").items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "path": "/n", "raw_path": b"/n", "query_string": b"",
             "headers": headers, "scheme": "http", "server": ("svc", 80), "client": None,
             "root_path": ""}

    async def serve(sent: list) -> None:
        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        await app(dict(scope), receive, send)

    async def run() -> list:
        first: list = []
        task = asyncio.create_task(serve(first))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert first == []  # nothing left the service
        again: list = []
        await serve(again)
        await store.close()
        return again

    again = asyncio.run(run())
    assert again[0]["status"] == 201
    with open_store(url) as check, check.connection() as conn:
        assert conn.execute("SELECT count(*) FROM notes").fetchone()[0] == 1
        assert [(r.decision, r.reason) for r in audit(check)] == [("unknown", "cancelled"),
                                                                   ("accepted", "applied")]
        assert check.high_water("note:n") == 5


@pytest.mark.parametrize("raw_meta", ['"a=1"', "[1, 2]", "5", "true", '"toolguard/fencing-token"'])
def test_mcp_meta_that_is_not_an_object_is_refused_and_audited(mcp_service, mcp_store, raw_meta):
    """Issue 21 point 4: the SDK's generic -32602 had no audit row; the docs promise one."""
    from .mcp_raw import RawMcp

    raw = RawMcp(mcp_service.url)
    try:
        answer = raw.call('{"name":"set_score","arguments":{"lead_id":"nm","score":1},'
                          f'"_meta":{raw_meta}}}')
    finally:
        raw.close()
    error = answer["error"]
    assert (error["code"], error["data"]["reason"], error["data"]["field"]) == (
        -32602, "invalid_fence_header", "_meta"), answer
    assert leads(mcp_store) == {}
    (row,) = audit(mcp_store)
    assert (row.decision, row.reason, row.tool) == ("rejected", "invalid_fence_header",
                                                    "set_score")


@pytest.mark.parametrize("first, second", [("lead%3Adk=5", "lead%3Adk=1"),
                                           ("lead%3Adk=5", "lead%3Adk=5")])
def test_a_repeated_mcp_meta_key_is_refused_as_a_repeated_header_is(mcp_service, mcp_store,
                                                                     first, second):
    """Issue 21 point 3: JSON objects keep the last of two equal keys; the first one may be the
    one the sender meant. Refused, even when both say the same, as REST refuses a repeat."""
    from .mcp_raw import RawMcp

    raw = RawMcp(mcp_service.url)
    try:
        answer = raw.call('{"name":"set_score","arguments":{"lead_id":"dk","score":1},'
                          f'"_meta":{{"toolguard/fencing-token":"{first}",'
                          '"toolguard/idempotency-key":"dk#1",'
                          f'"toolguard/fencing-token":"{second}"}}}}')
        # the same call with each key once is applied: the refusal is the repeat's alone
        applied = raw.call('{"name":"set_score","arguments":{"lead_id":"dk","score":1},'
                           f'"_meta":{{"toolguard/fencing-token":"{first}",'
                           '"toolguard/idempotency-key":"dk#2"}}')
    finally:
        raw.close()
    error = answer["error"]
    assert (error["code"], error["data"]["reason"], error["data"]["field"]) == (
        -32602, "invalid_fence_header", "toolguard/fencing-token"), answer
    assert "result" in applied, applied
    assert [(r.decision, r.reason) for r in audit(mcp_store)] == [
        ("rejected", "invalid_fence_header"), ("accepted", "applied")]
    assert leads(mcp_store) == {"dk": (1, 1)}


@pytest.fixture(params=["h11", "httptools"])
def any_http_service(request, service_store_url) -> Iterator[ServiceProcess]:
    """The REST service behind uvicorn with each of its HTTP/1.1 parsers."""
    from servers import free_port

    url, schema = service_store_url
    process = ServiceProcess("fences.service_app:create_app", url, schema, free_port(),
                             http=request.param)
    try:
        yield process.start()
    finally:
        process.stop()


def send_raw(service: ServiceProcess, data: bytes) -> int:
    """Send ``data`` on a fresh connection; the answer's status code."""
    host, port = service.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def chunked(path: str, headers: str, body: bytes, trailer: str) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: svc\r\nContent-Type: application/json\r\n"
            f"{headers}Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    return (head.encode() + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n"
            + trailer.encode() + b"\r\n")


def test_fence_fields_in_a_chunked_trailer_are_never_read_as_headers(any_http_service):
    """Issue 21 point 5: with httptools, uvicorn appends trailers to the scope's headers; a
    request fenced only by its trailer was applied, and a trailer's agent audited."""
    service = any_http_service
    only_trailer = send_raw(service, chunked(
        "/leads/tr/score", "", b'{"score": 1}',
        'Fencing-Token: lead%3Atr=5\r\nIdempotency-Key: "tr#1"\r\n'))
    spoofed = send_raw(service, chunked(
        "/leads/tr2/score", 'Fencing-Token: lead%3Atr2=5\r\nIdempotency-Key: "tr2#1"\r\n',
        b'{"score": 2}', 'Toolguard-Agent: "spoofed"\r\n'))
    options = {"schema": service.schema} if service.schema else {}
    with open_store(service.store_url, **options) as store:
        rows = wait_for_audit(store, 2)
        assert only_trailer in (400, 428)  # h11 drops trailers: no fences; httptools: refused
        assert "tr" not in leads(store)
        assert store.high_water("lead:tr") == 0
        assert all(r.agent != "spoofed" for r in rows), rows
        assert len(rows) == 2
        if service.http == "httptools":  # a fence field that may be a trailer is refused
            assert (only_trailer, spoofed) == (400, 400)
            assert {r.reason for r in rows} == {"invalid_fence_header"}
        else:
            assert (only_trailer, spoofed) == (428, 201)
            assert [r.reason for r in rows] == ["fences_required", "applied"]
