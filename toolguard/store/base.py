"""What every guarded store shares: records, the fenced-write flow, error mapping.

Only the thin I/O edges differ between PostgreSQL and SQLite, sync and async;
they implement a ``Session`` (enter, finish, abort, record_failure) and the
flow in ``fenced_flow`` / ``afenced_flow`` does the rest the same way for all
four, so an accepted write, a stale token and a crash are audited identically.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import asdict, dataclass, field
from datetime import datetime
from importlib import resources
from typing import (
    TYPE_CHECKING,
    Any,
    Literal,
    Protocol,
    Self,
    TypeGuard,
    runtime_checkable,
)

from toolguard.errors import (
    AuditAppendOnly,
    BackendUnavailable,
    ConfigurationError,
    DuplicateIntent,
    IdempotencyConflict,
    IntentRejected,
    InvalidFencingToken,
    LockError,
    LockLost,
    RecordNotFound,
    StaleFencingToken,
    StoreError,
    ToolGuardError,
    TooManyRows,
    is_control_flow,
)
from toolguard.store.placeholders import check_placeholders

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

log = logging.getLogger("toolguard.store")

Decision = Literal["accepted", "rejected", "replayed", "failed", "unknown"]
#: Decisions the store writes itself; the guard may add its own (the column is free text).
DECISIONS: tuple[str, ...] = ("accepted", "rejected", "replayed", "failed", "unknown")
IntentStatus = Literal["pending", "applied", "failed", "unknown"]

#: The custom SQLSTATE class ``TG``, raised by the SQL functions in ``toolguard/sql``.
SQLSTATES: Mapping[str, type[StoreError]] = {
    "TG001": StaleFencingToken,
    "TG002": InvalidFencingToken,
    "TG003": RecordNotFound,
    "TG004": IdempotencyConflict,
    "TG005": AuditAppendOnly,
}

SCHEMA_HINT = "the toolguard schema is not installed here: run `toolguard db init`"


# --- records ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class IntentRecord:
    """What the store needs to know about one intent (all of it already validated).

    ``idempotency_key`` makes the write exactly-once; without it ``fenced()``
    still fences and audits, but a retry would apply again. ``args_hash`` is
    required with a key: the same key with another hash is a conflict.
    ``intent_id`` (the tool-call id), ``args`` (already redacted),
    ``node_attempt`` and ``policy_version`` (the version of the policy that
    decided, e.g. its hash) only go to the audit log.
    """

    tool: str
    idempotency_key: str | None = None
    args_hash: str | None = None
    agent: str | None = None
    workflow: str | None = None
    keys: tuple[str, ...] = ()
    intent_id: str | None = None
    args: Any = None
    node_attempt: int | None = None
    policy_version: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tool, str) or not self.tool:
            msg = f"an intent needs a tool name, got {self.tool!r}"
            raise StoreError(msg, reason="invalid_intent")
        if self.idempotency_key is not None and not (
                isinstance(self.idempotency_key, str) and self.idempotency_key):
            msg = f"idempotency_key must be a non-empty string or None, got {self.idempotency_key!r}"
            raise StoreError(msg, reason="invalid_intent")
        if self.idempotency_key is not None and not self.args_hash:
            msg = f"intent {self.idempotency_key!r} has an idempotency key but no args_hash"
            raise StoreError(msg, reason="invalid_intent")
        object.__setattr__(self, "keys", tuple(self.keys))
        for name in _INTENT_TEXT:
            value = getattr(self, name)
            for text in (value if name == "keys" else (value,)):
                if type(text) is str and text.isascii() and "\x00" not in text:
                    continue  # the usual text: nothing a store refuses
                problem = text_problem(text) if isinstance(text, str) else None
                if problem:
                    msg = f"intent field {name!r} {problem}: {text!r} (the stores cannot keep it)"
                    raise StoreError(msg, reason="invalid_intent")
        check_policy_version(self.policy_version, "invalid_intent")


#: The intent's text that identifies it in the stores: refused, never altered, if unstorable.
_INTENT_TEXT = ("tool", "idempotency_key", "args_hash", "agent", "workflow", "intent_id", "keys")


@dataclass(frozen=True, slots=True)
class Begun:
    """``begin_intent`` reserved the key: run the intent (``attempt`` counts from 1).

    ``previous_status`` is None for a new key, else the status of the earlier
    attempt that is being reconciled ('pending', 'failed' or 'unknown'): that
    attempt certainly did not apply, since applying records the result in the
    same transaction as the mutation.
    """

    idempotency_key: str
    attempt: int
    previous_status: str | None = None

    @property
    def reconciled(self) -> bool:
        return self.previous_status is not None


@dataclass(frozen=True, slots=True)
class Replay:
    """The intent was already applied: return ``result`` and run nothing."""

    idempotency_key: str
    result: Any
    attempts: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditEntry:
    """One audit row. ``id`` and ``at`` are set by the database.

    ``args`` must already be redacted: the store writes what it is given.
    ``policy_version`` names the version of the policy that decided (e.g. its
    hash); None (NULL) when the writer does not know it. Every row also gets a
    hash of its own content in the store (``row_hash``, see ``docs/audit.md``).
    """

    decision: str
    reason: str
    tool: str | None = None
    agent: str | None = None
    intent_id: str | None = None
    idempotency_key: str | None = None
    workflow: str | None = None
    keys: tuple[str, ...] = ()
    tokens: Mapping[str, int] = field(default_factory=dict)
    args: Any = None
    detail: str | None = None
    duration_ms: float | None = None
    node_attempt: int | None = None
    policy_version: str | None = None
    id: int | None = None
    at: datetime | None = None

    def __post_init__(self) -> None:
        if not self.decision or not self.reason:
            msg = "an audit entry needs a decision and a reason code"
            raise StoreError(msg, reason="invalid_audit")
        check_policy_version(self.policy_version, "invalid_audit")
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "tokens", dict(self.tokens))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``at`` as ISO 8601 text, ``keys`` as a list."""
        data = asdict(self)
        data["keys"] = list(self.keys)
        data["at"] = self.at.isoformat() if self.at else None
        return data

    def insert_values(self, dialect: str) -> tuple[Any, ...]:
        """Column values in ``AUDIT_COLUMNS`` order; JSON columns (and SQLite's keys) as JSON text.

        Text a store could not keep (NUL, lone surrogates) gets U+FFFD instead
        (``storable_text``): an audit row is written whatever it records.
        """
        clean = _storable_text
        listed = [storable_text(k) for k in self.keys]
        keys: Any = listed if dialect == "postgresql" else _JSON.encode(listed)
        return (clean(self.agent), clean(self.tool), clean(self.intent_id),
                clean(self.idempotency_key), clean(self.workflow), storable_text(self.decision),
                storable_text(self.reason), keys,
                _JSON.encode({storable_text(k): v for k, v in self.tokens.items()}),
                None if self.args is None else _audit_json(self.args),
                clean(self.detail),
                # Exact types, as the columns keep them (the SQLite row hash is taken from these).
                None if self.duration_ms is None else float(self.duration_ms),
                None if self.node_attempt is None else int(self.node_attempt),
                clean(self.policy_version))


