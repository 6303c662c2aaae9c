"""The tamper-evident audit log: row hashes, seals, verify, anchors, export and drop.

Every test runs on PostgreSQL and on SQLite. "Tampering" is what the tables'
owner can do: switch the append-only triggers off (PostgreSQL: ``ALTER TABLE
... DISABLE TRIGGER``; SQLite: drop and re-create them), change the tables,
switch them back on. ``verify_audit`` must then say what changed, and where.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from store.envs import StoreEnv, rows
from toolguard.errors import AuditAppendOnly, ConfigurationError, StoreError
from toolguard.store import AuditEntry, GuardedStore, IntentRecord, migrations, read_export
from toolguard.store.chain import CANONICAL_FIELDS, pg_canonical, sqlite_canonical


@pytest.fixture(autouse=True)
def _seal_by_hand(request: pytest.FixtureRequest) -> None:
    """These tests seal by hand: a store's automatic sealing would race them."""
    if "env" in request.fixturenames:
        request.getfixturevalue("env").options["autoseal"] = None


#: The append-only triggers, per dialect and table.
PG_GUARDS = {"toolguard_audit": "toolguard_audit_append_only",
             "toolguard_audit_seal": "toolguard_audit_seal_append_only",
             "toolguard_audit_retention": "toolguard_audit_retention_append_only"}
SQLITE_GUARDS = ("toolguard_audit_no_update", "toolguard_audit_no_delete",
                 "toolguard_audit_seal_no_update", "toolguard_audit_seal_no_delete")


def tamper(store: GuardedStore, *statements: str, params: tuple[Any, ...] = ()) -> None:
    """Run ``statements`` as the tables' owner would: append-only triggers off, then on again."""
    with store.connection() as conn:
        if store.dialect == "postgresql":
            with conn.transaction():
                for table, trigger in PG_GUARDS.items():
                    conn.execute(f"ALTER TABLE {table} DISABLE TRIGGER {trigger}")
                for statement in statements:
                    conn.execute(statement, params if "%s" in statement else None)
                for table, trigger in PG_GUARDS.items():
                    conn.execute(f"ALTER TABLE {table} ENABLE TRIGGER {trigger}")
            return
        saved = [conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (name,)).fetchone()[0]
                 for name in SQLITE_GUARDS]
        conn.execute("BEGIN IMMEDIATE")
        for name in SQLITE_GUARDS:
            conn.execute(f"DROP TRIGGER {name}")
        for statement in statements:
            conn.execute(statement.replace("%s", "?"), params if "%s" in statement else ())
        for text in saved:
            conn.execute(text)
        conn.execute("COMMIT")


def write_log(store: GuardedStore, count: int = 6, *, start: int = 0) -> list[int]:
    """``count`` rows of every kind the store writes: fenced accepts, refusals, failures."""
    ids = []
    for i in range(start, start + count):
        kind = i % 3
        if kind == 0:
            intent = IntentRecord(tool="deposit", idempotency_key=f"k-{i}", args_hash="h",
                                  agent="payments", keys=(f"acct:{i}",), intent_id=f"call-{i}",
                                  args={"amount": i, "note": "caf\u00e9 \u2603", "n": 0.1 + 0.2},
                                  node_attempt=1, policy_version="sha256:feed")
            with store.fenced({f"acct:{i}": i + 1}, intent) as tx:
                tx.record({"ok": i})
        elif kind == 1:
            store.audit(AuditEntry(decision="rejected", reason="not_authorized", tool="refund",
                                   agent="intruder", args={"big": 2**70, "nested": [{"z": None}]},
                                   detail="agent intruder may not call refund",
                                   duration_ms=0.30000000000000004, policy_version="v1"))
        else:
            with contextlib.suppress(RuntimeError), store.fenced(
                    {f"acct:{i}": i + 1}, IntentRecord(tool="deposit", agent="payments")):
                raise RuntimeError("the tool failed")
        ids.append(store.query_audit(limit=1)[0].id or 0)
    return ids


