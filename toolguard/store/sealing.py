"""Sealing, verifying and exporting the audit log: the I/O around ``toolguard.store.chain``.

One flow for both stores; each store gives a ``ChainIO`` (its queries) and the
transaction each step needs. These are batch jobs, not the hot path: the async
stores run them in a worker thread on a connection of their own.

When a range may be sealed (PostgreSQL)
---------------------------------------
Ids are taken from the sequence when a row is inserted, but rows commit in
another order: a seal must never cover an id that can still commit later. The
sealer, in one READ COMMITTED transaction:

1. reads ``C``, the highest id it can see above the chain's head (snapshot S);
2. then lists the other transactions that hold a write lock on
   ``toolguard_audit`` (``pg_locks``), and waits until each of them has ended;
3. then, in a new snapshot, seals the rows with ids up to ``C``.

Why nothing with an id <= C can commit afterwards: C's row committed before S,
so every id below C was taken earlier still (the sequence hands out ids in
increasing order; keep its ``CACHE`` at 1, the default), by a transaction that
was already holding its write lock on the table (an ``INSERT`` locks the table
before it evaluates ``nextval``). If that transaction had committed before S,
its row is in S; if it was still open at step 2, it is in the list and the
sealer waited for it; if it committed between S and step 2, the new snapshot of
step 3 sees it. A transaction that is still open when the wait times out
(``wait_s``) leaves the range unsealed for the next run: nothing is sealed past
the head then, and ``SealResult.deferred`` says which process holds it. The
safety net: ``verify`` reports any row that appears inside a sealed range.

On SQLite, writers are serialized by the database's write lock: the sealer
holds it (``BEGIN IMMEDIATE``) and seals every committed row.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from toolguard.errors import ConfigurationError, StoreError
from toolguard.store.autoseal import DEFAULT_AUTOSEAL
from toolguard.store.chain import (
    GENESIS,
    AuditVerification,
    ChainHead,
    ExportResult,
    ExportRow,
    Problem,
    Retention,
    RowCheck,
    Seal,
    SealResult,
    Verifier,
    build_seal,
    pg_canonical,
    pg_row_hash,
    read_export,
    sealed_at_text,
    sqlite_canonical,
    sqlite_row_hash,
    unpack_rows,
    write_export,
)

__all__ = ["MAX_SEAL_ROWS", "ChainIO", "PgChainIO", "SqliteChainIO", "check_anchors", "export_log",
           "pg_export", "pg_seal", "pg_verify", "seal_log", "sqlite_export", "sqlite_seal",
           "sqlite_verify", "verify_log"]

#: Rows per seal (a seal stores 40 bytes per row) and per page read by the verifier.
MAX_SEAL_ROWS = 10_000
PAGE = 5_000
SEAL_PAGE = 16


class ChainIO(Protocol):
    """One store's queries for the chain, on one connection, inside the caller's transaction."""

    dialect: str

    def retention(self) -> Retention | None: ...

    def head(self, start: ChainHead) -> ChainHead: ...

    def seals(self, after_seq: int, limit: int) -> list[Seal]: ...

    def seal_ends(self, after_seq: int) -> list[tuple[int, int]]: ...

    def rows(self, after_id: int, upto_id: int | None, limit: int) -> list[RowCheck]: ...

    def seal_entries(self, after_id: int, upto_id: int, limit: int) -> list[tuple[int, bytes]]: ...

    def export_rows(self, after_id: int, upto_id: int) -> list[ExportRow]: ...

    def insert_seal(self, seal: Seal) -> None: ...

    def first_id_since(self, after_id: int, moment: datetime) -> int | None: ...

    def trigger_problems(self) -> list[Problem]: ...

    def id_ceiling(self) -> int | None: ...

    def oldest_since(self, after_id: int) -> datetime | None: ...


_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def check_anchors(anchor: str | Sequence[str] | None) -> list[str]:
    """``anchor`` as a list of seal hashes (64 hex digits each); a bad one is a usage error."""
    values = [] if anchor is None else [anchor] if isinstance(anchor, str) else list(anchor)
    out = []
    for value in values:
        text = value.strip().lower() if isinstance(value, str) else value
        if not isinstance(text, str) or not _HEX64.match(text) or text == GENESIS:
            msg = (f"an anchor is a seal hash (64 hex digits, as `toolguard audit verify` or "
                   f"`seal` prints it), got {value!r}")
            raise ConfigurationError(msg)
        out.append(text)
    return out


def start_of(retention: Retention | None) -> ChainHead:
    """Where the stored chain begins: after the last dropped range, else at the genesis."""
    return retention.head if retention is not None else ChainHead(0, 0, GENESIS)


def _all_rows(io: ChainIO, after_id: int, upto_id: int | None) -> Iterator[RowCheck]:
    while True:
        page = io.rows(after_id, upto_id, PAGE)
        yield from page
        if len(page) < PAGE:
            return
        after_id = page[-1].id


def _all_seals(io: ChainIO, after_seq: int, through_seq: int | None = None) -> Iterator[Seal]:
    """Seals after ``after_seq`` in ``seq`` order, a few at a time (each holds 40 bytes a row)."""
    while True:
        page = io.seals(after_seq, SEAL_PAGE)
        for seal in page:
            if through_seq is not None and seal.seq > through_seq:
                return
            yield seal
        if len(page) < SEAL_PAGE:
            return
        after_seq = page[-1].seq


# --- seal ---------------------------------------------------------------------------------------


def seal_rows(io: ChainIO, head: ChainHead, upto_id: int, max_rows: int,
              now: datetime) -> list[Seal]:
    """Seals over the rows in ``(head.last_id, upto_id]``, ``max_rows`` at most each, inserted.

    A seal records each row's stored hash (the commitment made at insert; whether the
    content still matches it is for ``verify`` to say); a row without one (written before
    schema 5, or with the trigger off) gets the hash of its content now.
    """
    made: list[Seal] = []
    while head.last_id < upto_id:
        entries = io.seal_entries(head.last_id, upto_id, max_rows)
        if not entries:
            break
        seal = build_seal(head, entries, now)
        io.insert_seal(seal)
        made.append(seal)
        head = seal.head
    return made


def seal_log(io: ChainIO, upto: Callable[[ChainHead], tuple[int, str | None]], *,
             max_rows: int = MAX_SEAL_ROWS) -> SealResult:
    """Seal what ``upto(head)`` allows (the highest id that may be sealed, and why not more)."""
    if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:
        msg = f"max_rows must be a positive integer, got {max_rows!r}"
        raise ConfigurationError(msg)
    head = io.head(start_of(io.retention()))
    limit, deferred = upto(head)
    seals = seal_rows(io, head, limit, max_rows, datetime.now(UTC))
    rows = sum(s.row_count for s in seals)
    return SealResult(len(seals), rows, seals[-1].head if seals else head, deferred)


# --- verify ---------------------------------------------------------------------------------------


def verify_log(io: ChainIO, *, anchors: Sequence[str] = (),
               exports: Sequence[str | os.PathLike[str]] = ()) -> AuditVerification:
    """Check every row and seal in one snapshot (the caller's transaction); see ``Verifier``."""
    retention = io.retention()
    start = start_of(retention)
    verifier = Verifier(io.dialect, start, retention)
    verifier.report.problems.extend(io.trigger_problems())
    if retention is not None:
        verifier.report.problems.extend(retention_problems(io, retention))
    if start.last_id > 0:
        verifier.stray(_all_rows(io, 0, start.last_id), 0, start.last_id,
                       kind="exported_row_present")
    covered = start.last_id
    for seal in _all_seals(io, start.seq):
        if seal.after_id > covered:
            verifier.stray(_all_rows(io, covered, seal.after_id), covered, seal.after_id)
        low = max(seal.after_id, covered)
        verifier.seal(seal, _all_rows(io, low, seal.last_id) if seal.last_id > low else ())
        covered = max(covered, seal.last_id)
    verifier.unsealed(_all_rows(io, covered, None), covered, io.id_ceiling())
    checks = [read_export(path) for path in exports]
    if checks:
        verifier.check_exports(checks)
    for anchor in anchors:
        verifier.check_anchor(anchor, checks)
    report = verifier.finish()
    if retention is not None and not checks and any(
            a == retention.final_hash for a in report.anchors) and not report.problems:
        report.notes.append(
            f"the anchor names seal #{retention.through_seq}, the last seal of the dropped "
            f"range: the database only records its hash, the rows it pins are in the export "
            f"file; `--export FILE` checks them against the anchor")
    report.oldest_unsealed = io.oldest_since(covered) if report.unsealed else None
    report.notes.extend(unsealed_notes(report))
    if not anchors and report.head.seq > report.start.seq:
        report.notes.append(
            "without an anchor, the newest seal deleted with its rows (or the whole chain "
            "rewritten) leaves no trace: keep the latest seal hash outside the database and "
            "pass it as `--anchor HASH`")
    if retention is not None and not checks:
        report.notes.append(
            f"ids <= {retention.through_id} were exported and dropped (through seal "
            f"#{retention.through_seq}, final hash {retention.final_hash}); `--export FILE` "
            f"checks the file")
    return report


def unsealed_notes(report: AuditVerification) -> list[str]:
    """What the rows not sealed yet leave unseen, in words (``AuditVerification.notes``)."""
    if not report.unsealed:
        return []
    rows = (f"the {report.unsealed} rows not sealed yet (ids above {report.head.last_id}"
            + (f", the oldest written {sealed_at_text(report.oldest_unsealed)}"
               if report.oldest_unsealed else "") + ")")
    bound = (f"toolguard stores seal the rows they write {DEFAULT_AUTOSEAL.describe()} by "
             f"default (`AutoSeal`), so only the newest rows wait like this")
    if report.dialect == "sqlite":
        return [f"{rows} are covered by their own hash and by their ids (SQLite hands them out "
                f"without gaps): a deleted row is found, but a row changed together with its "
                f"row hash is not, now or later (a seal covers the rows as it finds them); "
                f"{bound}"]
    return [f"{rows} are covered only by their own hash: a deletion among them, or a row "
            f"changed together with its row hash, leaves no trace, now or later (a seal covers "
            f"the rows as it finds them); {bound}"]


def retention_problems(io: ChainIO, retention: Retention) -> list[Problem]:
    """What contradicts the latest retention record (a drop deletes every seal through it, and
    each of those seals covered at least one row): a forged record would otherwise skip seals
    that still vouch for rows."""
    found: list[Problem] = []
    through = retention.through_seq
    if retention.through_id < through:
        found.append(Problem(
            "retention_inconsistent", f"the retention record says seals #1..#{through} were "
            f"dropped with ids up to {retention.through_id} only: every seal covers at least one "
            f"row, so the record was forged (ids <= {retention.through_id} are not checked)",
            seal=through))
    left = [seal.seq for seal in _all_seals(io, 0, through)]
    for first, last, count in _runs(left):
        which = f"seal #{first}" if count == 1 else f"seals #{first}..#{last}"
        found.append(Problem(
            "retention_inconsistent", f"{which} still in the store, though the retention record "
            f"says every seal through #{through} was exported and dropped: the record was forged "
            f"(or a drop did not finish), and verify does not check what it claims was dropped",
            seal=first))
    return found


def _runs(values: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Consecutive runs of sorted ``values``: ``(first, last, count)``."""
    run: list[int] = []
    for value in values:
        if run and value != run[-1] + 1:
            yield run[0], run[-1], len(run)
            run = []
        run.append(value)
    if run:
        yield run[0], run[-1], len(run)


# --- export ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExportPlan:
    start: ChainHead
    through_seq: int


def plan_export(io: ChainIO, before: datetime | None, through_seq: int | None) -> ExportPlan:
    """The whole seals to export: after the last dropped range, every row older than ``before``
    (or through seal ``through_seq``). Fails if there is none."""
    start = start_of(io.retention())
    ends = io.seal_ends(start.seq)
    if through_seq is not None:
        chosen = [seq for seq, _ in ends if seq <= through_seq]
        if not chosen or chosen[-1] != through_seq:
            msg = f"no seal #{through_seq} after seal #{start.seq} to export through"
            raise StoreError(msg, reason="nothing_to_export")
    else:
        assert before is not None
        young = io.first_id_since(start.last_id, before)
        chosen = [seq for seq, last_id in ends if young is None or last_id < young]
    if not chosen:
        when = f"before {sealed_at_text(before)} " if before is not None else ""
        msg = (f"nothing to export: no whole sealed range {when}after id {start.last_id} "
               f"(`toolguard audit seal` seals the log first)")
        raise StoreError(msg, reason="nothing_to_export")
    return ExportPlan(start, chosen[-1])


def export_log(io: ChainIO, path: str | os.PathLike[str], *, before: datetime | None = None,
               through_seq: int | None = None) -> ExportResult:
    """Write the chosen seals and their rows to ``path`` (never overwritten), after checking
    that the range verifies; the file is written to a temporary name, synced, then moved."""
    if (before is None) == (through_seq is None):
        msg = "export needs before= (a time) or through_seq= (a seal number), one of them"
        raise StoreError(msg, reason="invalid_query")
    if before is not None and before.tzinfo is None:
        msg = "before must be a timezone-aware datetime"
        raise StoreError(msg, reason="invalid_query")
    target = Path(path)
    if target.exists():
        msg = f"{target} exists: an export never overwrites a file"
        raise StoreError(msg, reason="export_exists")
    plan = plan_export(io, before, through_seq)
    verifier = Verifier(io.dialect, plan.start, None)

    def checked() -> Iterator[tuple[Seal, list[ExportRow]]]:
        for seal in _all_seals(io, plan.start.seq, plan.through_seq):
            rows = io.export_rows(seal.after_id, seal.last_id)
            computed = [hashlib.sha256(r.canonical.encode("utf-8", "surrogatepass")).digest()
                        for r in rows]
            verifier.seal(seal, [RowCheck(r.id, r.row_hash, c) for r, c in zip(rows, computed,
                                                                                strict=True)])
            # In a range that verifies, each row's content hash is the one its seal holds.
            yield seal, [ExportRow(r.id, c, r.canonical) for r, c in zip(rows, computed,
                                                                          strict=True)]

    target.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(  # noqa: SIM115 (moved into place, or removed, below)
        "w", encoding="utf-8", dir=target.parent, prefix=f".{target.name}.", delete=False)
    try:
        with handle:
            final, seals, rows = write_export(handle, io.dialect, plan.start, checked(),
                                              datetime.now(UTC))
            handle.flush()
            os.fsync(handle.fileno())
        problems = verifier.finish().problems
        if problems:
            listed = "; ".join(p.message for p in problems[:5])
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            msg = (f"the range to export does not verify, nothing exported: {listed}{more}; "
                   f"run `toolguard audit verify`")
            raise StoreError(msg, reason="audit_tampered")
        check = read_export(handle.name)
        if not check.ok or check.final != final:
            msg = f"the export file did not verify once written: {check.problems[:3]}"
            raise StoreError(msg, reason="export_invalid")
        os.link(handle.name, target)  # fails if the target appeared meanwhile: never overwrite
    finally:
        with contextlib.suppress(OSError):
            os.unlink(handle.name)
    return ExportResult(str(target), seals, rows, plan.start, final, check.file_sha256, False)


# --- PostgreSQL ---------------------------------------------------------------------------------------

PG_SEAL_LOCK = "SELECT pg_advisory_xact_lock(hashtext('toolguard.audit.seal'))"
PG_READ_COMMITTED = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
PG_SNAPSHOT = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"
_PG_WRITE_LOCKS = ("'RowExclusiveLock', 'ShareRowExclusiveLock', 'ExclusiveLock', "
                   "'AccessExclusiveLock'")
#: Other transactions that may have inserted audit rows and not ended yet.
PG_WRITERS = (
    "SELECT DISTINCT virtualtransaction, pid FROM pg_catalog.pg_locks "
    "WHERE locktype = 'relation' AND granted "
    "AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()) "
    f"AND relation = 'toolguard_audit'::regclass AND mode IN ({_PG_WRITE_LOCKS}) "
    "AND pid IS DISTINCT FROM pg_backend_pid()")
PG_STILL_WRITING = (
    "SELECT DISTINCT virtualtransaction, pid FROM pg_catalog.pg_locks "
    "WHERE locktype = 'relation' AND granted "
    "AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()) "
    f"AND relation = 'toolguard_audit'::regclass AND mode IN ({_PG_WRITE_LOCKS}) "
    "AND virtualtransaction = ANY(%s::text[])")
PG_MAX_ID = "SELECT max(id) FROM toolguard_audit WHERE id > %s"
#: Rows in ``(after, upto]`` (``PG_ROWS_FROM``: above ``after``), with the hash of their content.
#: Two statements, so that both bounds are index bounds (``x IS NULL OR id <= x`` is not).
PG_ROWS = (f"SELECT id, row_hash, {pg_row_hash('a')} FROM toolguard_audit a "
           "WHERE id > %s AND id <= %s ORDER BY id LIMIT %s")
#: What a seal records per row: its stored hash, or (none stored) the hash of its content.
PG_SEAL_ENTRIES = (f"SELECT id, coalesce(row_hash, {pg_row_hash('a')}) FROM toolguard_audit a "
                   "WHERE id > %s AND id <= %s ORDER BY id LIMIT %s")
PG_ROWS_FROM = (f"SELECT id, row_hash, {pg_row_hash('a')} FROM toolguard_audit a "
                "WHERE id > %s ORDER BY id LIMIT %s")
PG_EXPORT_ROWS = (f"SELECT id, row_hash, {pg_canonical('a')} FROM toolguard_audit a "
                  "WHERE id > %s AND id <= %s ORDER BY id")
_SEAL_COLUMNS = "seq, after_id, last_id, row_count, rows, prev_hash, seal_hash, sealed_at"
PG_SEALS = (f"SELECT {_SEAL_COLUMNS} FROM toolguard_audit_seal WHERE seq > %s "
            "ORDER BY seq LIMIT %s")
PG_HEAD = "SELECT seq, last_id, seal_hash FROM toolguard_audit_seal ORDER BY seq DESC LIMIT 1"
#: Every seal's number and last id (not its row list), for choosing what to export.
SEAL_ENDS = "SELECT seq, last_id FROM toolguard_audit_seal WHERE seq > %s ORDER BY seq"
PG_INSERT_SEAL = (f"INSERT INTO toolguard_audit_seal ({_SEAL_COLUMNS}) "
                  "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)")
_RETENTION_COLUMNS = "through_seq, through_id, final_hash, rows, seals, file_sha256, dropped_at"
PG_RETENTION = (f"SELECT {_RETENTION_COLUMNS} FROM toolguard_audit_retention "
                "ORDER BY through_seq DESC LIMIT 1")
PG_FIRST_SINCE = "SELECT min(id) FROM toolguard_audit WHERE id > %s AND at >= %s"
PG_DROP = "SELECT toolguard_audit_drop_exported(%s, %s, %s, %s)"
#: The triggers the log's protection rests on, by table (``tgenabled`` 'D' is disabled).
PG_TRIGGERS = {
    "toolguard_audit": ("toolguard_audit_append_only", "toolguard_audit_row_hash"),
    "toolguard_audit_seal": ("toolguard_audit_seal_append_only",),
    "toolguard_audit_retention": ("toolguard_audit_retention_append_only",),
}
PG_TRIGGER_STATE = (
    "SELECT c.relname, t.tgname, t.tgenabled FROM pg_catalog.pg_trigger t "
    "JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid "
    "WHERE t.tgrelid IN ('toolguard_audit'::regclass, 'toolguard_audit_seal'::regclass, "
    "'toolguard_audit_retention'::regclass) AND NOT t.tgisinternal")


def _bytes(value: Any) -> bytes | None:
    return None if value is None else bytes(value)


class PgChainIO:
    """The chain's queries on one psycopg connection (sync)."""

    dialect = "postgresql"

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def retention(self) -> Retention | None:
        row = self.conn.execute(PG_RETENTION).fetchone()
        if row is None:
            return None
        return Retention(int(row[0]), int(row[1]), str(row[2]), int(row[3]), int(row[4]),
                         row[5], row[6])

    def head(self, start: ChainHead) -> ChainHead:
        row = self.conn.execute(PG_HEAD).fetchone()
        return start if row is None else ChainHead(int(row[0]), int(row[1]), str(row[2]))

    def seals(self, after_seq: int, limit: int) -> list[Seal]:
        return [Seal(int(r[0]), int(r[1]), int(r[2]), int(r[3]), bytes(r[4]), str(r[5]),
                     str(r[6]), r[7]) for r in self.conn.execute(PG_SEALS, (after_seq, limit))]

    def seal_ends(self, after_seq: int) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in self.conn.execute(SEAL_ENDS, (after_seq,))]

    def rows(self, after_id: int, upto_id: int | None, limit: int) -> list[RowCheck]:
        cursor = (self.conn.execute(PG_ROWS_FROM, (after_id, limit)) if upto_id is None else
                  self.conn.execute(PG_ROWS, (after_id, upto_id, limit)))
        return [RowCheck(int(r[0]), _bytes(r[1]), _bytes(r[2])) for r in cursor]

    def seal_entries(self, after_id: int, upto_id: int, limit: int) -> list[tuple[int, bytes]]:
        cursor = self.conn.execute(PG_SEAL_ENTRIES, (after_id, upto_id, limit))
        return [(int(r[0]), bytes(r[1])) for r in cursor]

    def export_rows(self, after_id: int, upto_id: int) -> list[ExportRow]:
        cursor = self.conn.execute(PG_EXPORT_ROWS, (after_id, upto_id))
        return [ExportRow(int(r[0]), _bytes(r[1]), str(r[2])) for r in cursor]

    def insert_seal(self, seal: Seal) -> None:
        self.conn.execute(PG_INSERT_SEAL, (seal.seq, seal.after_id, seal.last_id, seal.row_count,
                                           seal.rows, seal.prev_hash, seal.seal_hash,
                                           seal.sealed_at))

    def first_id_since(self, after_id: int, moment: datetime) -> int | None:
        row = self.conn.execute(PG_FIRST_SINCE, (after_id, moment)).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def id_ceiling(self) -> int | None:
        """None: PostgreSQL's sequence skips rolled-back ids, its last value proves nothing."""
        return None

    def oldest_since(self, after_id: int) -> datetime | None:
        row = self.conn.execute("SELECT min(at) FROM toolguard_audit WHERE id > %s",
                                (after_id,)).fetchone()
        return None if row is None else row[0]

    def trigger_problems(self) -> list[Problem]:
        state = {(t, n): e for t, n, e in self.conn.execute(PG_TRIGGER_STATE)}
        problems = []
        for table, names in PG_TRIGGERS.items():
            for name in names:
                enabled = state.get((table, name))
                if enabled is None or enabled == "D":
                    what = "missing" if enabled is None else "disabled"
                    problems.append(Problem("trigger_disabled", f"the trigger {name} on {table} "
                                            f"is {what}: the log is not protected while it is"))
        return problems

    # sealing

    def sealable(self, head: ChainHead, wait_s: float) -> tuple[int, str | None]:
        """The highest id that may be sealed now (see the module docstring), and why not more."""
        row = self.conn.execute(PG_MAX_ID, (head.last_id,)).fetchone()
        highest = None if row is None or row[0] is None else int(row[0])
        if highest is None:
            return head.last_id, None
        writers = self.conn.execute(PG_WRITERS).fetchall()
        deadline = time.monotonic() + max(wait_s, 0.0)
        pause = 0.002
        while writers:
            writers = self.conn.execute(PG_STILL_WRITING, ([v for v, _ in writers],)).fetchall()
            if not writers:
                break
            if time.monotonic() >= deadline:
                pids = ", ".join(str(p) if p is not None else "a prepared transaction"
                                 for _, p in writers)
                return head.last_id, (
                    f"rows after id {head.last_id} wait for transactions that write the audit "
                    f"log and are still open (pid {pids}); the next seal covers them")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return highest, None


@contextlib.contextmanager
def pg_transaction(conn: Any, isolation: str) -> Iterator[PgChainIO]:
    with conn.transaction():
        conn.execute(isolation)
        yield PgChainIO(conn)


def pg_seal(conn: Any, *, max_rows: int, wait_s: float) -> SealResult:
    with pg_transaction(conn, PG_READ_COMMITTED) as io:
        conn.execute(PG_SEAL_LOCK)
        return seal_log(io, lambda head: io.sealable(head, wait_s), max_rows=max_rows)


def pg_verify(conn: Any, *, anchors: Sequence[str], exports: Sequence[Any]) -> AuditVerification:
    with pg_transaction(conn, PG_SNAPSHOT) as io:
        return verify_log(io, anchors=anchors, exports=exports)


def pg_export(conn: Any, path: Any, *, before: datetime | None, through_seq: int | None,
              drop: bool) -> ExportResult:
    with pg_transaction(conn, PG_SNAPSHOT) as io:
        result = export_log(io, path, before=before, through_seq=through_seq)
    if not drop:
        return result
    with pg_transaction(conn, PG_READ_COMMITTED):
        conn.execute(PG_DROP, (result.final.seq, result.final.hash, result.rows,
                               result.file_sha256))
    return _dropped(result)


def _dropped(result: ExportResult) -> ExportResult:
    return ExportResult(result.path, result.seals, result.rows, result.start, result.final,
                        result.file_sha256, True)


# --- SQLite ---------------------------------------------------------------------------------------

_CANONICAL_COLUMNS = ("id, at, agent, tool, intent_id, idempotency_key, workflow, decision, "
                      "reason, keys, tokens, args, detail, duration_ms, node_attempt, "
                      "policy_version")
SQLITE_ROWS = (f"SELECT {_CANONICAL_COLUMNS}, row_hash FROM toolguard_audit "
               "WHERE id > ? AND id <= ? ORDER BY id LIMIT ?")
#: No upper bound: as many as ``2**63 - 1`` allows (SQLite's largest rowid).
NO_UPPER = 2**63 - 1
SQLITE_SEALS = (f"SELECT {_SEAL_COLUMNS} FROM toolguard_audit_seal WHERE seq > ? "
                "ORDER BY seq LIMIT ?")
SQLITE_INSERT_SEAL = (f"INSERT INTO toolguard_audit_seal ({_SEAL_COLUMNS}) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?, ?)")
SQLITE_RETENTION = (f"SELECT {_RETENTION_COLUMNS} FROM toolguard_audit_retention "
                    "ORDER BY through_seq DESC LIMIT 1")
SQLITE_FIRST_SINCE = "SELECT min(id) FROM toolguard_audit WHERE id > ? AND at >= ?"
#: The triggers the log's protection rests on (SQLite cannot disable one: only drop it).
SQLITE_TRIGGERS = {
    "toolguard_audit": ("toolguard_audit_no_update", "toolguard_audit_no_delete"),
    "toolguard_audit_seal": ("toolguard_audit_seal_no_update", "toolguard_audit_seal_no_delete"),
    "toolguard_audit_retention": ("toolguard_audit_retention_no_update",
                                  "toolguard_audit_retention_no_delete"),
}


def _text_or_escape(raw: bytes) -> str:
    """Stored text as str; bytes that are not UTF-8 kept as surrogates, so they hash differently."""
    return raw.decode("utf-8", "surrogateescape")


def _sqlite_moment(value: Any) -> datetime:
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


#: What a malformed time reads as: a seal's hash over it then fails to match (reported).
_NO_MOMENT = datetime(1970, 1, 1, tzinfo=UTC)


def _lenient_int(value: Any, fallback: int) -> int:
    """A stored integer; SQLite lets its owner store anything, which reads as ``fallback``."""
    try:
        return int(value) if isinstance(value, int | float | str) and \
            not isinstance(value, bool) else fallback
    except (ValueError, OverflowError):
        return fallback


def _lenient_moment(value: Any) -> datetime:
    try:
        moment = _sqlite_moment(value)
    except (ValueError, TypeError):
        return _NO_MOMENT
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _sqlite_seal(row: Sequence[Any]) -> Seal:
    """A stored seal as it reads, malformed fields replaced so that its hash cannot match
    (``verify`` then reports the seal as changed, by number, instead of failing)."""
    rows = bytes(row[4]) if isinstance(row[4], bytes | memoryview) else b""
    entries = unpack_rows(rows)
    seq = _lenient_int(row[0], 0)
    after_id = _lenient_int(row[1], entries[0][0] - 1 if entries else 0)
    last_id = _lenient_int(row[2], entries[-1][0] if entries else after_id)
    intact = all(isinstance(row[i], int) for i in (1, 2, 3)) and isinstance(row[7], str)
    moment = _lenient_moment(row[7]) if intact else _NO_MOMENT
    return Seal(seq, after_id, last_id, _lenient_int(row[3], len(entries)), rows, str(row[5]),
                str(row[6]), moment)


class SqliteChainIO:
    """The chain's queries on one sqlite3 connection."""

    dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def retention(self) -> Retention | None:
        row = self.conn.execute(SQLITE_RETENTION).fetchone()
        if row is None:
            return None
        # Malformed numbers read as 0: ``retention_problems`` then reports the record.
        return Retention(_lenient_int(row[0], 0), _lenient_int(row[1], 0), str(row[2]),
                         _lenient_int(row[3], 0), _lenient_int(row[4], 0), row[5],
                         _lenient_moment(row[6]) if row[6] else None)

    def head(self, start: ChainHead) -> ChainHead:
        row = self.conn.execute("SELECT seq, last_id, seal_hash FROM toolguard_audit_seal "
                                "ORDER BY seq DESC LIMIT 1").fetchone()
        if row is None:
            return start
        if not isinstance(row[1], int) or not isinstance(row[2], str):
            msg = (f"seal #{row[0]}, the last of the chain, is malformed: nothing is sealed on "
                   f"top of it; run `toolguard audit verify`")
            raise StoreError(msg, reason="audit_tampered")
        return ChainHead(int(row[0]), int(row[1]), str(row[2]))

    def seals(self, after_seq: int, limit: int) -> list[Seal]:
        return [_sqlite_seal(r) for r in self.conn.execute(SQLITE_SEALS, (after_seq, limit))]

    def seal_ends(self, after_seq: int) -> list[tuple[int, int]]:
        return [(_lenient_int(a, 0), _lenient_int(b, 0))
                for a, b in self.conn.execute(SEAL_ENDS.replace("%s", "?"), (after_seq,))]

    def _raw_rows(self, after_id: int, upto_id: int | None, limit: int) -> list[tuple[Any, ...]]:
        previous = self.conn.text_factory
        self.conn.text_factory = _text_or_escape
        try:
            upper = NO_UPPER if upto_id is None else upto_id
            return self.conn.execute(SQLITE_ROWS, (after_id, upper, limit)).fetchall()
        finally:
            self.conn.text_factory = previous

    def rows(self, after_id: int, upto_id: int | None, limit: int) -> list[RowCheck]:
        checks = []
        for row in self._raw_rows(after_id, upto_id, limit):
            stored = row[-1]
            try:
                computed: bytes | None = sqlite_row_hash(*row[:-1])
            except (TypeError, ValueError, UnicodeError):
                computed = None
            # A row hash that is not a blob was written by hand: it matches nothing.
            checks.append(RowCheck(int(row[0]), bytes(stored) if isinstance(
                stored, bytes | memoryview) else None if stored is None else b"", computed))
        return checks

    def seal_entries(self, after_id: int, upto_id: int, limit: int) -> list[tuple[int, bytes]]:
        entries = []
        for row in self._raw_rows(after_id, upto_id, limit):
            stored = row[-1]
            if isinstance(stored, bytes | memoryview):
                entries.append((int(row[0]), bytes(stored)))
                continue
            try:
                digest = sqlite_row_hash(*row[:-1])
            except (TypeError, ValueError, UnicodeError):  # sealed as it is: verify reports it
                digest = hashlib.sha256(b"unreadable").digest()
            entries.append((int(row[0]), digest))
        return entries

    def export_rows(self, after_id: int, upto_id: int) -> list[ExportRow]:
        out = []
        for row in self._raw_rows(after_id, upto_id, -1):
            stored = row[-1]
            out.append(ExportRow(int(row[0]), bytes(stored) if isinstance(
                stored, bytes | memoryview) else None, sqlite_canonical(*row[:-1])))
        return out

    def insert_seal(self, seal: Seal) -> None:
        self.conn.execute(SQLITE_INSERT_SEAL, (seal.seq, seal.after_id, seal.last_id,
                                               seal.row_count, seal.rows, seal.prev_hash,
                                               seal.seal_hash, sealed_at_text(seal.sealed_at)))

    def first_id_since(self, after_id: int, moment: datetime) -> int | None:
        utc = moment.astimezone(UTC)
        text = utc.strftime("%Y-%m-%dT%H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z"
        row = self.conn.execute(SQLITE_FIRST_SINCE, (after_id, text)).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def id_ceiling(self) -> int | None:
        """The highest audit id ever handed out (AUTOINCREMENT keeps it after a delete)."""
        row = self.conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'toolguard_audit'"
                                ).fetchone()
        return _lenient_int(row[0], 0) if row is not None else None

    def oldest_since(self, after_id: int) -> datetime | None:
        row = self.conn.execute("SELECT min(at) FROM toolguard_audit WHERE id > ?",
                                (after_id,)).fetchone()
        if row is None or row[0] is None:
            return None
        moment = _lenient_moment(row[0])
        return None if moment == _NO_MOMENT else moment

    def trigger_problems(self) -> list[Problem]:
        present = {(t, n) for t, n in self.conn.execute(
            "SELECT tbl_name, name FROM sqlite_master WHERE type = 'trigger'")}
        return [Problem("trigger_disabled", f"the trigger {name} on {table} is missing: the log "
                        f"is not protected while it is")
                for table, names in SQLITE_TRIGGERS.items() for name in names
                if (table, name) not in present]


@contextlib.contextmanager
def sqlite_immediate(conn: sqlite3.Connection) -> Iterator[SqliteChainIO]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield SqliteChainIO(conn)
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


@contextlib.contextmanager
def sqlite_snapshot(conn: sqlite3.Connection) -> Iterator[SqliteChainIO]:
    """A read transaction: every query sees the same committed state (WAL)."""
    conn.execute("BEGIN")
    try:
        yield SqliteChainIO(conn)
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")


def sqlite_seal(conn: sqlite3.Connection, *, max_rows: int) -> SealResult:
    """Seal every committed row, one seal per write transaction (the write lock is held briefly)."""
    seals = rows = 0
    while True:
        with sqlite_immediate(conn) as io:
            result = seal_log(io, lambda head: (_sqlite_max_id(conn, head, max_rows), None),
                              max_rows=max_rows)
        seals, rows = seals + result.seals, rows + result.rows
        if result.rows < max_rows:
            return SealResult(seals, rows, result.head, None)


def _sqlite_max_id(conn: sqlite3.Connection, head: ChainHead, max_rows: int) -> int:
    """The last id of the next ``max_rows`` rows: one seal per write transaction."""
    row = conn.execute("SELECT max(id) FROM (SELECT id FROM toolguard_audit WHERE id > ? "
                       "ORDER BY id LIMIT ?)", (head.last_id, max_rows)).fetchone()
    return head.last_id if row is None or row[0] is None else int(row[0])


def sqlite_verify(conn: sqlite3.Connection, *, anchors: Sequence[str],
                  exports: Sequence[Any]) -> AuditVerification:
    with sqlite_snapshot(conn) as io:
        return verify_log(io, anchors=anchors, exports=exports)


def sqlite_export(conn: sqlite3.Connection, path: Any, *, before: datetime | None,
                  through_seq: int | None, drop: bool) -> ExportResult:
    with sqlite_snapshot(conn) as io:
        result = export_log(io, path, before=before, through_seq=through_seq)
    if not drop:
        return result
    with sqlite_immediate(conn):
        sqlite_drop(conn, result)
    return _dropped(result)


def _trigger_sql(conn: sqlite3.Connection, names: Iterable[str]) -> list[tuple[str, str]]:
    found = []
    for name in names:
        row = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = ?",
                           (name,)).fetchone()
        if row is None:
            msg = f"the trigger {name} is missing: run `toolguard audit verify`"
            raise StoreError(msg, reason="audit_tampered")
        found.append((name, str(row[0])))
    return found


