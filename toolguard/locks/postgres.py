"""PostgreSQL backend: leases in tables on database time, a FIFO line, hand-off by NOTIFY.

Tables (all ``toolguard_lock_*``, apart from the store's; in the ``schema=`` given,
else wherever the connection's ``search_path`` puts them)::

    toolguard_lock_fence   key -> last token granted: durable, strictly increasing per key
    toolguard_lock_holder  key -> owner, token, expires_at (database time)
    toolguard_lock_waiter  (key, owner) -> arrival, hand-off TTL, channel, presence deadline

Every operation is one call of a plpgsql function: one round trip, one transaction.
Each function first locks the key's fence row (``FOR UPDATE``), so the steps on one
key are serialized and a token is minted in the same transaction as its grant.
Tokens are hybrid-clock values like the other backends': ``max(last + 1, database
time in µs)``, so even a database restored from an old backup mints tokens above
the ones it forgot (``raise_floor`` covers a clock that went backwards).

A release hands the lock straight to the first live waiter (minting its token, for
the waiter's hand-off TTL) and NOTIFYs that waiter's process on the process's own
channel with ``owner token key``. One LISTEN connection per backend object receives
these and wakes the waiting thread or task with the token in hand. A crashed
holder's lock simply expires: the next contender, or a waiter's bounded poll, finds
it expired and passes it on. A crashed waiter's presence deadline lapses and it
drops out; one that is handed the lock first holds it only for its hand-off TTL.

Stale notifications: a NOTIFY is delivered whenever the listening connection reads
it, possibly long after its grant ended (this process was stopped, the waiter gave
up and queued again). Every acquire that answers "queued" also returns the key's
last token at that moment, and the waiter's doorbell drops any token at or below
it: a grant still ours would have been returned by that call, so an older token is
one that has already expired or been released. A token above it was granted after
the call, which is where the manager starts the lease's TTL.

The schema is installed on first use (``install()`` does it explicitly, and so does
``install_lock_schema(url)``, without a backend); an older lock schema is upgraded
in the same transaction. ``SCHEMA_VERSION`` is recorded as the comment of the
acquire function.

Upgrading from lock schema 1: the tables are kept (tokens stay above everything
granted before), the helper functions are replaced (their bodies mean the same in
both versions), and the new acquire function takes one more argument (the hand-off
TTL), so it is a separate overload. The version 1 acquire is left in place on
purpose: clients of the previous release that are still running keep working on
the same tables during a rolling upgrade, with their own semantics (their hand-offs
still run for their full TTL, which is what they expect).

Lock schema 3 changes function bodies only (same signatures, so version 2 clients
use them as they are): acquire creates or locks the key's fence row in one
statement (version 2 inserted it, then locked it in a second statement, and an
idle-row sweep in between made the grant fail with a NOT NULL violation), and a
grant creates a fence row that is missing instead of minting NULL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from toolguard.connection_errors import (
    definitive,
    misconfigured,
    postgres_probe_options,
    redacted_url,
)
from toolguard.errors import BackendUnavailable, ConfigurationError
from toolguard.locks.base import (
    MIN_TTL_MS,
    Attempt,
    BackendInfo,
    check_ms,
    check_seconds,
    owner_handoff_ms,
)

__all__ = [
    "SCHEMA",
    "SCHEMA_MARK",
    "SCHEMA_VERSION",
    "AsyncPostgresBackend",
    "PostgresBackend",
    "install_lock_schema",
    "lock_schema_version",
]

INFO = BackendInfo(
    name="postgres",
    durable_tokens=True,
    server_wakeup=True,
    fair=True,
    note="leases on database time; tokens durable in the same database as the store",
)

#: The lock schema's version, stored in the comment of the acquire function.
SCHEMA_VERSION = 3
SCHEMA_MARK = f"toolguard lock schema {SCHEMA_VERSION}"
_MARK_PREFIX = "toolguard lock schema "

#: The SQL of the current lock schema; ``{s}`` is the schema prefix (``"name".`` or empty).
SCHEMA = """
CREATE TABLE IF NOT EXISTS {s}toolguard_lock_fence (
    key   text PRIMARY KEY,
    token bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS {s}toolguard_lock_holder (
    key        text PRIMARY KEY,
    owner      text NOT NULL,
    token      bigint NOT NULL,
    expires_at timestamptz NOT NULL
);
-- ttl_ms: how long a hand-off to this waiter lasts until its first renewal.
CREATE TABLE IF NOT EXISTS {s}toolguard_lock_waiter (
    key           text NOT NULL,
    owner         text NOT NULL,
    arrival       bigint GENERATED ALWAYS AS IDENTITY,
    ttl_ms        integer NOT NULL,
    channel       text NOT NULL,
    present_until timestamptz NOT NULL,
    PRIMARY KEY (key, owner)
);
CREATE INDEX IF NOT EXISTS toolguard_lock_waiter_line ON {s}toolguard_lock_waiter (key, arrival);

-- Mint p_key's next token and make p_owner its holder for p_ttl_ms (the caller holds
-- the fence row lock). Returns the token. A fence row that is missing all the same (swept
-- as idle) is created with the database time, as acquire would: never a NULL token.
CREATE OR REPLACE FUNCTION {s}toolguard_lock_grant(p_key text, p_owner text, p_ttl_ms integer)
RETURNS bigint LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_token bigint;
BEGIN
    INSERT INTO {s}toolguard_lock_fence AS f (key, token)
    VALUES (p_key, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)
    ON CONFLICT (key) DO UPDATE SET token = greatest(f.token + 1, excluded.token)
    RETURNING f.token INTO v_token;
    INSERT INTO {s}toolguard_lock_holder (key, owner, token, expires_at)
    VALUES (p_key, p_owner, v_token, clock_timestamp() + p_ttl_ms * interval '1 millisecond')
    ON CONFLICT (key) DO UPDATE
       SET owner = excluded.owner, token = excluded.token, expires_at = excluded.expires_at;
    DELETE FROM {s}toolguard_lock_waiter WHERE key = p_key AND owner = p_owner;
    RETURN v_token;