AUDIT_COLUMNS = ("agent", "tool", "intent_id", "idempotency_key", "workflow", "decision", "reason",
                 "keys", "tokens", "args", "detail", "duration_ms", "node_attempt", "policy_version")
AUDIT_SELECT = ("id", "at", *AUDIT_COLUMNS)
#: Longest ``policy_version`` the stores accept (a hash with a prefix fits many times over).
POLICY_VERSION_MAX = 200


def check_policy_version(value: object, reason: str) -> None:
    """``policy_version`` is None or a short non-empty string (a hash, a tag): refused otherwise."""
    if value is None:
        return
    if not isinstance(value, str) or not value or len(value) > POLICY_VERSION_MAX:
        msg = (f"policy_version must be None or a non-empty string of at most "
               f"{POLICY_VERSION_MAX} characters (e.g. the policy's hash), got {value!r}")
        raise StoreError(msg, reason=reason)


#: Built once: ``json.dumps`` with these options would build a new encoder on every call.
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
#: Values that come back from a JSON round trip unchanged (exact types, not subclasses).
_JSON_SCALARS = (str, int, bool, type(None))


def dump_json(value: Any, what: str = "result") -> str:
    """Strict JSON text (no NaN, no arbitrary objects), so both stores keep the same value.

    Strings must be valid Unicode: a lone surrogate cannot be UTF-8, which both
    stores keep their text in, so it is refused (``not_json``) and never escaped.
    """
    try:
        text = _JSON.encode(value)
    except (TypeError, ValueError) as error:
        msg = f"the {what} must be JSON-serializable: {error}"
        raise StoreError(msg, reason="not_json") from error
    if not text.isascii() and _SURROGATE.search(text):
        where = _surrogate_path(value, what.rsplit(" ", 1)[-1]) or what
        msg = (f"the {what} must be valid Unicode: {where} holds a lone surrogate, which "
               f"UTF-8 cannot encode")
        raise StoreError(msg, reason="not_json")
    return text


