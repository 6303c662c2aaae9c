"""Reaching the PostgreSQL server, and what its errors become.

``_PgBase`` is what the sync and the asyncio store share before any statement
runs: the URL libpq must parse (``check_url``), the schema name
(``check_schema``) and its ``search_path``, the direct connection attempt that
tells a typo (``ConfigurationError``, now) from an outage (``BackendUnavailable``,
waited for), and the password-free URL for messages (``redact``).
``_connection_options`` is the pool's per-connection settings (autocommit,
``prepare_threshold`` for PgBouncer).

``translate`` maps psycopg's and the pool's errors to toolguard's: the ``TGnnn``
SQLSTATEs of ``toolguard/sql`` to their typed errors (``error_from_sqlstate``),
a statement the server ended (a timeout or cancel, a deadlock, a serialization
failure, ``lock_timeout``) to a ``TransactionAborted`` subclass with its own
reason code, a lost server or an empty pool to ``BackendUnavailable``, a missing
schema to ``schema_missing``. One mapping for the stores, their sessions and the
batch jobs. ``toolguard.store.postgres`` re-exports the public names.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import PoolTimeout

from toolguard.errors import BackendUnavailable, ConfigurationError, StoreError, ToolGuardError
from toolguard.runtime.connection_errors import definitive, misconfigured, postgres_probe_options
from toolguard.runtime.connection_errors import redacted_url as redact
from toolguard.store.base import error_from_sqlstate, schema_missing
from toolguard.store.postgres_sql import DIALECT

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


def _raise_translated(error: BaseException) -> NoReturn:
    mapped = translate(error)
    if mapped is error:
        raise error
    raise mapped from error


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
