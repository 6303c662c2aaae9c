"""The PostgreSQL guarded store (psycopg 3 + psycopg_pool), sync and asyncio.

All logic that must hold for every client lives in SQL (``toolguard/sql``);
this module only calls it. A fenced write costs two round trips besides the
tool's own statements: ``BEGIN; SELECT toolguard_enter(...)`` (every fence, in
sorted order, then the intent row: created, locked, checked for a replay or a
conflict) as one message, then ``SELECT toolguard_apply(...); INSERT INTO
toolguard_audit ...; COMMIT`` as one message. Both are sent with client-side
binding, which costs less client CPU than pipeline mode for the same single
round trip: a ``ClientCursor`` subclass kept per connection (``_HotCursor``)
quotes each value as one literal (never formatted into the SQL by hand) and
skips psycopg's per-value adapters and prepared-statement bookkeeping; any
other value type, or unusual server settings, take psycopg's own quoting. A failed write
sends its ``ROLLBACK`` together with the audit row (written after the
rollback, in a transaction of its own) the same way. A replay (the intent was
applied before) sends ``COMMIT`` instead: its fences were checked and advanced
before the replay was found, and the store must remember the tokens it has seen
(schema version 6 leaves the applied intent row unwritten, so only the fence
advance commits). Each audit row's hash is set by a trigger in the same
``INSERT`` (schema version 5): no round trip, and no lock shared between
writers; sealing the log (``seal_audit``) happens apart from the calls
(``toolguard.store.sealing``).

Connections are autocommit; a fenced write opens its own transaction. With
``schema=...`` every pooled connection uses that schema alone as its
``search_path`` (handy for tests and for several installs in one database).

A holder stopped inside its fenced transaction keeps its fence rows locked;
since schema version 3 the next holder, whose token for the key is newer, ends
that transaction once the stopped holder's lease is gone (see
``toolguard/sql/README.md``: it needs the same role for every client, or
``pg_signal_backend``). The stopped holder's attempt then fails when it wakes:
``LockLost`` when it passed its lease to ``fenced()``, else
``BackendUnavailable``; audited once, its intent not applied.

Errors: the ``TGnnn`` SQLSTATEs of ``toolguard/sql`` become their typed errors;
a statement the server ended (``statement_timeout`` or a cancel, a deadlock, a
serialization failure, ``lock_timeout``) becomes a ``TransactionAborted``
subclass with its own reason code (``statement_timeout``, ``query_canceled``,
``deadlock``, ``serialization_failure``, ``lock_not_available``); a lost
server ``BackendUnavailable``. Inside ``fenced()`` each is audited once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import re
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, Concatenate, Final, ParamSpec, TypeVar, cast

import psycopg
from psycopg import generators, sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from toolguard.cancellation import finish
from toolguard.connection_errors import definitive, misconfigured, postgres_probe_options
from toolguard.errors import (
    BackendUnavailable,
    ConfigurationError,
    DuplicateIntent,
    StoreError,
    ToolGuardError,
)
from toolguard.store.autoseal import DEFAULT_AUTOSEAL, AutoSeal, AutoSealer
from toolguard.store.base import (
    AUDIT_COLUMNS,
    AUDIT_SELECT,
    AsyncFencedTransaction,
    AuditEntry,
    AuditQuery,
    Begun,
    FencedTransaction,
    FencePlan,
    FenceSource,
    IntentRecord,
    IntentStatus,
    Migration,
    Replay,
    afenced_flow,
    effective_version,
    error_from_sqlstate,
    fenced_flow,
    finite_ms,
    migrations,
    pending_migrations,
    schema_missing,
)
from toolguard.store.chain import AuditVerification, ExportResult, SealResult
from toolguard.store.sealing import MAX_SEAL_ROWS, check_anchors, pg_export, pg_seal, pg_verify

__all__ = [
    "AsyncPostgresStore",
    "Deadlock",
    "LockNotAvailable",
    "PostgresStore",
    "SerializationFailure",
    "StatementTimeout",
    "TransactionAborted",
]

log = logging.getLogger("toolguard.store")

P = ParamSpec("P")
T = TypeVar("T")

DIALECT: Final = "postgresql"

INSTALL_LOCK = "SELECT pg_advisory_xact_lock(hashtext('toolguard.install'))"
VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS toolguard_schema_version (
    version integer PRIMARY KEY, name text NOT NULL,
    installed_at timestamptz NOT NULL DEFAULT now())"""
RECORD_VERSION = ("INSERT INTO toolguard_schema_version (version, name) VALUES (%s, %s) "
                  "ON CONFLICT (version) DO NOTHING")
INSTALLED = "SELECT version FROM toolguard_schema_version"
HAS_VERSION_TABLE = "SELECT to_regclass('toolguard_schema_version') IS NOT NULL"

BEGIN_INTENT = ("SELECT outcome, previous_status, attempts, result FROM toolguard_begin_intent("
                "%s::text, %s::text, %s::text, %s::text, %s::text[], %s::text)")
ENTER = ("SELECT applied, result FROM toolguard_enter("
         "%s::text[], %s::bigint[], %s::text, %s::text, %s::text, %s::text, %s::text, %s::text[])")
#: One message (client-side binding): open the transaction and fence it.
ENTER_TX = "BEGIN; " + ENTER
#: ``json``, not ``jsonb``: the result's text is kept exactly (NUL, key order, 1e16...).
APPLY = "SELECT toolguard_record(%s::text, %s::json, %s::jsonb)"
_AUDIT_VALUES = ("%s, %s, %s, %s, %s, %s, %s, %s::text[], %s::jsonb, %s::jsonb, %s, "
                 "%s::double precision, %s::integer, %s::text")