def problems(store: GuardedStore, **options: Any) -> list[tuple[str, int | None, int | None]]:
    report = store.verify_audit(**options)
    return [(p.kind, p.row_id, p.seal) for p in report.problems]


# --- an untouched log ------------------------------------------------------------------------------


def test_an_untouched_log_verifies(store: GuardedStore) -> None:
    write_log(store, 9)
    report = store.verify_audit()
    assert report.ok and report.rows == 9 and report.unsealed == 9 and report.seals == 0
    sealed = store.seal_audit()
    assert (sealed.seals, sealed.rows, sealed.deferred) == (1, 9, None)
    write_log(store, 3, start=9)
    report = store.verify_audit()
    assert report.ok, report.problems
    assert (report.rows, report.sealed_rows, report.unsealed, report.unhashed) == (12, 9, 3, 0)
    assert report.head == sealed.head and report.head.last_id == 9
    assert store.seal_audit().head.seq == 2
    report = store.verify_audit(anchor=sealed.head.hash)
    assert report.ok and report.sealed_rows == 12 and report.head.seq == 2
    assert store.seal_audit().rows == 0  # nothing new: no empty seal


def test_every_row_carries_a_hash_and_the_policy_version(store: GuardedStore) -> None:
    write_log(store, 3)
    found = rows(store, "SELECT id, policy_version, row_hash FROM toolguard_audit ORDER BY id")
    assert [r[1] for r in found] == ["sha256:feed", "v1", None]
    assert all(r[2] is not None and len(bytes(r[2])) == 32 for r in found)
    entries = store.query_audit(newest_first=False)
    assert [e.policy_version for e in entries] == ["sha256:feed", "v1", None]
    assert store.audit(AuditEntry(decision="accepted", reason="applied")).policy_version is None


@pytest.mark.parametrize("bad", ["", 7, "x" * 201])
def test_a_policy_version_is_a_short_string(bad: Any) -> None:
    with pytest.raises(StoreError, match="policy_version"):
        AuditEntry(decision="accepted", reason="applied", policy_version=bad)
    with pytest.raises(StoreError, match="policy_version"):
        IntentRecord(tool="t", policy_version=bad)


def test_the_row_hash_covers_the_policy_version(store: GuardedStore) -> None:
    write_log(store, 2)
    store.seal_audit()
    tamper(store, "UPDATE toolguard_audit SET policy_version = 'sha256:other' WHERE id = 1")
    assert problems(store) == [("row_changed", 1, 1)]


def test_the_sql_trigger_and_the_verifier_hash_the_same_text(store: GuardedStore) -> None:
    """Values whose text could vary (floats, big numbers, NUL, non-ASCII, nesting) verify."""
    odd = {"f": [0.1 + 0.2, 1e16, -0.0, 1.5e-300], "i": 2**63, "s": "\x00\u2603\U0001F600 \"\\",
           "k": {"b": 1, "a": 2}}
    store.audit(AuditEntry(decision="failed", reason="error", tool="t\u00e9", args=odd,
                           keys=("a:1", 'b:"2"'), tokens={"a:1": 3}, detail="x\x00y",
                           duration_ms=1 / 3, node_attempt=2))
    store.audit(AuditEntry(decision="failed", reason="error", duration_ms=5))
    store.seal_audit()
    assert store.verify_audit().ok


def test_the_shipped_sql_has_the_verifiers_canonical_form() -> None:
    """The verifier recomputes hashes with its own copy of the expression; the trigger's
    copy in the SQL file must be the same text."""
    (shipped,) = [m for m in migrations("postgresql") if m.name == "005_tamper_evident_audit"]
    text = " ".join(shipped.sql.split())
    for alias in ("NEW", "a"):
        assert " ".join(pg_canonical(alias).split()) in text.replace("( ", "(").replace(" )", ")")


