"""A REST service behind FenceMiddleware, called by guarded tools through FencedClient.

Every test runs the service in a uvicorn process of its own on a free loopback
port, with its own store (PostgreSQL schema or SQLite file), and checks what the
service's database holds afterwards: leads, fences, intents and audit rows.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from toolguard import StaleFencingToken, ToolGuardError
from toolguard.adapters import guarded
from toolguard.errors import IdempotencyConflict, LockLost
from toolguard.fences import FencedClient
from toolguard.fences.wire import Fences

from .conftest import leads, make_guard


def fenced(tokens: dict[str, int], key: str | None = "k#1", **extra: str) -> dict[str, str]:
    return Fences(tokens=tokens, idempotency_key=key, **extra).headers()


def audit(store, **filters):
    return store.query_audit(newest_first=False, limit=None, **filters)


def test_a_guarded_tool_writes_through_the_service_under_its_lease(service, service_store,
                                                                   redis_url, tmp_path, unique):
    guard = make_guard(tmp_path, "a", redis_url)
    http = FencedClient(base_url=service.url)
    lead = f"{unique}-L7"

    @guarded(guard, agent="intent_scorer")
    def set_score(lead_id: str, score: int) -> dict:
        return http.post(f"/leads/{lead_id}/score", json={"score": score}).json()

    decision = set_score.run({"lead_id": lead, "score": 80}, call_id="call-1", thread_id="t-1")
    assert decision.ok, decision.message
    assert decision.result["score"] == 80
    assert leads(service_store)[lead] == (80, 1)
    key = f"lead:{lead}"
    assert service_store.high_water(key) == decision.tokens[key]
    (row,) = audit(service_store, decision="accepted")
    assert (row.agent, row.intent_id, row.tool) == ("intent_scorer", "call-1",
                                                  f"POST /leads/{lead}/score")
    assert row.idempotency_key == f"/intent_scorer/{decision.idempotency_key}#1"  # its scope
    assert row.tokens == {key: decision.tokens[key]}


def test_a_stale_token_is_refused_by_the_service_naming_the_key_and_both_tokens(service,
                                                                                service_store):
    assert httpx.post(service.url + "/leads/x/score", json={"score": 1},
                      headers=fenced({"lead:x": 20}, "new#1")).status_code == 201
    response = httpx.post(service.url + "/leads/x/score", json={"score": 2},
                          headers=fenced({"lead:x": 10}, "old#1"))
    assert response.status_code == 409
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert (problem["reason"], problem["key"], problem["token"], problem["current"]) == (
        "stale_fencing_token", "lead:x", 10, 20)
    assert problem["type"] == "urn:toolguard:problem:stale_fencing_token"
    assert leads(service_store)["x"] == (1, 1)
    assert [r.reason for r in audit(service_store, decision="rejected")] == ["stale_fencing_token"]


def test_the_same_request_again_replays_the_stored_response(service, service_store):
    headers = fenced({"lead:r": 5}, "replay#1")
    first = httpx.post(service.url + "/leads/r/score", json={"score": 7}, headers=headers)
    again = httpx.post(service.url + "/leads/r/score", json={"score": 7}, headers=headers)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert leads(service_store)["r"] == (7, 1)
    assert [r.decision for r in audit(service_store)] == ["accepted", "replayed"]


def test_a_replayed_request_advances_the_services_fence(service, service_store):
    """The replay's token was checked, so the service must refuse every lower one afterwards."""
    first = httpx.post(service.url + "/leads/rf/score", json={"score": 7},
                       headers=fenced({"lead:rf": 10}, "rf#1"))
    again = httpx.post(service.url + "/leads/rf/score", json={"score": 7},
                       headers=fenced({"lead:rf": 20}, "rf#1"))
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["idempotent-replayed"] == "true"
    assert service_store.high_water("lead:rf") == 20
    older = httpx.post(service.url + "/leads/rf/score", json={"score": 8},
                       headers=fenced({"lead:rf": 15}, "rf#2"))
    assert older.status_code == 409
    assert (older.json()["token"], older.json()["current"]) == (15, 20)
    assert leads(service_store)["rf"] == (7, 1)
    assert [r.decision for r in audit(service_store)] == ["accepted", "replayed", "rejected"]


