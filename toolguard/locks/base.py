"""The lock contract every backend implements, and the pure logic they share.

A backend only knows single keys: try to take one (minting its fencing token in
the same atomic step), wait to be woken, renew, release. Everything above that
(sorting keys, all-or-nothing, one total deadline, backoff with jitter, leases
and their loss) lives in ``toolguard.locks.manager`` and is the same for all of
them.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from toolguard.errors import ConfigurationError

__all__ = [
    "MIN_TTL_MS",
    "AsyncLockBackend",
    "Attempt",
    "BackendInfo",
    "LockBackend",
    "canonical_keys",
    "full_jitter",
    "new_owner",
    "owner_ttl_ms",
]

#: A TTL below this cannot be renewed reliably over a network round trip.
MIN_TTL_MS = 100


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one try on one key gave: a token, or how long to wait before looking again."""

    token: int | None
    retry_ms: int = 0

    @property
    def granted(self) -> bool:
        return self.token is not None


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """What a backend guarantees, so users (and ``toolguard doctor``) can tell them apart."""

    name: str
    durable_tokens: bool
    server_wakeup: bool
    fair: bool
    note: str = ""


@runtime_checkable
class LockBackend(Protocol):
    """Single-key primitives; each method is one atomic step on the server."""

    info: BackendInfo

    def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        """Grant ``key`` to ``owner`` if it is free and ``owner`` is first in line.

        Otherwise join (or stay in) the key's queue. The token is minted only on
        a grant, in the same step, and is greater than every earlier token for
        the key.
        """
        ...

    def wait(self, key: str, owner: str, timeout_s: float) -> int | None:
        """Block until woken for ``key`` or ``timeout_s`` passes.

        Returns a token when the releaser handed the lock straight to ``owner``.
        """
        ...

    def release(self, key: str, owner: str) -> bool:
        """Release (or leave the queue of) ``key``; True if ``owner`` held it.

        Idempotent: releasing twice, or releasing a lock that expired, is not an
        error. Passes the lock to the next live waiter when there is one.
        """
        ...

    def renew(self, held: Sequence[tuple[str, str, int]]) -> list[bool]:
        """Extend each ``(key, owner, ttl_ms)``; False where the key is no longer owned.

        Raises ``BackendUnavailable`` for transport errors (the caller retries).
        """
        ...

    def raise_floor(self, key: str, token: int) -> None:
        """Make every later token for ``key`` greater than ``token``.

        The hook used to re-seed a lock server that lost its data from the
        store's high-water marks.
        """
        ...

    def close(self) -> None: ...


@runtime_checkable
class AsyncLockBackend(Protocol):
    """The asyncio face of a backend; renewals still go through the sync one."""

    info: BackendInfo

    async def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt: ...

    async def wait(self, key: str, owner: str, timeout_s: float) -> int | None: ...

    async def release(self, key: str, owner: str) -> bool: ...

    async def raise_floor(self, key: str, token: int) -> None: ...

    async def aclose(self) -> None: ...


def canonical_keys(keys: str | Iterable[str]) -> tuple[str, ...]:
    """Sorted, de-duplicated keys: the one order every agent takes them in."""
    if isinstance(keys, str):
        keys = (keys,)
    given = list(keys)
    for key in given:  # before sorting: a None among strings must be a ConfigurationError
        if not isinstance(key, str) or not key:
            msg = f"lock keys must be non-empty strings, got {key!r}"
            raise ConfigurationError(msg)
    if not given:
        msg = "at least one lock key is required"
        raise ConfigurationError(msg)
    return tuple(sorted(set(given)))


def new_owner(ttl_ms: int) -> str:
    """A unique owner id for one acquisition; it carries the TTL so a releaser can hand off."""
    return f"{uuid.uuid4().hex}:{ttl_ms}"


def owner_ttl_ms(owner: str) -> int:
    return int(owner.rsplit(":", 1)[1])


def full_jitter(attempt: int, base_s: float, cap_s: float) -> float:
    """Truncated exponential backoff with full jitter (uniform in [0, min(cap, base*2^n)])."""
    return random.uniform(0.0, min(cap_s, base_s * (2 ** min(attempt, 30))))


def check_ttl(ttl_ms: int) -> int:
    if not isinstance(ttl_ms, int) or isinstance(ttl_ms, bool) or ttl_ms < MIN_TTL_MS:
        msg = f"ttl_ms must be an integer >= {MIN_TTL_MS} (every lock expires), got {ttl_ms!r}"
        raise ConfigurationError(msg)
    return ttl_ms
