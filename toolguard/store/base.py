"""The guarded store's public shape: its protocols and the transaction a tool is handed.

``GuardedStore`` / ``AsyncGuardedStore`` are what every dialect implements and
every caller types against; ``FencedTransaction`` / ``AsyncFencedTransaction``
are what a tool gets inside ``fenced()``. The rest lives beside it, by what it
does, and is re-exported here so ``toolguard.store.base`` stays the one import
path:

- ``toolguard.store.records``: intent and audit records, ``AuditQuery``;
- ``toolguard.store.storable``: strict JSON and text every store can keep;
- ``toolguard.store.schema``: the shipped migrations and the ``TGnnn`` SQLSTATEs;
- ``toolguard.store.flow``: the fenced-write flow (``fenced_flow`` /
  ``afenced_flow``), its ``FencePlan`` and the lease it runs under.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

from toolguard.errors import ConfigurationError, RecordNotFound, StoreError, ToolGuardError, TooManyRows
from toolguard.store.flow import AsyncSession as AsyncSession
from toolguard.store.flow import Failure as Failure
from toolguard.store.flow import FencePlan, FenceSource, HeldLease, require_held
from toolguard.store.flow import Session as Session
from toolguard.store.flow import afenced_flow as afenced_flow
from toolguard.store.flow import classify as classify
from toolguard.store.flow import fenced_flow as fenced_flow
from toolguard.store.flow import mark_audited as mark_audited
from toolguard.store.flow import was_audited as was_audited
from toolguard.store.placeholders import check_placeholders
from toolguard.store.reads import ReadCheck
from toolguard.store.records import AUDIT_COLUMNS as AUDIT_COLUMNS
from toolguard.store.records import AUDIT_SELECT as AUDIT_SELECT
from toolguard.store.records import DECISIONS, AuditEntry, Begun, Decision, IntentRecord, IntentStatus, Replay
from toolguard.store.records import POLICY_VERSION_MAX as POLICY_VERSION_MAX
from toolguard.store.records import AuditQuery as AuditQuery
from toolguard.store.records import check_policy_version as check_policy_version
from toolguard.store.records import finite_ms as finite_ms
from toolguard.store.schema import SCHEMA_HINT as SCHEMA_HINT
from toolguard.store.schema import (
    SQLSTATES,
    Migration,
    effective_version,
    error_from_sqlstate,
    latest_version,
    migrations,
    pending_migrations,
)
from toolguard.store.schema import schema_missing as schema_missing
from toolguard.store.storable import _JSON_SCALARS, dump_json, storable_json, storable_text, text_problem

if TYPE_CHECKING:
    import os
    from contextlib import AbstractAsyncContextManager, AbstractContextManager

    from toolguard.store.chain import AuditVerification, ExportResult, SealResult

__all__ = [
    "DECISIONS",
    "SQLSTATES",
    "AsyncFencedTransaction",
    "AsyncGuardedStore",
    "AuditEntry",
    "Begun",
    "Decision",
    "FencePlan",
    "FenceSource",
    "FencedTransaction",
    "GuardedStore",
    "HeldLease",
    "IntentRecord",
    "IntentStatus",
    "Migration",
    "Replay",
    "dump_json",
    "effective_version",
    "error_from_sqlstate",
    "expected_rows",
    "latest_version",
    "migrations",
    "pending_migrations",
    "qmark",
    "require_held",
    "storable_json",
    "storable_text",
    "text_problem",
]


# --- the transaction handed to the tool ------------------------------------------------------


_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%s|%%")


def qmark(sql: str) -> str:
    """psycopg placeholders to sqlite3 ones: ``%s`` -> ``?``, ``%(n)s`` -> ``:n``, ``%%`` -> ``%``."""
    def swap(match: re.Match[str]) -> str:
        text = match.group(0)
        if text == "%%":
            return "%"
        return "?" if text == "%s" else f":{match.group(1)}"

    return _PLACEHOLDER.sub(swap, sql)


class _TxBase:
    """State shared by the sync and async transaction objects."""

    def __init__(self, connection: Any, plan: FencePlan, dialect: str) -> None:
        self.connection = connection
        self.plan = plan
        self.tokens: Mapping[str, int] = plan.tokens
        self.keys: tuple[str, ...] = plan.keys
        self.intent = plan.intent
        self.dialect = dialect
        #: Free text for the accepted audit row.
        self.detail: str | None = plan.detail
        self.recorded = False
        self._result: Any = None
        self._result_json = "null"
        #: A toolguard error seen by ``execute`` (e.g. TG001 from the tool's own fenced SQL):
        #: re-raised at commit if the tool swallowed it.
        self.failure: ToolGuardError | None = None
        #: The lease the tokens came from, when ``fenced()`` was given one.
        self.lease: Any = plan.lease
        #: A read: the version of each key read before the tool's own reads (what is recorded).
        self.versions: dict[str, int] = {}
        #: ``stale_reads: shadow``: the refusal the read check would have made (the write applies).
        self.would_refuse: ToolGuardError | None = None

    @property
    def result(self) -> Any:
        return self._result

    @result.setter
    def result(self, value: Any) -> None:
        self.record(value)

    def record(self, result: Any) -> None:
        """Set the intent's result, stored in the same commit and returned on replays (JSON)."""
        self._result_json = dump_json(result)
        # What a replay will return: the value as JSON gives it back (tuples become lists...).
        self._result = result if type(result) in _JSON_SCALARS else json.loads(self._result_json)
        self.recorded = True

    @property
    def result_json(self) -> str:
        return self._result_json

    def _require_rows(self, expected: int, cursor: Any, sql: str) -> None:
        actual = matched_rows(cursor)
        if actual != expected:
            error = row_count_error(expected, actual, sql)
            self.failure = error  # re-raised at commit if the tool swallows it
            raise error

    @property
    def tokens_json(self) -> str:
        """The tokens as JSON text, as the intent row records them."""
        return dump_json(dict(self.tokens), "tokens")


