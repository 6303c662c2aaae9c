"""Getting progress back after the lock server lost its tokens, without ever accepting a stale write.

Tokens are hybrid-clock values, so a Redis restarted empty normally keeps
issuing larger tokens. If its clock went backwards (or its counter was reset
some other way) it issues tokens *below* the store's high-water marks: every
write is then rejected, safely but forever. The store's high-water marks are
the durable memory: ``reseed`` raises the lock server's floor to them.

How to tell a regressed lock server from a genuinely stale holder: a
``StaleFencingToken`` for a token of a lease that is still held (not lost) means
the lock server misbehaved. Either it handed out a token below one it handed
out before (clock or counter regression), or it lost this lease's lock and
granted it again before the renewal loop noticed (data loss). A well-behaved
server cannot cause it: a newer holder needs this lease to expire first, and
the lease's local deadline passes before the server's. Either way the attempt
was rolled back, so ``run_fenced`` re-seeds and retries once with a fresh
lease (the body runs again and re-reads inside its transaction).

The re-seed waits until the leases granted before the loss have run out (one
TTL of the regressed lease, from its grant): a server that lost its state lost
their tokens too, and a holder that has not renewed since still writes with
one. Such a token may be above the store's marks; a floor raised to the marks
before it is over could hand the next holder that very token (equal tokens are
accepted as one lease's) or a lower one, and the late write would be accepted
after the newer. Once those leases are over no late write can commit, and the
marks read then are final. (This assumes no lease on the keys runs for a longer
TTL than the regressed one.) A recovery therefore takes one TTL, once per loss. A lost
lease means someone newer may have written: that rejection stands. The floor
also rises to the refusal's own ``current`` (a fenced service's high-water,
which the guard's store never sees), so a service that has seen newer tokens
than the lock server stops refusing every call once the retry clears it.

Callers who hold a lease and call ``store.fenced(lease, intent)`` themselves
("acquire now, write later") get the same step from ``reseed_if_regressed``:

>>> for attempt in (1, 2):
...     with locks.acquire([key]) as lease:
...         try:
...             with store.fenced(lease, intent) as tx:
...                 ...
...             break
...         except StaleFencingToken as stale:
...             if attempt == 2 or not reseed_if_regressed(locks, store, lease, stale):
...                 raise

Re-seeding never weakens safety: the store keeps rejecting every token below
its high-water mark whatever the lock server does; the floor only lets new
grants clear it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from toolguard.errors import BackendUnavailable, DuplicateIntent, StaleFencingToken, ToolGuardError
from toolguard.locks.base import canonical_keys
from toolguard.runtime import telemetry
from toolguard.runtime.cancellation import finish
from toolguard.store.base import (
    AsyncFencedTransaction,
    AsyncGuardedStore,
    FencedTransaction,
    GuardedStore,
    IntentRecord,
    mark_audited,
)
from toolguard.store.flow import HeldLease
from toolguard.store.reads import ReadCheck

if TYPE_CHECKING:
    from toolguard.locks import AsyncLockManager, Lease, LockManager

__all__ = [
    "Outcome",
    "areseed",
    "areseed_if_regressed",
    "arun_fenced",
    "lock_regressed",
    "reseed",
    "reseed_if_regressed",
    "run_fenced",
]

log = logging.getLogger("toolguard.store")

T = TypeVar("T")

#: Tokens below this are minted exactly by every lock server (a double's integer range).
_EXACT_TOKENS = 2**53 - 1


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T]):
    """What ``run_fenced`` did.

    ``value`` is the recorded result (the body's return value unless it called
    ``tx.record``); on a replay it is the result recorded by the earlier run.
    ``reseeded`` is true when the first attempt met a regressed lock server.
    """

    value: T
    replayed: bool = False
    tokens: Mapping[str, int] = field(default_factory=dict)
    reseeded: bool = False


def lock_regressed(lease: Lease, error: StaleFencingToken) -> bool:
    """True if ``error`` rejected a token of ``lease`` while the lease is still held.

    Only a lock server that went backwards or lost its data can cause that; a
    lost lease, or a token that is not this lease's, means a genuine stale write.
    """
    if lease.lost or lease.released:
        return False
    token = lease.tokens.get(error.key)
    return token is not None and (error.token is None or error.token == token)


def _raise_floors(raise_floor: Callable[[str, int], Any], floors: Mapping[str, int]) -> None:
    for key, token in floors.items():
        try:
            raise_floor(key, token)
        except ToolGuardError:
            raise
        except Exception as error:  # e.g. a redis ConnectionError: the server is away again
            msg = f"could not re-seed lock {key!r} to {token}: {error}"
            raise BackendUnavailable(msg) from error


async def _araise_floors(locks: AsyncLockManager, floors: Mapping[str, int]) -> None:
    """The asyncio twin of ``_raise_floors``."""
    for key, token in floors.items():
        try:
            await locks.raise_floor(key, token)
        except ToolGuardError:
            raise
        except Exception as error:
            msg = f"could not re-seed lock {key!r} to {token}: {error}"
            raise BackendUnavailable(msg) from error


def reseed(locks: LockManager, store: GuardedStore, keys: str | Iterable[str]) -> dict[str, int]:
    """Raise the lock server's floor for ``keys`` to the store's high-water marks.

    Afterwards every token granted for those keys is above everything the
    store accepted. Returns the floors that were set (keys the store has never
    fenced are skipped). Safe to call at any time, e.g. at start-up.
    """
    floors = store.high_waters(canonical_keys(keys))
    _raise_floors(locks.raise_floor, floors)
    if floors:
        log.warning("re-seeded lock tokens from the store: %s", floors)
    return floors


async def areseed(locks: AsyncLockManager, store: AsyncGuardedStore,
                  keys: str | Iterable[str]) -> dict[str, int]:
    """The asyncio twin of ``reseed``."""
    floors = await store.high_waters(canonical_keys(keys))
    await _araise_floors(locks, floors)
    if floors:
        log.warning("re-seeded lock tokens from the store: %s", floors)
    return floors


def _refusal_floor(lease: Lease, stale: StaleFencingToken) -> dict[str, int]:
    """The floor the refusal itself names: its key and ``current``, when above the lease's token.

    A fenced service (``toolguard.fences``) keeps high-water marks of its own that the
    guard's store never sees: its refusal's ``current`` is the only place they show. Raising
    the floor to it only makes later tokens larger. A ``current`` at or past 2^53 is left
    alone (the call stays refused): not every lock server mints tokens above it exactly
    (Redis scripts count in doubles, where 2^53 + 1 is 2^53), and a token equal to the
    service's would be accepted as the same lease's.
    """
    current, token = stale.current, lease.tokens.get(stale.key)
    if (isinstance(current, int) and not isinstance(current, bool) and token is not None
            and token < current < _EXACT_TOKENS):
        return {stale.key: current}
    return {}


@dataclass(frozen=True, slots=True)
class _Recovery:
    """What the retry after a regression does first: wait out the leases granted before the
    loss, then raise the floors of ``keys`` to the store's marks and to ``floors``."""

    keys: tuple[str, ...]
    floors: Mapping[str, int]
    settled_at: float  # time.monotonic() when every lease granted before the loss is over

    @classmethod
    def of(cls, lease: Lease, stale: StaleFencingToken) -> _Recovery:
        return cls(tuple(lease.keys), _refusal_floor(lease, stale), _settled_at(lease))

    def wait_s(self) -> float:
        return max(0.0, self.settled_at - time.monotonic())