_AUDIT_INTO = f"INSERT INTO toolguard_audit ({', '.join(AUDIT_COLUMNS)}) VALUES ({_AUDIT_VALUES})"
AUDIT_INSERT = f"{_AUDIT_INTO} RETURNING id, at"
#: One message (client-side binding): record the result, write the audit row, commit.
FINISH_TX = f"{APPLY}; {_AUDIT_INTO}; COMMIT"
FINISH_TX_NO_INTENT = f"{_AUDIT_INTO}; COMMIT"
# Upsert the intent row as 'failed'/'unknown' (its own row may have been rolled back with the
# failed transaction), never touching an applied row or another request's row (other tool or
# args). An attempt the row has not counted yet (its status is not 'pending') is counted here.
_INTENT_FAILED = (
    "INSERT INTO toolguard_intent AS i (idempotency_key, tool, agent, workflow, keys, args_hash, "
    "status, last_error) "
    "SELECT %s::text, %s::text, %s::text, %s::text, %s::text[], %s::text, %s::text, %s::text "
    "WHERE %s::boolean "
    "ON CONFLICT (idempotency_key) DO UPDATE SET status = EXCLUDED.status, "
    "last_error = EXCLUDED.last_error, updated_at = now(), "
    "attempts = i.attempts + (i.status <> 'pending')::integer "
    "WHERE i.status <> 'applied' AND i.tool = EXCLUDED.tool AND i.args_hash = EXCLUDED.args_hash "
    "RETURNING 1")
# One statement, so the audit row and the intent's status land together (or not at all).
FAILURE = f"WITH failed AS ({_INTENT_FAILED}) {_AUDIT_INTO}"
#: One message (client-side binding): end the failed transaction, then record the failure in a
#: transaction of its own (statements after ROLLBACK in one simple query commit together).
ROLLBACK_FAILURE = f"ROLLBACK; {FAILURE}"
#: The same for a replay found by ``toolguard_enter``: its fence advance is committed (the
#: store has seen its tokens), the intent row was left as it was, and the audit row follows.
COMMIT_FAILURE = f"COMMIT; {FAILURE}"
_OPEN = (TransactionStatus.INTRANS, TransactionStatus.INERROR)
MARK_UNKNOWN = ("UPDATE toolguard_intent SET status = 'unknown', updated_at = now() "
                "WHERE idempotency_key = %s AND status <> 'applied'")
MARK_UNKNOWN_UPSERT = (
    "INSERT INTO toolguard_intent AS i (idempotency_key, tool, agent, workflow, keys, args_hash, "
    "status) VALUES (%s::text, %s::text, %s::text, %s::text, %s::text[], %s::text, 'unknown') "
    "ON CONFLICT (idempotency_key) DO UPDATE SET status = 'unknown', updated_at = now() "
    "WHERE i.status <> 'applied' AND i.tool = EXCLUDED.tool AND i.args_hash = EXCLUDED.args_hash")
HAS_APPLIED = ("SELECT EXISTS (SELECT 1 FROM toolguard_intent WHERE status = 'applied' "
               "AND tool = %s AND keys @> ARRAY[%s::text] "
               "AND (%s::text IS NULL OR workflow = %s::text))")
HIGH_WATERS = "SELECT key, token FROM toolguard_high_water WHERE key = ANY(%s::text[])"
AUDIT_QUERY = f"SELECT {', '.join(AUDIT_SELECT)} FROM toolguard_audit"

POOL_EXHAUSTED = "the server answers, but the pool had no free connection in time"
_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$")
#: SQLSTATEs that mean "the server went away" (class 08, admin/crash shutdown, starting up).
_GONE = ("57P01", "57P02", "57P03")


class TransactionAborted(StoreError):
    """PostgreSQL ended a statement, and with it its transaction: nothing of it was committed.

    The server's own refusal to go on (a timeout, a deadlock, a serialization
    failure), not toolguard's; ``sqlstate`` names it. A fenced write that meets
    one is audited once as ``failed`` with this reason, its intent marked
    'failed', and the call may be retried.
    """

    reason = "transaction_aborted"

    def __init__(self, message: str, *, sqlstate: str | None = None,
                 reason: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.sqlstate = sqlstate


class StatementTimeout(TransactionAborted):
    """SQLSTATE 57014: ``statement_timeout`` ran out (reason ``statement_timeout``), or the
    statement was cancelled (``pg_cancel_backend``, a client's cancel: ``query_canceled``)."""

    reason = "statement_timeout"


class Deadlock(TransactionAborted):
    """SQLSTATE 40P01: PostgreSQL broke a deadlock by ending this transaction."""

    reason = "deadlock"


class SerializationFailure(TransactionAborted):
    """SQLSTATE 40001: a REPEATABLE READ or SERIALIZABLE transaction could not be serialized."""

    reason = "serialization_failure"


class LockNotAvailable(TransactionAborted):
    """SQLSTATE 55P03: a row or table lock was not granted within the session's
    ``lock_timeout`` (or ``NOWAIT``)."""

    reason = "lock_not_available"


#: What a SQLSTATE that ends the statement and its transaction becomes.
_ABORTED: dict[str, type[TransactionAborted]] = {
    "57014": StatementTimeout,
    "40P01": Deadlock,
    "40001": SerializationFailure,
    "55P03": LockNotAvailable,
}


def _aborted(error: psycopg.Error, state: str) -> TransactionAborted:
    cls = _ABORTED[state]
    said = (error.diag.message_primary or str(error)).strip()
    reason = None
    if cls is StatementTimeout and "statement timeout" not in said:
        reason = "query_canceled"
    msg = (f"postgresql ended the statement ({said}); its transaction was rolled back, "
           f"nothing of it was committed, and the call may be retried")
    return cls(msg, sqlstate=state, reason=reason)


def check_url(url: str) -> None:
    """Fail early, as a ``ConfigurationError``, on a URL libpq cannot parse."""
    try:
        conninfo_to_dict(url)
    except psycopg.Error as error:
        msg = f"invalid PostgreSQL URL: {error}"
        raise ConfigurationError(msg) from error


def check_schema(schema: str | None) -> str | None:
    if schema is not None and not _SCHEMA_NAME.match(schema):
        msg = f"schema must be a plain SQL identifier, got {schema!r}"
        raise ConfigurationError(msg)
    return schema


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)


def translate(error: BaseException) -> BaseException:
    """psycopg/pool errors to toolguard's; anything else is returned unchanged."""
    if isinstance(error, ToolGuardError):
        return error
    if isinstance(error, PoolTimeout):
        return BackendUnavailable(f"postgresql: no connection within the pool timeout: {error}")
    if not isinstance(error, psycopg.Error):
        return error
    state = error.sqlstate
    mapped = error_from_sqlstate(state, error.diag.message_primary or str(error),
                                 error.diag.message_detail)
    if mapped is not None:
        return mapped
    if state in _ABORTED:
        return _aborted(error, state)
    if isinstance(error, psycopg.OperationalError) and (
            state is None or state.startswith("08") or state in _GONE):
        return BackendUnavailable(f"postgresql: {str(error).strip()}")
    if isinstance(error, psycopg.InterfaceError) and state is None:
        return BackendUnavailable(f"postgresql: {str(error).strip()}")
    if state in ("42P01", "42883", "3F000") and "toolguard_" in str(error):
        return schema_missing(error)
    return error