def test_a_retried_call_gets_the_services_replay_after_the_agent_lost_its_record(
        service, service_store, redis_url, tmp_path, unique):
    """The service applied, the agent crashed before its own commit: the retry replays."""
    guard = make_guard(tmp_path, "a", redis_url)
    http = FencedClient(base_url=service.url)
    lead = f"{unique}-L8"
    crash = [False, True]

    @guarded(guard, agent="intent_scorer")
    def set_score(lead_id: str, score: int) -> dict:
        answer = http.post(f"/leads/{lead_id}/score", json={"score": score}).json()
        if crash.pop():
            raise ConnectionError("the agent died after the service committed")
        return answer

    identity = {"call_id": "call-9", "thread_id": "t-9"}
    first = set_score.run({"lead_id": lead, "score": 40}, **identity)
    assert first.kind == "failed"
    retry = set_score.run({"lead_id": lead, "score": 40}, **identity)
    assert retry.ok and retry.result["writes"] == 1
    assert leads(service_store)[lead] == (40, 1)
    assert [r.decision for r in audit(service_store)] == ["accepted", "replayed"]


def test_the_same_key_with_another_payload_is_a_conflict_and_changes_nothing(service,
                                                                             service_store):
    headers = fenced({"lead:c": 5}, "conflict#1")
    assert httpx.post(service.url + "/leads/c/score", json={"score": 1},
                      headers=headers).status_code == 201
    response = httpx.post(service.url + "/leads/c/score", json={"score": 2}, headers=headers)
    assert response.status_code == 422
    assert response.json()["reason"] == "idempotency_conflict"
    assert response.json()["idempotency_key"] == "conflict#1"
    assert leads(service_store)["c"] == (1, 1)
    assert audit(service_store)[-1].reason == "idempotency_conflict"


@pytest.mark.parametrize("method, path, extra", [
    ("POST", "/leads/c2/score", []),                                   # another path
    ("GET", "/leads/c", []),                                           # another method
    ("POST", "/leads/c/score?dry=1", []),                              # a query string
    ("POST", "/leads/c/score", [("content-type", "text/plain")]),      # another content type
    # the app reads the first Content-Type line: a request whose first line differs is another
    ("POST", "/leads/c/score", [("content-type", "text/plain"),
                                ("content-type", "application/json")]),
])
def test_a_key_reused_for_another_request_is_refused_never_replayed(service, service_store,
                                                                     method, path, extra):
    headers = fenced({"lead:c": 5}, "reuse#1")
    body = b'{"score": 1}'
    first = httpx.post(service.url + "/leads/c/score", content=body,
                       headers={**headers, "content-type": "application/json"})
    assert first.status_code == 201
    other = [(k.lower(), v) for k, v in headers.items()] + (
        extra or [("content-type", "application/json")])
    with httpx.Client(base_url=service.url) as client:
        response = client.request(method, path, content=body, headers=other)
    assert response.status_code == 422, response.text
    assert "idempotent-replayed" not in response.headers
    assert response.json()["reason"] == "idempotency_conflict"
    assert leads(service_store) == {"c": (1, 1)}
    assert [r.reason for r in audit(service_store)] == ["applied", "idempotency_conflict"]


@pytest.mark.parametrize("headers, missing", [
    ({}, ["Fencing-Token", "Idempotency-Key"]),
    (fenced({"lead:m": 1}, key=None), ["Idempotency-Key"]),
    ({"Idempotency-Key": '"m#1"'}, ["Fencing-Token"]),
])
def test_missing_headers_on_a_fenced_route_are_428(service, service_store, headers, missing):
    response = httpx.post(service.url + "/leads/m/score", json={"score": 1}, headers=headers)
    assert response.status_code == 428
    assert response.json()["missing"] == missing
    assert "m" not in leads(service_store)
    assert [r.reason for r in audit(service_store)] == ["fences_required"]