def test_the_canonical_sqlite_form_is_documented_json() -> None:
    values = [7, "2025-01-01T00:00:00.000Z", "agent", None, None, None, None, "accepted",
              "applied", '["k:1"]', '{"k:1":3}', None, None, 1.25, 1, "v1"]
    assert len(values) == len(CANONICAL_FIELDS)
    assert json.loads(sqlite_canonical(*values)) == ["toolguard.audit.1", *values]
    assert sqlite_canonical(*values[:-3], 1.0, 1, "v1") != sqlite_canonical(*values[:-3], 1, 1,
                                                                            "v1")


# --- tampering -------------------------------------------------------------------------------------


def test_a_changed_row_is_pinpointed(store: GuardedStore) -> None:
    write_log(store, 6)
    store.seal_audit()
    tamper(store, "UPDATE toolguard_audit SET detail = 'nothing to see' WHERE id = 2")
    report = store.verify_audit()
    assert not report.ok
    assert [(p.kind, p.row_id, p.seal) for p in report.problems] == [("row_changed", 2, 1)]
    assert "row #2 in seal #1 (ids 1..6) was changed after it was sealed" in str(
        report.problems[0])


def test_a_changed_row_with_its_hash_recomputed_is_still_caught_by_the_seal(
        store: GuardedStore) -> None:
    write_log(store, 4)
    store.seal_audit()
    recompute = ("UPDATE toolguard_audit AS a SET row_hash = sha256(convert_to("
                 "toolguard_audit_canonical(a), 'UTF8')) WHERE id = 3"
                 if store.dialect == "postgresql" else
                 f"UPDATE toolguard_audit SET row_hash = toolguard_audit_row_hash("
                 f"{', '.join(CANONICAL_FIELDS)}) WHERE id = 3")
    tamper(store, "UPDATE toolguard_audit SET reason = 'applied', decision = 'accepted' "
                  "WHERE id = 3", recompute)
    report = store.verify_audit()
    assert [(p.kind, p.row_id) for p in report.problems] == [("row_changed", 3)]
    assert "its row hash was rewritten to match the new content" in report.problems[0].message


def test_a_changed_row_hash_alone_is_reported(store: GuardedStore) -> None:
    write_log(store, 3)
    store.seal_audit()
    tamper(store, "UPDATE toolguard_audit SET row_hash = %s WHERE id = 1", params=(b"\0" * 32,))
    assert problems(store) == [("row_hash_changed", 1, 1)]


def test_deleted_rows_are_pinpointed(store: GuardedStore) -> None:
    write_log(store, 8)
    store.seal_audit(max_rows=4)
    tamper(store, "DELETE FROM toolguard_audit WHERE id IN (2, 3, 7)")
    report = store.verify_audit()
    assert [(p.kind, p.row_id, p.seal) for p in report.problems] == [
        ("row_deleted", 2, 1), ("row_deleted", 7, 2)]
    assert "rows #2..#3 (2) of seal #1 (ids 1..4) deleted" in report.problems[0].message


def test_a_row_inserted_into_a_sealed_range_is_pinpointed(store: GuardedStore) -> None:
    write_log(store, 4)
    tamper(store, "DELETE FROM toolguard_audit WHERE id = 2")  # a gap, as a rollback leaves
    store.seal_audit()
    skipped = [] if store.dialect == "postgresql" else [("row_deleted", 2, 1)]
    assert [(p.kind, p.row_id, p.seal) for p in store.verify_audit().problems] == skipped
    columns = "id, at, decision, reason, tool"
    at = "now()" if store.dialect == "postgresql" else "'2030-01-01T00:00:00.000Z'"
    rows(store, f"INSERT INTO toolguard_audit ({columns}) VALUES (2, {at}, 'accepted', "
                f"'applied', 'forged')")  # inserts are allowed: no trigger to switch off
    report = store.verify_audit()
    if store.dialect == "postgresql":
        assert [(p.kind, p.row_id, p.seal) for p in report.problems] == [("row_inserted", 2, 1)]
    else:  # the row the seal skipped is back, but not the one the seal would have listed
        assert [(p.kind, p.row_id, p.seal) for p in report.problems] == [
            ("row_inserted", 2, 1), ("row_deleted", 2, 1)]
    assert "row #2 inserted into seal #1 (ids 1..4): not in the seal" in report.problems[0].message