def _raise_translated(error: BaseException) -> None:
    mapped = translate(error)
    if mapped is error:
        raise error
    raise mapped from error


def _entry(row: Sequence[Any]) -> AuditEntry:
    values = dict(zip(AUDIT_SELECT, row, strict=True))
    values["keys"] = tuple(values["keys"] or ())
    values["tokens"] = {k: int(v) for k, v in (values["tokens"] or {}).items()}
    values["duration_ms"] = finite_ms(values["duration_ms"])
    return AuditEntry(**values)


def _begin_params(record: IntentRecord) -> tuple[Any, ...]:
    if record.idempotency_key is None:
        msg = f"begin_intent needs an idempotency key (tool {record.tool!r})"
        raise StoreError(msg, reason="invalid_intent")
    return (record.idempotency_key, record.tool, record.agent, record.workflow,
            list(record.keys), record.args_hash)


def _begun(key: str, row: Sequence[Any]) -> Begun | Replay:
    outcome, previous, attempts, result = row
    if outcome == "replay":
        return Replay(key, result, int(attempts))
    return Begun(key, int(attempts), previous)


def text_array(values: Iterable[Any]) -> str:
    """A ``text[]`` input literal, every element quoted: the value of one ``%s::text[]`` parameter.

    The same text psycopg's list dumper produces, without its per-element type
    inspection. It is still a bound parameter: psycopg quotes the whole literal
    as one string. None becomes NULL; anything else its ``str()``.
    """
    parts = []
    for value in values:
        if value is None:
            parts.append("NULL")
            continue
        text = value if type(value) is str else str(value)
        if "\\" in text or '"' in text:
            text = text.replace("\\", "\\\\").replace('"', '\\"')
        parts.append('"' + text + '"')
    return "{" + ",".join(parts) + "}"


def _bigint_array(values: Iterable[int]) -> str:
    return "{" + ",".join([str(int(v)) for v in values]) + "}"


def _audit_values(entry: AuditEntry) -> tuple[Any, ...]:
    """``entry.insert_values`` with ``keys`` as a ``text[]`` literal (see ``text_array``)."""
    values = entry.insert_values(DIALECT)
    return (*values[:7], text_array(entry.keys), *values[8:])


def _enter_params(plan: FencePlan) -> tuple[Any, ...]:
    keys = text_array(plan.keys)
    tokens = _bigint_array([plan.tokens[k] for k in plan.keys])
    intent = plan.intent
    key = intent.idempotency_key if intent else None
    if intent is None or key is None:
        return (keys, tokens, None, None, None, None, None, None)
    return (keys, tokens, key, intent.tool, intent.agent, intent.workflow, intent.args_hash,
            text_array(intent.keys))


def _failure_params(plan: FencePlan, entry: AuditEntry,
                    status: IntentStatus | None) -> tuple[Any, ...]:
    intent = plan.intent
    if status is None or intent is None or intent.idempotency_key is None:
        row: tuple[Any, ...] = (None, None, None, None, None, None, None, None, False)
    else:
        row = (intent.idempotency_key, intent.tool, intent.agent, intent.workflow,
               text_array(intent.keys or plan.keys), intent.args_hash, status, entry.reason, True)
    return (*row, *_audit_values(entry))


def _mark_unknown(idempotency_key: str, record: IntentRecord | None) -> tuple[str, tuple[Any, ...]]:
    if record is None:
        return MARK_UNKNOWN, (idempotency_key,)
    if record.idempotency_key != idempotency_key:
        msg = (f"mark_unknown: the record's idempotency key {record.idempotency_key!r} is not "
               f"{idempotency_key!r}")
        raise StoreError(msg, reason="invalid_intent")
    return MARK_UNKNOWN_UPSERT, (idempotency_key, record.tool, record.agent, record.workflow,
                                 text_array(record.keys), record.args_hash)


def _finish_params(tx: FencedTransaction | AsyncFencedTransaction,
                   entry: AuditEntry) -> tuple[str, tuple[Any, ...]]:
    key = tx.intent.idempotency_key if tx.intent else None
    values = _audit_values(entry)
    if key is None:
        return FINISH_TX_NO_INTENT, values
    return FINISH_TX, (key, tx.result_json, tx.tokens_json, *values)


def _duplicate(plan: FencePlan, result: Any) -> DuplicateIntent:
    msg = f"intent {plan.idempotency_key!r} was already applied; returning its recorded result"
    return DuplicateIntent(msg, result=result)


def _ended(tx_status: TransactionStatus) -> StoreError | None:
    """Why a fenced transaction cannot commit, judged from the connection's state."""
    if tx_status == TransactionStatus.INTRANS:
        return None
    if tx_status == TransactionStatus.INERROR:
        msg = ("a statement failed inside the fenced transaction and the tool carried on; "
               "nothing was committed")
        return StoreError(msg)
    msg = ("the fenced transaction was ended inside fenced() (a COMMIT or ROLLBACK by the tool); "
           "the tool must never end it itself")
    return StoreError(msg, reason="transaction_ended")


# --- the hot path's statements ------------------------------------------------------------
#
# ``enter`` and ``finish`` send a fixed template whose parameters are plain values (text,
# integers, floats, None), with client-side binding. psycopg's ``ClientCursor`` quotes
# each value through its adapters (one dumper lookup and call per value) and counts the
# merged text for statement preparation (never useful: the values differ every time).
# ``_HotCursor`` fills these templates itself: each value still becomes one quoted
# literal (``_literal``), never formatted into SQL by hand, and a value of another type,
# or a connection whose literals follow other rules, takes ``ClientCursor``'s own path.


def _template(query: str) -> tuple[str, ...]:
    """``query`` split at its ``%s`` placeholders (it must hold no other ``%``)."""
    parts = tuple(query.split("%s"))
    if any("%" in part for part in parts):
        msg = f"a hot-path template takes only %s placeholders: {query!r}"
        raise AssertionError(msg)
    return parts


