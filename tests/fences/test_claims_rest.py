"""A REST service in signed mode, in a uvicorn process of its own: only fences a guard signed count.

Each test checks what the service's store holds afterwards (fences, leads, audit
rows): a refused claim leaves exactly one audit row and changes nothing.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest

from toolguard.adapters import guarded
from toolguard.call.context import current
from toolguard.errors import LockLost
from toolguard.fences import ClaimRefused, FencedClient, Fences, FenceSigner, generate_signing_key
from toolguard.fences.keys import SigningKey
from toolguard.locks import connect
from toolguard.store import GuardedStore, open_store

from .conftest import ServiceProcess, audit, leads, make_guard, opened_store

OLD, NEW, STRANGER = (generate_signing_key("k1"), generate_signing_key("k2"),
                      generate_signing_key("k9"))


def _start(store: tuple[str, str | None], *keys: SigningKey, audience: str = "crm",
           unsigned: bool = False, factory: str = "fences.claims_service:create_app"
           ) -> ServiceProcess:
    from servers import free_port

    env = {"FENCES_AUDIENCE": audience,
           "TOOLGUARD_FENCE_VERIFY_KEYS": " ".join(k.public().text() for k in keys)}
    if unsigned:
        env["FENCES_UNSIGNED"] = "1"
    process = ServiceProcess(factory, store[0], store[1], free_port(), env=env)
    try:
        return process.start(timeout_s=120.0)  # a loaded machine starts Python slowly
    except BaseException:
        process.stop()
        raise


@pytest.fixture
def signed_service(service_store_url) -> Iterator[ServiceProcess]:
    process = _start(service_store_url, OLD, NEW)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def store(signed_service: ServiceProcess) -> Iterator[GuardedStore]:
    with opened_store(signed_service) as opened:
        yield opened


def _bad_signature(claim: str) -> str:
    """``claim`` with one bit of its signature flipped, spelled canonically.

    Always another signature: overwriting its last characters with fixed ones
    leaves it as it was whenever it already ended in them (about once in 16,000
    runs for an Ed25519 signature, and the forged claim is then the genuine one).
    """
    head, _, signature = claim.rpartition(".")
    raw = bytearray(base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4)))
    raw[0] ^= 0x01
    return f"{head}.{base64.urlsafe_b64encode(bytes(raw)).rstrip(b'=').decode('ascii')}"


def test_the_forged_signature_is_never_the_genuine_one() -> None:
    ending_as_forged_before = "tgf1.ed25519.k1.e30." + "B" * 83 + "AAA"  # 64 bytes, canonical
    assert ending_as_forged_before[:-3] + "AAA" == ending_as_forged_before  # the old forgery
    for claim in (ending_as_forged_before, "tgf1.ed25519.k1.e30." + "x" * 85 + "w"):
        forged = _bad_signature(claim)
        assert forged != claim and len(forged) == len(claim)
        assert forged.rpartition(".")[0] == claim.rpartition(".")[0]


def genuine_call(guard, url: str, key: SigningKey, lead: str, score: int, call_id: str):
    http = FencedClient(base_url=url, signer=FenceSigner(key, audience="crm"))

    @guarded(guard, agent="intent_scorer")
    def set_score(lead_id: str, score: int) -> dict:
        return http.post(f"/leads/{lead_id}/score", json={"score": score}).json()

    return set_score.run({"lead_id": lead, "score": score}, call_id=call_id, thread_id="t-1")


def test_a_genuine_holder_passes_and_the_token_inflation_request_is_refused(
        signed_service, store, redis_url, tmp_path, unique):
    guard = make_guard(tmp_path, "a", redis_url)
    lead = f"{unique}-L7"
    key = f"lead:{lead}"
    decision = genuine_call(guard, signed_service.url, OLD, lead, 80, "call-1")
    assert decision.ok, decision.message
    token = decision.tokens[key]
    assert store.high_water(key) == token
    (accepted,) = audit(store, decision="accepted")
    assert accepted.idempotency_key == f"crm/intent_scorer/{decision.idempotency_key}#1"
    assert accepted.detail == "HTTP 201; signed by k1"

    wire_key = key.replace(":", "%3A")
    forged = httpx.post(f"{signed_service.url}/leads/{lead}/score", json={"score": 1},
                        headers={"Fencing-Token": f"{wire_key}=9223372036854775807",
                                 "Idempotency-Key": '"forged#1"',
                                 "Toolguard-Agent": '"intent_scorer"'})
    assert forged.status_code == 401
    assert forged.headers["content-type"] == "application/problem+json"
    assert forged.json()["reason"] == "claim_missing"
    assert store.high_water(key) == token  # unchanged: the next genuine holder still passes
    assert [r.reason for r in audit(store, decision="rejected")] == ["claim_missing"]

    again = genuine_call(guard, signed_service.url, OLD, lead, 81, "call-2")
    assert again.ok, again.message
    assert leads(store)[lead] == (81, 2)


def test_every_forged_or_borrowed_claim_is_refused_audited_once_and_changes_nothing(
        signed_service, store, redis_url, unique):
    lead = f"{unique}-L8"
    key = f"lead:{lead}"
    url = f"{signed_service.url}/leads/{lead}/score"
    locks = connect(redis_url)
    lease = locks.acquire(key, ttl_ms=30_000)
    try:
        fences = Fences(tokens=dict(lease.tokens), idempotency_key="c#1", agent="intent_scorer",
                        intent_id="c")
        genuine = FenceSigner(OLD, audience="crm").sign(fences, lease)
        cases = [
            ("another service", FenceSigner(OLD, audience="billing").sign(fences, lease),
             403, "claim_wrong_audience"),
            ("expired", FenceSigner(OLD, audience="crm",
                                    clock=lambda: __import__("time").time() - 3600
                                    ).sign(fences, lease), 401, "claim_expired"),
            ("another token than the header's",
             replace(genuine, tokens={key: lease.tokens[key] + 1000}), 403, "claim_mismatch"),
            ("an unknown key", FenceSigner(STRANGER, audience="crm").sign(fences, lease),
             401, "claim_unknown_key"),
            ("replayed by another agent", replace(genuine, agent="lead_enricher"),
             403, "claim_mismatch"),
            ("another idempotency key", replace(genuine, idempotency_key="other#1"),
             403, "claim_mismatch"),
            ("a bad signature", replace(genuine, claims=_bad_signature(genuine.claims)),
             401, "claim_bad_signature"),
        ]
        for what, sent, status, reason in cases:
            response = httpx.post(url, json={"score": 5}, headers=sent.headers())
            assert (response.status_code, response.json()["reason"]) == (status, reason), what
        assert store.high_water(key) == 0  # no fence was ever touched
        assert lead not in leads(store)
        rows = audit(store, decision="rejected")
        assert [r.reason for r in rows] == [reason for *_, reason in cases]
        assert all(r.tokens == {} or r.keys == (key,) for r in rows)

        response = httpx.post(url, json={"score": 5}, headers=genuine.headers())
        assert response.status_code == 201
        assert store.high_water(key) == lease.tokens[key]
    finally:
        lease.release()
        locks.close()


def test_a_call_whose_lease_is_lost_is_not_signed_nor_sent(signed_service, store, redis_url,
                                                           tmp_path, unique):
    guard = make_guard(tmp_path, "a", redis_url)
    http = FencedClient(base_url=signed_service.url, signer=FenceSigner(OLD, audience="crm"))
    lead = f"{unique}-L9"

    @guarded(guard, agent="intent_scorer")
    def set_score(lead_id: str, score: int) -> dict:
        lease = current().lease
        assert lease is not None
        lease.mark_lost(LockLost("taken over", keys=lease.keys))
        return http.post(f"/leads/{lead_id}/score", json={"score": score}).json()

    decision = set_score.run({"lead_id": lead, "score": 3}, call_id="c", thread_id="t")
    assert not decision.ok
    assert audit(store) == []  # nothing reached the service


def test_a_rotation_with_two_key_ids_refuses_no_genuine_call(redis_url, tmp_path, unique):
    service_store_url = (f"sqlite:///{tmp_path}/service.db", None)  # one store, three restarts
    guard = make_guard(tmp_path, "a", redis_url)
    lead = f"{unique}-R"
    service = _start(service_store_url, OLD)  # before: only k1
    try:
        assert genuine_call(guard, service.url, OLD, lead, 1, "c1").ok
    finally:
        service.stop()
    service = _start(service_store_url, OLD, NEW)  # during: both; guards move to k2 one by one
    try:
        for n, key in enumerate([OLD, NEW, OLD, NEW], start=2):
            decision = genuine_call(guard, service.url, key, lead, n, f"c{n}")
            assert decision.ok, decision.message
    finally:
        service.stop()
    service = _start(service_store_url, NEW)  # after: k1 is gone
    try:
        assert genuine_call(guard, service.url, NEW, lead, 9, "c9").ok
        late = genuine_call(guard, service.url, OLD, lead, 10, "c10")
        assert not late.ok and late.reason == "claim_unknown_key"
        assert isinstance(late.error, ClaimRefused)
        options = {"schema": service.schema} if service.schema else {}
        with open_store(service.store_url, **options) as store:
            assert [r.reason for r in audit(store, decision="rejected")] == ["claim_unknown_key"]
            assert leads(store)[lead] == (9, 6)
    finally:
        service.stop()


def test_recorded_answers_are_scoped_to_the_service_and_the_agent(tmp_path, unique):
    """Unsigned services on one store, one idempotency key and body: each runs its handler."""
    service_store_url = (f"sqlite:///{tmp_path}/service.db", None)
    crm = _start(service_store_url, OLD, audience="crm", unsigned=True)
    billing = _start(service_store_url, OLD, audience="billing", unsigned=True)
    lead = f"{unique}-S"
    try:
        def post(service: ServiceProcess, agent: str) -> httpx.Response:
            headers = Fences(tokens={f"lead:{lead}": 7}, idempotency_key="same#1",
                             agent=agent).headers()
            return httpx.post(f"{service.url}/leads/{lead}/score", json={"score": 4},
                              headers=headers)

        first = post(crm, "intent_scorer")
        assert first.status_code == 201 and first.json()["writes"] == 1
        assert post(crm, "intent_scorer").headers["idempotent-replayed"] == "true"
        other_agent = post(crm, "lead_enricher")
        assert "idempotent-replayed" not in other_agent.headers
        assert other_agent.json()["writes"] == 2
        other_service = post(billing, "intent_scorer")
        assert "idempotent-replayed" not in other_service.headers
        assert other_service.json()["writes"] == 3
    finally:
        crm.stop()
        billing.stop()


def test_hmac_keys_and_the_asyncio_client_sign_and_a_lost_lease_sends_nothing(
        service_store_url, redis_url, tmp_path, unique):
    """The shared-secret option end to end: a service trusting one HMAC key, asyncio guarded
    calls through ``AsyncFencedClient``; a call whose lease is lost is neither signed nor sent."""
    import asyncio

    from toolguard.fences import AsyncFencedClient

    secret = generate_signing_key("h1", "hmac-sha256")
    service = _start(service_store_url, secret)
    guard = make_guard(tmp_path, "a", redis_url, asynchronous=True)
    lead = f"{unique}-H"
    try:
        async def main() -> tuple:
            async with AsyncFencedClient(base_url=service.url,
                                         signer=FenceSigner(secret, audience="crm")) as http:
                @guarded(guard, agent="intent_scorer")
                async def set_score(lead_id: str, score: int, lose: bool = False) -> dict:
                    if lose:
                        lease = current().lease
                        assert lease is not None
                        lease.mark_lost(LockLost("taken over", keys=lease.keys))
                    return (await http.post(f"/leads/{lead_id}/score",
                                            json={"score": score})).json()

                genuine = await set_score.arun({"lead_id": lead, "score": 5}, call_id="h-1",
                                               thread_id="th")
                lost = await set_score.arun({"lead_id": lead, "score": 6, "lose": True},
                                            call_id="h-2", thread_id="th")
                return genuine, lost

        genuine, lost = asyncio.run(main())
        assert genuine.ok, genuine.message
        assert not lost.ok
        with opened_store(service) as store:
            assert [(r.decision, r.agent) for r in audit(store)] == [("accepted",
                                                                      "intent_scorer")]
            assert leads(store)[lead] == (5, 1)  # the lost lease's call never arrived
    finally:
        service.stop()