END $$;

-- Give the free p_key to its first live waiter, if any, for that waiter's hand-off TTL,
-- and NOTIFY that waiter's process with 'owner token key' (the caller holds the fence
-- row lock).
CREATE OR REPLACE FUNCTION {s}toolguard_lock_pass(p_key text)
RETURNS void LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_next {s}toolguard_lock_waiter%ROWTYPE;
BEGIN
    DELETE FROM {s}toolguard_lock_waiter WHERE key = p_key AND present_until < clock_timestamp();
    SELECT * INTO v_next FROM {s}toolguard_lock_waiter WHERE key = p_key ORDER BY arrival LIMIT 1;
    IF FOUND THEN
        PERFORM pg_notify(v_next.channel, v_next.owner || ' '
                          || {s}toolguard_lock_grant(p_key, v_next.owner, v_next.ttl_ms)
                          || ' ' || p_key);
    END IF;
END $$;

-- Grant p_key to p_owner for p_ttl_ms if it is free and p_owner is first in line; if
-- p_owner holds it already (a hand-off that raced with the end of a wait, a retry after
-- a lost reply), extend it to p_ttl_ms from now. Else queue p_owner (or refresh its
-- presence), to be handed the lock for p_handoff_ms. A free key whose first waiter is
-- someone else is handed to that waiter on the way.
-- Returns (token, 0, token) on a grant, (NULL, ms left on the holder's lease, the key's
-- last token) when queued: a hand-off to p_owner with a token at or below that one is
-- over already.
CREATE OR REPLACE FUNCTION {s}toolguard_lock_acquire(
    p_key text, p_owner text, p_ttl_ms integer, p_handoff_ms integer, p_presence_ms integer,
    p_channel text, OUT token bigint, OUT retry_ms integer, OUT last_token bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_holder {s}toolguard_lock_holder%ROWTYPE;
    v_first text;
BEGIN
    -- Create or lock the key's fence row in one statement: an idle-row sweep
    -- (toolguard.locks.upkeep) can never delete it between finding and locking it.
    INSERT INTO {s}toolguard_lock_fence AS f (key, token) VALUES (p_key, 0)
    ON CONFLICT (key) DO UPDATE SET token = f.token;
    DELETE FROM {s}toolguard_lock_holder WHERE key = p_key AND expires_at <= clock_timestamp();
    SELECT * INTO v_holder FROM {s}toolguard_lock_holder WHERE key = p_key;
    IF NOT FOUND THEN
        DELETE FROM {s}toolguard_lock_waiter
         WHERE key = p_key AND present_until < clock_timestamp();
        SELECT owner INTO v_first FROM {s}toolguard_lock_waiter WHERE key = p_key
         ORDER BY arrival LIMIT 1;
        IF v_first IS NULL OR v_first = p_owner THEN
            token := {s}toolguard_lock_grant(p_key, p_owner, p_ttl_ms);
            retry_ms := 0;
            last_token := token;
            RETURN;
        END IF;
        PERFORM {s}toolguard_lock_pass(p_key);
        SELECT * INTO v_holder FROM {s}toolguard_lock_holder WHERE key = p_key;
    ELSIF v_holder.owner = p_owner THEN
        UPDATE {s}toolguard_lock_holder
           SET expires_at = clock_timestamp() + p_ttl_ms * interval '1 millisecond'
         WHERE key = p_key;
        token := v_holder.token;
        retry_ms := 0;
        last_token := token;
        RETURN;
    END IF;
    INSERT INTO {s}toolguard_lock_waiter (key, owner, ttl_ms, channel, present_until)
    VALUES (p_key, p_owner, p_handoff_ms, p_channel,
            clock_timestamp() + p_presence_ms * interval '1 millisecond')
    ON CONFLICT (key, owner) DO UPDATE
       SET present_until = excluded.present_until, channel = excluded.channel,
           ttl_ms = excluded.ttl_ms;
    token := NULL;
    retry_ms := greatest(1, ceil(extract(epoch FROM v_holder.expires_at - clock_timestamp()) * 1000));
    SELECT f.token INTO last_token FROM {s}toolguard_lock_fence f WHERE f.key = p_key;
END $$;

-- Release p_key if p_owner holds it (then pass it to the first live waiter), and
-- leave its line either way. Returns true if p_owner held an unexpired lease.
CREATE OR REPLACE FUNCTION {s}toolguard_lock_release(p_key text, p_owner text)
RETURNS boolean LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_expires timestamptz;
BEGIN
    PERFORM 1 FROM {s}toolguard_lock_fence WHERE key = p_key FOR UPDATE;
    DELETE FROM {s}toolguard_lock_waiter WHERE key = p_key AND owner = p_owner;
    DELETE FROM {s}toolguard_lock_holder WHERE key = p_key AND owner = p_owner
    RETURNING expires_at INTO v_expires;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM {s}toolguard_lock_pass(p_key);
    RETURN v_expires > clock_timestamp();
END $$;
"""

_ACQUIRE_ARGS = "text,text,integer,integer,integer,text"
#: The acquire function of lock schema 1 (kept for its clients; see the module docstring).
_ACQUIRE_ARGS_V1 = "text,text,integer,integer,text"
_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$")
#: SQLSTATEs meaning the lock schema is not (or no longer) there: install it again.
_SCHEMA_GONE = (pg_errors.UndefinedFunction, pg_errors.UndefinedTable, pg_errors.InvalidSchemaName)

# Extend every (key, owner) still held and unexpired; one row per input, in order.
RENEW = """
WITH held AS (
    SELECT * FROM unnest(%s::text[], %s::text[], %s::integer[]) WITH ORDINALITY
        AS h(key, owner, ttl_ms, n)
), renewed AS (
    UPDATE {s}toolguard_lock_holder l
       SET expires_at = clock_timestamp() + held.ttl_ms * interval '1 millisecond'
      FROM held
     WHERE l.key = held.key AND l.owner = held.owner AND l.expires_at > clock_timestamp()
    RETURNING held.n
)
SELECT held.n IN (SELECT n FROM renewed) FROM held ORDER BY held.n
"""
RAISE_FLOOR = """
INSERT INTO {s}toolguard_lock_fence (key, token) VALUES (%s, %s)
ON CONFLICT (key) DO UPDATE SET token = greatest({s}toolguard_lock_fence.token, excluded.token)
"""


def check_schema_name(schema: str | None) -> str | None:
    """A plain SQL identifier (as the store's ``schema=``), else ``ConfigurationError``."""
    if schema is not None and (not isinstance(schema, str) or not _SCHEMA_NAME.match(schema)):
        msg = f"schema must be a plain SQL identifier, got {schema!r}"
        raise ConfigurationError(msg)
    return schema


@dataclasses.dataclass(frozen=True)
class _Statements:
    """The lock SQL for one schema (the schema name is validated, then quoted)."""

    schema: str | None

    @functools.cached_property
    def prefix(self) -> str:
        return f'"{self.schema}".' if self.schema else ""

    def _q(self, text: str) -> str:
        return text.replace("{s}", self.prefix)

    @functools.cached_property
    def install(self) -> str:
        return self._q(SCHEMA)

    @functools.cached_property
    def create_schema(self) -> str | None:
        return f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"' if self.schema else None

    @functools.cached_property
    def mark(self) -> str:
        return self._q(f"COMMENT ON FUNCTION {{s}}toolguard_lock_acquire({_ACQUIRE_ARGS}) "
                       f"IS '{SCHEMA_MARK}'")

    @functools.cached_property
    def version(self) -> str:
        """One row: the marks of the current and of the version 1 acquire functions."""
        current = self._q(f"{{s}}toolguard_lock_acquire({_ACQUIRE_ARGS})")
        old = self._q(f"{{s}}toolguard_lock_acquire({_ACQUIRE_ARGS_V1})")
        return (f"SELECT obj_description(to_regprocedure('{current}'), 'pg_proc'), "
                f"obj_description(to_regprocedure('{old}'), 'pg_proc')")

    @functools.cached_property
    def install_lock(self) -> str:
        name = "toolguard_lock_schema" + (f":{self.schema}" if self.schema else "")
        return f"SELECT pg_advisory_xact_lock(hashtext('{name}'))"

    @functools.cached_property
    def acquire(self) -> str:
        return self._q("SELECT token, retry_ms, last_token FROM "
                       "{s}toolguard_lock_acquire(%s, %s, %s, %s, %s, %s)")

    @functools.cached_property
    def release(self) -> str:
        return self._q("SELECT {s}toolguard_lock_release(%s, %s)")

    @functools.cached_property
    def renew(self) -> str:
        return self._q(RENEW)

    @functools.cached_property
    def raise_floor(self) -> str:
        return self._q(RAISE_FLOOR)

    @functools.cached_property
    def current_token(self) -> str:
        return self._q("SELECT token FROM {s}toolguard_lock_fence WHERE key = %s")


def _version_of(row: tuple[Any, ...] | None) -> int:
    """The newest version marked in ``_Statements.version``'s row (0: none)."""
    versions = [int(mark[len(_MARK_PREFIX):]) for mark in row or ()
                if isinstance(mark, str) and mark.startswith(_MARK_PREFIX)
                and mark[len(_MARK_PREFIX):].isdigit()]
    return max(versions, default=0)


def _installed_version(conn: psycopg.Connection[Any], statements: _Statements) -> int:
    return _version_of(conn.execute(statements.version).fetchone())


def _install(conn: psycopg.Connection[Any], statements: _Statements, *, force: bool = False) -> int:
    """Create the schema, or upgrade an older one, in one transaction; returns the version.

    Serialized by an advisory lock, so concurrent first uses install once. Tables are
    kept (tokens stay above everything granted before); functions are created or
    replaced (see the module docstring for what happens to version 1's).
    """
    with conn.transaction():
        conn.execute(statements.install_lock)
        if statements.create_schema is not None:
            conn.execute(statements.create_schema)
        if not force and _installed_version(conn, statements) >= SCHEMA_VERSION:
            return SCHEMA_VERSION
        conn.execute(cast(Any, statements.install))
        conn.execute(statements.mark)
    return SCHEMA_VERSION


def install_lock_schema(url: str, *, schema: str | None = None, timeout_s: float = 10.0) -> int:
    """Install (or upgrade) the PostgreSQL lock schema at ``url``; returns its version.

    For ``toolguard db init`` and deploy scripts: one connection, no manager, no pool.
    """
    statements = _Statements(check_schema_name(schema))
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=max(1, int(timeout_s))) as conn:
            return _install(conn, statements)
    except psycopg.OperationalError as error:
        raise BackendUnavailable(f"postgres: {error}") from error


def lock_schema_version(url: str, *, schema: str | None = None, timeout_s: float = 10.0) -> int:
    """The lock schema version installed at ``url`` (0: none; ``SCHEMA_VERSION``: current)."""
    statements = _Statements(check_schema_name(schema))
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=max(1, int(timeout_s))) as conn:
            return _installed_version(conn, statements)
    except psycopg.OperationalError as error:
        raise BackendUnavailable(f"postgres: {error}") from error


