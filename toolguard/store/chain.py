"""The audit log's tamper evidence: row hashes, a chain of seals, and the checks over them.

Pure logic, no I/O; the stores read and write (``toolguard/store/sealing.py``).

* Every audit row carries ``row_hash``: SHA-256 of a canonical JSON array of
  its stored values (``id`` and ``at`` included), taken in the database on
  PostgreSQL (a ``BEFORE INSERT`` trigger, so any client gets it right) and in
  the same ``INSERT`` statement on SQLite (a function the store registers).
* A sealer links closed ranges of ids into a chain: a seal records the range
  ``(after_id, last_id]``, each row's id and hash in id order, and the hash of
  the previous seal; its own hash covers all of it. Inserts never touch a seal,
  so concurrent writers never contend on one row.
* ``verify`` recomputes every row's hash from its content and compares it with
  the row's own hash and with the seal's; it reports a changed, deleted or
  inserted row, and a changed, missing or relinked seal, by id and seal number.

What this cannot see on its own: an owner who rewrites rows, their hashes and
every seal after them produces a consistent chain. Comparing the latest seal's
hash with a copy kept outside the database (an *anchor*) catches that.
``docs/audit.md`` states the canonical forms and the argument for when a range
may be sealed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any, Literal

__all__ = [
    "CANONICAL_FIELDS",
    "CANONICAL_TAG",
    "GENESIS",
    "AuditVerification",
    "ChainHead",
    "ExportCheck",
    "ExportResult",
    "Problem",
    "Retention",
    "RowCheck",
    "Seal",
    "SealResult",
    "Verifier",
    "build_seal",
    "pack_rows",
    "pg_canonical",
    "pg_row_hash",
    "read_export",
    "seal_hash",
    "sealed_at_text",
    "sqlite_canonical",
    "sqlite_row_hash",
    "unpack_rows",
    "write_export",
]

#: The hash a first seal links to (there is no seal before it).
GENESIS = "0" * 64
#: First element of every canonical row: names the form, so a later one can differ.
CANONICAL_TAG = "toolguard.audit.1"
SEAL_TAG = "toolguard.audit.seal.1"
EXPORT_FORMAT = "toolguard.audit.export.1"
#: The stored values a row hash covers, in canonical order (after the tag).
CANONICAL_FIELDS = ("id", "at", "agent", "tool", "intent_id", "idempotency_key", "workflow",
                    "decision", "reason", "keys", "tokens", "args", "detail", "duration_ms",
                    "node_attempt", "policy_version")
#: One entry of a seal's row list: the id (8 bytes, big-endian) and the row hash (32 bytes).
ENTRY = 40


# --- canonical forms ---------------------------------------------------------------------


def pg_canonical(row: str) -> str:
    """The PostgreSQL canonical text of the row ``row`` (an alias, or ``NEW`` in the trigger).

    Only built-in functions, schema-qualified, and none whose output depends on a
    session setting: ``at`` as UTC text with microseconds, ``duration_ms`` as the
    hex of its IEEE 754 bits (a float's text depends on ``extra_float_digits``),
    ``keys`` as a JSON array, ``tokens`` and ``args`` as ``jsonb`` prints them (keys
    sorted, fixed spacing). ``json_build_array`` rather than ``jsonb_build_array``:
    the same text guarantees for less work in the trigger. The same expression is
    in ``toolguard/sql/005_tamper_evident_audit.sql``.
    """
    r = row
    return (
        f"pg_catalog.json_build_array('{CANONICAL_TAG}'::text, {r}.id, "
        f"pg_catalog.to_char({r}.at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), "
        f"{r}.agent, {r}.tool, {r}.intent_id, {r}.idempotency_key, {r}.workflow, "
        f"{r}.decision, {r}.reason, {r}.keys, {r}.tokens, {r}.args, "
        f"{r}.detail, pg_catalog.encode(pg_catalog.float8send({r}.duration_ms), 'hex'), "
        f"{r}.node_attempt, {r}.policy_version)::text")


def pg_row_hash(row: str) -> str:
    """SQL for the row hash (``bytea``) of the row ``row``."""
    return f"pg_catalog.sha256(pg_catalog.convert_to({pg_canonical(row)}, 'UTF8'))"


_CANONICAL_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=True)


def _sqlite_value(value: Any) -> Any:
    """A stored SQLite value as JSON: int, float (shortest repr), text, NULL; a blob tagged."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {"blob": bytes(value).hex()}
    return value


def sqlite_canonical(*values: Any) -> str:
    """The SQLite canonical text of one row, from its stored values in ``CANONICAL_FIELDS`` order.

    A JSON array: the tag, then each value as SQLite returns it (JSON columns as
    their stored text, ``at`` as its stored text, ``duration_ms`` as a JSON number
    in the shortest form that reads back the same double).
    """
    if len(values) != len(CANONICAL_FIELDS):
        msg = f"a canonical row has {len(CANONICAL_FIELDS)} values, got {len(values)}"
        raise ValueError(msg)
    return _CANONICAL_JSON.encode([CANONICAL_TAG, *(_sqlite_value(v) for v in values)])


def sqlite_row_hash(*values: Any) -> bytes:
    """SHA-256 of ``sqlite_canonical(*values)``: the SQLite store's SQL function of that name."""
    return hashlib.sha256(sqlite_canonical(*values).encode("utf-8", "surrogatepass")).digest()


# --- seals -----------------------------------------------------------------------------------


def pack_rows(rows: Iterable[tuple[int, bytes]]) -> bytes:
    """A seal's row list: each ``(id, hash)`` as 8 + 32 bytes, in the order given (id order)."""
    return b"".join(row_id.to_bytes(8, "big") + digest for row_id, digest in rows)


def unpack_rows(packed: bytes) -> list[tuple[int, bytes]]:
    """The ``(id, hash)`` pairs of a seal's row list (a length that is not a multiple of 40
    leaves its tail out; the seal's hash and count then disagree)."""
    data = bytes(packed)
    return [(int.from_bytes(data[i:i + 8], "big"), data[i + 8:i + ENTRY])
            for i in range(0, len(data) - len(data) % ENTRY, ENTRY)]


def sealed_at_text(moment: datetime) -> str:
    """A seal's time as its hash covers it: UTC, microseconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def seal_hash(seq: int, after_id: int, last_id: int, row_count: int, rows: bytes,
              prev_hash: str, sealed_at: datetime) -> str:
    """The hex SHA-256 that names a seal: every field, the row list through its SHA-256."""
    text = "\n".join((SEAL_TAG, str(seq), str(after_id), str(last_id), str(row_count),
                      hashlib.sha256(bytes(rows)).hexdigest(), prev_hash,
                      sealed_at_text(sealed_at)))
    return hashlib.sha256(text.encode("ascii")).hexdigest()


@dataclass(frozen=True, slots=True)
class ChainHead:
    """Where the chain stands: the last seal's number, last id and hash (0, 0, GENESIS: none)."""

    seq: int = 0
    last_id: int = 0
    hash: str = GENESIS


@dataclass(frozen=True, slots=True)
class Seal:
    """One sealed range of the audit log: ids ``(after_id, last_id]``, linked to ``prev_hash``."""

    seq: int
    after_id: int
    last_id: int
    row_count: int
    rows: bytes
    prev_hash: str
    seal_hash: str
    sealed_at: datetime

    def computed_hash(self) -> str:
        return seal_hash(self.seq, self.after_id, self.last_id, self.row_count, self.rows,
                         self.prev_hash, self.sealed_at)

    @property
    def head(self) -> ChainHead:
        return ChainHead(self.seq, self.last_id, self.seal_hash)

    def describe(self) -> str:
        return f"seal #{self.seq} (ids {self.after_id + 1}..{self.last_id})"


def build_seal(head: ChainHead, rows: Sequence[tuple[int, bytes]], sealed_at: datetime) -> Seal:
    """The seal after ``head`` over ``rows`` (``(id, hash)`` in id order, all above head's ids)."""
    if not rows:
        msg = "a seal covers at least one row"
        raise ValueError(msg)
    packed = pack_rows(rows)
    seq, last_id = head.seq + 1, rows[-1][0]
    moment = sealed_at.astimezone(UTC)
    return Seal(seq, head.last_id, last_id, len(rows), packed, head.hash,
                seal_hash(seq, head.last_id, last_id, len(rows), packed, head.hash, moment),
                moment)


@dataclass(frozen=True, slots=True)
class Retention:
    """An exported range dropped from the store: everything through seal ``through_seq``."""

    through_seq: int
    through_id: int
    final_hash: str
    rows: int
    seals: int
    file_sha256: str | None
    dropped_at: datetime | None

    @property
    def head(self) -> ChainHead:
        return ChainHead(self.through_seq, self.through_id, self.final_hash)


@dataclass(frozen=True, slots=True)
class SealResult:
    """What one ``seal_audit()`` did: new seals and rows, the head after it, what it left."""

    seals: int
    rows: int
    head: ChainHead
    #: Why rows above ``head.last_id`` stayed unsealed (a writer's transaction still open), or None.
    deferred: str | None = None


# --- verification ----------------------------------------------------------------------------

ProblemKind = Literal["row_changed", "row_hash_changed", "row_deleted", "row_inserted",
                      "row_unsealed_changed", "row_unreadable", "seal_changed", "seal_missing",
                      "seal_relinked", "range_unsealed", "exported_row_present", "anchor_missing",
                      "export_invalid", "export_mismatch", "trigger_disabled",
                      "retention_inconsistent"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One finding of ``verify``: what, where (row id, seal number), in words."""

    kind: ProblemKind
    message: str
    row_id: int | None = None
    seal: int | None = None

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True, slots=True)
class RowCheck:
    """One stored row as the verifier sees it: its stored hash and the hash of its content now
    (None: the content could not be read)."""

    id: int
    stored: bytes | None
    computed: bytes | None


@dataclass
class AuditVerification:
    """The result of ``verify_audit()``: ``ok`` when no problem was found."""

    dialect: str
    rows: int = 0
    first_id: int | None = None
    last_id: int | None = None
    seals: int = 0
    sealed_rows: int = 0
    unsealed: int = 0
    #: Rows with no row hash of their own (written before schema 5, or with its trigger off):
    #: a seal covers them once sealed; until then nothing does.
    unhashed: int = 0
    #: When the oldest row not sealed yet was written (None: every row is sealed).
    oldest_unsealed: datetime | None = None
    head: ChainHead = field(default_factory=ChainHead)
    start: ChainHead = field(default_factory=ChainHead)
    retention: Retention | None = None
    anchors: list[str] = field(default_factory=list)
    exports: list[ExportCheck] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "dialect": self.dialect, "rows": self.rows, "first_id": self.first_id,
            "last_id": self.last_id, "seals": self.seals, "sealed_rows": self.sealed_rows,
            "unsealed": self.unsealed, "unhashed": self.unhashed,
            "oldest_unsealed": None if self.oldest_unsealed is None else
            sealed_at_text(self.oldest_unsealed),
            "head": {"seal": self.head.seq, "last_id": self.head.last_id, "hash": self.head.hash},
            "start": {"seal": self.start.seq, "after_id": self.start.last_id,
                      "hash": self.start.hash},
            "exported": None if self.retention is None else {
                "through_seal": self.retention.through_seq,
                "through_id": self.retention.through_id,
                "final_hash": self.retention.final_hash, "rows": self.retention.rows,
                "file_sha256": self.retention.file_sha256},
            "anchors": self.anchors,
            "exports": [e.as_dict() for e in self.exports],
            "problems": [{"kind": p.kind, "row_id": p.row_id, "seal": p.seal,
                          "message": p.message} for p in self.problems],
            "notes": self.notes,
        }


def _runs(ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Consecutive runs of ``ids`` (sorted): ``(first, last, count)``."""
    start = previous = None
    count = 0
    for row_id in ids:
        if start is None:
            start, previous, count = row_id, row_id, 1
        elif row_id == previous + 1:  # type: ignore[operator]
            previous, count = row_id, count + 1
        else:
            yield start, previous, count  # type: ignore[misc]
            start, previous, count = row_id, row_id, 1
    if start is not None:
        yield start, previous, count  # type: ignore[misc]


def _gaps(ids: Sequence[int], after_id: int, last_id: int) -> Iterator[tuple[int, int]]:
    """The ranges ``(first, last)`` of ids in ``(after_id, last_id]`` not in sorted ``ids``."""
    previous = after_id
    for row_id in ids:
        if row_id > previous + 1:
            yield previous + 1, min(row_id - 1, last_id)
        previous = max(previous, row_id)
    if last_id > previous:
        yield previous + 1, last_id


def _rows_text(first: int, last: int, count: int) -> str:
    return f"row #{first}" if count == 1 else f"rows #{first}..#{last} ({count})"


class Verifier:
    """Checks a log seal by seal, in order: the chain's links, then the rows each seal covers.

    Feed it with ``seal(seal, rows)`` for every stored seal in ``seq`` order (``rows``:
    the stored rows with ids in the seal's range), ``stray(rows)`` for rows in no seal
    below the last one, and ``unsealed(rows)`` for rows above it; then ``finish()``.
    """

    def __init__(self, dialect: str, start: ChainHead, retention: Retention | None) -> None:
        self.report = AuditVerification(dialect, start=start, head=start, retention=retention)
        #: SQLite hands out audit ids without gaps (a rolled-back insert takes none back, the
        #: highest id ever is kept in ``sqlite_sequence``): a missing id is a deleted row.
        #: PostgreSQL's sequence skips the ids of rolled-back inserts: a gap proves nothing.
        self.gapless = dialect == "sqlite"
        self._previous = start
        self._hashes: set[str] = {start.hash}

    # chain

    def seal(self, seal: Seal, rows: Iterable[RowCheck]) -> None:
        report, previous = self.report, self._previous
        report.seals += 1
        changed = seal.computed_hash() != seal.seal_hash
        if changed:
            report.problems.append(Problem(
                "seal_changed", f"{seal.describe()} was changed: its hash does not match its "
                f"content", seal=seal.seq))
        if seal.seq > previous.seq + 1:  # the links and ids then differ too: one finding
            missing = (f"seal #{previous.seq + 1}" if seal.seq == previous.seq + 2
                       else f"seals #{previous.seq + 1}..#{seal.seq - 1}")
            report.problems.append(Problem(
                "seal_missing", f"{missing} missing: the chain goes from "
                f"{self._name(previous)} to {seal.describe()} (deleted seals?)", seal=seal.seq))
        elif seal.seq != previous.seq + 1:
            report.problems.append(Problem(
                "seal_relinked", f"{seal.describe()} follows seal #{previous.seq}: seal "
                f"numbers out of order", seal=seal.seq))
        elif not changed and seal.prev_hash != previous.hash:
            report.problems.append(Problem(
                "seal_relinked", f"{seal.describe()} does not link to {self._name(previous)}: "
                f"it names a previous hash {seal.prev_hash[:16]}..., the chain has "
                f"{previous.hash[:16]}...", seal=seal.seq))
        elif not changed and seal.after_id != previous.last_id:
            report.problems.append(Problem(
                "seal_relinked", f"{seal.describe()} starts after id {seal.after_id}, "
                f"{self._name(previous)} ends at id {previous.last_id}", seal=seal.seq))
        entries = unpack_rows(seal.rows)
        if len(entries) != seal.row_count or len(bytes(seal.rows)) != seal.row_count * ENTRY:
            report.problems.append(Problem(
                "seal_changed", f"{seal.describe()} lists {len(entries)} rows but counts "
                f"{seal.row_count}", seal=seal.seq))
        self._rows(seal, entries, rows)
        self._hashes.add(seal.seal_hash)
        report.head = seal.head
        self._previous = seal.head

    def _name(self, head: ChainHead) -> str:
        if head.seq == 0:
            return "the start of the log"
        start = self.report.start
        if head == start and start.seq:
            return f"the exported range's last seal #{head.seq}"
        return f"seal #{head.seq}"

    # rows

    def _rows(self, seal: Seal, entries: list[tuple[int, bytes]], rows: Iterable[RowCheck]) -> None:
        report = self.report
        sealed = dict(entries)
        seen: set[int] = set()
        inserted: list[int] = []
        for row in rows:
            self._count(row)
            seen.add(row.id)
            expected = sealed.get(row.id)
            if expected is None:
                inserted.append(row.id)
                continue
            report.sealed_rows += 1
            where = f"in {seal.describe()}"
            if row.computed is None:
                report.problems.append(Problem(
                    "row_unreadable", f"row #{row.id} {where} cannot be read as an audit row "
                    f"(a value of the wrong type or encoding)", row.id, seal.seq))
            elif row.computed != expected:
                rewritten = row.stored is not None and row.stored == row.computed
                report.problems.append(Problem(
                    "row_changed", f"row #{row.id} {where} was changed after it was sealed: "
                    f"its content no longer matches the hash the seal recorded"
                    + ("; its row hash was rewritten to match the new content" if rewritten
                       else ""), row.id, seal.seq))
            elif row.stored is not None and row.stored != expected:
                report.problems.append(Problem(
                    "row_hash_changed", f"row #{row.id} {where}: its stored row hash was changed "
                    f"(its content still matches the seal)", row.id, seal.seq))
        for first, last, count in _runs(inserted):
            report.problems.append(Problem(
                "row_inserted", f"{_rows_text(first, last, count)} inserted into "
                f"{seal.describe()}: not in the seal", first, seal.seq))
        missing = [row_id for row_id, _ in entries if row_id not in seen]
        for first, last, count in _runs(missing):
            report.problems.append(Problem(
                "row_deleted", f"{_rows_text(first, last, count)} of {seal.describe()} "
                f"deleted: sealed, no longer in the table", first, seal.seq))
        if self.gapless:
            for first, last in _gaps([row_id for row_id, _ in entries], seal.after_id,
                                     seal.last_id):
                count = last - first + 1
                report.problems.append(Problem(
                    "row_deleted", f"{_rows_text(first, last, count)} deleted before "
                    f"{seal.describe()} was made: the seal skips {'it' if count == 1 else 'them'}"
                    f", and SQLite ids have no gaps", first, seal.seq))

    def _count(self, row: RowCheck) -> None:
        report = self.report
        report.rows += 1
        report.first_id = row.id if report.first_id is None else min(report.first_id, row.id)
        report.last_id = row.id if report.last_id is None else max(report.last_id, row.id)
        if row.stored is None:
            report.unhashed += 1

    def stray(self, rows: Iterable[RowCheck], after_id: int, upto_id: int,
              kind: ProblemKind = "range_unsealed") -> None:
        """Rows in ``(after_id, upto_id]``, a range below the chain's head that no seal covers."""
        ids = []
        for row in rows:
            self._count(row)
            ids.append(row.id)
        for first, last, count in _runs(ids):
            if kind == "exported_row_present":
                text = (f"{_rows_text(first, last, count)} present in the exported range "
                        f"(ids <= {upto_id}): inserted after the range was dropped")
            else:
                text = (f"{_rows_text(first, last, count)} in ids {after_id + 1}..{upto_id}, "
                        f"which no seal covers (a seal was removed?)")
            self.report.problems.append(Problem(kind, text, first))

    def unsealed(self, rows: Iterable[RowCheck], after_id: int = 0,
                 ceiling: int | None = None) -> None:
        """Rows above the head (``after_id``): only their own row hash speaks for them, and on
        SQLite the ids (no gaps up to ``ceiling``, the highest id ever handed out)."""
        report = self.report
        previous = after_id
        gaps: list[tuple[int, int]] = []
        for row in rows:
            if row.id > previous + 1:
                gaps.append((previous + 1, row.id - 1))
            previous = max(previous, row.id)
            self._count(row)
            report.unsealed += 1
            if row.computed is None:
                report.problems.append(Problem(
                    "row_unreadable", f"row #{row.id} (not sealed yet) cannot be read as an "
                    f"audit row", row.id))
            elif row.stored is not None and row.stored != row.computed:
                report.problems.append(Problem(
                    "row_unsealed_changed", f"row #{row.id} (not sealed yet) was changed: its "
                    f"content does not match its row hash", row.id))
        if ceiling is not None and ceiling > previous:
            gaps.append((previous + 1, ceiling))
        for first, last in gaps:
            text = _rows_text(first, last, last - first + 1)
            if self.gapless:
                tail = " from the end of the log" if last == ceiling else ""
                report.problems.append(Problem(
                    "row_deleted", f"{text} deleted{tail} before a seal covered "
                    f"{'it' if first == last else 'them'}: SQLite ids have no gaps", first))
            else:
                report.notes.append(
                    f"ids {first}..{last} are missing among the rows not sealed yet: a "
                    f"transaction that rolled back leaves such a gap on PostgreSQL, so this "
                    f"proves no deletion")

    # anchors and exports

    def check_anchor(self, anchor: str, exports: Sequence[ExportCheck] = ()) -> None:
        """``anchor`` (a seal hash kept elsewhere) must be in this chain or an export's."""
        wanted = anchor.strip().lower()
        self.report.anchors.append(wanted)
        if wanted in self._hashes or any(wanted in e.hashes for e in exports):
            return
        self.report.problems.append(Problem(
            "anchor_missing", f"the anchor {wanted[:16]}... is not a seal of this log: the "
            f"chain was rewritten since that seal was taken (or the anchor is another log's)"))

    def check_exports(self, exports: Sequence[ExportCheck]) -> None:
        """Export files: each verifies itself; together they lead up to where the store starts."""
        report = self.report
        ordered = sorted(exports, key=lambda e: e.start.seq)
        report.exports = list(ordered)
        for check in ordered:
            report.problems.extend(check.problems)
        for earlier, later in itertools.pairwise(ordered):
            if later.start.hash != earlier.final.hash:
                report.problems.append(Problem(
                    "export_mismatch", f"{later.path} does not continue {earlier.path}: it starts "
                    f"after seal #{later.start.seq}, the other ends with seal #{earlier.final.seq} "
                    f"with another hash"))
        if ordered and ordered[0].start.hash != GENESIS:
            report.notes.append(f"the earliest export given starts after seal "
                                f"#{ordered[0].start.seq}: earlier exports were not checked")
        start = report.start
        if ordered and start.seq and not any(e.final == start for e in ordered):
            last = ordered[-1]
            report.problems.append(Problem(
                "export_mismatch", f"the store's log continues from seal #{start.seq} (hash "
                f"{start.hash[:16]}...), but {last.path} ends with seal #{last.final.seq} (hash "
                f"{last.final.hash[:16]}...): that file is not the range that was dropped"))

    def finish(self) -> AuditVerification:
        return self.report


# --- export files ----------------------------------------------------------------------------


@dataclass
class ExportCheck:
    """An export file read back and verified on its own."""

    path: str
    dialect: str | None = None
    start: ChainHead = field(default_factory=ChainHead)
    final: ChainHead = field(default_factory=ChainHead)
    seals: int = 0
    rows: int = 0
    file_sha256: str = ""
    hashes: set[str] = field(default_factory=set)
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok, "dialect": self.dialect,
                "start": {"seal": self.start.seq, "after_id": self.start.last_id,
                          "hash": self.start.hash},
                "final": {"seal": self.final.seq, "last_id": self.final.last_id,
                          "hash": self.final.hash},
                "seals": self.seals, "rows": self.rows, "file_sha256": self.file_sha256,
                "problems": [p.message for p in self.problems]}


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What ``export_audit()`` wrote (and dropped, with ``drop=True``)."""

    path: str
    seals: int
    rows: int
    start: ChainHead
    final: ChainHead
    file_sha256: str
    dropped: bool


@dataclass(frozen=True, slots=True)
class ExportRow:
    """One row of an export: its id, a hash (stored, or of its content) and its canonical text."""

    id: int
    row_hash: bytes | None
    canonical: str


def write_export(out: IO[str], dialect: str, start: ChainHead,
                 seals: Iterable[tuple[Seal, Sequence[ExportRow]]], exported_at: datetime) -> tuple[
                     ChainHead, int, int]:
    """Write a range as JSON Lines: a header, then each seal followed by its rows, then an end
    line. Returns the final head, the seals and the rows written."""
    def line(value: dict[str, Any]) -> None:
        out.write(json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n")

    line({"format": EXPORT_FORMAT, "dialect": dialect, "fields": ["tag", *CANONICAL_FIELDS],
          "exported_at": sealed_at_text(exported_at),
          "start": {"seal": start.seq, "after_id": start.last_id, "hash": start.hash}})
    final, count, rows = start, 0, 0
    for seal, seal_rows in seals:
        line({"seal": {"seq": seal.seq, "after_id": seal.after_id, "last_id": seal.last_id,
                       "row_count": seal.row_count, "prev_hash": seal.prev_hash,
                       "seal_hash": seal.seal_hash, "sealed_at": sealed_at_text(seal.sealed_at)}})
        for row in seal_rows:
            line({"row": {"id": row.id, "row_hash": (row.row_hash or b"").hex(),
                          "canonical": row.canonical}})
        final, count, rows = seal.head, count + 1, rows + len(seal_rows)
    line({"end": {"seals": count, "rows": rows, "final": {
        "seal": final.seq, "last_id": final.last_id, "hash": final.hash}}})
    return final, count, rows


def _parse_moment(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def read_export(path: str | os.PathLike[str]) -> ExportCheck:
    """Read an export file and verify it on its own: every row's hash from its canonical text,
    every seal's row list and hash, the links from its start to its end."""
    check = ExportCheck(str(path))
    digest = hashlib.sha256()

    def problem(text: str) -> None:
        check.problems.append(Problem("export_invalid", f"{path}: {text}"))

    try:
        with open(path, "rb") as handle:
            lines = []
            for raw in handle:
                digest.update(raw)
                lines.append(raw)
    except OSError as error:
        problem(f"cannot be read: {error}")
        return check
    check.file_sha256 = digest.hexdigest()
    previous: ChainHead | None = None
    current: dict[str, Any] | None = None
    current_rows: list[tuple[int, bytes]] = []
    ended = False

    def close_seal() -> None:
        nonlocal previous
        if current is None:
            return
        try:
            seal = Seal(int(current["seq"]), int(current["after_id"]), int(current["last_id"]),
                        int(current["row_count"]), pack_rows(current_rows),
                        str(current["prev_hash"]), str(current["seal_hash"]),
                        _parse_moment(str(current["sealed_at"])))
        except (KeyError, TypeError, ValueError) as error:
            problem(f"a seal line is malformed: {error}")
            return
        if seal.computed_hash() != seal.seal_hash:
            problem(f"{seal.describe()}: its rows or fields do not match its hash")
        assert previous is not None
        if seal.prev_hash != previous.hash or seal.seq != previous.seq + 1 or \
                seal.after_id != previous.last_id:
            problem(f"{seal.describe()} does not follow seal #{previous.seq} in the file")
        check.hashes.add(seal.seal_hash)
        check.seals += 1
        previous = seal.head

    for number, raw in enumerate(lines, start=1):
        try:
            item = json.loads(raw)
        except ValueError as error:
            problem(f"line {number} is not JSON: {error}")
            return check
        if number == 1:
            if not isinstance(item, dict) or item.get("format") != EXPORT_FORMAT:
                problem(f"not a toolguard audit export (line 1 has no format {EXPORT_FORMAT!r})")
                return check
            start = item.get("start") or {}
            try:
                check.start = ChainHead(int(start["seal"]), int(start["after_id"]),
                                        str(start["hash"]))
            except (KeyError, TypeError, ValueError) as error:
                problem(f"line 1 has no valid start: {error}")
                return check
            check.dialect = item.get("dialect")
            previous = check.start
            check.hashes.add(check.start.hash)
            continue
        if ended:
            problem(f"line {number} follows the end line")
            break
        if "seal" in item:
            close_seal()
            current, current_rows = item["seal"], []
        elif "row" in item:
            row = item["row"]
            try:
                row_id, stored = int(row["id"]), bytes.fromhex(row["row_hash"])
                canonical = str(row["canonical"])
            except (KeyError, TypeError, ValueError) as error:
                problem(f"line {number}: a malformed row: {error}")
                continue
            if current is None:
                problem(f"line {number}: row #{row_id} before any seal")
                continue
            computed = hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).digest()
            if computed != stored:
                problem(f"row #{row_id} (line {number}) was changed: its content does not match "
                        f"its hash")
            if not _canonical_id_matches(canonical, row_id):
                problem(f"row #{row_id} (line {number}): its content names another id")
            current_rows.append((row_id, stored))
            check.rows += 1
        elif "end" in item:
            close_seal()
            current = None
            ended = True
            end = item["end"]
            final = end.get("final") or {}
            try:
                claimed = ChainHead(int(final["seal"]), int(final["last_id"]), str(final["hash"]))
            except (KeyError, TypeError, ValueError) as error:
                problem(f"the end line is malformed: {error}")
                continue
            if previous != claimed or end.get("seals") != check.seals or \
                    end.get("rows") != check.rows:
                problem("the end line does not match the seals and rows before it (lines "
                        "removed or added?)")
            check.final = claimed
        else:
            problem(f"line {number} is neither a seal, a row nor the end")
    if not ended:
        close_seal()
        problem("the file has no end line: it was cut short")
        if previous is not None:
            check.final = previous
    return check


def _canonical_id_matches(canonical: str, row_id: int) -> bool:
    try:
        values = json.loads(canonical)
    except ValueError:
        return False
    return isinstance(values, list) and len(values) > 1 and values[0] == CANONICAL_TAG and \
        values[1] == row_id