def sqlite_drop(conn: sqlite3.Connection, result: ExportResult) -> None:
    """Drop the exported range (inside the caller's write transaction): its rows and seals go,
    a retention row records its final hash. The delete triggers are dropped and re-created
    around it, in the same transaction."""
    final = result.final
    row = conn.execute("SELECT seal_hash, last_id FROM toolguard_audit_seal WHERE seq = ?",
                       (final.seq,)).fetchone()
    if row is None or row[0] != final.hash:
        msg = f"no seal #{final.seq} with hash {final.hash} to drop through"
        raise StoreError(msg, reason="audit_tampered")
    (count,) = conn.execute("SELECT count(*) FROM toolguard_audit WHERE id <= ?",
                            (final.last_id,)).fetchone()
    if int(count) != result.rows:
        msg = (f"expected to drop {result.rows} exported rows through id {final.last_id}, found "
               f"{count}: the range changed since it was exported")
        raise StoreError(msg, reason="audit_tampered")
    triggers = _trigger_sql(conn, ("toolguard_audit_no_delete", "toolguard_audit_seal_no_delete"))
    for name, _ in triggers:
        conn.execute(f"DROP TRIGGER {name}")
    conn.execute("DELETE FROM toolguard_audit WHERE id <= ?", (final.last_id,))
    seals = conn.execute("DELETE FROM toolguard_audit_seal WHERE seq <= ?", (final.seq,)).rowcount
    for _, statement in triggers:
        conn.execute(statement)
    conn.execute("INSERT INTO toolguard_audit_retention (through_seq, through_id, final_hash, "
                 "rows, seals, file_sha256) VALUES (?, ?, ?, ?, ?, ?)",
                 (final.seq, final.last_id, final.hash, result.rows, seals, result.file_sha256))
