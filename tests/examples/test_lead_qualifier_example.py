"""The lead-qualifier example on the embedded default and on Redis + PostgreSQL.

Guard off, the records are wrong in the ways the scenario provokes; guard on,
they equal ``expected_records()``, the stalled worker's late write is refused
by the fence and audited, and running the pipeline again changes nothing.
The CRM the agents push to shows the same on its side: guard off, a push
applied twice and a stuck push landing over newer ones; guard on, its own
middleware replays the one and refuses the other (409), in its own audit log.
No timing assertions: the scenario orders its faults with events, not sleeps.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx
import pytest

from examples.lead_qualifier import (
    POLICY_PATH,
    SCHEMA_PATH,
    expected_crm_records,
    expected_records,
    run_pipeline,
)
from toolguard.demo import POLICY_PATH as PACKAGE_POLICY
from toolguard.demo import SCHEMA_PATH as PACKAGE_SCHEMA
from toolguard.demo.crm import PG_SCHEMA, CrmService, crm_store_for
from toolguard.demo.lead_qualifier import Report
from toolguard.fences.scope import scoped_key
from toolguard.policies import load_policy
from toolguard.store import open_store

LEADS = ["L-101", "L-102", "L-103", "L-104", "L-105", "L-106"]


def test_example_files_match_the_packaged_ones() -> None:
    assert POLICY_PATH.read_bytes() == PACKAGE_POLICY.read_bytes()
    assert SCHEMA_PATH.read_bytes() == PACKAGE_SCHEMA.read_bytes()
    policy = load_policy(POLICY_PATH)
    assert policy.tools["set_tier"].after == ("enrich_lead", "update_intent_score", "verify_email")


def test_expected_records_follow_the_scenario() -> None:
    expected = expected_records()
    assert sorted(expected) == LEADS
    assert (expected["L-101"].score, expected["L-101"].tier) == (70, "A")
    assert (expected["L-105"].score, expected["L-105"].tier) == (-15, "disqualified")  # 5, not 80
    assert (expected["L-106"].score, expected["L-106"].tier) == (60, "B")  # no router bump


def assert_unguarded_anomalies(report: Report) -> None:
    assert not report.correct
    assert report.mismatches
    double = {f.lead_id for f in report.of_kind("double_applied")}
    assert double == {"L-102", "L-104"}  # RetryPolicy re-run, resumed interrupt
    assert {f.lead_id for f in report.of_kind("tier_before_scoring")} == set(LEADS)
    assert {f.lead_id for f in report.of_kind("unchecked_write")} == {"L-105", "L-106"}
    lost = {f.lead_id for f in report.of_kind("lost_update")}
    assert "L-103" in lost  # the stalled enricher's stale write landed last
    assert report.stalls == 1 and report.crashes == 1 and report.interrupts == 1
    assert report.audit == ()
    crm = report.crm
    assert crm is not None and not crm.fenced and crm.audit == ()  # no middleware, no audit
    # The lost answer and the dropped connection each made an agent send its push again.
    assert {f.lead_id for f in report.of_kind("crm_double_push")} == {"L-102", "L-103"}
    assert crm.lost_answers == 1 and crm.records["L-102"].pushes == 3
    # The copy stuck in the network landed last, over the retry and the router's push.
    assert crm.late_copy is not None and crm.late_copy.landed and crm.late_copy.status == 200
    assert [f.lead_id for f in report.of_kind("crm_late_push")] == ["L-103"]
    last = [push for push in crm.pushes if push.lead_id == "L-103"][-1]
    assert (last.push, last.stage, last.agent) == (3, "enriched", "lead_enricher")


def assert_guarded_run(report: Report) -> None:
    assert report.correct, report.mismatches
    assert dict(report.records) == expected_records()  # every field, and 4 writes per lead
    assert report.findings == ()
    stale = report.stale_rejections
    assert len(stale) == 1
    (entry,) = stale
    assert (entry.tool, entry.agent, entry.keys) == ("enrich_lead", "lead_enricher", ("lead:L-103",))
    assert entry.tokens["lead:L-103"] > 0 and "stale fencing token" in (entry.detail or "")
    refused = report.rejected_by_reason()
    assert refused["invalid_arguments"] == 1 and refused["not_authorized"] == 1
    out_of_order = {e.keys for e in report.audit if e.reason == "out_of_order"}
    assert {("lead:L-103",), ("lead:L-105",)} <= out_of_order
    replayed = {e.keys[0] for e in report.audit if e.decision == "replayed"}
    assert {"lead:L-102", "lead:L-104"} <= replayed  # the re-runs returned the recorded result
    assert any(e.decision == "unknown" and e.reason == "interrupted" for e in report.audit)
    redacted = [e.args for e in report.audit if e.tool == "verify_email" and e.args]
    assert redacted and all(args["email"] == "[redacted]" for args in redacted)
    assert_crm_outcome(report)


def assert_crm_outcome(report: Report) -> None:
    """The CRM's side of a first guarded run, checked against the agents' side."""
    crm = report.crm
    assert crm is not None and crm.fenced
    # Exactly one record per lead, each the lead's final record, pushed once per stage.
    assert dict(crm.records) == expected_crm_records()
    applied = Counter((push.lead_id, push.stage, push.agent) for push in crm.pushes)
    assert set(applied.values()) == {1} and len(applied) == 12
    assert {(lead, stage) for lead, stage, _ in applied} == {
        (lead, stage) for lead in expected_records() for stage in ("enriched", "qualified")}
    assert Counter(e.decision for e in crm.audit) == {"accepted": 12, "replayed": 1, "rejected": 1}

    pushes = [e for e in report.audit if e.tool == "push_to_crm"]
    failed = {e.keys: e for e in pushes if e.decision == "failed"}
    assert set(failed) == {("lead:L-102",), ("lead:L-103",)}
    assert all(e.reason == "tool_error" and "did not answer" in (e.detail or "")
               for e in failed.values())
    assert Counter(e.decision for e in pushes) == {"accepted": 12, "failed": 2}

    # L-103: the enricher's push stuck in the network reached the CRM after the newer pushes:
    # 409, on the CRM's side, for the very call the agents' store audited as failed.
    late = crm.late_copy
    assert (late.lead_id, late.agent, late.status, late.reason) == (
        "L-103", "lead_enricher", 409, "stale_fencing_token")
    (stale,) = [e for e in crm.audit if e.decision == "rejected"]
    assert (stale.reason, stale.agent, stale.keys) == (
        "stale_fencing_token", "lead_enricher", ("lead:L-103",))
    assert stale.tool == "PUT /leads/L-103"
    assert stale.intent_id == failed[("lead:L-103",)].intent_id
    # the CRM keeps its answers per service and agent (toolguard.fences.scope)
    assert stale.idempotency_key == scoped_key(
        failed[("lead:L-103",)].idempotency_key + "#1", audience=None, agent="lead_enricher")
    # It came after the enricher's retry (a newer lease) and the router's push (sent before or
    # after it, depending on who got the lock first): the CRM had seen a greater token.
    landed = {e.agent: e.tokens["lead:L-103"] for e in crm.audit
              if e.decision == "accepted" and e.keys == ("lead:L-103",)}
    assert set(landed) == {"lead_enricher", "router"}
    assert stale.tokens["lead:L-103"] < landed["lead_enricher"]
    assert f"already seen {max(landed.values())}" in (stale.detail or "")

    # L-102: the router's push was applied and its answer lost; sent again, it was replayed.
    assert crm.lost_answers == 1
    (replay,) = [e for e in crm.audit if e.decision == "replayed"]
    assert (replay.reason, replay.agent, replay.keys) == ("duplicate", "router", ("lead:L-102",))
    first = [e for e in crm.audit if e.decision == "accepted"
             and e.idempotency_key == replay.idempotency_key]
    assert len(first) == 1 and first[0].intent_id == failed[("lead:L-102",)].intent_id
    assert replay.tokens["lead:L-102"] > first[0].tokens["lead:L-102"]  # a newer lease
    (retried,) = [e for e in pushes if e.decision == "accepted" and e.intent_id == replay.intent_id]
    assert "the CRM replayed its recorded answer" in (retried.detail or "")


def assert_second_run_changes_nothing(first: Report, second: Report) -> None:
    assert second.correct
    assert dict(second.records) == dict(first.records)
    applied = {e.idempotency_key for e in first.audit if e.decision == "accepted" and e.keys}
    writes = [e for e in second.audit if e.keys]  # request_review (read-only) locks nothing
    assert not [e for e in writes if e.decision == "accepted" and e.idempotency_key in applied]
    assert {e.idempotency_key for e in writes if e.decision == "replayed"} >= applied
    assert second.stale_rejections == []
    # Every push replayed from the agents' store: nothing reached the CRM, nothing changed there.
    assert second.crm.audit == () and second.crm.late_copy is None
    assert dict(second.crm.records) == dict(first.crm.records) == expected_crm_records()
    assert second.crm.pushes == first.crm.pushes


def test_embedded_default(tmp_path: Path) -> None:
    locks, store = f"sqlite:///{tmp_path}/locks.db", f"sqlite:///{tmp_path}/store.db"
    assert_unguarded_anomalies(run_pipeline(guarded=False, lock_url=locks, store_url=store))
    first = run_pipeline(guarded=True, lock_url=locks, store_url=store)
    assert_guarded_run(first)
    with open_store(store) as opened:  # the rejection is in the audit log itself
        (audited,) = opened.query_audit(reason="stale_fencing_token")
        assert audited.id == first.stale_rejections[0].id and audited.decision == "rejected"
    # The CRM's refusal is in the CRM's own store, a separate file, and only there.
    assert first.crm.store == f"sqlite:///{tmp_path}/crm.db"
    with open_store(f"sqlite:///{tmp_path}/crm.db") as crm_store:
        (refused,) = crm_store.query_audit(decision="rejected")
        assert refused.reason == "stale_fencing_token" and refused.tool == "PUT /leads/L-103"
        assert refused.id == first.crm.of("rejected")[0].id
    assert_second_run_changes_nothing(first, run_pipeline(guarded=True, lock_url=locks,
                                                          store_url=store))


def test_embedded_default_without_urls(tmp_path: Path) -> None:
    """No settings at all: the embedded files under ./.toolguard (here: a temporary folder)."""
    report = run_pipeline(guarded=True)
    assert report.correct
    assert (tmp_path / ".toolguard" / "store.db").exists()


def test_redis_and_postgresql(redis_url: str, postgres_url: str, unique: str) -> None:
    from store.envs import drop_schema

    schema = f"tg_example_{unique}"
    options = {"lock_url": redis_url, "lock_options": {"prefix": f"tgex-{unique}"},
               "store_url": postgres_url, "store_options": {"schema": schema},
               "crm_store_options": {"schema": f"{schema}_crm"}}
    try:
        assert_unguarded_anomalies(run_pipeline(guarded=False, **options))
        first = run_pipeline(guarded=True, **options)
        assert_guarded_run(first)
        assert first.store.startswith("postgresql://") and first.locks.startswith("redis://")
        assert first.crm.store.endswith(f"(schema {schema}_crm)")
        assert_second_run_changes_nothing(first, run_pipeline(guarded=True, **options))
    finally:
        drop_schema(postgres_url, schema)
        drop_schema(postgres_url, f"{schema}_crm")


def test_the_crm_store_sits_beside_the_agents_store(tmp_path: Path) -> None:
    assert crm_store_for(f"sqlite:///{tmp_path}/d/store.db") == (f"sqlite:///{tmp_path}/d/crm.db", {})
    url = "postgresql://app@db.internal/crm"
    assert crm_store_for(url) == (url, {"schema": PG_SCHEMA})
    with open_store(f"sqlite:///{tmp_path}/own.db", install=True) as store:
        assert crm_store_for(None, store) == (f"sqlite:///{tmp_path}/crm.db", {})


@pytest.mark.parametrize("fenced", [True, False])
def test_the_crm_without_fences(tmp_path: Path, fenced: bool) -> None:
    """Guard on, the CRM refuses a push without fences (428); guard off it has no middleware."""
    body = {"stage": "qualified", "agent": "router", "company": "Acme", "email": "a@b.example",
            "score": 70, "tier": "A"}
    with CrmService(f"sqlite:///{tmp_path}/crm.db", pipeline="p", fenced=fenced) as crm:
        response = httpx.put(f"{crm.url}/leads/L-1", json=body)
        assert response.status_code == (428 if fenced else 200), response.text
        assert httpx.put(f"{crm.url}/leads/L-1", json={"stage": "?"}).status_code == (
            428 if fenced else 422)  # fences first; guard off, the body is still validated
        if fenced:
            assert [(e.decision, e.reason) for e in crm.audit()] == [
                ("rejected", "fences_required")] * 2
            assert crm.records() == {}
        else:
            assert crm.audit() == () and crm.records()["L-1"].pushes == 1


@pytest.mark.parametrize("guarded", [False, True])
def test_open_store_and_locks_objects(tmp_path: Path, guarded: bool) -> None:
    """Callers can pass their own store and lock manager; the pipeline leaves them open."""
    from toolguard.locks import connect

    store = open_store(f"sqlite:///{tmp_path}/store.db", install=True)
    locks = connect(f"sqlite:///{tmp_path}/locks.db")
    try:
        report = run_pipeline(guarded=guarded, store=store, locks=locks, pipeline=f"own-{guarded}")
        assert report.correct is guarded
        assert store.schema_version() > 0  # still open
    finally:
        locks.close()
        store.close()
