"""Attacks on the audit log by its owner, beyond ``test_audit_chain.py``: forged retention
records, malformed seals, and a verify that must say where and never crash.

Every test runs on PostgreSQL and on SQLite (the ``store`` fixture).
"""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Any

import pytest

from store.test_audit_chain import problems, tamper, write_log
from toolguard.errors import StoreError
from toolguard.store import GuardedStore
from toolguard.store.chain import CANONICAL_FIELDS


@pytest.fixture(autouse=True)
def _seal_by_hand(request: pytest.FixtureRequest) -> None:
    """These tests seal by hand: a store's automatic sealing would race them."""
    if "env" in request.fixturenames:
        request.getfixturevalue("env").options["autoseal"] = None


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


# --- malformed values the SQLite file's owner can write (PostgreSQL's types refuse them) ---------


@pytest.mark.parametrize("env", ["sqlite"], indirect=True)
@pytest.mark.parametrize("statement", [
    "UPDATE toolguard_audit_seal SET sealed_at = 'garbage' WHERE seq = 2",
    "UPDATE toolguard_audit_seal SET sealed_at = 7 WHERE seq = 2",
    "UPDATE toolguard_audit_seal SET sealed_at = NULL WHERE seq = 2",
    "UPDATE toolguard_audit_seal SET last_id = 'x' WHERE seq = 2",
    "UPDATE toolguard_audit_seal SET last_id = 1e400 WHERE seq = 2",
])
def test_a_malformed_seal_is_reported_not_a_crash(store: GuardedStore, statement: str) -> None:
    write_log(store, 6)
    store.seal_audit(max_rows=2)
    with contextlib.suppress(sqlite3.IntegrityError):  # a CHECK may refuse it: then nothing to see
        tamper(store, statement)
        # the seal after it still links to it: one finding, at seal #2
        assert problems(store) == [("seal_changed", None, 2)]
        if "last_id" in statement:  # the chain's head unknown: nothing is sealed on top of it
            tamper(store, statement.replace("seq = 2", "seq = 3"))
            write_log(store, 1, start=6)
            with pytest.raises(StoreError, match="seal #3, the last of the chain, is malformed"):
                store.seal_audit()
            assert ("seal_changed", None, 3) in problems(store)


@pytest.mark.parametrize("env", ["sqlite"], indirect=True)
def test_a_malformed_retention_record_is_reported_not_a_crash(store: GuardedStore) -> None:
    write_log(store, 2)
    store.seal_audit()
    tamper(store, "INSERT INTO toolguard_audit_retention (through_seq, through_id, final_hash, "
                  "rows, seals, dropped_at) VALUES (1, 'x', %s, 'y', 0, 'garbage')",
           params=("a" * 64,))
    report = store.verify_audit()
    assert "retention_inconsistent" in [p.kind for p in report.problems]


@pytest.mark.parametrize("env", ["sqlite"], indirect=True)
def test_a_row_hash_that_is_not_a_hash_is_reported(store: GuardedStore) -> None:
    write_log(store, 2)
    store.seal_audit()
    write_log(store, 1, start=2)
    tamper(store, "UPDATE toolguard_audit SET row_hash = 'text' WHERE id IN (1, 3)")
    assert problems(store) == [("row_hash_changed", 1, 1), ("row_unsealed_changed", 3, None)]