def test_a_fenced_read_needs_no_key_and_advances_the_fence(service, service_store):
    response = httpx.get(service.url + "/leads/g", headers=fenced({"lead:g": 9}, key=None))
    assert response.status_code == 200
    assert service_store.high_water("lead:g") == 9
    stale = httpx.post(service.url + "/leads/g/score", json={"score": 1},
                       headers=fenced({"lead:g": 8}, "g#1"))
    assert stale.status_code == 409
    assert httpx.get(service.url + "/health").text == "up"  # unfenced route, no headers


def test_a_handler_that_answers_an_error_has_its_writes_rolled_back(service, service_store):
    response = httpx.post(service.url + "/leads/b/broken", json={},
                          headers=fenced({"lead:b": 3}, "b#1"))
    assert response.status_code == 404
    assert "b" not in leads(service_store)
    assert service_store.high_water("lead:b") == 0
    (row,) = audit(service_store)
    assert (row.decision, row.reason) == ("failed", "declined")
    # nothing was recorded: a retry runs the handler again
    again = httpx.post(service.url + "/leads/b/broken", json={},
                       headers=fenced({"lead:b": 3}, "b#1"))
    assert again.status_code == 404 and "idempotent-replayed" not in again.headers


def test_concurrent_requests_with_one_key_apply_once(service, service_store):
    headers = fenced({"lead:cc": 5}, "same#1")
    body = {"score": 3, "sleep": 1.0}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=service.url, timeout=30) as client:
            first = asyncio.create_task(client.post("/leads/cc/score", json=body, headers=headers))
            await asyncio.sleep(0.3)  # the first one is inside its fenced transaction now
            others = await asyncio.gather(*[client.post("/leads/cc/score", json=body,
                                                        headers=headers) for _ in range(4)])
            return [await first, *others]

    first, *others = asyncio.run(burst())
    assert first.status_code == 201
    assert [r.status_code for r in others] == [409] * 4
    assert {r.json()["reason"] for r in others} == {"in_flight"}
    assert leads(service_store)["cc"] == (3, 1)
    after = httpx.post(service.url + "/leads/cc/score", json=body, headers=headers)
    assert after.headers["idempotent-replayed"] == "true" and after.content == first.content
    reasons = [r.reason for r in audit(service_store)]
    assert sorted(reasons) == sorted(["applied", "in_flight", "in_flight", "in_flight",
                                      "in_flight", "duplicate"])


def test_a_holder_paused_past_its_ttl_is_refused_by_the_service_while_the_next_lands(
        service, service_store, redis_url, tmp_path, unique):
    """A's request leaves before its lease ends and is held in the network (a stalled link)
    past its TTL; its renewals are stalled too. B takes the lock and writes; then A's
    request arrives: the service, not the client, refuses it."""
    from proxy import TcpProxy

    redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    service_port = int(service.url.rsplit(":", 1)[1])
    with TcpProxy(("127.0.0.1", redis_port)) as lock_link, \
            TcpProxy(("127.0.0.1", service_port)) as service_link:
        lock_url = redis_url.replace(f":{redis_port}", f":{lock_link.port}")
        guard_a = make_guard(tmp_path, "a", lock_url, ttl_ms=600)
        guard_b = make_guard(tmp_path, "b", redis_url, ttl_ms=600)
        http_a = FencedClient(base_url=f"http://127.0.0.1:{service_link.port}", timeout=30)
        http_b = FencedClient(base_url=service.url, timeout=30)
        lead = f"{unique}-P"
        a_sending = threading.Event()

        @guarded(guard_a, agent="enricher", name="add_score")
        def add_a(lead_id: str, delta: int) -> dict:
            lock_link.stall()
            service_link.stall()
            a_sending.set()
            return http_a.post(f"/leads/{lead_id}/add", json={"delta": delta}).json()

        @guarded(guard_b, agent="scorer", name="add_score")
        def add_b(lead_id: str, delta: int) -> dict:
            return http_b.post(f"/leads/{lead_id}/add", json={"delta": delta}).json()

        outcome: list = []
        holder = threading.Thread(target=lambda: outcome.append(
            add_a.run({"lead_id": lead, "delta": 1}, call_id="a-1", thread_id="ta")))
        holder.start()
        assert a_sending.wait(10)
        b = add_b.run({"lead_id": lead, "delta": 10}, call_id="b-1", thread_id="tb")
        assert b.ok, b.message          # granted once A's lease expired on the server
        service_link.heal()
        lock_link.heal()
        holder.join(30)
    (a,) = outcome
    assert (a.kind, a.reason) == ("rejected", "stale_fencing_token")
    assert isinstance(a.error, StaleFencingToken) and a.error.key == f"lead:{lead}"
    assert a.error.current == b.tokens[f"lead:{lead}"] > a.error.token
    assert leads(service_store)[lead] == (10, 1)
    assert [r.reason for r in audit(service_store)] == ["applied", "stale_fencing_token"]