def test_a_changed_seal_is_reported(store: GuardedStore) -> None:
    write_log(store, 6)
    store.seal_audit(max_rows=2)
    tamper(store, "UPDATE toolguard_audit_seal SET last_id = last_id WHERE seq = 2",
           "UPDATE toolguard_audit_seal SET sealed_at = %s WHERE seq = 2",
           params=(datetime(2020, 1, 1, tzinfo=UTC) if store.dialect == "postgresql"
                   else "2020-01-01T00:00:00.000000Z",))
    assert problems(store) == [("seal_changed", None, 2)]


def test_a_deleted_seal_is_reported(store: GuardedStore) -> None:
    write_log(store, 6)
    store.seal_audit(max_rows=2)
    tamper(store, "DELETE FROM toolguard_audit_seal WHERE seq = 2")
    report = store.verify_audit()
    assert [(p.kind, p.row_id, p.seal) for p in report.problems] == [
        ("range_unsealed", 3, None), ("seal_missing", None, 3)]
    assert "rows #3..#4 (2) in ids 3..4, which no seal covers" in str(report.problems[0])
    assert "seal #2 missing: the chain goes from seal #1 to seal #3" in str(report.problems[1])


def test_deleting_the_last_seal_needs_the_anchor_to_show(store: GuardedStore) -> None:
    """What the database alone cannot tell: the newest seal and its rows' sealing undone."""
    write_log(store, 4)
    store.seal_audit(max_rows=2)
    anchor = store.seal_audit().head.hash
    head = store.verify_audit().head
    assert head.seq == 2 and head.hash == anchor
    tamper(store, "DELETE FROM toolguard_audit_seal WHERE seq = 2")
    assert store.verify_audit().ok  # rows 3..4 now look unsealed: consistent
    assert problems(store, anchor=anchor) == [("anchor_missing", None, None)]


def test_a_rewritten_chain_is_caught_only_by_the_anchor(store: GuardedStore) -> None:
    """The owner changes a row, recomputes its hash, drops every seal and seals again."""
    write_log(store, 5)
    anchor = store.seal_audit().head.hash
    recompute = ("UPDATE toolguard_audit AS a SET row_hash = sha256(convert_to("
                 "toolguard_audit_canonical(a), 'UTF8'))"
                 if store.dialect == "postgresql" else
                 f"UPDATE toolguard_audit SET row_hash = toolguard_audit_row_hash("
                 f"{', '.join(CANONICAL_FIELDS)})")
    tamper(store, "UPDATE toolguard_audit SET decision = 'accepted' WHERE id = 2", recompute,
           "DELETE FROM toolguard_audit_seal")
    store.seal_audit()
    assert store.verify_audit().ok
    report = store.verify_audit(anchor=anchor)
    assert [p.kind for p in report.problems] == ["anchor_missing"]
    assert "the chain was rewritten" in report.problems[0].message


def test_a_changed_unsealed_row_is_reported(store: GuardedStore) -> None:
    write_log(store, 3)
    tamper(store, "UPDATE toolguard_audit SET agent = 'someone else' WHERE id = 3")
    assert problems(store) == [("row_unsealed_changed", 3, None)]


def test_a_disabled_or_missing_trigger_is_reported(store: GuardedStore) -> None:
    write_log(store, 1)
    with store.connection() as conn:
        if store.dialect == "postgresql":
            conn.execute("ALTER TABLE toolguard_audit DISABLE TRIGGER toolguard_audit_row_hash")
        else:
            conn.execute("DROP TRIGGER toolguard_audit_seal_no_delete")
    report = store.verify_audit()
    assert [p.kind for p in report.problems] == ["trigger_disabled"]
    expected = ("toolguard_audit_row_hash" if store.dialect == "postgresql"
                else "toolguard_audit_seal_no_delete")
    assert expected in report.problems[0].message