#: A session's statement runner: ``(sql, params, counted)``; ``counted`` asks for a cursor
#: whose ``matched`` (or ``rowcount``) is the rows the statement returned or changed.
Execute = Callable[[str, Any, bool], Any]


class FencedTransaction(_TxBase):
    """An open fenced transaction: fences checked, intent locked, not yet committed.

    Run the tool's reads and writes with ``execute`` (or on ``connection``,
    never committing it), then ``record()`` the result. ``execute`` takes
    psycopg-style ``%s`` placeholders on both stores, and refuses on both what
    one of them would refuse or misread (``toolguard.store.placeholders``).
    """

    def __init__(self, connection: Any, plan: FencePlan, dialect: str, execute: Execute) -> None:
        super().__init__(connection, plan, dialect)
        self._execute = execute

    def execute(self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None, *,
                expect_rows: int | None = None) -> Any:
        """Run one statement in the transaction; returns the driver's cursor.

        ``expect_rows=n`` requires the statement to match exactly ``n`` rows (the
        rows it changed, or returned for a SELECT / ``RETURNING``): fewer raise
        ``RecordNotFound``, more ``TooManyRows``, and the transaction cannot commit.
        """
        expected = expected_rows(expect_rows)
        if params is not None:
            check_placeholders(sql)  # the same SQL on every store
        cursor = self._execute(sql, params, expected is not None)
        if expected is not None:
            self._require_rows(expected, cursor, sql)
        return cursor


class AsyncFencedTransaction(_TxBase):
    """The asyncio twin of ``FencedTransaction``: ``await tx.execute(...)``, then
    ``await cursor.fetchone()``."""

    def __init__(self, connection: Any, plan: FencePlan, dialect: str,
                 execute: Callable[[str, Any, bool], Awaitable[Any]]) -> None:
        super().__init__(connection, plan, dialect)
        self._execute = execute

    async def execute(self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None, *,
                      expect_rows: int | None = None) -> Any:
        """Run one statement in the transaction; returns an async cursor (``expect_rows``: as
        ``FencedTransaction.execute``)."""
        expected = expected_rows(expect_rows)
        if params is not None:
            check_placeholders(sql)
        cursor = await self._execute(sql, params, expected is not None)
        if expected is not None:
            self._require_rows(expected, cursor, sql)
        return cursor


