"""Attacks on the audit log by its owner, beyond ``test_audit_chain.py``: forged retention
records, malformed seals, and a verify that must say where and never crash.

Every test runs on PostgreSQL and on SQLite (the ``store`` fixture).
"""

from __future__ import annotations

from typing import Any

from store.test_audit_chain import problems, tamper, write_log
from toolguard.store import GuardedStore
from toolguard.store.chain import CANONICAL_FIELDS

RETENTION = ("INSERT INTO toolguard_audit_retention (through_seq, through_id, final_hash, rows, "
             "seals, file_sha256) VALUES (%s, %s, %s, %s, %s, NULL)")


def recompute(store: GuardedStore, where: str = "") -> str:
    """The statement that gives rows a row hash matching their (changed) content."""
    if store.dialect == "postgresql":
        return ("UPDATE toolguard_audit AS a SET row_hash = sha256(convert_to("
                f"toolguard_audit_canonical(a), 'UTF8')) {where}")
    return (f"UPDATE toolguard_audit SET row_hash = toolguard_audit_row_hash("
            f"{', '.join(CANONICAL_FIELDS)}) {where}")


def test_a_forged_retention_record_cannot_hide_a_rewrite_from_the_anchor(
        store: GuardedStore) -> None:
    """A retention record that claims far more seals were dropped than were: every seal is
    then skipped, and rows rewritten with their hashes recomputed looked unsealed and fine,
    even against the anchor (the record's final hash being the anchor itself)."""
    write_log(store, 4)
    anchor = store.seal_audit().head.hash
    tamper(store, "UPDATE toolguard_audit SET decision = 'accepted' WHERE id = 2",
           recompute(store, "WHERE id = 2"))
    tamper(store, RETENTION, params=(1000, 0, anchor, 0, 0))
    report = store.verify_audit(anchor=anchor)
    assert not report.ok
    kinds = [(p.kind, p.seal) for p in report.problems]
    assert ("retention_inconsistent", 1) in kinds, report.problems
    assert "seal #1" in " ".join(p.message for p in report.problems)


def test_a_retention_record_that_drops_more_seals_than_rows_is_reported(
        store: GuardedStore) -> None:
    write_log(store, 2)
    anchor = store.seal_audit().head.hash
    tamper(store, "DELETE FROM toolguard_audit_seal", RETENTION, params=(50, 0, anchor, 0, 50))
    report = store.verify_audit(anchor=anchor)
    assert [p.kind for p in report.problems] == ["retention_inconsistent"], report.problems


def test_an_anchor_that_only_names_the_dropped_range_says_the_file_is_needed(
        store: GuardedStore, tmp_path: Any) -> None:
    write_log(store, 3)
    anchor = store.seal_audit().head.hash
    store.export_audit(tmp_path / "a.jsonl", through_seq=1, drop=True)
    report = store.verify_audit(anchor=anchor)
    assert report.ok
    assert any("--export" in n and "anchor" in n for n in report.notes), report.notes
    assert store.verify_audit(anchor=anchor, exports=[tmp_path / "a.jsonl"]).ok


def test_an_untouched_log_after_two_drops_verifies(store: GuardedStore, tmp_path: Any) -> None:
    write_log(store, 6)
    store.seal_audit(max_rows=2)
    store.export_audit(tmp_path / "a.jsonl", through_seq=1, drop=True)
    store.export_audit(tmp_path / "b.jsonl", through_seq=2, drop=True)
    write_log(store, 2, start=6)
    store.seal_audit()
    assert problems(store) == []
    assert store.verify_audit(exports=[tmp_path / "a.jsonl", tmp_path / "b.jsonl"]).ok
