"""A signed service audits who a claim proved, never who a header said.

A genuine signed request resent with another ``Toolguard-Agent`` is refused
``claim_mismatch``; its audit row names the agent the claim names, and the
header's agent only as unproven (``args["unproven"]``). A request whose claims
prove nothing (a bad signature, an expired claim, none at all) leaves the agent,
intent, idempotency key and fence columns empty: what it brought is kept as
unproven. The same on REST and MCP, for refusals decided before the claims are
read too; the review page and ``toolguard audit show`` mark it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest
from mcp.shared.exceptions import MCPError
from review.helpers import fetch, serving
from typer.testing import CliRunner

from toolguard.cli import app
from toolguard.fences import Fences, FenceSigner
from toolguard.fences.scope import scoped_key
from toolguard.locks import connect
from toolguard.review import create_app
from toolguard.store import AuditEntry, GuardedStore

from .conftest import ServiceProcess, audit, opened_store
from .test_claims_mcp import call
from .test_claims_rest import OLD, _bad_signature, _start

AGENT, FORGED = "intent_scorer", "other_writer"


@dataclass(frozen=True)
class Case:
    what: str
    sent: Fences
    reason: str
    proven: bool  # a claim proved the call: its columns are the claim's
    unproven: dict[str, Any]


@contextlib.contextmanager
def signed_fences(redis_url: str, key: str) -> Iterator[tuple[Fences, list[Case]]]:
    """A held lease on ``key``: its genuine request for ``crm``, and every case's."""
    locks = connect(redis_url)
    lease = locks.acquire(key, ttl_ms=30_000)
    try:
        yield cases(lease, key)
    finally:
        lease.release()
        locks.close()


def cases(lease: Any, key: str) -> tuple[Fences, list[Case]]:
    token = lease.tokens[key]
    fences = Fences(tokens=dict(lease.tokens), idempotency_key="c#1", agent=AGENT,
                    intent_id="c")
    genuine = FenceSigner(OLD, audience="crm").sign(fences, lease)
    expired = FenceSigner(OLD, audience="crm", clock=lambda: time.time() - 3600).sign(fences,
                                                                                      lease)
    without_key = FenceSigner(OLD, audience="crm").sign(replace(fences, idempotency_key=None),
                                                        lease)
    everything = {"agent": AGENT, "idempotency_key": "c#1", "intent_id": "c",
                  "tokens": {key: token}}
    return genuine, [
        Case("a forged agent header", replace(genuine, agent=FORGED), "claim_mismatch", True,
             {"agent": FORGED}),
        Case("another idempotency key", replace(genuine, idempotency_key="other#1"),
             "claim_mismatch", True, {"idempotency_key": "other#1"}),
        Case("another intent id", replace(genuine, intent_id="d"), "claim_mismatch", True,
             {"intent_id": "d"}),
        Case("another token", replace(genuine, tokens={key: token + 1000}), "claim_mismatch",
             True, {"tokens": {key: token + 1000}}),
        Case("a bad signature", replace(genuine, claims=_bad_signature(genuine.claims or "")),
             "claim_bad_signature", False, everything),
        Case("an expired claim", expired, "claim_expired", False, everything),
        Case("no claim", replace(genuine, claims=None), "claim_missing", False, everything),
        Case("no idempotency key, a forged agent", replace(without_key, agent=FORGED),
             "fences_required", True, {"agent": FORGED}),
    ]


def check_row(row: AuditEntry, case: Case, key: str, token: int) -> None:
    """The row's columns are what the claim proved, and the rest is marked unproven."""
    if case.proven:
        idempotency = None if case.reason == "fences_required" else scoped_key(
            "c#1", audience="crm", agent=AGENT)
        assert (row.agent, row.intent_id, row.idempotency_key, row.keys, row.tokens) == (
            AGENT, "c", idempotency, (key,), {key: token}), case.what
    else:
        assert (row.agent, row.intent_id, row.idempotency_key, row.keys, row.tokens) == (
            None, None, None, (), {}), case.what
    assert row.args == {"unproven": case.unproven}, case.what
    assert FORGED not in (row.detail or ""), case.what


@pytest.fixture
def signed_rest(service_store_url) -> Iterator[ServiceProcess]:
    process = _start(service_store_url, OLD)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def signed_mcp(service_store_url) -> Iterator[ServiceProcess]:
    process = _start(service_store_url, OLD, factory="fences.claims_service:create_mcp_app")
    try:
        yield process
    finally:
        process.stop()


def test_a_rest_refusal_audits_the_claims_agent_and_marks_the_rest_unproven(
        signed_rest, redis_url, unique):
    lead = f"{unique}-U"
    key = f"lead:{lead}"
    url = f"{signed_rest.url}/leads/{lead}/score"
    with signed_fences(redis_url, key) as (genuine, sent), opened_store(signed_rest) as store:
        token = next(iter(genuine.tokens.values()))
        for case in sent:
            response = httpx.post(url, json={"score": 5}, headers=case.sent.headers())
            assert response.json()["reason"] == case.reason, case.what
        rows = audit(store)
        assert [r.reason for r in rows] == [c.reason for c in sent]
        for row, case in zip(rows, sent, strict=True):
            check_row(row, case, key, token)
        assert store.high_water(key) == 0  # nothing was touched

        assert httpx.post(url, json={"score": 5}, headers=genuine.headers()).status_code == 201
        accepted = audit(store, decision="accepted")[-1]
        assert (accepted.agent, accepted.args) == (AGENT, None)
        assert audit(store, agent=FORGED) == []  # no row says the forger did anything