def _settled_at(lease: Lease) -> float:
    """When every lease granted before the lock server lost its state has run out.

    A server that lost its state also lost the tokens of the leases it had granted
    and that are still running: their holders learn of it only at their next renewal,
    and until then a late write of theirs carries a token the store has not seen. It
    may be above the store's marks, so a floor raised to the marks alone could hand
    the next holder a token at or below it (equal tokens are accepted as the same
    lease's), and the late write would then be accepted after the newer one. Every
    such lease was granted before ``lease`` (the loss came first), so its local
    deadline passes within one TTL of ``lease``'s grant: the re-seed reads the marks
    after that, when no late write can commit any more. This assumes no lease on
    these keys runs for a longer TTL than ``lease``.
    """
    return float(lease.acquired_at) + lease.ttl_ms / 1000


def _wait_out(lease: Lease) -> None:
    time.sleep(max(0.0, _settled_at(lease) - time.monotonic()))


def _regressed(lease: Lease, stale: StaleFencingToken) -> bool:
    """Pure: a refusal under a lease still held means the lock server regressed."""
    if not lock_regressed(lease, stale):
        return False
    log.warning("lock server issued %s for %s below the store's %s: re-seeding",
                stale.token, stale.key, stale.current)
    return True


def reseed_if_regressed(locks: LockManager, store: GuardedStore, lease: Lease,
                        stale: StaleFencingToken) -> bool:
    """After ``store.fenced(lease, ...)`` raised ``stale``: re-seed if the lock server regressed.

    True when ``stale`` refused a token of ``lease`` while the lease is still
    held (see ``lock_regressed``): once the leases granted before the loss have run
    out (up to one TTL of ``lease``; see the module docstring), the lock server's
    floors for the lease's keys are raised to the store's high-water marks, and the caller should
    acquire again and retry once (the write was rolled back). False when the
    refusal stands (the lease was lost: someone newer may have written); then
    nothing is changed.
    """
    if not _regressed(lease, stale):
        return False
    _wait_out(lease)
    reseed(locks, store, lease.keys)
    return True