def test_seals_and_retention_are_append_only(store: GuardedStore) -> None:
    write_log(store, 2)
    store.seal_audit()
    for statement in ("UPDATE toolguard_audit_seal SET row_count = 1",
                      "DELETE FROM toolguard_audit_seal"):
        with pytest.raises(AuditAppendOnly, match="append-only"):
            rows(store, statement)


def test_an_anchor_must_look_like_a_seal_hash(store: GuardedStore) -> None:
    for bad in ("abc", "0" * 64, "g" * 64):
        with pytest.raises(ConfigurationError, match="anchor"):
            store.verify_audit(anchor=bad)
    head = (write_log(store, 1), store.seal_audit().head)[1]
    assert store.verify_audit(anchor=head.hash.upper()).ok


# --- rows written before the row hash existed --------------------------------------------------------


def test_rows_from_before_the_upgrade_are_sealed_by_content(env: StoreEnv) -> None:
    store = env.open()
    try:
        # the migrations before the tamper-evident log (later ones build on it)
        store.install(list(itertools.takewhile(lambda m: "tamper_evident" not in m.name,
                                               migrations(env.kind))))
        rows(store, "INSERT INTO toolguard_audit (decision, reason, tool) "
                    "VALUES ('accepted', 'applied', 'old')")
        store.install()
        write_log(store, 2)
        report = store.verify_audit()
        assert report.ok and report.unhashed == 1
        store.seal_audit()
        assert store.verify_audit().ok
        tamper(store, "UPDATE toolguard_audit SET tool = 'rewritten' WHERE id = 1")
        assert problems(store) == [("row_changed", 1, 1)]
    finally:
        store.close()


# --- export, drop, retention ----------------------------------------------------------------------


def test_export_and_drop_keep_the_rest_verifiable(store: GuardedStore, tmp_path: Path) -> None:
    write_log(store, 6)
    store.seal_audit(max_rows=2)
    write_log(store, 2, start=6)  # not sealed yet: never exported
    anchor = store.verify_audit().head.hash
    path = tmp_path / "audit-2025.jsonl"
    result = store.export_audit(path, before=datetime.now(UTC) + timedelta(minutes=1), drop=True)
    assert (result.seals, result.rows, result.dropped) == (3, 6, True)
    assert (result.start.seq, result.final.seq, result.final.last_id) == (0, 3, 6)
    check = read_export(path)
    assert check.ok and check.rows == 6 and check.final == result.final
    assert check.file_sha256 == result.file_sha256
    assert [r[0] for r in rows(store, "SELECT id FROM toolguard_audit ORDER BY id")] == [7, 8]
    with pytest.raises(AuditAppendOnly, match="append-only"):
        rows(store, "DELETE FROM toolguard_audit_retention")
    report = store.verify_audit(exports=[path], anchor=anchor)
    assert report.ok, report.problems
    assert report.start.seq == 3 and report.unsealed == 2 and report.retention is not None
    store.seal_audit()
    write_log(store, 1, start=8)
    report = store.verify_audit()
    assert report.ok and report.head.seq == 4 and report.sealed_rows == 2
    assert "were exported and dropped" in " ".join(report.notes)
    # a second export continues the first
    second = tmp_path / "audit-2026.jsonl"
    store.export_audit(second, through_seq=4, drop=True)
    report = store.verify_audit(exports=[second, path])
    assert report.ok and report.start.seq == 4 and len(report.exports) == 2