def expected_rows(value: object) -> int | None:
    """``expect_rows`` validated: None or a row count."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        msg = f"expect_rows must be a row count (an int >= 0) or None, got {value!r}"
        raise ConfigurationError(msg)
    return value


def matched_rows(cursor: Any) -> int:
    """Rows a statement returned (if it returns rows) or changed, from a ``counted`` cursor."""
    matched = getattr(cursor, "matched", None)
    return int(cursor.rowcount if matched is None else matched)


def row_count_error(expected: int, actual: int, sql: str) -> StoreError:
    """``RecordNotFound`` for fewer rows than expected, ``TooManyRows`` for more."""
    statement = " ".join(sql.split())
    statement = statement if len(statement) <= 200 else statement[:199] + "\u2026"
    plural = "" if expected == 1 else "s"
    msg = f"expected {expected} row{plural}, the statement matched {actual}: {statement}"
    if actual < expected:
        return RecordNotFound(msg, expected=expected, actual=actual)
    return TooManyRows(msg, expected=expected, actual=actual)



# --- the public shape --------------------------------------------------------------------


@runtime_checkable
class GuardedStore(Protocol):
    """The sync guarded store: fences, exactly-once intents, an append-only audit log whose
    rows are hashed and sealed into a chain (``seal_audit``, ``verify_audit``, ``export_audit``)."""

    dialect: str

    def install(self) -> int: ...

    def schema_version(self) -> int: ...

    def begin_intent(self, record: IntentRecord) -> Begun | Replay: ...

    def fenced(self, lease: FenceSource, intent: IntentRecord | None = None, *,
               detail: str | None = None,
               reads: ReadCheck | None = None) -> AbstractContextManager[FencedTransaction]: ...

    def read(self, keys: Iterable[str], intent: IntentRecord | None = None, *, caller: str,
             detail: str | None = None) -> AbstractContextManager[FencedTransaction]: ...

    def audit(self, entry: AuditEntry) -> AuditEntry: ...

    def mark_unknown(self, idempotency_key: str, record: IntentRecord | None = None) -> bool: ...

    def has_applied(self, tool: str, resource_key: str, workflow: str | None = None) -> bool: ...

    def high_water(self, key: str) -> int: ...

    def high_waters(self, keys: Iterable[str]) -> dict[str, int]: ...

    def query_audit(self, **filters: Any) -> list[AuditEntry]: ...

    def seal_audit(self, *, max_rows: int = ..., wait_s: float = ...) -> SealResult: ...

    def verify_audit(self, *, anchor: str | Sequence[str] | None = None,
                     exports: Sequence[str | os.PathLike[str]] = ()) -> AuditVerification: ...

    def export_audit(self, path: str | os.PathLike[str], *, before: datetime | None = None,
                     through_seq: int | None = None, drop: bool = False) -> ExportResult: ...

    def connection(self) -> AbstractContextManager[Any]: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...  # ``with open_store(...) as store:`` closes it at the end

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class AsyncGuardedStore(Protocol):
    """The asyncio guarded store: the same methods, awaited."""

    dialect: str

    async def install(self) -> int: ...

    async def schema_version(self) -> int: ...

    async def begin_intent(self, record: IntentRecord) -> Begun | Replay: ...

    def fenced(self, lease: FenceSource, intent: IntentRecord | None = None, *,
               detail: str | None = None, reads: ReadCheck | None = None
               ) -> AbstractAsyncContextManager[AsyncFencedTransaction]: ...

    def read(self, keys: Iterable[str], intent: IntentRecord | None = None, *, caller: str,
             detail: str | None = None) -> AbstractAsyncContextManager[AsyncFencedTransaction]: ...

    async def audit(self, entry: AuditEntry) -> AuditEntry: ...

    async def mark_unknown(self, idempotency_key: str,
                           record: IntentRecord | None = None) -> bool: ...

    async def has_applied(self, tool: str, resource_key: str,
                          workflow: str | None = None) -> bool: ...

    async def high_water(self, key: str) -> int: ...

    async def high_waters(self, keys: Iterable[str]) -> dict[str, int]: ...

    async def query_audit(self, **filters: Any) -> list[AuditEntry]: ...

    async def seal_audit(self, *, max_rows: int = ..., wait_s: float = ...) -> SealResult: ...

    async def verify_audit(self, *, anchor: str | Sequence[str] | None = None,
                           exports: Sequence[str | os.PathLike[str]] = ()
                           ) -> AuditVerification: ...

    async def export_audit(self, path: str | os.PathLike[str], *,
                           before: datetime | None = None, through_seq: int | None = None,
                           drop: bool = False) -> ExportResult: ...

    def connection(self) -> AbstractAsyncContextManager[Any]: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc: object) -> None: ...