_TEMPLATES = {query: _template(query) for query in (ENTER_TX, FINISH_TX, FINISH_TX_NO_INTENT)}
_NUL_TEXT = "PostgreSQL text fields cannot contain NUL (0x00) bytes"


def _literal(value: Any) -> str | None:
    """One SQL literal for ``value`` (standard_conforming_strings on), or None if ``value``
    is not of a type this path quotes."""
    kind = type(value)
    if isinstance(value, str) and kind is str:
        if "\x00" in value:
            raise psycopg.DataError(_NUL_TEXT)
        return "'" + value.replace("'", "''") + "'"
    if value is None:
        return "NULL"
    if kind is int:
        return f"'{value:d}'"
    if kind is float and math.isfinite(value):
        return f"'{value!r}'"
    if kind is bool:
        return "true" if value else "false"
    return None


def _filled(parts: tuple[str, ...], params: Sequence[Any]) -> bytes | None:
    """``parts`` joined by the literals of ``params`` (UTF-8); None if a value needs
    psycopg's own quoting."""
    if len(params) != len(parts) - 1:
        return None
    chunks = [parts[0]]
    append = chunks.append
    for value, tail in zip(params, parts[1:], strict=True):
        if type(value) is str:  # the usual value: inline, the rest through _literal
            if "\x00" in value:
                raise psycopg.DataError(_NUL_TEXT)
            append("'" + value.replace("'", "''") + "'")
        elif value is None:
            append("NULL")
        else:
            quoted = _literal(value)
            if quoted is None:
                return None
            append(quoted)
        append(tail)
    try:
        return "".join(chunks).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: psycopg's own path says what is wrong
        return None


class _HotCursor(psycopg.ClientCursor[Any]):
    """A ``ClientCursor`` that fills the hot-path templates with ``_literal`` and sends them
    as one simple query, past the prepared-statement bookkeeping (never prepared: the
    merged text differs on every call). Anything else is ``ClientCursor``'s own path."""

    def _execute_gen(self, query: Any, params: Any = None, *, prepare: bool | None = None,
                     binary: bool | None = None) -> Any:
        built = self._hot(query, params)
        if built is None:
            return (yield from super()._execute_gen(query, params, prepare=prepare,
                                                    binary=binary))
        yield from self._start_query(query)
        pgconn = self._pgconn
        pgconn.send_query(built)
        results = yield from generators.execute(pgconn)
        self._check_results(results)
        self._set_results(results)
        self._last_query = query
        return None

    def _hot(self, query: Any, params: Any) -> bytes | None:
        parts = _TEMPLATES.get(query) if type(query) is str and params is not None else None
        conn = self._conn
        if parts is None or conn._pipeline is not None or (
                self._pgconn.parameter_status(b"standard_conforming_strings") != b"on"
                or conn.info.encoding != "utf-8"):
            return None
        return _filled(parts, params)


def _hot_cursor(conn: psycopg.Connection[Any], slot: str) -> _HotCursor:
    """The connection's own ``_HotCursor`` for one template (``slot``), made once.

    One per template: a cursor keeps its adapters while it runs the same query
    object again, which saves building them on every call.
    """
    cursor = conn.__dict__.get(slot)
    if cursor is None:
        cursor = conn.__dict__[slot] = _HotCursor(conn)
    return cast(_HotCursor, cursor)


class _PgBase:
    dialect = DIALECT

    def __init__(self, url: str, schema: str | None) -> None:
        check_url(url)
        self.url = url
        self.schema = check_schema(schema)

    def _set_path(self) -> sql.Composed | None:
        if self.schema is None:
            return None
        return sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema))

    def _create_schema(self) -> sql.Composed | None:
        if self.schema is None:
            return None
        return sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema))

    def _probe(self) -> str:
        """Why the server cannot be reached, from one direct connection attempt.

        ``ConfigurationError`` when the answer is final (unknown database, bad
        credentials, a host name that does not resolve): no wait fixes a typo.
        """
        try:
            psycopg.connect(self.url, **postgres_probe_options()).close()
        except psycopg.Error as error:
            self._refuse_definitive(error)
            return str(error).strip()
        return POOL_EXHAUSTED

    def _refuse_definitive(self, error: BaseException) -> None:
        why = definitive(error)
        if why is not None:
            raise misconfigured("postgresql", redact(self.url), error, why) from error

    def _check_first_contact(self) -> None:
        """One direct connection before the pool opens: a typo raises now, in one line.

        A server that is down or slow is not a verdict: the pool waits for it, as
        for any outage, and the calls report ``BackendUnavailable``.
        """
        try:
            psycopg.connect(self.url, **postgres_probe_options()).close()
        except psycopg.Error as error:
            self._refuse_definitive(error)

    def __repr__(self) -> str:
        where = f", schema={self.schema!r}" if self.schema else ""
        return f"{type(self).__name__}({redact(self.url)!r}{where})"


# --- sync ---------------------------------------------------------------------------------------