def test_an_export_without_drop_changes_nothing(store: GuardedStore, tmp_path: Path) -> None:
    write_log(store, 3)
    store.seal_audit()
    result = store.export_audit(tmp_path / "a.jsonl", through_seq=1)
    assert not result.dropped and store.verify_audit().rows == 3
    with pytest.raises(StoreError, match="never overwrites"):
        store.export_audit(tmp_path / "a.jsonl", through_seq=1)
    with pytest.raises(StoreError, match="nothing to export"):
        store.export_audit(tmp_path / "b.jsonl", before=datetime(2000, 1, 1, tzinfo=UTC))
    with pytest.raises(StoreError, match="no seal #9"):
        store.export_audit(tmp_path / "c.jsonl", through_seq=9)
    assert not (tmp_path / "b.jsonl").exists() and not (tmp_path / "c.jsonl").exists()


def test_a_tampered_range_is_not_exported(store: GuardedStore, tmp_path: Path) -> None:
    write_log(store, 3)
    store.seal_audit()
    tamper(store, "UPDATE toolguard_audit SET detail = 'x' WHERE id = 1")
    out = tmp_path / "exports"
    with pytest.raises(StoreError, match=r"does not verify, nothing exported: row #1"):
        store.export_audit(out / "a.jsonl", through_seq=1, drop=True)
    assert list(out.iterdir()) == []  # not even the temporary file
    assert store.verify_audit().rows == 3


def test_a_tampered_export_file_is_reported(store: GuardedStore, tmp_path: Path) -> None:
    write_log(store, 4)
    store.seal_audit(max_rows=2)
    path = tmp_path / "a.jsonl"
    store.export_audit(path, through_seq=2, drop=True)
    lines = path.read_text(encoding="utf-8").splitlines()
    row = next(i for i, line in enumerate(lines) if '"row"' in line and '"id":2' in line)
    changed = tmp_path / "changed.jsonl"
    changed.write_text("\n".join([*lines[:row], lines[row].replace("payments", "nobody")
                                  if "payments" in lines[row] else
                                  lines[row].replace("intruder", "nobody"), *lines[row + 1:]])
                       + "\n", encoding="utf-8")
    check = read_export(changed)
    assert not check.ok and "row #2" in check.problems[0].message
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:row] + lines[row + 1:]) + "\n", encoding="utf-8")
    assert not read_export(cut).ok
    report = store.verify_audit(exports=[changed])
    assert not report.ok and {p.kind for p in report.problems} >= {"export_invalid"}


def test_an_export_file_for_another_range_does_not_link(store: GuardedStore,
                                                        tmp_path: Path) -> None:
    write_log(store, 4)
    store.seal_audit(max_rows=2)
    first = tmp_path / "first.jsonl"
    store.export_audit(first, through_seq=1)  # not dropped: only seal 1
    store.export_audit(tmp_path / "both.jsonl", through_seq=2, drop=True)
    report = store.verify_audit(exports=[first])
    assert [p.kind for p in report.problems] == ["export_mismatch"]


def test_rows_inserted_into_a_dropped_range_are_reported(store: GuardedStore,
                                                         tmp_path: Path) -> None:
    write_log(store, 3)
    store.seal_audit()
    store.export_audit(tmp_path / "a.jsonl", through_seq=1, drop=True)
    at = "now()" if store.dialect == "postgresql" else "'2030-01-01T00:00:00.000Z'"
    rows(store, f"INSERT INTO toolguard_audit (id, at, decision, reason) "
                f"VALUES (2, {at}, 'accepted', 'applied')")
    assert problems(store) == [("exported_row_present", 2, None)]


def test_rows_and_seals_deleted_without_an_export_record_are_reported(
        store: GuardedStore) -> None:
    write_log(store, 4)
    store.seal_audit(max_rows=2)
    tamper(store, "DELETE FROM toolguard_audit WHERE id <= 2",
           "DELETE FROM toolguard_audit_seal WHERE seq = 1")
    assert [k for k, _, _ in problems(store)] == ["seal_missing"]


# --- async ----------------------------------------------------------------------------------------


