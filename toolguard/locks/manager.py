"""Multi-key, all-or-nothing acquisition with one deadline, for sync and asyncio code.

The rules are the same on both paths and live in ``_Plan``: keys in canonical
order; on each key wait in its FIFO queue; when a later key of a multi-key set
is not granted within ``round_wait_s``, give back what is held, back off with
full jitter and start a new round; past the total deadline raise
``LockTimeout`` naming the key that was not granted.

Why a lease is the server's current grant when ``acquire`` returns it
---------------------------------------------------------------------
The lease's local ``deadline`` is ``start + grant TTL``, less a drift margin,
where ``start`` is a local time known to precede the server setting that TTL:

* A direct grant (``try_acquire`` returned a token) ran its TTL from that call,
  also when the key was already ours (backends extend it then, see
  ``toolguard.locks.base``): ``start`` is the call's send time.
* A hand-off (``wait`` returned a token) is one the releaser made after our
  latest ``try_acquire`` that answered "queued": a backend never returns an
  older one (PostgreSQL and SQLite drop tokens at or below the key's last token
  as that call saw it; Redis clears the waiter's hand-off list in that call). The
  releaser grants it for the waiter's hand-off TTL (``owner_handoff_ms``: the
  TTL, at most the presence window). So ``start`` is that call's send time, and
  the grant TTL the hand-off TTL. Waits between calls are capped at a third of
  the hand-off TTL, so a hand-off arrives with two thirds of it left.
* Before handing a lease out, the manager checks that at least a third of the
  grant's TTL is left on the local clock. A grant that is older (the process
  was stopped, a reply was slow) is not returned: the manager asks
  ``try_acquire`` again, which extends the grant from that call if it is still
  ours, or queues the owner again if it expired and went to someone else.

Hence a lease returned is held on the server at the moment it is returned, and
``lease.lost`` turns true no later than the server can give the key away.

Transient errors
----------------
``BackendUnavailable`` from ``try_acquire`` or ``wait`` is retried within the
caller's own deadline (the key's wait deadline), with jittered exponential
backoff. Retrying is safe: acquire is idempotent per owner, and a grant whose
reply was lost is found again (and extended from the call that finds it, so its
``start`` is that call's). When the deadline passes, the acquisition ends in
``BackendUnavailable`` if the last call to the server failed (the server is
away; nobody is known to hold the key), else in ``LockTimeout``. Giving up
releases what it holds best-effort; each release is bounded by the backend's
call timeouts, so it never hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from toolguard.errors import (
    BackendUnavailable,
    ConfigurationError,
    LockError,
    LockLost,
    LockTimeout,
)
from toolguard.locks.base import (
    AsyncLockBackend,
    LockBackend,
    canonical_keys,
    check_seconds,
    check_ttl,
    full_jitter,
    new_owner,
)
from toolguard.locks.lease import RENEW_FRACTION, Lease, heartbeat
from toolguard.runtime.cancellation import finish

__all__ = ["AsyncLockManager", "LockManager"]

T = TypeVar("T")

#: Longest a waiter sleeps without re-checking the key: bounds the delay after a
#: crashed holder's TTL runs out, and keeps the waiter's place in the queue alive.
MAX_POLL_S = 0.5
POLL_JITTER_S = 0.005
#: Backoff between retries of a call that failed with a transient error.
RETRY_BASE_S = 0.02
RETRY_CAP_S = 0.5


@dataclass(frozen=True, slots=True)
class _Grant:
    """One key's grant: its token, a local time before the server set its TTL, that TTL."""

    token: int
    start: float
    ttl_ms: int

    @property
    def expires(self) -> float:
        """The earliest local time at which the server may let the grant go (before drift)."""
        return self.start + self.ttl_ms / 1000

    def usable(self, now: float) -> bool:
        """At least a third of the grant's TTL is left: enough to renew it in time."""
        return now < self.expires - self.ttl_ms / 1000 * RENEW_FRACTION