def test_a_call_after_the_lease_was_lost_is_refused_before_it_leaves(service, service_store,
                                                                     redis_url, tmp_path,
                                                                     unique):
    from proxy import TcpProxy

    redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    with TcpProxy(("127.0.0.1", redis_port)) as lock_link:
        guard = make_guard(tmp_path, "a",
                           redis_url.replace(f":{redis_port}", f":{lock_link.port}"), ttl_ms=300)
        http = FencedClient(base_url=service.url)

        @guarded(guard, agent="enricher")
        def set_score(lead_id: str, score: int) -> dict:
            lock_link.stall()
            time.sleep(0.6)           # renewals cannot land: the lease ends locally
            return http.post(f"/leads/{lead_id}/score", json={"score": score}).json()

        decision = set_score.run({"lead_id": f"{unique}-Q", "score": 1}, call_id="q",
                                 thread_id="tq")
        lock_link.heal()
    assert decision.reason == "lease_lost" and isinstance(decision.error, LockLost)
    assert audit(service_store) == [] and leads(service_store) == {}


def test_a_fenced_client_never_sends_outside_a_guarded_call(service, service_store):
    with pytest.raises(ToolGuardError) as raised:
        FencedClient(base_url=service.url).post("/leads/z/score", json={"score": 1})
    assert raised.value.reason == "no_context"
    assert audit(service_store) == []


def test_refusals_reach_the_guard_as_typed_errors(service, service_store, redis_url, tmp_path,
                                                  unique):
    lead = f"{unique}-T"
    assert httpx.post(f"{service.url}/leads/{lead}/score", json={"score": 1},
                      headers=fenced({f"lead:{lead}": 1}, "manual#1", agent="scorer")
                      ).status_code == 201  # the same agent: answers are scoped to it
    guard = make_guard(tmp_path, "a", redis_url)
    http = FencedClient(base_url=service.url)

    @guarded(guard, agent="scorer")
    def set_score(lead_id: str, score: int) -> dict:
        return http.post(f"/leads/{lead_id}/score", json={"score": score},
                         headers={"Idempotency-Key": '"manual#1"'}).json()

    decision = set_score.run({"lead_id": lead, "score": 2}, call_id="t", thread_id="tt")
    assert (decision.kind, decision.reason) == ("rejected", "idempotency_conflict")
    assert isinstance(decision.error, IdempotencyConflict)
    assert leads(service_store)[lead] == (1, 1)


def test_the_service_restarted_mid_run_keeps_its_fences_and_records(service, service_store):
    body = {"score": 5, "sleep": 1.5}
    headers = fenced({"lead:s": 50}, "slow#1")
    timer = threading.Timer(0.5, service.kill)
    timer.start()
    with pytest.raises(httpx.HTTPError):  # killed while the handler runs
        httpx.post(service.url + "/leads/s/score", json=body, headers=headers, timeout=30)
    timer.join()
    service.start()
    assert "s" not in leads(service_store)  # it died before its commit: nothing landed
    retry = httpx.post(service.url + "/leads/s/score", json=body, headers=headers, timeout=30)
    assert retry.status_code == 201 and retry.json()["writes"] == 1
    service.kill()
    service.start()
    replay = httpx.post(service.url + "/leads/s/score", json=body, headers=headers, timeout=30)
    assert replay.headers["idempotent-replayed"] == "true" and replay.content == retry.content
    stale = httpx.post(service.url + "/leads/s/score", json={"score": 6},
                       headers=fenced({"lead:s": 49}, "older#1"))
    assert (stale.status_code, stale.json()["current"]) == (409, 50)
    assert leads(service_store)["s"] == (5, 1)