def test_the_async_store_writes_hashed_rows_and_seals_and_verifies(env: StoreEnv,
                                                                   store: GuardedStore) -> None:
    async def main() -> tuple[Any, Any, Any]:
        astore = env.open_async()
        try:
            intent = IntentRecord(tool="deposit", idempotency_key="a-1", args_hash="h",
                                  policy_version="sha256:async")
            async with astore.fenced({"acct:a": 1}, intent) as tx:
                tx.record(1)
            await astore.audit(AuditEntry(decision="rejected", reason="not_authorized",
                                          policy_version="sha256:async"))
            sealed = await astore.seal_audit()
            report = await astore.verify_audit(anchor=sealed.head.hash)
            entries = await astore.query_audit(newest_first=False)
            return sealed, report, entries
        finally:
            await astore.close()

    sealed, report, entries = asyncio.run(main())
    assert sealed.rows == 2 and report.ok and report.sealed_rows == 2
    assert [e.policy_version for e in entries] == ["sha256:async"] * 2
    tamper(store, "UPDATE toolguard_audit SET reason = 'applied' WHERE id = 2")
    assert problems(store) == [("row_changed", 2, 1)]


def test_the_async_store_exports_and_drops(env: StoreEnv, store: GuardedStore,
                                           tmp_path: Path) -> None:
    write_log(store, 4)

    async def main() -> tuple[Any, Any]:
        astore = env.open_async()
        try:
            await astore.seal_audit(max_rows=2)
            result = await astore.export_audit(tmp_path / "a.jsonl", through_seq=1, drop=True)
            return result, await astore.verify_audit(exports=[tmp_path / "a.jsonl"])
        finally:
            await astore.close()

    result, report = asyncio.run(main())
    assert result.dropped and result.rows == 2 and report.ok and report.start.seq == 1
    assert [r[0] for r in rows(store, "SELECT id FROM toolguard_audit ORDER BY id")] == [3, 4]


# --- sealing under concurrency ---------------------------------------------------------------------


def test_two_sealers_at_once_make_one_chain(env: StoreEnv, store: GuardedStore) -> None:
    write_log(store, 20)
    import threading

    others = [env.open() for _ in range(3)]
    barrier = threading.Barrier(len(others))
    results: list[Any] = []

    def seal(each: GuardedStore) -> None:
        barrier.wait()
        try:
            results.append(each.seal_audit(max_rows=3))
        except Exception as error:  # collected, asserted below
            results.append(error)

    threads = [threading.Thread(target=seal, args=(s,)) for s in others]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for each in others:
        each.close()
    assert all(not isinstance(r, Exception) for r in results), results
    assert sum(r.rows for r in results) == 20
    report = store.verify_audit()
    assert report.ok and report.sealed_rows == 20 and report.seals == 7


@contextlib.contextmanager
def _uncommitted_row(env: StoreEnv) -> Iterator[tuple[Any, int]]:
    """A PostgreSQL transaction that has inserted an audit row and not committed yet."""
    import psycopg
    from psycopg import sql

    conn = psycopg.connect(env.url)
    conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(env.schema)))
    (held,) = conn.execute("INSERT INTO toolguard_audit (decision, reason, tool) VALUES "
                           "('accepted', 'applied', 'late') RETURNING id").fetchone()
    try:
        yield conn, held
    finally:
        conn.close()


@pytest.mark.parametrize("env", ["postgresql"], indirect=True)  # SQLite serializes writers
def test_a_row_that_commits_late_is_never_left_out_of_a_seal(env: StoreEnv,
                                                              store: GuardedStore) -> None:
    """Ids are taken at insert, rows commit later: a seal must not cover a range an open
    transaction can still commit into (PostgreSQL; SQLite serializes its writers)."""
    write_log(store, 2)
    with _uncommitted_row(env) as (conn, held):
        write_log(store, 2, start=2)  # committed, with ids above the held one
        result = store.seal_audit(wait_s=0.2)
        assert result.rows == 0 and result.deferred is not None
        assert re.search(r"pid \d+", result.deferred) and "still open" in result.deferred
        conn.commit()
    result = store.seal_audit(wait_s=0.2)
    assert result.rows == 5 and result.deferred is None
    report = store.verify_audit()
    assert report.ok and report.sealed_rows == 5 and held == 3