def test_tail_truncation_is_named_as_a_limit_without_an_anchor(store: GuardedStore) -> None:
    """Rows deleted from the end before they are sealed, or with the newest seal, leave no
    trace in the database: verify says so rather than a bare OK."""
    write_log(store, 4)
    store.seal_audit(max_rows=2)
    anchor = store.verify_audit().head.hash
    write_log(store, 2, start=4)
    tamper(store, "DELETE FROM toolguard_audit WHERE id = 6")  # the unsealed tail
    report = store.verify_audit()
    notes = " ".join(report.notes)
    if store.dialect == "postgresql":  # a rolled-back insert leaves the same gap: no proof
        assert report.ok
        assert "not sealed yet" in notes and "a deletion among them" in notes
        assert "leaves no trace, now or later" in notes
    else:  # SQLite's ids have no gaps, and sqlite_sequence keeps the highest one
        assert [(p.kind, p.row_id) for p in report.problems] == [("row_deleted", 6)]
        assert "row #6 deleted from the end of the log before a seal covered it" in \
            report.problems[0].message
        assert "a deleted row is found" in notes
    assert "every 1,000 rows or 1 s" in notes  # the automatic sealing bound
    assert "without an anchor" in notes
    assert "without an anchor" not in " ".join(store.verify_audit(anchor=anchor).notes)
    tamper(store, "DELETE FROM toolguard_audit WHERE id >= 3",
           "DELETE FROM toolguard_audit_seal WHERE seq = 2")  # the newest seal and its rows
    if store.dialect == "sqlite":  # ... and the highest id, to hide the tail
        tamper(store, "UPDATE sqlite_sequence SET seq = 2 WHERE name = 'toolguard_audit'")
    assert store.verify_audit().ok
    assert problems(store, anchor=anchor) == [("anchor_missing", None, None)]


# --- every column, swaps and renumbering (regressions: each is caught today) ---------------------

COLUMN_CHANGES = {
    "at": ("at - interval '1 second'", "'2001-01-01T00:00:00.000Z'"),
    "agent": ("'x'", "'x'"), "tool": ("'x'", "'x'"), "intent_id": ("'x'", "'x'"),
    "idempotency_key": ("'x'", "'x'"), "workflow": ("'x'", "'x'"),
    "decision": ("'accepted'", "'accepted'"), "reason": ("'applied'", "'applied'"),
    "keys": ("ARRAY['x:1']", "'[\"x:1\"]'"), "tokens": ("'{\"x:1\": 9}'", "'{\"x:1\":9}'"),
    "args": ("'{\"amount\": 1000000}'", "'{\"amount\":1000000}'"),
    "detail": ("'nothing to see'", "'nothing to see'"), "duration_ms": ("12345", "12345"),
    "node_attempt": ("99", "99"), "policy_version": ("'sha256:other'", "'sha256:other'"),
}


@pytest.mark.parametrize("column", sorted(COLUMN_CHANGES))
def test_a_change_to_any_column_is_pinpointed(store: GuardedStore, column: str) -> None:
    write_log(store, 3)
    store.seal_audit()
    pg, lite = COLUMN_CHANGES[column]
    value = pg if store.dialect == "postgresql" else lite
    tamper(store, f"UPDATE toolguard_audit SET {column} = {value} WHERE id = 2")
    assert problems(store) == [("row_changed", 2, 1)]


def test_two_rows_swapped_or_renumbered_are_pinpointed(store: GuardedStore) -> None:
    write_log(store, 4)
    store.seal_audit()
    tamper(store, "UPDATE toolguard_audit SET id = -2 WHERE id = 2",
           "UPDATE toolguard_audit SET id = 2 WHERE id = 3",
           "UPDATE toolguard_audit SET id = 3 WHERE id = -2")
    assert problems(store) == [("row_changed", 2, 1), ("row_changed", 3, 1)]
    tamper(store, "UPDATE toolguard_audit SET id = id + 100 WHERE id = 4")
    found = problems(store)
    assert ("row_deleted", 4, 1) in found and ("row_unsealed_changed", 104, None) in found


def test_the_first_a_middle_and_the_last_sealed_rows_deleted_are_pinpointed(
        store: GuardedStore) -> None:
    write_log(store, 6)
    store.seal_audit()
    tamper(store, "DELETE FROM toolguard_audit WHERE id IN (1, 3, 6)")
    assert problems(store) == [("row_deleted", 1, 1), ("row_deleted", 3, 1),
                               ("row_deleted", 6, 1)]