@dataclass(slots=True)
class _Plan:
    """Deadlines, backoff and retries for one acquisition; pure, shared by sync and async."""

    keys: tuple[str, ...]
    ttl_ms: int
    deadline: float
    round_wait_s: float
    backoff_base_s: float
    backoff_cap_s: float
    #: How long a hand-off to this acquisition runs before its first renewal.
    handoff_ms: int = 0
    owner: str = ""
    rounds: int = 0
    failures: int = 0
    #: The last transport error, cleared by every answer from the server.
    last_error: BackendUnavailable | None = None
    grants: dict[str, _Grant] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.handoff_ms:
            self.handoff_ms = self.ttl_ms
        if not self.owner:
            self.owner = new_owner(self.ttl_ms, self.handoff_ms)

    def key_deadline(self, index: int) -> float:
        """The first key waits for the whole deadline; later ones only for one round.

        Keys already taken are not renewed until the lease exists, so a later key
        is awaited at most until the earliest grant held is a third into its TTL:
        the lease is never handed out with less than two thirds of it left.
        """
        if index == 0:
            return self.deadline
        held = min(g.start + g.ttl_ms / 1000 * RENEW_FRACTION for g in self.grants.values())
        return min(self.deadline, time.monotonic() + self.round_wait_s, held)

    def poll_s(self, until: float, retry_ms: int) -> float | None:
        remaining = until - time.monotonic()
        if remaining <= 0:
            return None
        # Jittered, so waiters that saw the same expiring holder do not all look at once.
        if retry_ms > 0:
            hint = retry_ms / 1000 + random.uniform(0.0, POLL_JITTER_S)
        else:
            hint = MAX_POLL_S * random.uniform(0.5, 1.0)
        # A hand-off starts its TTL at the last "queued" answer: ask again often enough
        # that it arrives with two thirds of its TTL left.
        cap = min(MAX_POLL_S, self.handoff_ms / 1000 * RENEW_FRACTION)
        return max(0.001, min(remaining, hint, cap))

    def answered(self) -> None:
        """The server answered: the failure streak is over."""
        self.failures = 0
        self.last_error = None

    def retry_s(self, error: BackendUnavailable, until: float) -> float | None:
        """How long to pause before retrying after ``error``; None past ``until``."""
        self.last_error = error
        self.failures += 1
        remaining = until - time.monotonic()
        if remaining <= 0:
            return None
        return min(remaining, max(0.001, full_jitter(self.failures, RETRY_BASE_S, RETRY_CAP_S)))

    def backoff_s(self) -> float | None:
        """Sleep before the next round, or None when the deadline leaves no room for one."""
        self.rounds += 1
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            return None
        return min(remaining, full_jitter(self.rounds, self.backoff_base_s, self.backoff_cap_s))

    def failure(self, key: str) -> LockError | BackendUnavailable:
        """What giving up on ``key`` raises: the server's absence, or contention."""
        if self.last_error is not None:
            msg = (f"lock server unavailable while waiting for lock {key!r} "
                   f"(keys {list(self.keys)}): {self.last_error}")
            error = BackendUnavailable(msg)
            error.__cause__ = self.last_error
            return error
        msg = f"timed out waiting for lock {key!r} (keys {list(self.keys)})"
        return LockTimeout(msg, keys=(key,))

    def lease_window(self) -> tuple[float, float]:
        """``(acquired_at, first_ttl_ms)`` covering every grant: the earliest start, and
        the time from it to the earliest expiry."""
        start = min(g.start for g in self.grants.values())
        expires = min(g.expires for g in self.grants.values())
        return start, (expires - start) * 1000

    def usable(self) -> bool:
        now = time.monotonic()
        return all(g.usable(now) for g in self.grants.values())


def _check_keys_and_options(keys: str | Iterable[str], ttl_ms: int | None,
                            timeout_s: float | None) -> tuple[str, ...]:
    """Validate the per-call arguments eagerly (``ConfigurationError`` naming the value)."""
    if ttl_ms is not None:
        check_ttl(ttl_ms)
    if timeout_s is not None:
        check_seconds("timeout_s", timeout_s)
    return canonical_keys(keys)