async def areseed_if_regressed(locks: AsyncLockManager, store: AsyncGuardedStore, lease: Lease,
                               stale: StaleFencingToken) -> bool:
    """The asyncio twin of ``reseed_if_regressed``."""
    if not _regressed(lease, stale):
        return False
    await asyncio.sleep(max(0.0, _settled_at(lease) - time.monotonic()))
    await areseed(locks, store, lease.keys)
    return True


def run_fenced(locks: LockManager, store: GuardedStore, keys: str | Iterable[str],
               body: Callable[[FencedTransaction], T], *, intent: IntentRecord | None = None,
               ttl_ms: int | None = None, timeout_s: float | None = None,
               reseed_on_regression: bool = True, reads: ReadCheck | None = None,
               held: HeldLease | None = None) -> Outcome[Any]:
    """Lock ``keys``, run ``body(tx)`` in one fenced transaction, release.

    ``held``: a lease on ``keys`` the caller already holds (a hold kept across calls,
    ``toolguard.steps.holds``): the write runs under it, with no acquisition, and the
    caller releases it; a regressed lock server then ends the call (no retry).

    The body's return value is recorded as the intent's result (it must be
    JSON) unless the body called ``tx.record``. With an idempotency key, an
    intent applied before is not run again: its recorded result comes back as
    ``Outcome(replayed=True)`` (audited as ``replayed``). A
    ``StaleFencingToken`` under a lease that is still held means the lock
    server regressed: re-seed from the store and retry once.
    Every other error propagates (already audited by the store).

    There is no separate ``begin_intent`` round trip: the fenced transaction's
    first statement creates and locks the intent row, and finds a replay
    (``DuplicateIntent``: the body never runs; only its fence advance is committed) or a conflict
    (``IdempotencyConflict``) there. A replay therefore waits for the lock
    like any call; the body never runs twice.
    """
    ordered = canonical_keys(keys)
    probe = telemetry.start_fenced(intent)
    recovery: _Recovery | None = None
    for attempt in (1, 2):
        if recovery is not None:
            time.sleep(recovery.wait_s())
            reseed(locks, store, recovery.keys)
            _raise_floors(locks.raise_floor, recovery.floors)
        acquired: Lease | None = None
        lease: HeldLease
        if held is not None:
            lease = held
        else:
            lease = acquired = probe.acquire(
                lambda: locks.acquire(ordered, ttl_ms=ttl_ms, timeout_s=timeout_s), ordered,
                attempt)
        held_since = time.monotonic()
        try:
            with probe.transaction(lease, attempt), store.fenced(lease, intent, reads=reads) as tx:
                value = body(tx)
                if not tx.recorded:
                    tx.record(value)
            return Outcome(tx.result, tokens=dict(lease.tokens), reseeded=attempt > 1)
        except DuplicateIntent as duplicate:
            probe.replayed()
            return Outcome(duplicate.result, replayed=True, tokens=dict(lease.tokens),
                           reseeded=attempt > 1)
        except StaleFencingToken as stale:
            regressed = (attempt == 1 and reseed_on_regression and acquired is not None
                         and _regressed(acquired, stale))
            probe.stale(reseeded=regressed)
            if not regressed or acquired is None:
                raise
            recovery = _Recovery.of(acquired, stale)
        finally:
            if acquired is not None:
                with contextlib.suppress(Exception):
                    acquired.release()
            probe.released(held_since)
    raise AssertionError("unreachable")  # pragma: no cover


