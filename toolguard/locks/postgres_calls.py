"""How a PostgreSQL lock statement stays bounded, and how its failure is read.

psycopg has no client-side read timeout, so a process-wide watchdog thread cuts
the socket of a statement that outlives its deadline; after a failed call, the
"down" or "stalled" verdict decides whether the next call waits on the pool, uses
a connection of its own, or fails at once. Separate from
``toolguard.locks.postgres`` because none of it is about locks: it is the
connection plumbing both backends share. (The deadline itself, ``CALL_TIMEOUT_S``,
and the process's watchdog instance stay in ``toolguard.locks.postgres``, where
the backends look them up.)
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from toolguard.errors import BackendUnavailable

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
