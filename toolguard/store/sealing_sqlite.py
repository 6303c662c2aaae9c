"""Sealing on SQLite: the chain's queries (``SqliteChainIO``), its transactions and its drop.

On SQLite, writers are serialized by the database's write lock: the sealer
holds it (``BEGIN IMMEDIATE``) and seals every committed row.
Apart from PostgreSQL's because SQLite lets the file's owner store anything in
any column: every read here is lenient (a malformed value reads so that its
hash cannot match, and ``verify`` reports it), and dropping an exported range
re-creates the delete triggers around it.
"""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

from toolguard.errors import StoreError
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
    sealed_at_text,
    sqlite_canonical,
    sqlite_row_hash,
    unpack_rows,
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