T = TypeVar("T")


class _Doorbell:
    """Where a hand-off's token lands for one waiting (key, owner): a thread's event,
    and futures of asyncio tasks on their loops.

    ``floor`` is the key's last token as the latest "queued" answer saw it: a token at
    or below it belongs to a grant that has ended, and is dropped (see the module
    docstring).
    """

    def __init__(self) -> None:
        self.token: int | None = None
        self.floor = 0
        self.event = threading.Event()
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[int]]] = []
        self._lock = threading.Lock()

    def ring(self, token: int) -> None:
        with self._lock:
            if token <= self.floor or (self.token is not None and token <= self.token):
                return  # a hand-off that is over already, or one rung before
            self.token = token
            self.event.set()
            futures, self._futures = self._futures, []
        for loop, future in futures:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve, future, token)

    def queued(self, floor: int) -> None:
        """A "queued" answer that saw ``floor`` as the key's last token."""
        with self._lock:
            self.floor = max(self.floor, floor)
            if self.token is not None and self.token <= self.floor:
                self.token = None
                self.event.clear()

    def taken(self) -> int | None:
        with self._lock:
            return self.token

    def future(self) -> asyncio.Future[int]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        with self._lock:
            if self.token is not None:
                future.set_result(self.token)
            else:
                self._futures.append((loop, future))
        return future


