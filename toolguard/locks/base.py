"""The lock contract every backend implements, and the pure logic they share.

A backend only knows single keys: try to take one (minting its fencing token in
the same atomic step), wait to be woken, renew, release. Everything above that
(sorting keys, all-or-nothing, one total deadline, backoff with jitter, retries
of transient errors, leases and their loss) lives in ``toolguard.locks.manager``
and is the same for all of them.

Two rules every backend keeps, on which the manager's safety argument rests
(see ``toolguard.locks.manager``):

* ``try_acquire`` is idempotent per owner, and a grant it returns runs its TTL
  from that call: a key already held by the caller is granted again from now
  (a hand-off that raced with the end of a wait, a retry after a lost reply).
* ``wait`` returns only a hand-off made after the caller's latest
  ``try_acquire`` that answered "queued"; the releaser grants it for the
  waiter's hand-off TTL (``owner_handoff_ms``), at most its presence window.
"""

from __future__ import annotations

import math
import os
import random
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
    "check_ms",
    "check_seconds",
    "check_ttl",
    "full_jitter",
    "new_owner",
    "owner_handoff_ms",
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
    #: A queued owner that has not called ``try_acquire`` for this long drops out of
    #: line; a hand-off grants at most this long until the first renewal.
    presence_ms: int

    def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        """Grant ``key`` to ``owner`` if it is free and ``owner`` is first in line.

        Otherwise join (or stay in) the key's queue. The token is minted only on
        a grant, in the same step, and is greater than every earlier token for
        the key. If ``owner`` holds ``key`` already, the grant is extended to
        ``ttl_ms`` from this call and returned again.
        """
        ...

    def wait(self, key: str, owner: str, timeout_s: float) -> int | None:
        """Block until woken for ``key`` or ``timeout_s`` passes.

        Returns a token when the releaser handed the lock straight to ``owner``
        after the latest ``try_acquire`` that queued it (never an older one).
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

    @property
    def presence_ms(self) -> int: ...  # read-only: the async twins read the sync backend's

    async def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt: ...

    async def wait(self, key: str, owner: str, timeout_s: float) -> int | None: ...

    async def release(self, key: str, owner: str) -> bool: ...

    async def raise_floor(self, key: str, token: int) -> None: ...

    async def aclose(self) -> None: ...


def canonical_keys(keys: str | Iterable[str]) -> tuple[str, ...]:
    """Sorted, de-duplicated keys: the one order every agent takes them in."""
    if type(keys) is str and keys:  # the common case, without the checks below
        return (keys,)
    if type(keys) is tuple and keys and all(type(k) is str and k for k in keys):
        return tuple(sorted(set(keys)))
    if isinstance(keys, str):
        keys = (keys,)
    if isinstance(keys, bytes | bytearray | memoryview) or not isinstance(keys, Iterable):
        msg = f"lock keys must be a string or an iterable of strings, got {keys!r}"
        raise ConfigurationError(msg)
    given = list(keys)
    for key in given:  # before sorting: a None among strings must be a ConfigurationError
        if not isinstance(key, str) or not key:
            msg = f"lock keys must be non-empty strings, got {key!r}"
            raise ConfigurationError(msg)
    if not given:
        msg = "at least one lock key is required"
        raise ConfigurationError(msg)
    return tuple(sorted(set(given)))


def new_owner(ttl_ms: int, handoff_ms: int | None = None) -> str:
    """A unique owner id for one acquisition: ``hex[:handoff]:ttl``.

    It carries what a releaser in another process needs to hand the lock over:
    the TTL, and the shorter hand-off TTL when there is one (the waiter's
    presence window: a waiter that died while queued then holds up the line no
    longer than that).
    """
    unique = os.urandom(16).hex()  # as unique as a uuid4, without building a UUID
    if handoff_ms is None or handoff_ms >= ttl_ms:
        return f"{unique}:{ttl_ms}"
    return f"{unique}:{handoff_ms}:{ttl_ms}"


def owner_ttl_ms(owner: str) -> int:
    return int(owner.rsplit(":", 1)[1])


def owner_handoff_ms(owner: str) -> int:
    """How long a hand-off to ``owner`` lasts before its first renewal (its TTL if unset)."""
    parts = owner.rsplit(":", 2)
    ttl_ms = int(parts[-1])
    if len(parts) == 3 and parts[1].isdigit():
        return min(int(parts[1]), ttl_ms)
    return ttl_ms


def full_jitter(attempt: int, base_s: float, cap_s: float) -> float:
    """Truncated exponential backoff with full jitter (uniform in [0, min(cap, base*2^n)])."""
    return random.uniform(0.0, min(cap_s, base_s * (2 ** min(attempt, 30))))


def check_ttl(ttl_ms: int) -> int:
    if not isinstance(ttl_ms, int) or isinstance(ttl_ms, bool) or ttl_ms < MIN_TTL_MS:
        msg = f"ttl_ms must be an integer >= {MIN_TTL_MS} (every lock expires), got {ttl_ms!r}"
        raise ConfigurationError(msg)
    return ttl_ms


def check_seconds(name: str, value: float, *, positive: bool = False) -> float:
    """A finite duration in seconds, >= 0 (> 0 when ``positive``), else ``ConfigurationError``."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        msg = f"{name} must be a finite number of seconds {bound}, got {value!r}"
        raise ConfigurationError(msg)
    return float(value)


def check_ms(name: str, value: int, minimum: int) -> int:
    """An integer number of milliseconds >= ``minimum``, else ``ConfigurationError``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        msg = f"{name} must be an integer number of milliseconds >= {minimum}, got {value!r}"
        raise ConfigurationError(msg)
    return value