class _Session:
    """The fenced flow's I/O on one pooled connection."""

    def __init__(self, store: PostgresStore, conn: psycopg.Connection[Any]) -> None:
        self.store = store
        self.conn = conn
        self.tx: FencedTransaction | None = None
        #: ``abort`` left the ROLLBACK to ``record_failure``, to send it with the audit row.
        self.rollback_pending = False
        #: The replay ``enter`` found: its transaction ends with COMMIT, not ROLLBACK.
        self.replay: DuplicateIntent | None = None
        self.commit_pending = False

    def _execute(self, query: str, params: Any, counted: bool = False) -> psycopg.Cursor[Any]:
        # ``counted``: a psycopg cursor's ``rowcount`` already counts returned or changed rows.
        try:
            return self.conn.execute(cast(Any, query), params)
        except psycopg.Error as error:
            mapped = translate(error)
            if mapped is error:
                raise
            if self.tx is not None and isinstance(mapped, ToolGuardError):
                self.tx.failure = mapped
            raise mapped from error

    def enter(self, plan: FencePlan) -> FencedTransaction:
        conn = self.conn
        cursor = _hot_cursor(conn, "_toolguard_enter")
        cursor.execute(ENTER_TX, _enter_params(plan), prepare=False)
        cursor.nextset()  # past BEGIN's empty result
        found = cursor.pgresult
        # The usual answer, "not applied", read without loading the row.
        if found is None or found.ntuples != 1 or found.get_value(0, 0) != b"f":
            row = cursor.fetchone()
            assert row is not None
            if row[0]:
                self.replay = _duplicate(plan, row[1])
                raise self.replay
        self.tx = FencedTransaction(conn, plan, DIALECT, self._execute)
        return self.tx

    def finish(self, tx: FencedTransaction, entry: AuditEntry) -> None:
        if tx.failure is not None:
            raise tx.failure
        problem = _ended(self.conn.info.transaction_status)
        if problem is not None:
            raise problem
        query, params = _finish_params(tx, entry)
        _hot_cursor(self.conn, "_toolguard_finish").execute(query, params, prepare=False)
        self.store.sealer.wrote()

    def abort(self, error: BaseException) -> BaseException:
        # The ROLLBACK (a replay's COMMIT) goes out with the failure's audit row, in one
        # message (record_failure); ``settle`` sends it alone if that never happens.
        self.rollback_pending = not self.conn.closed and self.conn.info.transaction_status in _OPEN
        self.commit_pending = self.rollback_pending and error is self.replay
        mapped = translate(error)
        if isinstance(mapped, BackendUnavailable):
            self.store._forget_dead()
        return mapped

    def settle(self) -> None:
        """End a transaction that ``abort`` left open (before the connection goes back)."""
        conn = self.conn
        ending = "COMMIT" if self.commit_pending else "ROLLBACK"
        self.rollback_pending = self.commit_pending = False
        if not conn.closed and conn.info.transaction_status in _OPEN:
            with contextlib.suppress(psycopg.Error):
                conn.execute(ending)

    def record_failure(self, plan: FencePlan, entry: AuditEntry,
                       status: IntentStatus | None) -> None:
        params = _failure_params(plan, entry, status)
        if self.rollback_pending:
            self.rollback_pending = False
            query = COMMIT_FAILURE if self.commit_pending else ROLLBACK_FAILURE
            try:
                psycopg.ClientCursor(self.conn).execute(query, params)
                self.commit_pending = False
                self.store.sealer.wrote()
                return
            except psycopg.Error:
                self.settle()  # then try once more below, alone
        if not self.conn.closed and self.conn.info.transaction_status == TransactionStatus.IDLE:
            self.conn.execute(FAILURE, params)
        else:
            with self.store.connection(timeout=1.0) as other:
                other.execute(FAILURE, params)
        self.store.sealer.wrote()


#: psycopg's own: a statement a connection runs this often is prepared on it.
DEFAULT_PREPARE_THRESHOLD = 5


def _connection_options(prepare_threshold: int | None) -> dict[str, Any]:
    """The pool's connection options. ``prepare_threshold=None``: the tool's statements are
    never prepared (behind PgBouncer in transaction mode before 1.21, where a prepared
    statement stays on a server connection the next transaction may not get); the store's
    own statements are never prepared either way."""
    if prepare_threshold is not None and (
            not isinstance(prepare_threshold, int) or isinstance(prepare_threshold, bool)
            or prepare_threshold < 0):
        msg = ("prepare_threshold must be a non-negative integer, or None to never prepare "
               f"statements (PgBouncer in transaction mode), got {prepare_threshold!r}")
        raise ConfigurationError(msg)
    return {"autocommit": True, "prepare_threshold": prepare_threshold}