@pytest.mark.parametrize("env", ["postgresql"], indirect=True)  # SQLite serializes writers
def test_the_naive_rule_would_seal_past_a_late_commit(env: StoreEnv, store: GuardedStore,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the wait matters: sealing up to the highest visible id leaves the late row out,
    and verify then reports it as inserted into the sealed range (the safety net)."""
    from toolguard.store.sealing import PgChainIO

    def naive(self: PgChainIO, head: Any, wait_s: float) -> tuple[int, None]:
        (highest,) = self.conn.execute("SELECT max(id) FROM toolguard_audit").fetchone()
        return int(highest), None

    monkeypatch.setattr(PgChainIO, "sealable", naive)
    with _uncommitted_row(env) as (conn, held):
        write_log(store, 1)
        assert store.seal_audit().rows == 1
        conn.commit()
    assert problems(store) == [("row_inserted", held, 1)]


def test_concurrent_writers_and_a_sealer_leave_a_log_that_verifies(env: StoreEnv,
                                                                    store: GuardedStore) -> None:
    """Writers (some slow to commit, some rolling back) while a sealer runs in a loop: at the
    end every committed row is sealed exactly once and nothing is reported."""
    import threading
    import time

    stop = threading.Event()
    errors: list[BaseException] = []
    written: list[int] = []
    lock = threading.Lock()

    def writer(index: int) -> None:
        each = env.open()
        try:
            for i in range(25):
                if env.kind == "postgresql" and i % 5 == 0:
                    with each.connection() as conn, contextlib.suppress(RuntimeError), \
                            conn.transaction():
                        conn.execute("INSERT INTO toolguard_audit (decision, reason) "
                                     "VALUES ('accepted', 'applied')")
                        time.sleep(0.01)  # committed late, or not at all
                        if i % 10 == 0:
                            raise RuntimeError("rolled back")
                        with lock:
                            written.append(1)
                    continue
                each.audit(AuditEntry(decision="rejected", reason="not_authorized",
                                      agent=f"w{index}", tool=f"t{i}"))
                with lock:
                    written.append(1)
        except BaseException as error:
            errors.append(error)
        finally:
            each.close()

    def sealer() -> None:
        each = env.open()
        try:
            while not stop.is_set():
                each.seal_audit(max_rows=7, wait_s=1.0)
        except BaseException as error:
            errors.append(error)
        finally:
            each.close()

    writers = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    sealing = threading.Thread(target=sealer)
    sealing.start()
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join(60)
    stop.set()
    sealing.join(60)
    assert not errors, errors
    store.seal_audit()
    report = store.verify_audit()
    assert report.ok, report.problems
    assert report.rows == report.sealed_rows == len(written)


def test_sqlite_row_hash_needs_the_stores_function(tmp_path: Path) -> None:
    """A plain sqlite3 connection cannot forge a hashed row by the store's INSERT."""
    from toolguard.store import open_store
    from toolguard.store.sqlite import AUDIT_INSERT

    store = open_store(f"sqlite:///{tmp_path}/s.db", install=True)
    store.close()
    raw = sqlite3.connect(tmp_path / "s.db")
    with pytest.raises(sqlite3.OperationalError, match="toolguard_audit_row_hash"):
        raw.execute(AUDIT_INSERT, AuditEntry(decision="a", reason="b").insert_values("sqlite"))
    raw.close()


def test_the_schema_files_are_listed() -> None:
    names = [p.name for p in resources.files("toolguard").joinpath("sql").iterdir()]
    assert "005_tamper_evident_audit.sql" in names
    sqlite_names = [p.name for p in resources.files("toolguard").joinpath("sql", "sqlite")
                    .iterdir()]
    assert "003_tamper_evident_audit.sql" in sqlite_names