async def arun_fenced(locks: AsyncLockManager, store: AsyncGuardedStore,
                      keys: str | Iterable[str],
                      body: Callable[[AsyncFencedTransaction], Awaitable[T]], *,
                      intent: IntentRecord | None = None, ttl_ms: int | None = None,
                      timeout_s: float | None = None,
                      reseed_on_regression: bool = True,
                      reads: ReadCheck | None = None,
                      held: HeldLease | None = None) -> Outcome[Any]:
    """The asyncio twin of ``run_fenced``; ``body`` is a coroutine function."""
    ordered = canonical_keys(keys)
    probe = telemetry.start_fenced(intent)
    recovery: _Recovery | None = None
    for attempt in (1, 2):
        if recovery is not None:
            await asyncio.sleep(recovery.wait_s())
            await areseed(locks, store, recovery.keys)
            await _araise_floors(locks, recovery.floors)
        acquired: Lease | None = None
        lease: HeldLease
        if held is not None:
            lease = held
        else:
            lease = acquired = await probe.aacquire(
                lambda: locks.acquire(ordered, ttl_ms=ttl_ms, timeout_s=timeout_s), ordered,
                attempt)
        held_since = time.monotonic()
        committed = False  # the transaction (with its audit row) is in: the outcome is known
        try:
            with probe.transaction(lease, attempt):
                async with store.fenced(lease, intent, reads=reads) as tx:
                    value = await body(tx)
                    if not tx.recorded:
                        tx.record(value)
            committed = True
            return Outcome(tx.result, tokens=dict(lease.tokens), reseeded=attempt > 1)
        except DuplicateIntent as duplicate:
            committed = True  # a replay: its row is written too
            probe.replayed()
            return Outcome(duplicate.result, replayed=True, tokens=dict(lease.tokens),
                           reseeded=attempt > 1)
        except StaleFencingToken as stale:
            regressed = (attempt == 1 and reseed_on_regression and acquired is not None
                         and _regressed(acquired, stale))
            probe.stale(reseeded=regressed)
            if not regressed or acquired is None:
                raise
            recovery = _Recovery.of(acquired, stale)
        finally:
            try:
                if acquired is not None:  # ends before this task's cancellation goes on
                    await finish(acquired.arelease())
            except asyncio.CancelledError as cancelled:
                if committed:  # cancelled after the commit: its row says what happened
                    mark_audited(cancelled)
                raise
            except Exception:
                pass
            finally:
                probe.released(held_since)
    raise AssertionError("unreachable")  # pragma: no cover
