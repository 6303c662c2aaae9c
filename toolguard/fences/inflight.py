"""Telling "this idempotency key is still in flight" apart from "wait, then replay".

Inside the fenced transaction a second request with the same key waits on the
first one's row locks and then replays its result: exactly-once holds without
any of this. What the IETF idempotency-key draft asks for is an immediate 409
while the first request runs, so the client does not hold a connection for the
whole of it. A registry answers that before the fenced transaction opens:

* ``PostgresInFlight`` holds a transaction-level advisory lock on the key's
  64-bit hash, on a connection of the service's own store, for as long as the
  request runs (``pg_try_advisory_xact_lock``: never waits). It covers every
  process and machine on that database and ends with the connection, so a
  crashed service frees its keys at once. Two keys with one hash would give a
  spurious 409, never a wrong result. A marker's request needs a second
  connection for its fenced transaction, so at most half the pool holds
  markers at once (the others wait for a turn, within the pool's timeout):
  markers alone can never take every connection and starve their own
  transactions.
* ``LocalInFlight`` is a set in this process: the default for SQLite, whose
  services run on one machine. Several processes on one SQLite file see each
  other's requests as "wait, then replay" instead of 409.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any, Protocol

from toolguard.errors import BackendUnavailable, GuardMisconfigured
from toolguard.runtime.cancellation import finish
from toolguard.store import AsyncGuardedStore

__all__ = ["InFlightRegistry", "LocalInFlight", "PostgresInFlight", "default_registry"]

#: One message: open a transaction and try the lock (psycopg client-side binding).
_TRY_LOCK = "BEGIN; SELECT pg_try_advisory_xact_lock(hashtextextended(%s, 0))"


class InFlightRegistry(Protocol):
    """``async with registry.hold(key) as held``: ``held`` is False if ``key`` is already in flight."""

    def hold(self, key: str) -> contextlib.AbstractAsyncContextManager[bool]: ...


class LocalInFlight:
    """The keys in flight in this process (also across event loops in several threads)."""

    def __init__(self) -> None:
        self._keys: set[str] = set()
        self._lock = threading.Lock()

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[bool]:
        with self._lock:
            held = key not in self._keys
            self._keys.add(key)
        if not held:
            yield False
            return
        try:
            yield True
        finally:
            with self._lock:
                self._keys.discard(key)


class PostgresInFlight:
    """In-flight keys as advisory locks in the service's PostgreSQL database.

    ``markers`` bounds the connections held by markers at once (default: half
    the store's pool, which must have at least 2: one marker, one transaction).
    """

    def __init__(self, store: Any, *, namespace: str | None = None,
                 markers: int | None = None) -> None:
        self.store = store
        schema = getattr(store, "schema", None) or ""
        self.namespace = namespace if namespace is not None else f"toolguard.inflight:{schema}:"
        pool = getattr(store, "pool_max_size", None)
        if markers is None:
            markers = pool // 2 if isinstance(pool, int) else 5
        if isinstance(pool, int) and not 0 < markers < pool:
            msg = (f"the store's pool has {pool} connection(s): a fenced request holds an "
                   f"in-flight marker and a transaction at once, so give the store "
                   f"max_size >= 2 and at most max_size - 1 markers (got {markers})")
            raise GuardMisconfigured(msg)
        self.markers = markers
        self._turns = asyncio.Semaphore(markers)
        self._timeout_s = float(getattr(store, "pool_timeout_s", 10.0))

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[bool]:
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._turns.acquire()
        except TimeoutError:
            msg = (f"postgresql: no connection for an in-flight marker within "
                   f"{self._timeout_s:g} s ({self.markers} requests hold one)")
            raise BackendUnavailable(msg) from None
        try:
            async with self._marker(key) as held:
                yield held
        finally:
            self._turns.release()

    @contextlib.asynccontextmanager
    async def _marker(self, key: str) -> AsyncIterator[bool]:
        import psycopg

        async with self.store.connection() as conn:
            try:
                cursor = psycopg.AsyncClientCursor(conn)
                await cursor.execute(_TRY_LOCK, (self.namespace + key,))
                cursor.nextset()  # past BEGIN's empty result
                row = await cursor.fetchone()
                yield bool(row and row[0])
            finally:
                # The connection goes back to the pool only once this has ended, cancelled
                # or not: never with a statement still running on it.
                await finish(self._end(conn))

    async def _end(self, conn: Any) -> None:
        """End the marker's transaction, and with it the lock; a connection that cannot be
        brought back to idle is closed (the pool replaces it, and the lock ends with it)."""
        import psycopg
        from psycopg.pq import TransactionStatus

        with contextlib.suppress(psycopg.Error, TimeoutError):
            async with asyncio.timeout(self._timeout_s):
                if not conn.closed:
                    await conn.execute("ROLLBACK")
        if not conn.closed and conn.info.transaction_status != TransactionStatus.IDLE:
            await conn.close()


def default_registry(store: AsyncGuardedStore) -> InFlightRegistry:
    """Advisory locks on a PostgreSQL store, the in-process set otherwise."""
    if getattr(store, "dialect", None) == "postgresql":
        return PostgresInFlight(store)
    return LocalInFlight()
