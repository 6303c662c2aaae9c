"""Sealing on PostgreSQL: the chain's queries (``PgChainIO``) and the transactions around them.

Apart from SQLite's because the two differ in what makes a range safe to seal
(below), in their SQL and in how they read a malformed row.

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
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

from toolguard.store.chain import (
    AuditVerification,
    ChainHead,
    ExportResult,
    ExportRow,
    Problem,
    Retention,
    RowCheck,
    Seal,
    SealResult,
    pg_canonical,
    pg_row_hash,
)
from toolguard.store.sealing_flow import (
    _RETENTION_COLUMNS,
    _SEAL_COLUMNS,
    SEAL_ENDS,
    _dropped,
    export_log,
    seal_log,
    verify_log,
)

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
PG_SEALS = (f"SELECT {_SEAL_COLUMNS} FROM toolguard_audit_seal WHERE seq > %s "
            "ORDER BY seq LIMIT %s")
PG_HEAD = "SELECT seq, last_id, seal_hash FROM toolguard_audit_seal ORDER BY seq DESC LIMIT 1"
PG_INSERT_SEAL = (f"INSERT INTO toolguard_audit_seal ({_SEAL_COLUMNS}) "
                  "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)")
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