class PostgresStore(_PgBase):
    """The guarded store on PostgreSQL; one pool, shared by every thread of a process."""

    def __init__(self, url: str, *, schema: str | None = None, min_size: int = 1,
                 max_size: int = 10, timeout_s: float = 10.0,
                 autoseal: AutoSeal | None = DEFAULT_AUTOSEAL,
                 prepare_threshold: int | None = DEFAULT_PREPARE_THRESHOLD) -> None:
        super().__init__(url, schema)
        #: Seals the audit rows this store writes (``toolguard.store.autoseal``; None: off).
        self.sealer = AutoSealer(functools.partial(
            self.seal_audit, wait_s=autoseal.wait_s if autoseal else 0.0), autoseal,
            name="toolguard-autoseal-pg")
        self._pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
            url, min_size=min_size, max_size=max_size, timeout=timeout_s, open=False,
            kwargs=_connection_options(prepare_threshold), configure=self._configure,
            name=f"toolguard-store{'-' + schema if schema else ''}")
        self._check_first_contact()
        self._pool.open(wait=False)

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        statement = self._set_path()
        if statement is not None:
            conn.execute(statement)

    def _forget_dead(self) -> None:
        """After a lost connection, drop the other idle ones that died with it."""
        with contextlib.suppress(Exception):
            self._pool.check()

    @contextlib.contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[psycopg.Connection[Any]]:
        """A pooled autocommit connection, errors mapped to toolguard's.

        For reads and setup; writes that must be fenced go through ``fenced()``.
        """
        try:
            with self._pool.connection(timeout=timeout) as conn:
                yield conn
        except PoolTimeout as error:
            msg = f"postgresql {redact(self.url)}: no connection: {self._probe()}"
            raise BackendUnavailable(msg) from error
        except psycopg.Error as error:
            mapped = translate(error)
            if isinstance(mapped, BackendUnavailable):
                self._forget_dead()
            _raise_translated(error)

    def install(self, steps: Sequence[Migration] | None = None) -> int:
        """Create or upgrade the schema; idempotent, serialized by an advisory lock."""
        steps = tuple(steps) if steps is not None else migrations(DIALECT)
        with self.connection() as conn, conn.transaction():
            conn.execute(INSTALL_LOCK)
            create = self._create_schema()
            if create is not None:
                conn.execute(create)
            conn.execute(VERSION_TABLE)
            installed = {int(v) for (v,) in conn.execute(INSTALLED).fetchall()}
            for step in pending_migrations(steps, installed):
                log.info("installing toolguard schema %s", step.name)
                conn.execute(cast(Any, step.sql))
                conn.execute(RECORD_VERSION, (step.version, step.name))
            installed = {int(v) for (v,) in conn.execute(INSTALLED).fetchall()}
            return effective_version(installed, migrations(DIALECT))

    def schema_version(self) -> int:
        """The installed schema version (0: not installed; see ``effective_version``)."""
        with self.connection() as conn:
            row = conn.execute(HAS_VERSION_TABLE).fetchone()
            if not row or not row[0]:
                return 0
            installed = {int(v) for (v,) in conn.execute(INSTALLED).fetchall()}
            return effective_version(installed, migrations(DIALECT))

    def begin_intent(self, record: IntentRecord) -> Begun | Replay:
        """Reserve ``record.idempotency_key``: ``Begun`` (run it) or ``Replay`` (don't)."""
        params = _begin_params(record)
        with self.connection() as conn:
            row = conn.execute(BEGIN_INTENT, params).fetchone()
        assert row is not None and record.idempotency_key is not None
        return _begun(record.idempotency_key, row)

    @contextlib.contextmanager
    def _session(self) -> Iterator[_Session]:
        with self.connection() as conn:
            session = _Session(self, conn)
            try:
                yield session
            finally:
                if session.rollback_pending:
                    session.settle()

    def fenced(self, lease: FenceSource, intent: IntentRecord | None = None, *,
               detail: str | None = None) -> contextlib.AbstractContextManager[FencedTransaction]:
        """One transaction: fences, the tool's SQL, the result and the audit row; all or nothing.

        ``lease``: a ``Lease`` (checked right before the commit: ``LockLost`` if it was lost
        or released meanwhile) or a mapping of key to token (no such check).
        """
        return fenced_flow(self._session(), lease, intent, detail)

    def audit(self, entry: AuditEntry) -> AuditEntry:
        """Append one audit row (for decisions taken outside a fenced write)."""
        with self.connection() as conn:
            row = conn.execute(AUDIT_INSERT, _audit_values(entry)).fetchone()
        assert row is not None
        self.sealer.wrote()
        return replace(entry, id=int(row[0]), at=row[1])

    def mark_unknown(self, idempotency_key: str, record: IntentRecord | None = None) -> bool:
        """Record that a call was cancelled mid-flight; never touches an applied intent.

        With ``record`` (the intent with that key) a missing row is created with
        status 'unknown' (a fenced write creates its row inside its own
        transaction, so a cancelled one may have left none); without it only an
        existing row is marked. A row of another tool or other arguments is left
        alone. True if a row was marked.
        """
        query, params = _mark_unknown(idempotency_key, record)
        with self.connection() as conn:
            return conn.execute(query, params).rowcount > 0

    def has_applied(self, tool: str, resource_key: str, workflow: str | None = None) -> bool:
        """Whether ``tool`` was applied on ``resource_key`` (in ``workflow``, if given)."""
        with self.connection() as conn:
            row = conn.execute(HAS_APPLIED, (tool, resource_key, workflow, workflow)).fetchone()
        return bool(row and row[0])

    def high_water(self, key: str) -> int:
        """The greatest token accepted for ``key`` (0 if none)."""
        return self.high_waters([key]).get(key, 0)

    def high_waters(self, keys: Iterable[str]) -> dict[str, int]:
        """High-water marks of several keys in one query (absent keys are omitted)."""
        with self.connection() as conn:
            rows = conn.execute(HIGH_WATERS, (list(keys),)).fetchall()
        return {key: int(token) for key, token in rows}

    def query_audit(self, **filters: Any) -> list[AuditEntry]:
        """Audit rows matching ``filters`` (see ``AuditQuery``), newest first by default."""
        query = AuditQuery(**filters)
        where, params = query.where(DIALECT, _moment)
        tail, more = query.tail()
        with self.connection() as conn:
            rows = conn.execute(cast(Any, AUDIT_QUERY + where + tail), [*params, *more]).fetchall()
        return [_entry(row) for row in rows]

    def seal_audit(self, *, max_rows: int = MAX_SEAL_ROWS, wait_s: float = 5.0) -> SealResult:
        """Seal the audit rows that can no longer be joined by a late commit (``toolguard audit
        seal``): every id below the highest committed one, once the transactions that were
        writing the log meanwhile have ended (``wait_s`` at most; see ``toolguard.store.sealing``).
        Concurrent sealers queue on an advisory lock; writers never wait for a sealer.
        """
        with self.connection() as conn:
            return pg_seal(conn, max_rows=max_rows, wait_s=wait_s)

    def verify_audit(self, *, anchor: str | Sequence[str] | None = None,
                     exports: Sequence[str | os.PathLike[str]] = ()) -> AuditVerification:
        """Check every audit row and seal in one snapshot (``toolguard audit verify``).

        ``anchor``: seal hashes kept outside the database (a rewrite of the whole chain
        is caught only by them); ``exports``: export files of dropped ranges.
        """
        anchors = check_anchors(anchor)
        with self.connection() as conn:
            return pg_verify(conn, anchors=anchors, exports=exports)

    def export_audit(self, path: str | os.PathLike[str], *, before: datetime | None = None,
                     through_seq: int | None = None, drop: bool = False) -> ExportResult:
        """Export whole sealed ranges older than ``before`` (or through seal ``through_seq``) to
        ``path``; ``drop=True`` then deletes them (``toolguard_audit_drop_exported``: needs the
        tables' owner), keeping the rest verifiable."""
        with self.connection() as conn:
            return pg_export(conn, path, before=before, through_seq=through_seq, drop=drop)

    def close(self) -> None:
        """Seal the audit rows this store wrote (see ``autoseal``), then close the pool."""
        self.sealer.close()
        self._pool.close()

    def __enter__(self) -> PostgresStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _moment(value: datetime) -> datetime:
    return value


# --- asyncio ------------------------------------------------------------------------------------


