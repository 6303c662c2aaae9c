"""PostgreSQL backend: leases in tables on database time, a FIFO line, hand-off by NOTIFY.

Tables (created idempotently, all ``toolguard_lock_*``, apart from the store's)::

    toolguard_lock_fence   key -> last token granted: durable, strictly increasing per key
    toolguard_lock_holder  key -> owner, token, expires_at (database time)
    toolguard_lock_waiter  (key, owner) -> arrival, TTL, channel, presence deadline

Every operation is one call of a plpgsql function: one round trip, one transaction.
Each function first locks the key's fence row (``FOR UPDATE``), so the steps on one
key are serialized and a token is minted in the same transaction as its grant.
Tokens are hybrid-clock values like the other backends': ``max(last + 1, database
time in µs)``, so even a database restored from an old backup mints tokens above
the ones it forgot (``raise_floor`` covers a clock that went backwards).

A release hands the lock straight to the first live waiter (minting its token)
and NOTIFYs that waiter's process on the process's own channel with ``owner token
key``. One LISTEN connection per backend object receives these and wakes the
waiting thread or task with the token in hand. A crashed holder's lock simply
expires: the next contender, or a waiter's bounded poll, finds it expired and
passes it on. A crashed waiter's presence deadline lapses and it drops out.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from toolguard.errors import BackendUnavailable
from toolguard.locks.base import Attempt, BackendInfo

__all__ = ["SCHEMA", "SCHEMA_MARK", "AsyncPostgresBackend", "PostgresBackend"]

INFO = BackendInfo(
    name="postgres",
    durable_tokens=True,
    server_wakeup=True,
    fair=True,
    note="leases on database time; tokens durable in the same database as the store",
)

#: Stored as the comment of the acquire function: a database that has it needs no DDL.
SCHEMA_MARK = "toolguard lock schema 1"

SCHEMA = """
CREATE TABLE IF NOT EXISTS toolguard_lock_fence (
    key   text PRIMARY KEY,
    token bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS toolguard_lock_holder (
    key        text PRIMARY KEY,
    owner      text NOT NULL,
    token      bigint NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS toolguard_lock_waiter (
    key           text NOT NULL,
    owner         text NOT NULL,
    arrival       bigint GENERATED ALWAYS AS IDENTITY,
    ttl_ms        integer NOT NULL,
    channel       text NOT NULL,
    present_until timestamptz NOT NULL,
    PRIMARY KEY (key, owner)
);
CREATE INDEX IF NOT EXISTS toolguard_lock_waiter_line ON toolguard_lock_waiter (key, arrival);

-- Mint p_key's next token and make p_owner its holder for p_ttl_ms (the caller holds
-- the fence row lock). Returns the token.
CREATE OR REPLACE FUNCTION toolguard_lock_grant(p_key text, p_owner text, p_ttl_ms integer)
RETURNS bigint LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_token bigint;
BEGIN
    UPDATE toolguard_lock_fence
       SET token = greatest(token + 1, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)
     WHERE key = p_key
    RETURNING token INTO v_token;
    INSERT INTO toolguard_lock_holder (key, owner, token, expires_at)
    VALUES (p_key, p_owner, v_token, clock_timestamp() + p_ttl_ms * interval '1 millisecond')
    ON CONFLICT (key) DO UPDATE
       SET owner = excluded.owner, token = excluded.token, expires_at = excluded.expires_at;
    DELETE FROM toolguard_lock_waiter WHERE key = p_key AND owner = p_owner;
    RETURN v_token;
END $$;

-- Give the free p_key to its first live waiter, if any, and NOTIFY that waiter's
-- process with 'owner token key' (the caller holds the fence row lock).
CREATE OR REPLACE FUNCTION toolguard_lock_pass(p_key text)
RETURNS void LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_next toolguard_lock_waiter%ROWTYPE;
BEGIN
    DELETE FROM toolguard_lock_waiter WHERE key = p_key AND present_until < clock_timestamp();
    SELECT * INTO v_next FROM toolguard_lock_waiter WHERE key = p_key ORDER BY arrival LIMIT 1;
    IF FOUND THEN
        PERFORM pg_notify(v_next.channel, v_next.owner || ' '
                          || toolguard_lock_grant(p_key, v_next.owner, v_next.ttl_ms) || ' ' || p_key);
    END IF;
END $$;

-- Grant p_key to p_owner if it is free and p_owner is first in line, else queue
-- p_owner (or refresh its presence). A free key whose first waiter is someone else
-- is handed to that waiter on the way.
-- Returns (token, 0) on a grant, (NULL, ms left on the holder's lease) when queued.
CREATE OR REPLACE FUNCTION toolguard_lock_acquire(
    p_key text, p_owner text, p_ttl_ms integer, p_presence_ms integer, p_channel text,
    OUT token bigint, OUT retry_ms integer)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_holder toolguard_lock_holder%ROWTYPE;
    v_first text;
BEGIN
    INSERT INTO toolguard_lock_fence (key, token) VALUES (p_key, 0) ON CONFLICT (key) DO NOTHING;
    PERFORM 1 FROM toolguard_lock_fence WHERE key = p_key FOR UPDATE;
    DELETE FROM toolguard_lock_holder WHERE key = p_key AND expires_at <= clock_timestamp();
    SELECT * INTO v_holder FROM toolguard_lock_holder WHERE key = p_key;
    IF NOT FOUND THEN
        DELETE FROM toolguard_lock_waiter WHERE key = p_key AND present_until < clock_timestamp();
        SELECT owner INTO v_first FROM toolguard_lock_waiter WHERE key = p_key
         ORDER BY arrival LIMIT 1;
        IF v_first IS NULL OR v_first = p_owner THEN
            token := toolguard_lock_grant(p_key, p_owner, p_ttl_ms);
            retry_ms := 0;
            RETURN;
        END IF;
        PERFORM toolguard_lock_pass(p_key);
        SELECT * INTO v_holder FROM toolguard_lock_holder WHERE key = p_key;
    ELSIF v_holder.owner = p_owner THEN  -- a hand-off raced with the end of our wait
        token := v_holder.token;
        retry_ms := 0;
        RETURN;
    END IF;
    INSERT INTO toolguard_lock_waiter (key, owner, ttl_ms, channel, present_until)
    VALUES (p_key, p_owner, p_ttl_ms, p_channel,
            clock_timestamp() + p_presence_ms * interval '1 millisecond')
    ON CONFLICT (key, owner) DO UPDATE
       SET present_until = excluded.present_until, channel = excluded.channel;
    token := NULL;
    retry_ms := greatest(1, ceil(extract(epoch FROM v_holder.expires_at - clock_timestamp()) * 1000));
END $$;

-- Release p_key if p_owner holds it (then pass it to the first live waiter), and
-- leave its line either way. Returns true if p_owner held an unexpired lease.
CREATE OR REPLACE FUNCTION toolguard_lock_release(p_key text, p_owner text)
RETURNS boolean LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_expires timestamptz;
BEGIN
    PERFORM 1 FROM toolguard_lock_fence WHERE key = p_key FOR UPDATE;
    DELETE FROM toolguard_lock_waiter WHERE key = p_key AND owner = p_owner;
    DELETE FROM toolguard_lock_holder WHERE key = p_key AND owner = p_owner
    RETURNING expires_at INTO v_expires;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM toolguard_lock_pass(p_key);
    RETURN v_expires > clock_timestamp();
END $$;
"""

_ACQUIRE_SIGNATURE = "toolguard_lock_acquire(text,text,integer,integer,text)"

CHECK_SCHEMA = f"SELECT obj_description(to_regprocedure('{_ACQUIRE_SIGNATURE}'), 'pg_proc')"
MARK_SCHEMA = f"COMMENT ON FUNCTION {_ACQUIRE_SIGNATURE} IS '{SCHEMA_MARK}'"
ACQUIRE = "SELECT token, retry_ms FROM toolguard_lock_acquire(%s, %s, %s, %s, %s)"
RELEASE = "SELECT toolguard_lock_release(%s, %s)"
# Extend every (key, owner) still held and unexpired; one row per input, in order.
RENEW = """
WITH held AS (
    SELECT * FROM unnest(%s::text[], %s::text[], %s::integer[]) WITH ORDINALITY
        AS h(key, owner, ttl_ms, n)
), renewed AS (
    UPDATE toolguard_lock_holder l
       SET expires_at = clock_timestamp() + held.ttl_ms * interval '1 millisecond'
      FROM held
     WHERE l.key = held.key AND l.owner = held.owner AND l.expires_at > clock_timestamp()
    RETURNING held.n
)
SELECT held.n IN (SELECT n FROM renewed) FROM held ORDER BY held.n
"""
RAISE_FLOOR = """
INSERT INTO toolguard_lock_fence (key, token) VALUES (%s, %s)
ON CONFLICT (key) DO UPDATE SET token = greatest(toolguard_lock_fence.token, excluded.token)
"""
CURRENT_TOKEN = "SELECT token FROM toolguard_lock_fence WHERE key = %s"

T = TypeVar("T")


class _Doorbell:
    """Where a hand-off's token lands for one waiting (key, owner): a thread's event,
    and futures of asyncio tasks on their loops."""

    def __init__(self) -> None:
        self.token: int | None = None
        self.event = threading.Event()
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[int]]] = []
        self._lock = threading.Lock()

    def ring(self, token: int) -> None:
        with self._lock:
            self.token = token
            self.event.set()
            futures, self._futures = self._futures, []
        for loop, future in futures:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve, future, token)

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
    """Sync PostgreSQL backend on a psycopg_pool ``ConnectionPool`` (opened on first use)."""

    info = INFO

    def __init__(self, url: str = "postgresql://127.0.0.1/postgres", *, min_size: int = 1,
                 max_size: int = 10, timeout_s: float = 10.0, presence_ms: int = 2_000,
                 application_name: str = "toolguard-locks") -> None:
        self.url = url
        self.min_size = min_size
        self.max_size = max_size
        self.timeout_s = timeout_s
        self.presence_ms = presence_ms
        # A partitioned link must not leave a lock call waiting forever: the kernel drops a
        # connection whose data goes unacknowledged for timeout_s, and probes idle ones.
        self.connect_options: dict[str, Any] = {
            "application_name": application_name, "connect_timeout": max(1, int(timeout_s)),
            "tcp_user_timeout": int(timeout_s * 1000), "keepalives": 1, "keepalives_idle": 5,
            "keepalives_interval": 2, "keepalives_count": 3}
        self._lock = threading.Lock()
        self._pool: ConnectionPool | None = None
        self._listener: _Listener | None = None
        self._schema_ready = False
        self._pid = os.getpid()
        self._closed = False

    # --- plumbing ---------------------------------------------------------------------------

    def _fork_check(self) -> None:
        if self._pid != os.getpid():  # a forked child must not touch the parent's sockets
            self._pid = os.getpid()
            self._pool = None
            self._listener = None

    def _get_pool(self) -> ConnectionPool:
        if self._closed:
            msg = "postgres lock backend is closed"
            raise BackendUnavailable(msg)
        self._fork_check()
        pool = self._pool
        if pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ConnectionPool(
                        self.url, min_size=self.min_size, max_size=self.max_size,
                        kwargs={"autocommit": True, **self.connect_options},
                        timeout=self.timeout_s, open=True, name="toolguard-locks")
                pool = self._pool
        if not self._schema_ready:
            self._install(pool)
        return pool

    def _install(self, pool: ConnectionPool) -> None:
        """Create the tables and functions unless this database already has this version."""
        def install(conn: psycopg.Connection[Any]) -> None:
            if _marked(conn.execute(CHECK_SCHEMA).fetchone()):
                return
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtext('toolguard_lock_schema'))")
                if not _marked(conn.execute(CHECK_SCHEMA).fetchone()):
                    conn.execute(SCHEMA)
                    conn.execute(MARK_SCHEMA)

        self._with(pool, install)
        self._schema_ready = True

    def _with(self, pool: ConnectionPool, step: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run ``step`` on a pooled connection; after a broken connection, drop every
        broken idle one and retry once.

        Every statement here is idempotent (a repeated acquire returns the same
        grant), so one retry after a dropped connection is safe.
        """
        for attempt in (1, 2):
            call: _Call | None = None
            try:
                with pool.connection(timeout=CALL_TIMEOUT_S) as conn, \
                        _watchdog.watch(conn, CALL_TIMEOUT_S) as call:
                    return step(conn)
            except (psycopg.OperationalError, psycopg.InterfaceError) as error:
                silent = _timed_out(call, error)
                if silent is not None:  # a link that stopped answering: no second wait
                    raise silent from error
                if attempt == 2:
                    raise BackendUnavailable(f"postgres: {error}") from error
                with contextlib.suppress(Exception):
                    pool.check()  # e.g. the server restarted: its other connections died too
            except PoolTimeout as error:
                raise BackendUnavailable(f"postgres: {error}") from error
        raise AssertionError("unreachable")

    def _run(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        pool = self._get_pool()
        return self._with(pool, lambda conn: _rows(conn.execute(sql, params)))

    def _listening(self) -> _Listener:
        self._fork_check()
        listener = self._listener
        if listener is None:
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

    def _attempt(self, key: str, owner: str, row: tuple[Any, ...] | None) -> Attempt:
        if row is None:
            msg = "postgres: acquire returned no row"
            raise BackendUnavailable(msg)
        token, retry_ms = row
        if token is not None:
            self._forget(key, owner)
            return Attempt(token=int(token))
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
            rows = self._run(ACQUIRE, (key, owner, ttl_ms, self.presence_ms, channel))
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
        self._forget(key, owner)
        return bell.token

    def release(self, key: str, owner: str) -> bool:
        self._forget(key, owner)
        rows = self._run(RELEASE, (key, owner))
        return bool(rows and rows[0][0])

    def renew(self, held: Sequence[tuple[str, str, int]]) -> list[bool]:
        """Extend every lease in one statement."""
        if not held:
            return []
        keys, owners, ttls = (list(column) for column in zip(*held, strict=True))
        return [bool(row[0]) for row in self._run(RENEW, (keys, owners, ttls))]

    def raise_floor(self, key: str, token: int) -> None:
        self._run(RAISE_FLOOR, (key, token))

    def current_token(self, key: str) -> int:
        """The last token granted for ``key`` (0 if it was never locked)."""
        rows = self._run(CURRENT_TOKEN, (key,))
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


def _marked(row: tuple[Any, ...] | None) -> bool:
    return row is not None and row[0] == SCHEMA_MARK


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
        async with self._pool.connection(timeout=CALL_TIMEOUT_S) as conn:
            yield conn

    async def _run(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        for attempt in (1, 2):  # one retry on a dropped connection, as in the sync backend
            call: _Call | None = None
            try:
                async with self._connection() as conn:
                    with _watchdog.watch(conn, CALL_TIMEOUT_S) as call:
                        cursor = await conn.execute(sql, params)
                        return await cursor.fetchall() if cursor.description else []
            except (psycopg.OperationalError, psycopg.InterfaceError) as error:
                silent = _timed_out(call, error)
                if silent is not None:
                    raise silent from error
                if attempt == 2:
                    raise BackendUnavailable(f"postgres: {error}") from error
                if self._pool is not None:
                    with contextlib.suppress(Exception):
                        await self._pool.check()
            except PoolTimeout as error:
                raise BackendUnavailable(f"postgres: {error}") from error
        raise AssertionError("unreachable")

    async def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        if self.sync._listener is None:
            await asyncio.to_thread(self.sync._listening)  # starting it blocks briefly, once
        (channel,) = self.sync._before_acquire(key, owner)
        try:
            rows = await self._run(ACQUIRE, (key, owner, ttl_ms, self.sync.presence_ms, channel))
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
        rows = await self._run(RELEASE, (key, owner))
        return bool(rows and rows[0][0])

    async def raise_floor(self, key: str, token: int) -> None:
        await self._run(RAISE_FLOOR, (key, token))

    async def aclose(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close(timeout=1.0)