# --- text every store can keep ---------------------------------------------------------------

_SURROGATE = re.compile("[\ud800-\udfff]")


def text_problem(text: str) -> str | None:
    """Why a store cannot keep ``text`` as it is (None if it can).

    PostgreSQL refuses NUL in ``text`` (SQLite keeps it), and neither store can
    keep a lone surrogate (no UTF-8 form): refused the same way on both.
    """
    if "\x00" in text:
        return "contains NUL (U+0000)"
    if not text.isascii() and _SURROGATE.search(text):
        return "is not valid Unicode (a lone surrogate)"
    return None


def storable_text(text: str) -> str:
    """``text`` with NUL and lone surrogates replaced by U+FFFD.

    For the audit log only, which must be written whatever arrives (a tool's
    error message, redacted args): an identity (a key, an idempotency key) is
    refused instead (``text_problem``), never changed.
    """
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    if not text.isascii():
        text = _SURROGATE.sub("\ufffd", text)
    return text


def storable_json(value: Any) -> Any:
    """A JSON value with every string and object key passed through ``storable_text``."""
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, Mapping):
        return {storable_text(k) if isinstance(k, str) else k: storable_json(v)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable_json(v) for v in value]
    return value


def _storable_text(value: str | None) -> str | None:
    return None if value is None else storable_text(value)


def _audit_json(value: Any) -> str:
    """Audit args as JSON text, cleaned first only when they hold text a store refuses."""
    try:
        text = _JSON.encode(value)
    except (TypeError, ValueError) as error:
        msg = f"the audit args must be JSON-serializable: {error}"
        raise StoreError(msg, reason="not_json") from error
    # NUL is escaped as \u0000 in the text (a false alarm on a literal backslash is harmless).
    if "\\u0000" in text or (not text.isascii() and _SURROGATE.search(text)):
        text = _JSON.encode(storable_json(value))
    return text