async def _not_swallowing(call: Awaitable[T]) -> T:
    """Await ``call``; if it returned although this task was cancelled meanwhile, raise the
    cancellation. ``asyncio.wait_for`` before Python 3.12 returns the result of a call that
    finished as it was cancelled (redis-py awaits its socket writes that way), so a task
    cancelled at that point would otherwise go on, holding the lock it was just granted."""
    task = asyncio.current_task()
    before = task.cancelling() if task is not None else 0
    result = await call
    if task is not None and task.cancelling() > before:
        raise asyncio.CancelledError
    return result


class _Holds:
    """The keys this process's managers of one lock space hold or are taking, and who waits.

    A key claimed by one owner is not taken by another owner in this process, whatever
    the server answers: the server may have forgotten a live lease (a Redis restarted
    without persistence, a lock record deleted), and the process knows its own leases.
    A second acquisition of a held key waits here for the local release, in FIFO order,
    as another process waits in the server's queue, until its own deadline. Claims are
    taken in the keys' canonical order, as on the server, so local waits cannot deadlock.
    A release hands the claim to the first waiter. ``_mutex`` is held for a few
    dictionary operations, never across I/O.
    """

    def __init__(self) -> None:
        self._owners: dict[str, str] = {}
        self._leases: dict[str, Lease] = {}
        self._queues: dict[str, deque[tuple[str, Callable[[], None]]]] = {}
        self._mutex = threading.Lock()

    def held(self, lease: Lease) -> None:
        """``lease`` holds its keys: a claim counts while the lease is live (held, not lost,
        not past its local deadline: a holder paused past it is no longer live)."""
        with self._mutex:
            for key in lease.keys:
                if self._owners.get(key) == lease.owner:
                    self._leases[key] = lease

    def expiry(self, key: str) -> float | None:
        """The local deadline of the lease holding ``key``, if one does."""
        lease = self._leases.get(key)
        return lease.deadline if lease is not None else None

    def _drop_stale(self, key: str) -> Callable[[], None] | None:
        """Under ``_mutex``: a claim whose lease is no longer live is dropped (handed on)."""
        lease = self._leases.get(key)
        if lease is None or lease.owner != self._owners.get(key):
            return None
        if not (lease.released or lease._lost or time.monotonic() > lease.deadline):
            return None
        return self._hand_on(key)

    def _hand_on(self, key: str) -> Callable[[], None] | None:
        """Under ``_mutex``: the claim on ``key`` goes to the first in line (or nobody)."""
        self._leases.pop(key, None)
        line = self._queues.get(key)
        if not line:
            self._owners.pop(key, None)
            return None
        following, wake = line.popleft()
        if not line:
            del self._queues[key]
        self._owners[key] = following
        return wake

    def claim(self, key: str, owner: str) -> bool:
        """Claim ``key`` for ``owner`` if nobody has it; True if ``owner`` has it now."""
        with self._mutex:
            wake = self._drop_stale(key)
            mine = self._owners.setdefault(key, owner) == owner
        if wake is not None:
            wake()
        return mine

    def queue(self, key: str, owner: str, wake: Callable[[], None]) -> bool:
        """Wait in line for ``key``: True if claimed at once, else ``wake()`` once handed."""
        with self._mutex:
            handed = self._drop_stale(key)
            mine = self._owners.setdefault(key, owner) == owner
            if not mine:
                self._queues.setdefault(key, deque()).append((owner, wake))
        if handed is not None:
            handed()
        return mine

    def withdraw(self, key: str, owner: str) -> bool:
        """Leave the line for ``key``; True if the claim was handed to ``owner`` meanwhile."""
        with self._mutex:
            line = self._queues.get(key)
            if line:
                kept = deque(entry for entry in line if entry[0] != owner)
                if kept:
                    self._queues[key] = kept
                else:
                    del self._queues[key]
            return self._owners.get(key) == owner

    def free(self, key: str, owner: str) -> None:
        """Drop ``owner``'s claim on ``key`` (if it has it); hand it to the first in line."""
        with self._mutex:
            if self._owners.get(key) != owner:
                return
            wake = self._hand_on(key)
        if wake is not None:
            wake()

    def holder(self, key: str) -> str | None:
        return self._owners.get(key)