class _AsyncSession:
    """The fenced flow's I/O on one pooled async connection."""

    def __init__(self, store: AsyncPostgresStore, conn: psycopg.AsyncConnection[Any]) -> None:
        self.store = store
        self.conn = conn
        self.tx: AsyncFencedTransaction | None = None
        self.rollback_pending = False
        self.replay: DuplicateIntent | None = None  # as in the sync session
        self.commit_pending = False

    async def _execute(self, query: str, params: Any,
                       counted: bool = False) -> psycopg.AsyncCursor[Any]:
        try:
            return await self.conn.execute(cast(Any, query), params)
        except psycopg.Error as error:
            mapped = translate(error)
            if mapped is error:
                raise
            if self.tx is not None and isinstance(mapped, ToolGuardError):
                self.tx.failure = mapped
            raise mapped from error

    async def enter(self, plan: FencePlan) -> AsyncFencedTransaction:
        conn = self.conn
        cursor = psycopg.AsyncClientCursor(conn)
        await cursor.execute(ENTER_TX, _enter_params(plan))
        cursor.nextset()  # past BEGIN's empty result
        row = await cursor.fetchone()
        assert row is not None
        if row[0]:
            self.replay = _duplicate(plan, row[1])
            raise self.replay
        self.tx = AsyncFencedTransaction(conn, plan, DIALECT, self._execute)
        return self.tx

    async def finish(self, tx: AsyncFencedTransaction, entry: AuditEntry) -> None:
        if tx.failure is not None:
            raise tx.failure
        problem = _ended(self.conn.info.transaction_status)
        if problem is not None:
            raise problem
        query, params = _finish_params(tx, entry)
        await psycopg.AsyncClientCursor(self.conn).execute(query, params)
        self.store.sealer.wrote()

    async def abort(self, error: BaseException) -> BaseException:
        # As the sync twin: the ROLLBACK (a replay's COMMIT) goes out with the audit row (or
        # alone, in ``settle``).
        self.rollback_pending = not self.conn.closed and self.conn.info.transaction_status in _OPEN
        self.commit_pending = self.rollback_pending and error is self.replay
        mapped = translate(error)
        if isinstance(mapped, BackendUnavailable):
            await self.store._forget_dead()
        return mapped

    async def settle(self) -> None:
        """End a transaction that ``abort`` left open (before the connection goes back)."""
        conn = self.conn
        ending = "COMMIT" if self.commit_pending else "ROLLBACK"
        self.rollback_pending = self.commit_pending = False
        if not conn.closed and conn.info.transaction_status in _OPEN:
            with contextlib.suppress(psycopg.Error):
                await conn.execute(ending)

    async def record_failure(self, plan: FencePlan, entry: AuditEntry,
                             status: IntentStatus | None) -> None:
        params = _failure_params(plan, entry, status)
        if self.rollback_pending:
            self.rollback_pending = False
            query = COMMIT_FAILURE if self.commit_pending else ROLLBACK_FAILURE
            try:
                await psycopg.AsyncClientCursor(self.conn).execute(query, params)
                self.commit_pending = False
                self.store.sealer.wrote()
                return
            except psycopg.Error:
                await self.settle()
        if not self.conn.closed and self.conn.info.transaction_status == TransactionStatus.IDLE:
            await self.conn.execute(FAILURE, params)
        else:
            async with self.store.connection(timeout=1.0) as other:
                await other.execute(FAILURE, params)
        self.store.sealer.wrote()