def _surrogate_path(value: Any, path: str) -> str | None:
    """Where in ``value`` the first string (or object key) with a lone surrogate is."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and _SURROGATE.search(key):
                return f"the key {key!r} of {path}"
            found = _surrogate_path(item, f"{path}[{key!r}]")
            if found:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _surrogate_path(item, f"{path}[{index}]")
            if found:
                return found
    return None


# --- migrations ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Migration:
    """One numbered schema file: ``NNN_name.sql``."""

    version: int
    name: str
    sql: str


_MIGRATION_NAME = re.compile(r"^(\d{3})_(\w+)\.sql$")


def _read_shipped(dialect: Literal["postgresql", "sqlite"]) -> tuple[Migration, ...] | str:
    """The schema files of ``dialect`` read from the package, or why they cannot be."""
    folder = resources.files("toolguard").joinpath("sql")
    if dialect == "sqlite":
        folder = folder.joinpath("sqlite")
    found: list[Migration] = []
    try:
        entries = list(folder.iterdir())
        for entry in entries:
            match = _MIGRATION_NAME.match(entry.name)
            if match and entry.is_file():
                found.append(Migration(int(match.group(1)), f"{match.group(1)}_{match.group(2)}",
                                       entry.read_text(encoding="utf-8")))
    except OSError as error:
        return f"toolguard's SQL files are missing from the installation ({folder}): {error}"
    if not found:
        return f"no schema files found in {folder}"
    found.sort(key=lambda m: m.version)
    return tuple(found)


#: The packaged schema files, read once at import: the async paths check a store's schema
#: version on their first call, and reading files there would block the event loop.
_SHIPPED: dict[str, tuple[Migration, ...] | str] = {
    dialect: _read_shipped(dialect) for dialect in ("postgresql", "sqlite")}


def migrations(dialect: Literal["postgresql", "sqlite"]) -> tuple[Migration, ...]:
    """The schema files shipped in ``toolguard/sql`` (``sql/sqlite`` for SQLite), in order.

    Read once, when toolguard is imported (no file I/O here: async paths call this)."""
    shipped = _SHIPPED[dialect]
    if isinstance(shipped, str):
        raise ConfigurationError(shipped)
    return shipped


def latest_version(dialect: Literal["postgresql", "sqlite"]) -> int:
    """The schema version this toolguard installs."""
    return migrations(dialect)[-1].version


def pending_migrations(steps: Iterable[Migration], installed: Collection[int]) -> list[Migration]:
    """The steps not recorded as installed, in version order.

    By the set of recorded versions, not by "above the highest one": files are
    numbered by whoever adds them, so a store may have received version 5 before
    version 4 exists; 4 is applied when it arrives. Every file is written to be
    independent of files with other numbers that touch other tables.
    """
    done = set(installed)
    return sorted((step for step in steps if step.version not in done), key=lambda m: m.version)


def effective_version(installed: Collection[int], shipped: Sequence[Migration]) -> int:
    """The schema version a store counts as: the highest shipped version with every shipped
    version up to it installed (so a missing file shows as "behind"); with all of them
    installed, the highest recorded one (a newer toolguard's, if any). 0: nothing installed."""
    done = set(installed)
    if not done:
        return 0
    for step in sorted(shipped, key=lambda m: m.version):
        if step.version not in done:
            below = [v for v in done if v < step.version]
            return max(below) if below else 0
    return max(done)


# --- errors --------------------------------------------------------------------------


def error_from_sqlstate(sqlstate: str | None, message: str, detail: str | None) -> StoreError | None:
    """The toolguard error for a ``TGnnn`` SQLSTATE (None for any other state)."""
    cls = SQLSTATES.get(sqlstate or "")
    if cls is None:
        return None
    if cls is StaleFencingToken:
        info: dict[str, Any] = {}
        with contextlib.suppress(ValueError, TypeError):
            info = json.loads(detail or "{}")
        return StaleFencingToken(message, key=str(info.get("key", "")), token=info.get("token"),
                                 current=info.get("current"))
    return cls(message)


def schema_missing(error: BaseException) -> StoreError:
    return StoreError(f"{SCHEMA_HINT} ({error})", reason="schema_not_installed")


@dataclass(frozen=True, slots=True)
class Failure:
    """How a failed fenced write is audited, and what becomes of its intent row."""

    decision: str
    reason: str
    status: IntentStatus | None  # None: leave the intent row alone


def classify(error: BaseException) -> Failure:
    """Pure: the audit decision/reason and intent status for an error out of ``fenced()``."""
    if isinstance(error, DuplicateIntent):
        return Failure("replayed", error.reason, None)
    if isinstance(error, IdempotencyConflict):  # the row belongs to another request
        return Failure("rejected", error.reason, None)
    if isinstance(error, StaleFencingToken | InvalidFencingToken | IntentRejected | LockError):
        return Failure("rejected", error.reason, "failed")
    if isinstance(error, BackendUnavailable):  # the commit may or may not have landed
        return Failure("failed", error.reason, "unknown")
    if isinstance(error, ToolGuardError):
        return Failure("failed", error.reason, "failed")
    if not isinstance(error, Exception):  # cancelled, interrupted, exiting
        return Failure("unknown", "cancelled", "unknown")
    if is_control_flow(error):  # a LangGraph interrupt: the call runs again on resume
        return Failure("unknown", "interrupted", "unknown")
    return Failure("failed", "error", "failed")


# --- the lease a fenced write runs under -------------------------------------------------------


@runtime_checkable
class HeldLease(Protocol):
    """What ``fenced()`` needs of a lease (``toolguard.locks.Lease`` is one): its tokens, and
    whether it is still held."""

    keys: tuple[str, ...]
    tokens: Mapping[str, int]
    released: bool

    @property
    def lost(self) -> bool: ...

    def check(self) -> None: ...


#: What ``fenced()`` takes: a lease (checked before the commit) or its tokens alone.
FenceSource = HeldLease | Mapping[str, int]


def _is_lease(value: object) -> TypeGuard[HeldLease]:
    # Duck-typed (cheaper than a runtime Protocol check, and any lease class will do).
    return all(hasattr(value, name) for name in ("tokens", "keys", "released", "lost", "check"))


def require_held(lease: HeldLease | None) -> None:
    """Raise ``LockLost`` unless ``lease`` (if any) is still held: neither lost nor released."""
    if lease is None:
        return
    if lease.released:
        msg = f"the lease on {', '.join(lease.keys)} was released before its fenced write committed"
        raise LockLost(msg, keys=lease.keys)
    lease.check()


def _lost_meanwhile(lease: HeldLease | None, error: BaseException) -> BaseException:
    """The lease's loss, if it explains a connection that broke before the commit was sent.

    A next holder may end the transaction of a holder whose lease ran out
    (PostgreSQL: ``toolguard_fence`` terminates a stale blocker), which the
    late holder sees as a lost connection: nothing was committed, and the cause
    is the lease, not the server.
    """
    if lease is None or not isinstance(error, BackendUnavailable):
        return error
    try:
        require_held(lease)
    except LockLost as lost:
        msg = f"{lost.message}; its fenced transaction was ended meanwhile ({error.message})"
        superseded = LockLost(msg, keys=lost.keys)
        superseded.__cause__ = error
        return superseded
    return error


# --- the fenced-write plan -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FencePlan:
    """Validated input of one fenced transaction: keys in canonical order, their tokens.

    Building never raises: an unusable input is kept as ``problem`` so that the
    flow can audit it like any other rejection. ``lease`` is the lease the
    tokens came from, when the caller passed one.
    """

    keys: tuple[str, ...]
    tokens: Mapping[str, int]
    intent: IntentRecord | None
    detail: str | None
    started: float
    problem: ToolGuardError | None = None
    lease: HeldLease | None = None

    @classmethod
    def build(cls, source: FenceSource, intent: IntentRecord | None,
              detail: str | None = None) -> FencePlan:
        started = time.monotonic()
        problem: ToolGuardError | None = None
        clean: dict[str, int] = {}
        lease: HeldLease | None = None
        tokens: Any = source
        if not isinstance(source, Mapping) and _is_lease(source):
            lease, tokens = source, source.tokens
        try:
            items = list(tokens.items())
        except AttributeError:
            items = []
            problem = InvalidFencingToken(
                f"fenced() takes a Lease or a mapping of key to token, got {source!r}")
        for key, token in items:
            if not isinstance(key, str) or not key:
                problem = problem or InvalidFencingToken(f"fencing keys must be non-empty strings, "
                                                         f"got {key!r}")
            elif (unstorable := text_problem(key)) is not None:
                problem = problem or InvalidFencingToken(f"fencing key {key!r} {unstorable}")
            elif not isinstance(token, int) or isinstance(token, bool) or token <= 0:
                problem = problem or InvalidFencingToken(
                    f"fencing token for key {key!r} must be a positive integer, got {token!r}")
            else:
                clean[key] = token
        if not items and problem is None:
            problem = InvalidFencingToken("a fenced write needs at least one key and its token")
        given: object = intent  # untyped callers may pass anything
        if given is not None and not isinstance(given, IntentRecord):
            problem = problem or StoreError(f"intent must be an IntentRecord, got {intent!r}",
                                            reason="invalid_intent")
            intent = None
        keys = tuple(sorted(clean))
        return cls(keys, {k: clean[k] for k in keys}, intent, detail, started, problem, lease)

    @property
    def idempotency_key(self) -> str | None:
        return self.intent.idempotency_key if self.intent else None

    def elapsed_ms(self) -> float:
        return round((time.monotonic() - self.started) * 1000, 3)

    def entry(self, decision: str, reason: str, detail: str | None) -> AuditEntry:
        """The audit row for this write's outcome."""
        intent = self.intent
        return AuditEntry(
            decision=decision, reason=reason,
            tool=intent.tool if intent else None,
            agent=intent.agent if intent else None,
            intent_id=intent.intent_id if intent else None,
            idempotency_key=intent.idempotency_key if intent else None,
            workflow=intent.workflow if intent else None,
            keys=self.keys, tokens=self.tokens,
            args=intent.args if intent else None,
            detail=detail, duration_ms=self.elapsed_ms(),
            node_attempt=intent.node_attempt if intent else None,
            policy_version=intent.policy_version if intent else None,
        )

    def failure_entry(self, error: BaseException) -> tuple[AuditEntry, IntentStatus | None]:
        outcome = classify(error)
        text = str(error) or type(error).__name__
        return self.entry(outcome.decision, outcome.reason, text[:4000]), outcome.status


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


# --- the flow --------------------------------------------------------------------------


class Session(Protocol):
    """One connection's worth of the fenced flow (sync)."""

    def enter(self, plan: FencePlan) -> FencedTransaction: ...

    def finish(self, tx: FencedTransaction, entry: AuditEntry) -> None: ...

    def abort(self, error: BaseException) -> BaseException:
        """End the transaction (or leave its end to ``record_failure``): a replay that
        ``enter`` found commits its fence advance, anything else rolls back."""
        ...

    def record_failure(self, plan: FencePlan, entry: AuditEntry,
                       status: IntentStatus | None) -> None: ...


class AsyncSession(Protocol):
    """One connection's worth of the fenced flow (asyncio)."""

    async def enter(self, plan: FencePlan) -> AsyncFencedTransaction: ...

    async def finish(self, tx: AsyncFencedTransaction, entry: AuditEntry) -> None: ...

    async def abort(self, error: BaseException) -> BaseException: ...

    async def record_failure(self, plan: FencePlan, entry: AuditEntry,
                             status: IntentStatus | None) -> None: ...


_AUDITED = "_toolguard_audited"


def mark_audited(error: BaseException) -> None:
    """Note on the exception that its audit row is written, so no caller writes a second one."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(error, _AUDITED, True)


def was_audited(error: BaseException) -> bool:
    return bool(getattr(error, _AUDITED, False))


def _raise(error: BaseException, cause: BaseException) -> None:
    if error is cause:
        raise error
    raise error from cause


@contextlib.contextmanager
def fenced_flow(session: AbstractContextManager[Session], source: FenceSource,
                intent: IntentRecord | None, detail: str | None) -> Iterator[FencedTransaction]:
    """Fence, run the tool, record and audit, commit; on failure roll back and audit outside.

    A replay (``DuplicateIntent`` from ``enter``) is the one failure whose fence
    advance is committed: its tokens were checked, so lower ones must be refused
    afterwards; the intent row is left as it was. With a lease, it must still
    be held right before the commit is sent (``LockLost`` otherwise). It is not
    checked at entry: a holder that paused before its write meets the fence
    there, the data tier's own refusal.
    """
    plan = FencePlan.build(source, intent, detail)
    committing = False
    with session as s:
        try:
            if plan.problem is not None:
                raise plan.problem
            tx = s.enter(plan)
            yield tx
            require_held(plan.lease)
            committing = True
            s.finish(tx, plan.entry("accepted", "applied", tx.detail))
        except BaseException as raised:
            error = s.abort(raised)
            if not committing:
                error = _lost_meanwhile(plan.lease, error)
            entry, status = plan.failure_entry(error)
            try:
                s.record_failure(plan, entry, status)
                mark_audited(error)
                mark_audited(raised)
            except Exception as audit_error:  # never hide the real failure behind the audit's
                log.warning("could not audit a failed fenced write (%s): %s", entry.reason,
                            audit_error)
            _raise(error, raised)


@contextlib.asynccontextmanager
async def afenced_flow(session: AbstractAsyncContextManager[AsyncSession],
                       source: FenceSource, intent: IntentRecord | None,
                       detail: str | None) -> AsyncIterator[AsyncFencedTransaction]:
    """The asyncio twin of ``fenced_flow``; a cancelled write is audited as ``unknown``.

    A commit, once sent, runs to its end: a cancellation that arrives meanwhile
    is raised after it, marked audited when the commit wrote the call's row.
    """
    plan = FencePlan.build(source, intent, detail)
    committing = committed = False
    try:
        async with session as s:
            try:
                if plan.problem is not None:
                    raise plan.problem
                tx = await s.enter(plan)
                yield tx
                require_held(plan.lease)
                committing = True
                # The commit is not cut by a cancellation (a worker thread or the server would
                # finish it anyway): its outcome is awaited, so the call is audited as what it
                # became, once, and the connection goes back idle.
                cancelled = await _to_the_end(s.finish(tx, plan.entry("accepted", "applied", tx.detail)))
                committed = True
                if cancelled is not None:  # committed and audited: the caller still stops
                    mark_audited(cancelled)
                    raise cancelled
            except BaseException as raised:
                if committed:
                    raise
                error = await s.abort(raised)
                if not committing:
                    error = _lost_meanwhile(plan.lease, error)
                entry, status = plan.failure_entry(error)
                try:
                    await s.record_failure(plan, entry, status)
                    mark_audited(error)
                    mark_audited(raised)
                except Exception as audit_error:
                    log.warning("could not audit a failed fenced write (%s): %s", entry.reason,
                                audit_error)
                _raise(error, raised)
    except asyncio.CancelledError as cancelled:
        # the session's own end (the connection going back) may be cut after the commit:
        # the commit wrote the call's row, so no other follows
        if committed:
            mark_audited(cancelled)
        raise


async def _to_the_end(work: Awaitable[None]) -> asyncio.CancelledError | None:
    """Await ``work`` to its end whatever cancellation arrives meanwhile; the first one, if any.

    Used for the commit: the database may apply it whether or not the caller
    still waits, so the caller learns how it ended before it stops.
    """
    task = asyncio.ensure_future(work)
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as error:
            if task.cancelled():  # the commit itself was cancelled (the loop is shutting down)
                raise
            cancelled = cancelled or error
            continue
        return cancelled


# --- audit queries -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditQuery:
    """Filters of ``query_audit``; ``where()`` renders them for one dialect."""

    decision: str | Collection[str] | None = None
    reason: str | Collection[str] | None = None
    tool: str | Collection[str] | None = None
    agent: str | Collection[str] | None = None
    key: str | None = None
    idempotency_key: str | None = None
    intent_id: str | None = None
    workflow: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    after_id: int | None = None
    limit: int | None = 100
    newest_first: bool = True

    def __post_init__(self) -> None:
        for moment in (self.since, self.until):
            if moment is not None and moment.tzinfo is None:
                msg = "since/until must be timezone-aware datetimes"
                raise StoreError(msg, reason="invalid_query")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 0):
            msg = f"limit must be a non-negative integer or None, got {self.limit!r}"
            raise StoreError(msg, reason="invalid_query")

    def where(self, dialect: str, moment: Callable[[datetime], Any]) -> tuple[str, list[Any]]:
        """A ``WHERE ...`` clause (or "") and its parameters, with ``%s`` placeholders."""
        clauses: list[str] = []
        params: list[Any] = []
        for column in ("decision", "reason", "tool", "agent"):
            value = getattr(self, column)
            if value is None:
                continue
            values = [value] if isinstance(value, str) else list(value)
            clauses.append(f"{column} IN ({', '.join(['%s'] * len(values))})" if values else "1 = 0")
            params.extend(values)
        for column in ("idempotency_key", "intent_id", "workflow"):
            value = getattr(self, column)
            if value is not None:
                clauses.append(f"{column} = %s")
                params.append(value)
        if self.key is not None:
            if dialect == "postgresql":
                clauses.append("keys @> ARRAY[%s]::text[]")
            else:
                clauses.append("EXISTS (SELECT 1 FROM json_each(toolguard_audit.keys) "
                               "WHERE json_each.value = %s)")
            params.append(self.key)
        if self.since is not None:
            clauses.append("at >= %s")
            params.append(moment(self.since))
        if self.until is not None:
            clauses.append("at < %s")
            params.append(moment(self.until))
        if self.after_id is not None:
            clauses.append("id > %s")
            params.append(self.after_id)
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", params

    def tail(self) -> tuple[str, list[Any]]:
        order = " ORDER BY id DESC" if self.newest_first else " ORDER BY id"
        if self.limit is None:
            return order, []
        return order + " LIMIT %s", [self.limit]


def finite_ms(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


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