#: lock space -> the claims of every manager of this process on it (see ``holds_of``);
#: an entry goes with the last manager that used it
_SPACES: weakref.WeakValueDictionary[str, _Holds] = weakref.WeakValueDictionary()
_SPACES_MUTEX = threading.Lock()


def holds_of(space: str) -> _Holds:
    """The process's claims on one lock space (a lock server and namespace): managers made
    for the same space share them, so no two holders in this process get one key at once,
    whatever the server answers."""
    with _SPACES_MUTEX:
        holds = _SPACES.get(space)
        if holds is None:
            holds = _SPACES[space] = _Holds()
        return holds


def own_space(backend: object) -> str:
    """The space of a backend object handed in directly: that object's own."""
    return f"{type(backend).__qualname__}@{id(backend):x}"


class _ManagerBase:
    def __init__(
        self,
        *,
        ttl_ms: int = 10_000,
        timeout_s: float = 5.0,
        round_wait_s: float = 1.0,
        backoff_base_s: float = 0.005,
        backoff_cap_s: float = 0.25,
        space: str,
    ) -> None:
        self.ttl_ms = check_ttl(ttl_ms)
        self.timeout_s = check_seconds("timeout_s", timeout_s)
        self.round_wait_s = check_seconds("round_wait_s", round_wait_s, positive=True)
        self.backoff_base_s = check_seconds("backoff_base_s", backoff_base_s)
        self.backoff_cap_s = check_seconds("backoff_cap_s", backoff_cap_s)
        self._presence: int | None = None  # the backend's presence window, once read
        self._holds = holds_of(space)  # the space names a URL: kept out of reprs
        if self.backoff_cap_s < self.backoff_base_s:
            msg = (f"backoff_cap_s ({backoff_cap_s!r}) must not be below backoff_base_s "
                   f"({backoff_base_s!r})")
            raise ConfigurationError(msg)

    def _presence_ms(self) -> int | None:
        presence = getattr(self._queueing_backend(), "presence_ms", None)
        return presence if isinstance(presence, int) and presence > 0 else None

    def _handoff_ms(self, ttl: int) -> int:
        """The hand-off TTL of an acquisition of ``ttl`` ms (the backend's presence window
        is read once: it is fixed when the backend is made)."""
        presence = self._presence
        if presence is None:
            presence = self._presence = self._presence_ms() or 0
        return min(ttl, presence) if presence else ttl

    def _queueing_backend(self) -> Any:
        raise NotImplementedError

    def _plan(self, keys: str | Iterable[str], ttl_ms: int | None,
              timeout_s: float | None) -> _Plan:
        canonical = _check_keys_and_options(keys, ttl_ms, timeout_s)
        wait = self.timeout_s if timeout_s is None else timeout_s
        ttl = self.ttl_ms if ttl_ms is None else ttl_ms
        return _Plan(
            keys=canonical,
            ttl_ms=ttl,
            deadline=time.monotonic() + wait,
            round_wait_s=self.round_wait_s,
            backoff_base_s=self.backoff_base_s,
            backoff_cap_s=self.backoff_cap_s,
            handoff_ms=self._handoff_ms(ttl),
        )

    def _new_lease(self, plan: _Plan, renewer: LockBackend) -> Lease:
        acquired_at, first_ttl_ms = plan.lease_window()
        lease = Lease(keys=plan.keys, tokens={k: g.token for k, g in plan.grants.items()},
                      owner=plan.owner, ttl_ms=plan.ttl_ms, acquired_at=acquired_at,
                      backend=renewer, releaser=self, first_ttl_ms=first_ttl_ms)
        heartbeat().add(lease)
        self._holds.held(lease)
        lease.on_lost(self._on_lost)
        return lease

    def _on_lost(self, lease: Lease) -> None:
        self._lost(lease)

    def _lost(self, lease: Lease) -> None:
        """A lost lease is not live: its keys may be taken again (the server decides)."""
        for key in lease.keys:
            self._holds.free(key, lease.owner)


