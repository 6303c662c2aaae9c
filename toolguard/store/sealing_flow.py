"""Sealing, verifying and exporting the audit log: one flow for both stores, over a ``ChainIO``.

The dialect-neutral half of ``toolguard.store.sealing``: each store gives a
``ChainIO`` (its queries, on one connection, inside the transaction the step
needs) and these functions decide what to seal, check every row and seal
(``toolguard.store.chain`` holds the pure hashing), and write exports. Apart
from the dialects' queries so that one flow serves PostgreSQL and SQLite.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

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
    read_export,
    sealed_at_text,
    write_export,
)

#: Rows per seal (a seal stores 40 bytes per row) and per page read by the verifier.
MAX_SEAL_ROWS = 10_000
PAGE = 5_000
SEAL_PAGE = 16
#: The seal and retention tables' columns, the same in both dialects' schemas.
_SEAL_COLUMNS = "seq, after_id, last_id, row_count, rows, prev_hash, seal_hash, sealed_at"
_RETENTION_COLUMNS = "through_seq, through_id, final_hash, rows, seals, file_sha256, dropped_at"
#: Every seal's number and last id (not its row list), for choosing what to export.
SEAL_ENDS = "SELECT seq, last_id FROM toolguard_audit_seal WHERE seq > %s ORDER BY seq"



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


def _dropped(result: ExportResult) -> ExportResult:
    return ExportResult(result.path, result.seals, result.rows, result.start, result.final,
                        result.file_sha256, True)
