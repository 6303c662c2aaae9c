"""Leases and the one renewal loop that keeps every lease of a process alive."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from toolguard.errors import BackendUnavailable, LockLost, NotOwned

if TYPE_CHECKING:
    from toolguard.locks.base import LockBackend

__all__ = ["Heartbeat", "Lease", "heartbeat"]

log = logging.getLogger("toolguard.locks")

#: Renew when a third of the TTL has passed: two more tries fit before expiry.
RENEW_FRACTION = 1 / 3
#: Local deadline safety margin against clock-rate drift between client and server.
DRIFT_FRACTION = 0.02
#: A backend's renewal thread exits after this long without work.
RENEWER_IDLE_S = 30.0

#: Guards the rare paths of every lease (loss, loss callbacks, the lazily made event):
#: a lease that is released before anything goes wrong never builds a lock or an event.
_RARE = threading.Lock()


class Lease:
    """Proof of holding one or more lock keys, with the fencing token of each.

    ``lost`` turns true (and ``lost_event`` is set) the moment the process
    learns the lease is gone: the server said "not yours", or renewals failed
    until the local deadline passed. Call ``check()`` before a side effect that
    cannot check tokens itself; pass ``tokens`` to one that can.

    ``deadline`` (local monotonic time) is when the server may have let the
    lease go at the earliest: ``acquired_at`` (sent before the grant) plus the
    TTL the grant ran for, which for a hand-off is the shorter ``first_ttl_ms``,
    less a margin for clock-rate drift. Each renewal moves it.
    """

    def __init__(
        self,
        *,
        keys: tuple[str, ...],
        tokens: Mapping[str, int],
        owner: str,
        ttl_ms: int,
        acquired_at: float,
        backend: LockBackend,
        releaser: Any,
        first_ttl_ms: float | None = None,
    ) -> None:
        first_ms = ttl_ms if first_ttl_ms is None else min(first_ttl_ms, ttl_ms)
        self.keys = keys
        self.tokens: Mapping[str, int] = MappingProxyType(dict(tokens))
        self.owner = owner
        self.ttl_ms = ttl_ms
        self.acquired_at = acquired_at
        self.deadline = acquired_at + first_ms / 1000 * (1 - DRIFT_FRACTION)
        self.lost_reason: LockLost | None = None
        self.released = False
        self._lost = False
        self._event: threading.Event | None = None
        self._backend = backend
        self._releaser = releaser
        self._callbacks: list[Callable[[Lease], None]] = []
        #: When the heartbeat should renew next: a third into the TTL the grant runs for.
        self._renew_due = acquired_at + first_ms / 1000 * RENEW_FRACTION

    # --- state ------------------------------------------------------------------

    @property
    def token(self) -> int:
        """The token of a single-key lease (the highest one for a multi-key lease)."""
        return max(self.tokens.values())

    @property
    def lost_event(self) -> threading.Event:
        """Set the moment the lease is lost (made on first use; set at once if lost already)."""
        event = self._event
        if event is None:
            with _RARE:
                if self._event is None:
                    made = threading.Event()
                    if self._lost:
                        made.set()
                    self._event = made
                event = self._event
        return event

    @property
    def lost(self) -> bool:
        if not self._lost and not self.released and time.monotonic() > self.deadline:
            self.mark_lost(LockLost(f"lease on {', '.join(self.keys)} expired locally",
                                   keys=self.keys))
        return self._lost

    def check(self) -> None:
        """Raise ``LockLost`` if the lease is no longer safe to act under."""
        if self.lost:
            assert self.lost_reason is not None
            raise self.lost_reason

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def on_lost(self, callback: Callable[[Lease], None]) -> None:
        """Call ``callback(lease)`` once, from the renewal thread, when the lease is lost."""
        with _RARE:
            if not self._lost:
                self._callbacks.append(callback)
                return
        callback(self)

    def mark_lost(self, error: LockLost) -> None:
        with _RARE:
            if self._lost or self.released:
                return
            self.lost_reason = error
            self._lost = True
            if self._event is not None:
                self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        log.warning("lease lost: %s", error)
        _count_lost(error)
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # a broken callback must not stop the renewal loop
                log.exception("lease-lost callback failed")

    # --- release ----------------------------------------------------------------

    def release(self) -> None:
        """Release every key; idempotent, never raises for an already-expired lease."""
        self._releaser.release(self)

    async def arelease(self) -> None:
        await self._releaser.arelease(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "lost" if self._lost else ("released" if self.released else "held")
        return f"Lease(keys={list(self.keys)}, tokens={dict(self.tokens)}, {state})"


def _count_lost(error: LockLost) -> None:
    """``toolguard.leases.lost``; imported here, on the rare loss, to keep ``import`` light."""
    try:
        from toolguard.runtime import telemetry

        telemetry.lease_lost(error.reason)
    except Exception:  # a metrics failure must not stop the renewal loop
        log.exception("could not count a lost lease")


class Heartbeat:
    """One daemon thread per process watching every held lease; renewals batched per backend.

    The loop itself never waits on a server: each backend's batch is renewed on
    that backend's renewal thread (at most one batch in flight per backend), and
    the loop marks a lease lost as soon as its local deadline passes. A server
    that hangs without answering therefore cannot keep a holder believing it
    holds the lock, nor stall the renewals of other backends.
    """

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._in_flight: set[int] = set()
        self._renewers: dict[int, queue.SimpleQueue[list[Lease]]] = {}
        self._pid = os.getpid()
        #: When the sleeping loop will wake on its own (0 while it is awake): a new lease
        #: due later needs no wake-up, which keeps ``acquire`` from waking this thread.
        self._wake_at = 0.0

    def add(self, lease: Lease) -> None:
        with self._cond:
            self._leases[id(lease)] = lease
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="toolguard-heartbeat",
                                                daemon=True)
                self._thread.start()
            elif self._due_at(lease) < self._wake_at:
                self._cond.notify()

    def remove(self, lease: Lease) -> None:
        with self._cond:
            self._leases.pop(id(lease), None)

    def held(self) -> list[Lease]:
        with self._cond:
            return list(self._leases.values())

    def _due_at(self, lease: Lease) -> float:
        return lease._renew_due

    @staticmethod
    def _early_s(lease: Lease) -> float:
        """How early a lease may ride along with a batch: half a renewal interval."""
        return lease.ttl_ms / 1000 * RENEW_FRACTION / 2

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                expired: list[Lease] = []
                soon: dict[int, list[Lease]] = {}
                due: set[int] = set()
                wake = now + 1.0
                for lease in list(self._leases.values()):
                    if lease._lost or lease.released:
                        self._leases.pop(id(lease), None)  # a lost lease is never renewed again
                    elif now >= lease.deadline:
                        expired.append(lease)
                        self._leases.pop(id(lease), None)
                    else:
                        wake = min(wake, lease.deadline)
                        if id(lease._backend) in self._in_flight:
                            continue
                        if self._due_at(lease) <= now + self._early_s(lease):
                            soon.setdefault(id(lease._backend), []).append(lease)
                        if self._due_at(lease) <= now:
                            due.add(id(lease._backend))
                        else:
                            wake = min(wake, self._due_at(lease))
                # A backend with one lease due renews all its leases due soon in the same call.
                groups = {backend: group for backend, group in soon.items() if backend in due}
                if not expired and not groups:
                    self._wake_at = wake
                    self._cond.wait(timeout=max(0.001, wake - now))
                    self._wake_at = 0.0
                    continue
                self._in_flight.update(groups)
                for backend_id, group in groups.items():
                    self._submit(backend_id, group)
            for lease in expired:
                lease.mark_lost(LockLost(f"lease on {', '.join(lease.keys)} passed its deadline "
                                         "before a renewal succeeded", keys=lease.keys))

    def _submit(self, backend_id: int, group: list[Lease]) -> None:
        """Queue a batch for the backend's renewal thread (started on demand); holds ``_cond``."""
        jobs = self._renewers.get(backend_id)
        if jobs is None:
            jobs = self._renewers[backend_id] = queue.SimpleQueue()
            threading.Thread(target=self._renewer, args=(backend_id, jobs),
                             name="toolguard-renew", daemon=True).start()
        jobs.put(group)

    def _renewer(self, backend_id: int, jobs: queue.SimpleQueue[list[Lease]]) -> None:
        """One backend's renewals, one batch at a time; keeps its connection warm between them."""
        while True:
            try:
                group = jobs.get(timeout=RENEWER_IDLE_S)
            except queue.Empty:
                with self._cond:  # submissions hold _cond too, so no batch is left behind
                    if jobs.empty():
                        self._renewers.pop(backend_id, None)
                        return
                continue
            try:
                self._renew(group)
            finally:
                with self._cond:
                    self._in_flight.discard(backend_id)
                    self._cond.notify()

    def _renew(self, group: list[Lease]) -> None:
        """Renew one backend's due leases in one call and apply the verdicts."""
        backend = group[0]._backend
        sent_at = time.monotonic()
        held = [(key, lease.owner, lease.ttl_ms) for lease in group for key in lease.keys]
        try:
            owned = backend.renew(held)
        except (BackendUnavailable, OSError) as error:
            self._retry_later(group, sent_at, error)
            return
        except Exception as error:  # an unexpected error is as unknown as a transport one
            log.exception("renewal failed")
            self._retry_later(group, sent_at, error)
            return
        position = 0
        for lease in group:
            results = owned[position:position + len(lease.keys)]
            position += len(lease.keys)
            if all(results):
                lease._renew_due = sent_at + lease.ttl_ms / 1000 * RENEW_FRACTION
                lease.deadline = sent_at + lease.ttl_ms / 1000 * (1 - DRIFT_FRACTION)
            else:
                gone = [k for k, ok in zip(lease.keys, results, strict=True) if not ok]
                lease.mark_lost(NotOwned(f"lock {', '.join(gone)} is no longer held by this "
                                         "lease (expired or taken)", keys=gone))
                self.remove(lease)

    def _retry_later(self, group: list[Lease], sent_at: float, error: BaseException) -> None:
        """Transient failure: try again soon, until the lease's local deadline passes."""
        for lease in group:
            if time.monotonic() >= lease.deadline:
                lease.mark_lost(LockLost(f"could not renew {', '.join(lease.keys)} before its "
                                         f"deadline: {error}", keys=lease.keys))
                self.remove(lease)
            else:
                retry_in = min(lease.ttl_ms / 1000 / 10, max(0.0, lease.deadline - sent_at) / 2)
                lease._renew_due = time.monotonic() + retry_in


_heartbeat = Heartbeat()


def heartbeat() -> Heartbeat:
    """The process-wide renewal loop (a fresh one in a forked child)."""
    return _heartbeat


def _reset_after_fork() -> None:
    global _heartbeat
    _heartbeat = Heartbeat()


os.register_at_fork(after_in_child=_reset_after_fork)