class LockManager(_ManagerBase):
    """Takes fenced leases on one or more keys from a ``LockBackend``.

    >>> with locks.acquire(["account:1", "account:2"], ttl_ms=5_000) as lease:
    ...     write(lease.tokens)
    """

    def __init__(self, backend: LockBackend, *, space: str | None = None,
                 **options: Any) -> None:
        super().__init__(space=space or own_space(backend), **options)
        self.backend = backend

    def _queueing_backend(self) -> Any:
        return self.backend

    def acquire(self, keys: str | Iterable[str], *, ttl_ms: int | None = None,
                timeout_s: float | None = None) -> Lease:
        """Take every key or none; raise ``LockTimeout`` (naming the key) at the deadline,
        or ``BackendUnavailable`` if the lock server was away until then."""
        plan = self._plan(keys, ttl_ms, timeout_s)
        while True:
            plan.grants.clear()
            try:
                for index, key in enumerate(plan.keys):
                    grant = self._take(key, plan, plan.key_deadline(index))
                    if grant is None:
                        break
                    plan.grants[key] = grant
            except BaseException:
                self._give_back(plan.keys, plan.owner)
                raise
            if len(plan.grants) == len(plan.keys) and plan.usable():
                return self._new_lease(plan, self.backend)
            missing = next((k for k in plan.keys if k not in plan.grants), plan.keys[0])
            self._give_back(plan.keys, plan.owner)
            pause = plan.backoff_s()
            if pause is None:
                raise plan.failure(missing)
            time.sleep(pause)

    def _take(self, key: str, plan: _Plan, until: float) -> _Grant | None:
        """Wait in line for ``key`` until granted (a usable grant) or ``until`` passes:
        first behind this manager's own holder of it, if any, then on the server."""
        owner = plan.owner
        if not self._claim(key, owner, until):
            return None
        while True:
            sent = time.monotonic()
            try:
                attempt = self.backend.try_acquire(key, owner, plan.ttl_ms)
            except BackendUnavailable as error:
                pause = plan.retry_s(error, until)
                if pause is None:
                    return None
                time.sleep(pause)
                continue
            plan.answered()
            if attempt.token is not None:
                grant = _Grant(attempt.token, sent, plan.ttl_ms)
                if grant.usable(time.monotonic()):
                    return grant
                if time.monotonic() >= until:  # too old, and no time left to ask again
                    self._leave(key, owner)
                    return None
                continue  # too old to hand out: ask again (extended if still ours)
            queued_at = sent
            poll = plan.poll_s(until, attempt.retry_ms)
            if poll is None:
                self._leave(key, owner)  # leave the queue (or return a late hand-off)
                return None
            try:
                handed = self.backend.wait(key, owner, poll)
            except BackendUnavailable as error:
                pause = plan.retry_s(error, until)
                if pause is None:
                    self._leave(key, owner)
                    return None
                time.sleep(pause)
                continue
            if handed is not None:
                grant = _Grant(handed, queued_at, plan.handoff_ms)
                if grant.usable(time.monotonic()):
                    return grant
                # Handed over too long ago (this process was stopped?): ask again.

    def _claim(self, key: str, owner: str, until: float) -> bool:
        """Claim ``key`` in this manager, waiting in line behind its local holder until
        ``until``."""
        if self._holds.claim(key, owner):  # the usual case: nobody here holds it, no Event
            return True
        while True:
            handed = threading.Event()
            if self._holds.queue(key, owner, handed.set):
                return True
            expiry = self._holds.expiry(key)
            wake_at = until if expiry is None else min(until, expiry + 0.001)
            if handed.wait(max(0.0, wake_at - time.monotonic())):
                return True
            if self._holds.withdraw(key, owner):
                return True
            if time.monotonic() >= until:
                return False
            # the local holder's lease ran out meanwhile: ask again (its claim is stale)

    def _leave(self, key: str, owner: str) -> None:
        try:
            with contextlib.suppress(Exception):  # best effort: an unreleased entry lapses
                self.backend.release(key, owner)
        finally:
            self._holds.free(key, owner)

    def _give_back(self, keys: tuple[str, ...], owner: str) -> None:
        for key in keys:
            self._leave(key, owner)

    def release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        # Release first, unregister after: the next holder is waiting on the release,
        # and the heartbeat already skips a lease marked released.
        self._give_back(lease.keys, lease.owner)
        heartbeat().remove(lease)

    async def arelease(self, lease: Lease) -> None:
        await asyncio.to_thread(self.release, lease)

    def raise_floor(self, key: str, token: int) -> None:
        """Re-seed: every later token for ``key`` will be greater than ``token``."""
        self.backend.raise_floor(key, token)

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> LockManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncLockManager(_ManagerBase):
    """The asyncio twin of ``LockManager``; leases are renewed by the shared heartbeat.

    A lost lease cancels the task that holds it inside ``async with``; the
    cancellation surfaces as ``LockLost`` at the end of the block.

    >>> async with locks.acquire("lead:42") as lease:
    ...     await write(lease.token)
    """

    def __init__(self, backend: AsyncLockBackend, renewer: LockBackend, *,
                 space: str | None = None, **options: Any) -> None:
        super().__init__(space=space or own_space(renewer), **options)
        self.backend = backend
        self.renewer = renewer
        #: id(lease) -> the loop that took it, while it is held (for ``_on_lost``)
        self._loops: dict[int, asyncio.AbstractEventLoop] = {}

    def _queueing_backend(self) -> Any:
        return self.backend

    def _on_lost(self, lease: Lease) -> None:
        """From the renewal thread: the claims are freed on the loop that took them."""
        loop = self._loops.get(id(lease))
        if loop is None:
            self._lost(lease)
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits on it
            loop.call_soon_threadsafe(self._lost, lease)

    def acquire(self, keys: str | Iterable[str], *, ttl_ms: int | None = None,
                timeout_s: float | None = None) -> _AsyncAcquire:
        """Awaitable (gives a ``Lease``) and async context manager (releases it).

        The arguments are checked here, at the call; the wait starts when awaited.
        """
        _check_keys_and_options(keys, ttl_ms, timeout_s)
        return _AsyncAcquire(self, keys, ttl_ms, timeout_s)

    async def _acquire(self, keys: str | Iterable[str], ttl_ms: int | None,
                       timeout_s: float | None) -> Lease:
        plan = self._plan(keys, ttl_ms, timeout_s)
        while True:
            plan.grants.clear()
            try:
                for index, key in enumerate(plan.keys):
                    grant = await self._take(key, plan, plan.key_deadline(index))
                    if grant is None:
                        break
                    plan.grants[key] = grant
            except BaseException:
                await finish(self._give_back(plan.keys, plan.owner))
                raise
            if len(plan.grants) == len(plan.keys) and plan.usable():
                lease = self._new_lease(plan, self.renewer)
                self._loops[id(lease)] = asyncio.get_running_loop()
                return lease
            missing = next((k for k in plan.keys if k not in plan.grants), plan.keys[0])
            await finish(self._give_back(plan.keys, plan.owner))
            pause = plan.backoff_s()
            if pause is None:
                raise plan.failure(missing)
            await asyncio.sleep(pause)

    async def _take(self, key: str, plan: _Plan, until: float) -> _Grant | None:
        """As ``LockManager._take``."""
        owner = plan.owner
        if not await self._claim(key, owner, until):
            return None
        while True:
            sent = time.monotonic()
            try:
                # to its end, also when this task is cancelled meanwhile: a request still out
                # (in a worker thread, on the wire) may yet take the key, and the give-back
                # that follows a cancellation must come after it, not before
                attempt = await finish(self.backend.try_acquire(key, owner, plan.ttl_ms))
            except BackendUnavailable as error:
                pause = plan.retry_s(error, until)
                if pause is None:
                    return None
                await asyncio.sleep(pause)
                continue
            plan.answered()
            if attempt.token is not None:
                grant = _Grant(attempt.token, sent, plan.ttl_ms)
                if grant.usable(time.monotonic()):
                    return grant
                if time.monotonic() >= until:
                    await self._leave(key, owner)
                    return None
                continue
            queued_at = sent
            poll = plan.poll_s(until, attempt.retry_ms)
            if poll is None:
                await self._leave(key, owner)
                return None
            try:
                handed = await _not_swallowing(self.backend.wait(key, owner, poll))
            except BackendUnavailable as error:
                pause = plan.retry_s(error, until)
                if pause is None:
                    await self._leave(key, owner)
                    return None
                await asyncio.sleep(pause)
                continue
            if handed is not None:
                grant = _Grant(handed, queued_at, plan.handoff_ms)
                if grant.usable(time.monotonic()):
                    return grant

    async def _claim(self, key: str, owner: str, until: float) -> bool:
        """As ``LockManager._claim``; the wait is a future woken from whichever thread frees."""
        if self._holds.claim(key, owner):  # the usual case: nobody here holds it
            return True
        loop = asyncio.get_running_loop()
        handed: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            def settle() -> None:
                if not handed.done():
                    handed.set_result(None)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(settle)

        while True:
            if self._holds.queue(key, owner, wake):
                return True
            expiry = self._holds.expiry(key)
            wake_at = until if expiry is None else min(until, expiry + 0.001)
            try:
                await asyncio.wait_for(asyncio.shield(handed),
                                       max(0.001, wake_at - time.monotonic()))
                return True
            except TimeoutError:
                if self._holds.withdraw(key, owner):
                    return True
                if time.monotonic() >= until:
                    return False
            except BaseException:
                if self._holds.withdraw(key, owner):  # handed meanwhile: give it on
                    self._holds.free(key, owner)
                raise

    async def _leave(self, key: str, owner: str) -> None:
        try:
            with contextlib.suppress(Exception):
                await self.backend.release(key, owner)
        finally:
            self._holds.free(key, owner)

    async def _give_back(self, keys: tuple[str, ...], owner: str) -> None:
        for key in keys:
            await self._leave(key, owner)

    def release(self, lease: Lease) -> None:
        msg = "this lease came from an AsyncLockManager: use `await lease.arelease()`"
        raise TypeError(msg)

    async def arelease(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        heartbeat().remove(lease)
        self._loops.pop(id(lease), None)
        await finish(self._give_back(lease.keys, lease.owner))

    async def raise_floor(self, key: str, token: int) -> None:
        await self.backend.raise_floor(key, token)

    async def aclose(self) -> None:
        await self.backend.aclose()
        await asyncio.to_thread(self.renewer.close)  # joins threads, closes pools: not in the loop

    async def __aenter__(self) -> AsyncLockManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _AsyncAcquire:
    """``await manager.acquire(...)`` or ``async with manager.acquire(...) as lease``."""

    def __init__(self, manager: AsyncLockManager, keys: str | Iterable[str],
                 ttl_ms: int | None, timeout_s: float | None) -> None:
        self._manager = manager
        self._args = (keys, ttl_ms, timeout_s)
        self._lease: Lease | None = None
        self._cancelled_by_loss = False
        self._inside = False

    def __await__(self) -> Generator[Any, None, Lease]:
        return self._manager._acquire(*self._args).__await__()

    async def __aenter__(self) -> Lease:
        lease = await self._manager._acquire(*self._args)
        self._lease = lease
        self._inside = True
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()

        def cancel_if_inside() -> None:  # runs on the loop thread, so no race with __aexit__
            if self._inside and task is not None and not task.done():
                self._cancelled_by_loss = True
                task.cancel("toolguard: lease lost")

        def on_lost(_: Lease) -> None:
            with contextlib.suppress(RuntimeError):  # the loop may be closed already
                loop.call_soon_threadsafe(cancel_if_inside)

        lease.on_lost(on_lost)
        return lease

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> bool:
        lease = self._lease
        assert lease is not None
        self._inside = False
        try:
            await lease.arelease()
        except asyncio.CancelledError:
            if not self._cancelled_by_loss:
                raise
        if self._cancelled_by_loss:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            reason = lease.lost_reason or LockLost("lease lost", keys=lease.keys)
            raise reason from exc
        return False