#: Longest one lock statement may wait for a pooled connection, and then for its answer
#: before that connection is cut.
CALL_TIMEOUT_S = 5.0
#: After a call failed to reach the server, and until the pool has an idle connection
#: again, calls do not wait on the pool (whose reconnects are 1, 2, 4... s apart): a
#: server that refused or dropped the connection ("down") is tried on a connection of
#: the call's own, refused at once while it is away and used as soon as it is back; a
#: link that stopped answering ("stalled") fails the call at once, since a new
#: connection would stall too. So a retrying acquire keeps its deadline, and a
#: release on give-up returns quickly. A connection of its own gives up after this.
DIRECT_CONNECT_TIMEOUT_S = 2  # libpq's shortest
_DOWN, _STALLED = "down", "stalled"


class _Call:
    """One statement under the watchdog; ``cut`` tells the caller why its connection died."""

    __slots__ = ("cut", "deadline", "fd")

    def __init__(self, fd: int, deadline: float) -> None:
        self.fd = fd
        self.deadline = deadline
        self.cut = False


class _Watchdog:
    """Cuts the socket of a statement that outlives its deadline.

    psycopg has no client-side read timeout: on a link that stopped answering
    (not closed), a lock call would wait as long as the stall lasts, and a
    release must never hang. Shutting the socket down makes psycopg's wait
    return at once with an OperationalError; the pool then drops the connection.
    One thread serves every connection of the process.
    """

    def __init__(self) -> None:
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._wake_at = 0.0

    @contextlib.contextmanager
    def watch(self, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
              timeout_s: float) -> Any:
        call = _Call(conn.fileno(), time.monotonic() + timeout_s)
        ident = next(self._ids)
        with self._cond:
            self._calls[ident] = call
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="toolguard-pg-watchdog",
                                                daemon=True)
                self._thread.start()
            elif call.deadline < self._wake_at:
                self._cond.notify()
        try:
            yield call
        finally:
            with self._cond:
                self._calls.pop(ident, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                late = [ident for ident, call in self._calls.items() if call.deadline <= now]
                # Cut while holding the lock: ``watch`` cannot return (and the connection
                # cannot be closed and its descriptor reused) until this is done.
                for ident in late:
                    call = self._calls.pop(ident)
                    call.cut = True
                    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(call.fd)) as sock:
                        sock.shutdown(socket.SHUT_RDWR)
                if not late:
                    self._wake_at = min((c.deadline for c in self._calls.values()), default=now + 60)
                    self._cond.wait(max(0.001, self._wake_at - now))
                    self._wake_at = 0.0


