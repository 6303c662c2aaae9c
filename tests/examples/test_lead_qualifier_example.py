"""The lead-qualifier example on the embedded default and on Redis + PostgreSQL.

Guard off, the records are wrong in the ways the scenario provokes; guard on,
they equal ``expected_records()``, the stalled worker's late write is refused
by the fence and audited, and running the pipeline again changes nothing.
No timing assertions: the scenario orders its faults with events, not sleeps.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.lead_qualifier import POLICY_PATH, SCHEMA_PATH, expected_records, run_pipeline
from toolguard.demo import POLICY_PATH as PACKAGE_POLICY
from toolguard.demo import SCHEMA_PATH as PACKAGE_SCHEMA
from toolguard.demo.lead_qualifier import Report
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


def assert_second_run_changes_nothing(first: Report, second: Report) -> None:
    assert second.correct
    assert dict(second.records) == dict(first.records)
    applied = {e.idempotency_key for e in first.audit if e.decision == "accepted" and e.keys}
    writes = [e for e in second.audit if e.keys]  # request_review (read-only) locks nothing
    assert not [e for e in writes if e.decision == "accepted" and e.idempotency_key in applied]
    assert {e.idempotency_key for e in writes if e.decision == "replayed"} >= applied
    assert second.stale_rejections == []


def test_embedded_default(tmp_path: Path) -> None:
    locks, store = f"sqlite:///{tmp_path}/locks.db", f"sqlite:///{tmp_path}/store.db"
    assert_unguarded_anomalies(run_pipeline(guarded=False, lock_url=locks, store_url=store))
    first = run_pipeline(guarded=True, lock_url=locks, store_url=store)
    assert_guarded_run(first)
    with open_store(store) as opened:  # the rejection is in the audit log itself
        (audited,) = opened.query_audit(reason="stale_fencing_token")
        assert audited.id == first.stale_rejections[0].id and audited.decision == "rejected"
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
               "store_url": postgres_url, "store_options": {"schema": schema}}
    try:
        assert_unguarded_anomalies(run_pipeline(guarded=False, **options))
        first = run_pipeline(guarded=True, **options)
        assert_guarded_run(first)
        assert first.store.startswith("postgresql://") and first.locks.startswith("redis://")
        assert_second_run_changes_nothing(first, run_pipeline(guarded=True, **options))
    finally:
        drop_schema(postgres_url, schema)


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
