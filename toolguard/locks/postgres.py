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

The schema is installed on first use (``install()`` does it explicitly, and so does
``install_lock_schema(url)``, without a backend); an older lock schema is upgraded
in the same transaction. ``SCHEMA_VERSION`` is recorded as the comment of the
acquire function.

The parts: ``toolguard.locks.postgres_schema`` holds the SQL and installs it (and
says how older schemas are upgraded), ``toolguard.locks.postgres_listen`` the
LISTEN connection and the waiters' doorbells (and how stale notifications are
dropped), ``toolguard.locks.postgres_calls`` the watchdog and the outage verdicts
that keep each statement bounded. This module holds the two backends and
re-exports the public names of the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from toolguard.errors import BackendUnavailable, ConfigurationError
from toolguard.locks.base import (
    MIN_TTL_MS,
    Attempt,
    BackendInfo,
    check_ms,
    check_seconds,
    owner_handoff_ms,
)
from toolguard.locks.postgres_calls import (
    _STALLED,
    DIRECT_CONNECT_TIMEOUT_S,
    _Call,
    _has_idle,
    _pool_trouble,
    _trouble_of,
    _Watchdog,
)
from toolguard.locks.postgres_listen import _Listener
from toolguard.locks.postgres_schema import (
    _SCHEMA_GONE,
    SCHEMA,
    SCHEMA_MARK,
    SCHEMA_VERSION,
    _install,
    install_lock_schema,
    lock_schema_version,
)

# Moved to postgres_schema; still imported from here (the doctor's checks, toolguard.cli.db).
from toolguard.locks.postgres_schema import _installed_version as _installed_version
from toolguard.locks.postgres_schema import _Statements as _Statements
from toolguard.locks.postgres_schema import check_schema_name as check_schema_name
from toolguard.runtime.connection_errors import (
    definitive,
    misconfigured,
    postgres_probe_options,
    redacted_url,
)
from toolguard.runtime.postgres_pool import AsyncRecentFirstPool, RecentFirstPool

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

T = TypeVar("T")

#: Longest one lock statement may wait for a pooled connection, and then for its answer
#: before that connection is cut. (Here, with the code that reads it, rather than in
#: ``postgres_calls``: the fault tests patch it on this module.)
CALL_TIMEOUT_S = 5.0

#: The process's watchdog (``postgres_calls._Watchdog``), looked up here on every call:
#: a forked child gets a new one.
_watchdog = _Watchdog()


def _new_watchdog_after_fork() -> None:
    global _watchdog
    _watchdog = _Watchdog()


os.register_at_fork(after_in_child=_new_watchdog_after_fork)


def _timed_out(call: _Call | None, error: BaseException) -> BackendUnavailable | None:
    if call is None or not call.cut:
        return None
    return BackendUnavailable(f"postgres: no answer within {CALL_TIMEOUT_S:g}s ({error})")


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
                    self._pool = RecentFirstPool(
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
                    pool = AsyncRecentFirstPool(
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
