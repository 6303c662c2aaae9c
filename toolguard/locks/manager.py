"""Multi-key, all-or-nothing acquisition with one deadline, for sync and asyncio code.

The rules are the same on both paths and live in ``_Plan``: keys in canonical
order; on each key wait in its FIFO queue; when a later key of a multi-key set
is not granted within ``round_wait_s``, give back what is held, back off with
full jitter and start a new round; past the total deadline raise
``LockTimeout`` naming the key that was not granted.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import Any

from toolguard.errors import LockLost, LockTimeout
from toolguard.locks.base import (
    AsyncLockBackend,
    LockBackend,
    canonical_keys,
    check_ttl,
    full_jitter,
    new_owner,
)
from toolguard.locks.lease import RENEW_FRACTION, Lease, heartbeat

__all__ = ["AsyncLockManager", "LockManager"]

#: Longest a waiter sleeps without re-checking the key: bounds the delay after a
#: crashed holder's TTL runs out, and keeps the waiter's place in the queue alive.
MAX_POLL_S = 0.5
POLL_JITTER_S = 0.005


@dataclass(slots=True)
class _Plan:
    """Deadlines and backoff for one acquisition; pure, shared by sync and async."""

    keys: tuple[str, ...]
    ttl_ms: int
    deadline: float
    round_wait_s: float
    backoff_base_s: float
    backoff_cap_s: float
    rounds: int = 0

    def key_deadline(self, index: int, held_since: float) -> float:
        """The first key waits for the whole deadline; later ones only for one round.

        Keys already taken are not renewed until the lease exists, so a later
        key is awaited at most until the first one is due for renewal
        (``held_since`` + ttl/3): the lease is never handed out already expired.
        """
        if index == 0:
            return self.deadline
        return min(self.deadline, time.monotonic() + self.round_wait_s,
                   held_since + self.ttl_ms / 1000 * RENEW_FRACTION)

    def poll_s(self, until: float, retry_ms: int) -> float | None:
        remaining = until - time.monotonic()
        if remaining <= 0:
            return None
        # Jittered, so waiters that saw the same expiring holder do not all look at once.
        if retry_ms > 0:
            hint = retry_ms / 1000 + random.uniform(0.0, POLL_JITTER_S)
        else:
            hint = MAX_POLL_S * random.uniform(0.5, 1.0)
        return max(0.001, min(remaining, hint, MAX_POLL_S))

    def backoff_s(self) -> float | None:
        """Sleep before the next round, or None when the deadline leaves no room for one."""
        self.rounds += 1
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            return None
        return min(remaining, full_jitter(self.rounds, self.backoff_base_s, self.backoff_cap_s))

    def timeout(self, key: str) -> LockTimeout:
        msg = f"timed out waiting for lock {key!r} (keys {list(self.keys)})"
        return LockTimeout(msg, keys=(key,))


class _ManagerBase:
    def __init__(
        self,
        *,
        ttl_ms: int = 10_000,
        timeout_s: float = 5.0,
        round_wait_s: float = 1.0,
        backoff_base_s: float = 0.005,
        backoff_cap_s: float = 0.25,
    ) -> None:
        self.ttl_ms = check_ttl(ttl_ms)
        self.timeout_s = timeout_s
        self.round_wait_s = round_wait_s
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s

    def _plan(self, keys: str | Iterable[str], ttl_ms: int | None,
              timeout_s: float | None) -> _Plan:
        wait = self.timeout_s if timeout_s is None else timeout_s
        return _Plan(
            keys=canonical_keys(keys),
            ttl_ms=check_ttl(self.ttl_ms if ttl_ms is None else ttl_ms),
            deadline=time.monotonic() + max(0.0, wait),
            round_wait_s=self.round_wait_s,
            backoff_base_s=self.backoff_base_s,
            backoff_cap_s=self.backoff_cap_s,
        )


class LockManager(_ManagerBase):
    """Takes fenced leases on one or more keys from a ``LockBackend``.

    >>> with locks.acquire(["account:1", "account:2"], ttl_ms=5_000) as lease:
    ...     write(lease.tokens)
    """

    def __init__(self, backend: LockBackend, **options: Any) -> None:
        super().__init__(**options)
        self.backend = backend

    def acquire(self, keys: str | Iterable[str], *, ttl_ms: int | None = None,
                timeout_s: float | None = None) -> Lease:
        """Take every key or none; raise ``LockTimeout`` (naming the key) at the deadline."""
        plan = self._plan(keys, ttl_ms, timeout_s)
        owner = new_owner(plan.ttl_ms)
        while True:
            started = time.monotonic()
            tokens: dict[str, int] = {}
            try:
                for index, key in enumerate(plan.keys):
                    taken = self._take(key, owner, plan, plan.key_deadline(index, started))
                    if taken is None:
                        break
                    tokens[key] = taken[0]
                    if index == 0:
                        started = taken[1]
            except BaseException:
                self._give_back(plan.keys, owner)
                raise
            if len(tokens) == len(plan.keys):
                return self._lease(plan, owner, tokens, started)
            missing = plan.keys[len(tokens)]
            self._give_back(tuple(tokens), owner)
            pause = plan.backoff_s()
            if pause is None:
                raise plan.timeout(missing)
            time.sleep(pause)

    def _take(self, key: str, owner: str, plan: _Plan, until: float) -> tuple[int, float] | None:
        """``(token, sent_at)``: sent_at, taken before the granting call, bounds the TTL's start."""
        sent_at = time.monotonic()
        attempt = self.backend.try_acquire(key, owner, plan.ttl_ms)
        while attempt.token is None:
            poll = plan.poll_s(until, attempt.retry_ms)
            if poll is None:
                self.backend.release(key, owner)  # leave the queue (or return a late hand-off)
                return None
            sent_at = time.monotonic()
            handed = self.backend.wait(key, owner, poll)
            if handed is not None:
                return handed, sent_at
            sent_at = time.monotonic()
            attempt = self.backend.try_acquire(key, owner, plan.ttl_ms)
        return attempt.token, sent_at

    def _give_back(self, keys: tuple[str, ...], owner: str) -> None:
        for key in keys:
            with contextlib.suppress(Exception):
                self.backend.release(key, owner)

    def _lease(self, plan: _Plan, owner: str, tokens: dict[str, int], started: float) -> Lease:
        lease = Lease(keys=plan.keys, tokens=tokens, owner=owner, ttl_ms=plan.ttl_ms,
                      acquired_at=started, backend=self.backend, releaser=self)
        heartbeat().add(lease)
        return lease

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

    def __init__(self, backend: AsyncLockBackend, renewer: LockBackend, **options: Any) -> None:
        super().__init__(**options)
        self.backend = backend
        self.renewer = renewer

    def acquire(self, keys: str | Iterable[str], *, ttl_ms: int | None = None,
                timeout_s: float | None = None) -> _AsyncAcquire:
        """Awaitable (gives a ``Lease``) and async context manager (releases it)."""
        return _AsyncAcquire(self, keys, ttl_ms, timeout_s)

    async def _acquire(self, keys: str | Iterable[str], ttl_ms: int | None,
                       timeout_s: float | None) -> Lease:
        plan = self._plan(keys, ttl_ms, timeout_s)
        owner = new_owner(plan.ttl_ms)
        while True:
            started = time.monotonic()
            tokens: dict[str, int] = {}
            try:
                for index, key in enumerate(plan.keys):
                    taken = await self._take(key, owner, plan, plan.key_deadline(index, started))
                    if taken is None:
                        break
                    tokens[key] = taken[0]
                    if index == 0:
                        started = taken[1]
            except BaseException:
                await asyncio.shield(self._give_back(plan.keys, owner))
                raise
            if len(tokens) == len(plan.keys):
                lease = Lease(keys=plan.keys, tokens=tokens, owner=owner, ttl_ms=plan.ttl_ms,
                              acquired_at=started, backend=self.renewer, releaser=self)
                heartbeat().add(lease)
                return lease
            missing = plan.keys[len(tokens)]
            await self._give_back(tuple(tokens), owner)
            pause = plan.backoff_s()
            if pause is None:
                raise plan.timeout(missing)
            await asyncio.sleep(pause)

    async def _take(self, key: str, owner: str, plan: _Plan,
                    until: float) -> tuple[int, float] | None:
        """``(token, sent_at)`` as in ``LockManager._take``."""
        sent_at = time.monotonic()
        attempt = await self.backend.try_acquire(key, owner, plan.ttl_ms)
        while attempt.token is None:
            poll = plan.poll_s(until, attempt.retry_ms)
            if poll is None:
                await self.backend.release(key, owner)
                return None
            sent_at = time.monotonic()
            handed = await self.backend.wait(key, owner, poll)
            if handed is not None:
                return handed, sent_at
            sent_at = time.monotonic()
            attempt = await self.backend.try_acquire(key, owner, plan.ttl_ms)
        return attempt.token, sent_at

    async def _give_back(self, keys: tuple[str, ...], owner: str) -> None:
        for key in keys:
            with contextlib.suppress(Exception):
                await self.backend.release(key, owner)

    def release(self, lease: Lease) -> None:
        msg = "this lease came from an AsyncLockManager: use `await lease.arelease()`"
        raise TypeError(msg)

    async def arelease(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        heartbeat().remove(lease)
        await asyncio.shield(self._give_back(lease.keys, lease.owner))

    async def raise_floor(self, key: str, token: int) -> None:
        await self.backend.raise_floor(key, token)

    async def aclose(self) -> None:
        await self.backend.aclose()
        self.renewer.close()

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