_watchdog = _Watchdog()


def _new_watchdog_after_fork() -> None:
    global _watchdog
    _watchdog = _Watchdog()


os.register_at_fork(after_in_child=_new_watchdog_after_fork)


def _timed_out(call: _Call | None, error: BaseException) -> BackendUnavailable | None:
    if call is None or not call.cut:
        return None
    return BackendUnavailable(f"postgres: no answer within {CALL_TIMEOUT_S:g}s ({error})")


def _resolve(future: asyncio.Future[int], token: int) -> None:
    if not future.done():
        future.set_result(token)


class _Listener:
    """One LISTEN connection per backend object, on a channel of its own.

    Notifications name the owner, so the thread rings exactly one doorbell; while
    the connection is down waiters fall back to their bounded poll.
    """

    def __init__(self, conninfo: str, channel: str, connect_options: dict[str, Any]) -> None:
        self.conninfo = conninfo
        self.channel = channel
        self.connect_options = connect_options
        self.ready = threading.Event()
        self._bells: dict[tuple[str, str], _Doorbell] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float) -> None:
        """Start listening; the first call waits (at most ``timeout_s``) for LISTEN to be in
        place, so the first hand-off is not missed. Later calls never block."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="toolguard-pg-listen",
                                            daemon=True)
            self._thread.start()
        self.ready.wait(timeout_s)

    def bell(self, key: str, owner: str, *, create: bool = False) -> _Doorbell | None:
        with self._lock:
            bell = self._bells.get((key, owner))
            if bell is None and create:
                bell = self._bells[(key, owner)] = _Doorbell()
            return bell

    def forget(self, key: str, owner: str) -> None:
        with self._lock:
            self._bells.pop((key, owner), None)

    def close(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        pause = 0.05
        while not self._stopped.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True,
                                     **self.connect_options) as conn:
                    conn.execute(f'LISTEN "{self.channel}"')
                    self.ready.set()
                    pause = 0.05
                    while not self._stopped.is_set():
                        for note in conn.notifies(timeout=0.5):
                            if self._stopped.is_set():
                                break
                            self._deliver(note.payload)
            except Exception:  # the connection broke (or worse): listen again, waiters poll meanwhile
                self.ready.clear()
                if self._stopped.wait(pause):
                    return
                pause = min(1.0, pause * 2)

    def _deliver(self, payload: str) -> None:
        parts = payload.split(" ", 2)
        if len(parts) != 3 or not parts[1].isdigit():  # e.g. the empty wake-up sent by close()
            return
        owner, token, key = parts
        bell = self.bell(key, owner)
        if bell is not None:
            bell.ring(int(token))


class PostgresBackend:
    """Sync PostgreSQL backend on a psycopg_pool ``ConnectionPool`` (opened on first use).

    ``schema=`` keeps the lock tables and functions in that schema (a plain SQL
    identifier, created if missing), e.g. the store's schema.
    """

    info = INFO

    def __init__(self, url: str = "postgresql://127.0.0.1/postgres", *, schema: str | None = None,
                 min_size: int = 1, max_size: int = 10, timeout_s: float = 10.0,
                 presence_ms: int = 2_000, application_name: str = "toolguard-locks") -> None:
        self.url = url
        self.schema = check_schema_name(schema)
        for name, size in (("min_size", min_size), ("max_size", max_size)):
            if not isinstance(size, int) or isinstance(size, bool) or size < (name == "max_size"):
                msg = f"{name} must be a non-negative integer (max_size >= 1), got {size!r}"
                raise ConfigurationError(msg)
        if max_size < min_size:
            msg = f"max_size ({max_size}) must not be below min_size ({min_size})"
            raise ConfigurationError(msg)
        self.min_size = min_size
        self.max_size = max_size
        self.timeout_s = check_seconds("timeout_s", timeout_s, positive=True)
        self.presence_ms = check_ms("presence_ms", presence_ms, MIN_TTL_MS)
        self.statements = _Statements(self.schema)
        # A partitioned link must not leave a lock call waiting forever: the kernel drops a
        # connection whose data goes unacknowledged for timeout_s, and probes idle ones.
        self.connect_options: dict[str, Any] = {
            "application_name": application_name, "connect_timeout": max(1, int(timeout_s)),
            "tcp_user_timeout": int(timeout_s * 1000), "keepalives": 1, "keepalives_idle": 5,
            "keepalives_interval": 2, "keepalives_count": 3}
        self._direct_options = {**self.connect_options,
                                "connect_timeout": DIRECT_CONNECT_TIMEOUT_S}
        self._lock = threading.Lock()
        self._pool: ConnectionPool | None = None
        self._listener: _Listener | None = None
        self._contacted = False  # the first contact's answer was no typo (see _check_first_contact)
        self._schema_ready = False
        #: Why the last call failed to reach the server (``_DOWN``/``_STALLED``); cleared
        #: by the next call through the pool.
        self._trouble: str | None = None
        self._pool_errors = 0
        self._pid = os.getpid()
        self._closed = False

    # --- plumbing ---------------------------------------------------------------------------

    def _fork_check(self) -> None:
        if self._pid != os.getpid():  # a forked child must not touch the parent's sockets
            self._pid = os.getpid()
            self._pool = None
            self._listener = None

    def _open_pool(self) -> ConnectionPool:
        if self._closed:
            msg = "postgres lock backend is closed"
            raise BackendUnavailable(msg)
        self._fork_check()
        pool = self._pool
        if pool is None:
            self._check_first_contact()
            with self._lock:
                if self._pool is None:
                    self._pool = ConnectionPool(
                        self.url, min_size=self.min_size, max_size=self.max_size,
                        kwargs={"autocommit": True, **self.connect_options},
                        timeout=self.timeout_s, open=True, name="toolguard-locks")
                pool = self._pool
        return pool

    def _check_first_contact(self) -> None:
        """One direct connection before the pool opens: a typo in the URL (unknown database,
        bad credentials, a host name that does not resolve) raises ``ConfigurationError``
        now, instead of the pool retrying it until every call times out. A server that is
        down or slow is not a verdict: the pool waits for it as for any outage. Once per
        backend (again after a typo, so a fixed server is found)."""
        if self._contacted:
            return
        try:
            psycopg.connect(self.url, **postgres_probe_options(self._direct_options)).close()
        except psycopg.Error as error:
            why = definitive(error)
            if why is not None:
                raise misconfigured("postgresql locks", redacted_url(self.url), error, why) \
                    from error
        self._contacted = True

    def _get_pool(self) -> ConnectionPool:
        """The pool, with the schema checked (installed or upgraded if needed) once."""
        pool = self._open_pool()
        if not self._schema_ready:
            def ensure(conn: psycopg.Connection[Any]) -> None:
                if _installed_version(conn, self.statements) < SCHEMA_VERSION:
                    _install(conn, self.statements)

            self._with(pool, ensure)
            self._schema_ready = True
        return pool

    def _reinstall(self) -> None:
        """A lock table or function went missing under us (dropped, a restore): put every
        piece back, whatever the version mark says."""
        self._with(self._open_pool(), lambda conn: _install(conn, self.statements, force=True))
        self._schema_ready = True

    def install(self) -> int:
        """Create the lock tables and functions, or upgrade older ones; returns the version.

        Idempotent and safe to run concurrently. Not needed before use (the first
        call installs what is missing), but deploy scripts may prefer it explicit.
        """
        version = self._with(self._open_pool(), lambda conn: _install(conn, self.statements))
        self._schema_ready = True
        return version

    def schema_version(self) -> int:
        """The lock schema version installed (0: none; ``SCHEMA_VERSION``: current)."""
        return self._with(self._open_pool(),
                          lambda conn: _installed_version(conn, self.statements))

    @contextlib.contextmanager
    def _connection(self, pool: ConnectionPool) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection; while the server is in trouble and the pool has none idle,
        one of its own or an immediate failure (see ``DIRECT_CONNECT_TIMEOUT_S``)."""
        trouble = self._trouble
        if trouble is not None and not _has_idle(pool):
            if trouble == _STALLED:
                msg = "postgres: the link stopped answering and no connection has come back"
                raise BackendUnavailable(msg)
            with psycopg.connect(self.url, autocommit=True, **self._direct_options) as conn:
                yield conn
            return
        with pool.connection(timeout=CALL_TIMEOUT_S) as conn:
            yield conn
        self._trouble = None

    def _with(self, pool: ConnectionPool, step: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run ``step`` on a connection; after a broken connection, drop every broken
        idle one and retry once.

        Every statement here is idempotent (a repeated acquire returns the same
        grant), so one retry after a dropped connection is safe.
        """
        for attempt in (1, 2):
            call: _Call | None = None
            try:
                with self._connection(pool) as conn, \
                        _watchdog.watch(conn, CALL_TIMEOUT_S) as call:
                    return step(conn)
            except (psycopg.OperationalError, psycopg.InterfaceError) as error:
                silent = _timed_out(call, error)
                self._trouble = _trouble_of(error, silent)
                if silent is not None:  # a link that stopped answering: no second wait
                    raise silent from error
                if attempt == 2:
                    raise BackendUnavailable(f"postgres: {error}") from error
                with contextlib.suppress(Exception):
                    pool.check()  # e.g. the server restarted: its other connections died too
            except PoolTimeout as error:
                self._trouble, self._pool_errors = _pool_trouble(pool, self._pool_errors)
                raise BackendUnavailable(f"postgres: {error}") from error
        raise AssertionError("unreachable")

    def _run(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        pool = self._get_pool()
        try:
            return self._with(pool, lambda conn: _rows(conn.execute(sql, params)))
        except _SCHEMA_GONE:  # dropped or restored under us: install it again, once
            self._reinstall()
            return self._with(pool, lambda conn: _rows(conn.execute(sql, params)))

    def _listening(self) -> _Listener:
        self._fork_check()
        listener = self._listener
        if listener is None:
            self._check_first_contact()
            with self._lock:
                if self._listener is None:
                    channel = f"toolguard_lock_{uuid.uuid4().hex}"
                    self._listener = _Listener(self.url, channel, self.connect_options)
                listener = self._listener
        listener.start(self.timeout_s)
        return listener

    # --- pure steps shared with the asyncio backend -----------------------------------------

    def _before_acquire(self, key: str, owner: str) -> tuple[str, ...]:
        """Ring a doorbell before asking: a hand-off may land before the reply does."""
        listener = self._listening()
        listener.bell(key, owner, create=True)
        return (listener.channel,)

    def _acquire_params(self, key: str, owner: str, ttl_ms: int, channel: str) -> tuple[Any, ...]:
        return (key, owner, ttl_ms, owner_handoff_ms(owner), self.presence_ms, channel)

    def _attempt(self, key: str, owner: str, row: tuple[Any, ...] | None) -> Attempt:
        if row is None:
            msg = "postgres: acquire returned no row"
            raise BackendUnavailable(msg)
        token, retry_ms, last_token = row
        if token is not None:
            self._forget(key, owner)
            return Attempt(token=int(token))
        bell = self._listener.bell(key, owner) if self._listener is not None else None
        if bell is not None:
            bell.queued(int(last_token or 0))
        return Attempt(token=None, retry_ms=int(retry_ms))

    def _forget(self, key: str, owner: str) -> None:
        if self._listener is not None:
            self._listener.forget(key, owner)

    def _wait_budget(self, timeout_s: float) -> float:
        """Wait at most a third of the presence deadline, so the caller's next
        try_acquire keeps this waiter's place in line."""
        return max(0.001, min(timeout_s, self.presence_ms / 3000))

    # --- the protocol -------------------------------------------------------------------------

    def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        self._get_pool()  # an unreachable database fails here, before the listener waits for it
        (channel,) = self._before_acquire(key, owner)
        try:
            rows = self._run(self.statements.acquire,
                             self._acquire_params(key, owner, ttl_ms, channel))
        except BaseException:
            self._forget(key, owner)
            raise
        return self._attempt(key, owner, rows[0] if rows else None)

    def wait(self, key: str, owner: str, timeout_s: float) -> int | None:
        """Block until the releaser's NOTIFY brings our token, or the budget passes."""
        budget = self._wait_budget(timeout_s)
        bell = self._listener.bell(key, owner) if self._listener is not None else None
        if bell is None:  # not queued through try_acquire: nothing will ring
            time.sleep(budget)
            return None
        if not bell.event.wait(budget):
            return None
        token = bell.taken()
        if token is not None:
            self._forget(key, owner)
        return token

    def release(self, key: str, owner: str) -> bool:
        self._forget(key, owner)
        rows = self._run(self.statements.release, (key, owner))
        return bool(rows and rows[0][0])

    def renew(self, held: Sequence[tuple[str, str, int]]) -> list[bool]:
        """Extend every lease in one statement."""
        if not held:
            return []
        keys, owners, ttls = (list(column) for column in zip(*held, strict=True))
        return [bool(row[0]) for row in self._run(self.statements.renew, (keys, owners, ttls))]

    def raise_floor(self, key: str, token: int) -> None:
        self._run(self.statements.raise_floor, (key, token))

    def current_token(self, key: str) -> int:
        """The last token granted for ``key`` (0 if it was never locked)."""
        rows = self._run(self.statements.current_token, (key,))
        return int(rows[0][0]) if rows else 0

    def close(self) -> None:
        self._closed = True
        if self._pid != os.getpid():
            return
        listener, self._listener = self._listener, None
        if listener is not None:
            listener._stopped.set()
            if self._pool is not None:  # wake the listening thread now rather than in 0.5 s
                with contextlib.suppress(Exception):
                    self._with(self._pool, lambda conn: conn.execute(
                        "SELECT pg_notify(%s, '')", (listener.channel,)))
            listener.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(timeout=1.0)


def _rows(cursor: psycopg.Cursor[Any]) -> list[tuple[Any, ...]]:
    return cursor.fetchall() if cursor.description else []


def _has_idle(pool: ConnectionPool | AsyncConnectionPool) -> bool:
    return bool(pool.get_stats().get("pool_available", 0))


def _pool_trouble(pool: ConnectionPool | AsyncConnectionPool, seen_errors: int) -> tuple[str, int]:
    """After waiting for a pooled connection in vain: did the pool's own attempts fail
    since ``seen_errors`` (the server refuses: down), or just not finish (stalled)?
    Returns the trouble and the pool's error count now."""
    errors = int(pool.get_stats().get("connections_errors", 0))
    return (_DOWN if errors > seen_errors else _STALLED), errors


def _trouble_of(error: BaseException, silent: BackendUnavailable | None) -> str:
    """A call cut by the watchdog, or a connection that could not be made in time, is a
    stalled link; any other connection error means the server refused or dropped it."""
    if silent is not None or isinstance(error, pg_errors.ConnectionTimeout):
        return _STALLED
    return _DOWN


class AsyncPostgresBackend:
    """The asyncio twin: the same SQL through psycopg's ``AsyncConnectionPool``.

    It shares the sync backend's schema check and LISTEN connection: a hand-off's
    NOTIFY resolves the waiting task's future, so waiting holds no thread.
    """

    info = INFO

    def __init__(self, sync: PostgresBackend) -> None:
        self.sync = sync
        self._pool: AsyncConnectionPool | None = None
        self._opening: asyncio.Lock | None = None
        self._trouble: str | None = None  # as in the sync backend
        self._pool_errors = 0

    @property
    def presence_ms(self) -> int:
        return self.sync.presence_ms

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if self._pool is None:
            self._opening = self._opening or asyncio.Lock()
            async with self._opening:
                if self._pool is None:
                    await asyncio.to_thread(self.sync._get_pool)  # schema, once per database
                    pool = AsyncConnectionPool(
                        self.sync.url, min_size=self.sync.min_size, max_size=self.sync.max_size,
                        kwargs={"autocommit": True, **self.sync.connect_options},
                        timeout=self.sync.timeout_s, open=False, name="toolguard-locks-async")
                    await pool.open()
                    self._pool = pool
        assert self._pool is not None
        trouble = self._trouble
        if trouble is not None and not _has_idle(self._pool):
            if trouble == _STALLED:
                msg = "postgres: the link stopped answering and no connection has come back"
                raise BackendUnavailable(msg)
            connect = psycopg.AsyncConnection.connect
            async with await connect(self.sync.url, autocommit=True,
                                     **self.sync._direct_options) as conn:
                yield conn
            return
        async with self._pool.connection(timeout=CALL_TIMEOUT_S) as conn:
            yield conn
        self._trouble = None

    async def _run(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        try:
            return await self._run_once(sql, params)
        except _SCHEMA_GONE:  # dropped or restored under us: install it again, once
            await asyncio.to_thread(self.sync._reinstall)
            return await self._run_once(sql, params)

    async def _run_once(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        for attempt in (1, 2):  # one retry on a dropped connection, as in the sync backend
            call: _Call | None = None
            try:
                async with self._connection() as conn:
                    with _watchdog.watch(conn, CALL_TIMEOUT_S) as call:
                        cursor = await conn.execute(sql, params)
                        return await cursor.fetchall() if cursor.description else []
            except (psycopg.OperationalError, psycopg.InterfaceError) as error:
                silent = _timed_out(call, error)
                self._trouble = _trouble_of(error, silent)
                if silent is not None:
                    raise silent from error
                if attempt == 2:
                    raise BackendUnavailable(f"postgres: {error}") from error
                if self._pool is not None:
                    with contextlib.suppress(Exception):
                        await self._pool.check()
            except PoolTimeout as error:
                if self._pool is not None:
                    self._trouble, self._pool_errors = _pool_trouble(self._pool, self._pool_errors)
                raise BackendUnavailable(f"postgres: {error}") from error
        raise AssertionError("unreachable")

    async def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        if self.sync._listener is None:
            await asyncio.to_thread(self.sync._listening)  # starting it blocks briefly, once
        (channel,) = self.sync._before_acquire(key, owner)
        try:
            rows = await self._run(self.sync.statements.acquire,
                                   self.sync._acquire_params(key, owner, ttl_ms, channel))
        except BaseException:
            self.sync._forget(key, owner)
            raise
        return self.sync._attempt(key, owner, rows[0] if rows else None)

    async def wait(self, key: str, owner: str, timeout_s: float) -> int | None:
        budget = self.sync._wait_budget(timeout_s)
        listener = self.sync._listener
        bell = listener.bell(key, owner) if listener is not None else None
        if bell is None:
            await asyncio.sleep(budget)
            return None
        try:
            token = await asyncio.wait_for(bell.future(), budget)
        except TimeoutError:
            return None
        self.sync._forget(key, owner)
        return token

    async def release(self, key: str, owner: str) -> bool:
        self.sync._forget(key, owner)
        rows = await self._run(self.sync.statements.release, (key, owner))
        return bool(rows and rows[0][0])

    async def raise_floor(self, key: str, token: int) -> None:
        await self._run(self.sync.statements.raise_floor, (key, token))

    async def aclose(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close(timeout=1.0)