class AsyncPostgresStore(_PgBase):
    """The asyncio guarded store on PostgreSQL; the pool opens on first use."""

    def __init__(self, url: str, *, schema: str | None = None, min_size: int = 1,
                 max_size: int = 10, timeout_s: float = 10.0, install: bool = False,
                 autoseal: AutoSeal | None = DEFAULT_AUTOSEAL,
                 prepare_threshold: int | None = DEFAULT_PREPARE_THRESHOLD) -> None:
        super().__init__(url, schema)
        #: Seals the audit rows this store writes, in a thread on a connection of its own.
        self.sealer = AutoSealer(functools.partial(
            self._run_batch, pg_seal, max_rows=MAX_SEAL_ROWS,
            wait_s=autoseal.wait_s if autoseal else 0.0), autoseal, name="toolguard-autoseal-apg")
        #: The pool's bounds, for callers that hold a connection while they need another
        #: (``toolguard.fences.inflight``).
        self.pool_max_size = max_size
        self.pool_timeout_s = timeout_s
        #: ``install=True``: the schema is installed (or upgraded) before the first operation.
        self._install_pending = install
        self._install_lock = asyncio.Lock()
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
            url, min_size=min_size, max_size=max_size, timeout=timeout_s, open=False,
            kwargs=_connection_options(prepare_threshold), configure=self._configure,
            name=f"toolguard-astore{'-' + schema if schema else ''}")
        self._opened = False

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        statement = self._set_path()
        if statement is not None:
            await conn.execute(statement)

    async def _aprobe(self) -> str:
        """The asyncio twin of ``_probe`` (``ConfigurationError`` for a final answer)."""
        try:
            conn = await psycopg.AsyncConnection.connect(self.url, **postgres_probe_options())
        except psycopg.Error as error:
            self._refuse_definitive(error)
            return str(error).strip()
        await conn.close()
        return POOL_EXHAUSTED

    async def _forget_dead(self) -> None:
        with contextlib.suppress(Exception):
            await self._pool.check()

    async def _ready(self) -> None:
        """Run the install ``install=True`` asked for, once (retried by the next call if it fails)."""
        if not self._install_pending:
            return
        async with self._install_lock:
            if self._install_pending:
                await self._install(None)

    @contextlib.asynccontextmanager
    async def connection(self, timeout: float | None = None
                         ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pooled autocommit async connection, errors mapped to toolguard's."""
        await self._ready()
        async with self._pooled(timeout) as conn:
            yield conn

    @contextlib.asynccontextmanager
    async def _pooled(self, timeout: float | None = None
                      ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if not self._opened:
            await self._aprobe()  # a typo raises ConfigurationError now, before the pool waits
            await self._pool.open(wait=False)
            self._opened = True
        try:
            async with self._pool.connection(timeout=timeout) as conn:
                yield conn
        except PoolTimeout as error:
            msg = f"postgresql {redact(self.url)}: no connection: {await self._aprobe()}"
            raise BackendUnavailable(msg) from error
        except psycopg.Error as error:
            if isinstance(translate(error), BackendUnavailable):
                await self._forget_dead()
            _raise_translated(error)

    async def install(self, steps: Sequence[Migration] | None = None) -> int:
        """Create or upgrade the schema; idempotent, serialized by an advisory lock."""
        async with self._install_lock:
            return await self._install(steps)

    async def _install(self, steps: Sequence[Migration] | None) -> int:
        version = await self._migrate(tuple(steps) if steps is not None else migrations(DIALECT))
        self._install_pending = False
        return version

    async def _migrate(self, steps: Sequence[Migration]) -> int:
        async with self._pooled() as conn, conn.transaction():
            await conn.execute(INSTALL_LOCK)
            create = self._create_schema()
            if create is not None:
                await conn.execute(create)
            await conn.execute(VERSION_TABLE)
            rows = await (await conn.execute(INSTALLED)).fetchall()
            for step in pending_migrations(steps, {int(v) for (v,) in rows}):
                log.info("installing toolguard schema %s", step.name)
                await conn.execute(cast(Any, step.sql))
                await conn.execute(RECORD_VERSION, (step.version, step.name))
            rows = await (await conn.execute(INSTALLED)).fetchall()
            return effective_version({int(v) for (v,) in rows}, migrations(DIALECT))

    async def schema_version(self) -> int:
        """The installed schema version (0: not installed; see ``effective_version``)."""
        async with self.connection() as conn:
            row = await (await conn.execute(HAS_VERSION_TABLE)).fetchone()
            if not row or not row[0]:
                return 0
            rows = await (await conn.execute(INSTALLED)).fetchall()
            return effective_version({int(v) for (v,) in rows}, migrations(DIALECT))

    async def begin_intent(self, record: IntentRecord) -> Begun | Replay:
        """Reserve ``record.idempotency_key``: ``Begun`` (run it) or ``Replay`` (don't)."""
        params = _begin_params(record)
        async with self.connection() as conn:
            row = await (await conn.execute(BEGIN_INTENT, params)).fetchone()
        assert row is not None and record.idempotency_key is not None
        return _begun(record.idempotency_key, row)

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[_AsyncSession]:
        async with self.connection() as conn:
            session = _AsyncSession(self, conn)
            try:
                yield session
            finally:
                if session.rollback_pending:
                    await finish(session.settle())

    def fenced(self, lease: FenceSource, intent: IntentRecord | None = None, *,
               detail: str | None = None
               ) -> contextlib.AbstractAsyncContextManager[AsyncFencedTransaction]:
        """``async with store.fenced(lease, intent) as tx``: as ``PostgresStore.fenced``."""
        return afenced_flow(self._session(), lease, intent, detail)

    async def audit(self, entry: AuditEntry) -> AuditEntry:
        """Append one audit row (for decisions taken outside a fenced write)."""
        async with self.connection() as conn:
            row = await (await conn.execute(AUDIT_INSERT, _audit_values(entry))).fetchone()
        assert row is not None
        self.sealer.wrote()
        return replace(entry, id=int(row[0]), at=row[1])

    async def mark_unknown(self, idempotency_key: str,
                           record: IntentRecord | None = None) -> bool:
        """Record that a call was cancelled mid-flight (see ``PostgresStore.mark_unknown``)."""
        query, params = _mark_unknown(idempotency_key, record)
        async with self.connection() as conn:
            return (await conn.execute(query, params)).rowcount > 0

    async def has_applied(self, tool: str, resource_key: str, workflow: str | None = None) -> bool:
        """Whether ``tool`` was applied on ``resource_key`` (in ``workflow``, if given)."""
        async with self.connection() as conn:
            cursor = await conn.execute(HAS_APPLIED, (tool, resource_key, workflow, workflow))
            row = await cursor.fetchone()
        return bool(row and row[0])

    async def high_water(self, key: str) -> int:
        """The greatest token accepted for ``key`` (0 if none)."""
        return (await self.high_waters([key])).get(key, 0)

    async def high_waters(self, keys: Iterable[str]) -> dict[str, int]:
        """High-water marks of several keys in one query (absent keys are omitted)."""
        async with self.connection() as conn:
            rows = await (await conn.execute(HIGH_WATERS, (list(keys),))).fetchall()
        return {key: int(token) for key, token in rows}

    async def query_audit(self, **filters: Any) -> list[AuditEntry]:
        """Audit rows matching ``filters`` (see ``AuditQuery``), newest first by default."""
        query = AuditQuery(**filters)
        where, params = query.where(DIALECT, _moment)
        tail, more = query.tail()
        async with self.connection() as conn:
            cursor = await conn.execute(cast(Any, AUDIT_QUERY + where + tail), [*params, *more])
            rows = await cursor.fetchall()
        return [_entry(row) for row in rows]

    async def seal_audit(self, *, max_rows: int = MAX_SEAL_ROWS,
                         wait_s: float = 5.0) -> SealResult:
        """Seal the audit rows that can be sealed (see ``PostgresStore.seal_audit``); a batch
        job, run in a worker thread on a connection of its own."""
        return await self._batch(pg_seal, max_rows=max_rows, wait_s=wait_s)

    async def verify_audit(self, *, anchor: str | Sequence[str] | None = None,
                           exports: Sequence[str | os.PathLike[str]] = ()
                           ) -> AuditVerification:
        """Check every audit row and seal (see ``PostgresStore.verify_audit``)."""
        return await self._batch(pg_verify, anchors=check_anchors(anchor), exports=exports)

    async def export_audit(self, path: str | os.PathLike[str], *,
                           before: datetime | None = None, through_seq: int | None = None,
                           drop: bool = False) -> ExportResult:
        """Export (and with ``drop=True`` drop) old sealed ranges (see
        ``PostgresStore.export_audit``)."""
        return await self._batch(pg_export, path, before=before, through_seq=through_seq,
                                 drop=drop)

    async def _batch(self, job: Callable[Concatenate[psycopg.Connection[Any], P], T],
                     *args: P.args, **kwargs: P.kwargs) -> T:
        await self._ready()
        run: Callable[[], T] = functools.partial(self._run_batch, job, *args, **kwargs)
        return await asyncio.to_thread(run)

    def _run_batch(self, job: Callable[Concatenate[psycopg.Connection[Any], P], T],
                   *args: P.args, **kwargs: P.kwargs) -> T:
        """``job(conn, ...)`` on a sync connection of its own (the pool is the event loop's)."""
        try:
            with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:
                statement = self._set_path()
                if statement is not None:
                    conn.execute(statement)
                return job(conn, *args, **kwargs)
        except psycopg.Error as error:
            raise translate(error) from error

    async def close(self) -> None:
        """Seal the audit rows this store wrote (see ``autoseal``), then close the pool."""
        if not self.sealer.idle:
            await asyncio.to_thread(self.sealer.close)
        await self._pool.close()

    aclose = close

    async def __aenter__(self) -> AsyncPostgresStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