def test_an_mcp_refusal_audits_the_claims_agent_and_marks_the_rest_unproven(
        signed_mcp, redis_url, unique):
    lead = f"{unique}-V"
    key = f"lead:{lead}"
    args = {"lead_id": lead, "score": 5}
    with signed_fences(redis_url, key) as (genuine, sent), opened_store(signed_mcp) as store:
        token = next(iter(genuine.tokens.values()))
        for case in sent:
            with pytest.raises(MCPError) as refused:
                asyncio.run(call(signed_mcp.url, args, case.sent.meta()))
            assert refused.value.error.data["reason"] == case.reason, case.what
        rows = audit(store)
        assert [r.reason for r in rows] == [c.reason for c in sent]
        for row, case in zip(rows, sent, strict=True):
            check_row(row, case, key, token)

        asyncio.run(call(signed_mcp.url, args, genuine.meta()))
        accepted = audit(store, decision="accepted")[-1]
        assert (accepted.agent, accepted.args) == (AGENT, None)
        assert audit(store, agent=FORGED) == []


def _shown(text: str) -> str:
    return " ".join(text.split())


def test_the_review_page_and_audit_show_mark_the_unproven_agent(signed_rest, redis_url, unique):
    lead = f"{unique}-W"
    key = f"lead:{lead}"
    url = f"{signed_rest.url}/leads/{lead}/score"
    with signed_fences(redis_url, key) as (genuine, _), opened_store(signed_rest) as store:
        for sent in (replace(genuine, agent=FORGED), replace(genuine, claims=None)):
            assert httpx.post(url, json={"score": 5}, headers=sent.headers()).status_code in (
                401, 403)
        forged, unsigned = audit(store)
        assert_review_page(store, forged, unsigned)
        assert_audit_show(signed_rest, forged, unsigned)


def assert_review_page(store: GuardedStore, forged: AuditEntry, unsigned: AuditEntry) -> None:
    with serving(create_app(store)) as base:
        page = _shown(fetch(base, f"/entry/{forged.id}").body)
        assert f'<dt>agent</dt><dd>{AGENT}</dd>' in page
        assert f'<dt class="unproven">agent (unproven)</dt><dd>{FORGED}</dd>' in page
        assert f"the request said {FORGED}, unproven" in page
        assert ('<h2 id="args">Arguments (redacted)</h2> <p class="none">none recorded</p>'
                in page)  # the marker is not shown as the call's arguments
        page = _shown(fetch(base, f"/entry/{unsigned.id}").body)
        assert "<dt>agent</dt><dd>-</dd>" in page
        assert f'<dt class="unproven">agent (unproven)</dt><dd>{AGENT}</dd>' in page
        assert '<dt class="unproven">intent id (unproven)</dt><dd><code>c</code></dd>' in page
        assert "no proven agent" in page
        listing = _shown(fetch(base, "/").body)
        assert f"(unproven: {FORGED})" in listing and f"(unproven: {AGENT})" in listing


def assert_audit_show(service: ServiceProcess, forged: AuditEntry, unsigned: AuditEntry) -> None:
    runner = CliRunner()
    where = ["--url", service.store_url, *(["--schema", service.schema] if service.schema else [])]
    result = runner.invoke(app, ["audit", "show", str(forged.id), *where])
    assert result.exit_code == 0, result.output
    text = _shown(result.stdout)
    assert f"agent {AGENT} agent (unproven) {FORGED} tool" in text
    assert "args -" in text
    result = runner.invoke(app, ["audit", "show", str(unsigned.id), *where])
    text = _shown(result.stdout)
    assert f"agent - agent (unproven) {AGENT} tool" in text
    assert "intent id (unproven) c" in text and "idempotency key (unproven) c#1" in text
    assert f"tokens (unproven) {next(iter(forged.keys))}=" in text
    listing = _shown(runner.invoke(app, ["audit", *where]).stdout)
    assert f"? (unproven: {FORGED})" not in listing  # the forged row has a proven agent
    assert f"{AGENT} (unproven: {FORGED}) →" in listing
    assert f"? (unproven: {AGENT}) →" in listing


def test_a_signed_request_cancelled_before_its_transaction_names_only_the_claims_agent(
        tmp_path, redis_url, unique):
    """The gate's own rows (a cancellation, a refusal before the claims are read) in a real
    store: the claim's agent in the column, the header's marked unproven."""
    from toolguard.errors import ToolGuardError
    from toolguard.fences import ClaimVerifier, Keyring
    from toolguard.fences.gate import FenceGate
    from toolguard.store import open_async_store, open_store

    url = f"sqlite:///{tmp_path}/service.db"
    key = f"lead:{unique}-C"
    with signed_fences(redis_url, key) as (genuine, _):
        forged = replace(genuine, agent=FORGED)

        async def run() -> None:
            store = open_async_store(url, install=True)
            try:
                gate = FenceGate(store, claims=ClaimVerifier(audience="crm",
                                                             keys=Keyring([OLD.public()])))
                await gate.cancelled(asyncio.CancelledError(), tool="POST /x", fences=forged)
                too_large = ToolGuardError("the request body is larger than 1 bytes",
                                           reason="request_too_large")
                await gate.refuse(too_large, tool="POST /x", fences=forged)
            finally:
                await store.close()

        asyncio.run(run())
        with open_store(url) as store:
            rows = audit(store)
        assert [(r.decision, r.reason) for r in rows] == [("unknown", "cancelled"),
                                                          ("rejected", "request_too_large")]
        for row in rows:
            assert (row.agent, row.intent_id, row.idempotency_key, row.keys) == (
                AGENT, "c", scoped_key("c#1", audience="crm", agent=AGENT), (key,))
            assert row.args == {"unproven": {"agent": FORGED}}
