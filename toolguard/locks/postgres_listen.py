"""The PostgreSQL backend's LISTEN side: one connection that receives hand-offs, and
the doorbells it rings.

A release hands the lock to the first live waiter and NOTIFYs that waiter's
process with ``owner token key``; the ``_Listener`` thread reads those on the
backend's own channel and rings the waiter's ``_Doorbell`` (a thread's event, or
futures of asyncio tasks). Separate from ``toolguard.locks.postgres`` because it
is a thread and connection of its own, shared by the sync and asyncio backends,
and knows nothing of pools or lock statements.

Stale notifications: a NOTIFY is delivered whenever the listening connection reads
it, possibly long after its grant ended (this process was stopped, the waiter gave
up and queued again). Every acquire that answers "queued" also returns the key's
last token at that moment, and the waiter's doorbell drops any token at or below
it: a grant still ours would have been returned by that call, so an older token is
one that has already expired or been released. A token above it was granted after
the call, which is where the manager starts the lease's TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import psycopg


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
