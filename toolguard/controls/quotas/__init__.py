"""Quotas: at most N calls per window, K in flight, a budget per window (``quotas:``).

The guard's step, once the call is validated and its keys are known::

    admission = quotas.admit(rule, facts)   # raises RateLimited / InFlightLimited /
    try:                                    # BudgetExceeded with retry_after_s
        ...                                 # lock, run, fenced write
    finally:
        admission.finish(applied=...)       # frees in-flight slots; refunds the budget
                                            # of a call that did not apply

Windows slide (at most N in any trailing window, no burst at a boundary) and
are kept on the backend's clock; every quota of a call is admitted in one
atomic step, all or nothing. A retried intent (same idempotency key) is not
counted twice. Backends: ``RedisQuotas`` (Lua), ``PostgresQuotas`` (one SQL
function), ``SqliteQuotas`` (one ``BEGIN IMMEDIATE``), each with an asyncio twin;
``quota_backend(store_or_url)`` picks one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from toolguard.call.facts import CallFacts
from toolguard.controls.quotas.base import (
    Admitted,
    AsyncQuotaBackend,
    Entry,
    QuotaBackend,
    Refused,
    Verdict,
)
from toolguard.controls.quotas.charges import IN_FLIGHT_RETRY_S, Charge, charges, refusal, scope_name
from toolguard.errors import ConfigurationError
from toolguard.policies.model import ToolPolicy
from toolguard.runtime.extras import require

log = logging.getLogger("toolguard.quotas")

__all__ = [
    "IN_FLIGHT_RETRY_S",
    "Admission",
    "Admitted",
    "AsyncAdmission",
    "AsyncQuotaBackend",
    "AsyncQuotas",
    "Charge",
    "Entry",
    "QuotaBackend",
    "Quotas",
    "Refused",
    "Verdict",
    "async_quota_backend",
    "charges",
    "quota_backend",
    "refusal",
    "scope_name",
]


@dataclass(slots=True)
class _Held:
    """The entries one admission added (only those may be taken back)."""

    charges: tuple[Charge, ...] = ()
    fresh: tuple[bool, ...] = ()
    done: bool = False

    def entries(self, kinds: tuple[str, ...]) -> list[Entry]:
        return [(c.scope, c.entry) for c, new in zip(self.charges, self.fresh, strict=True)
                if new and c.kind in kinds]

    def lease_ms(self) -> int:
        return max((c.ttl_ms for c in self.charges if c.kind == "in_flight"), default=0)

    def lost(self, kept: Sequence[bool]) -> tuple[Charge, ...]:
        """The in-flight charges whose slot ``renew`` found gone (``kept``: per fresh slot)."""
        slots = [c for c, new in zip(self.charges, self.fresh, strict=True)
                 if new and c.kind == "in_flight"]
        return tuple(c for c, ok in zip(slots, kept, strict=True) if not ok)

    def shared(self) -> tuple[Charge, ...]:
        """The budget entries this admission found counted by another attempt of its intent."""
        return tuple(c for c, new in zip(self.charges, self.fresh, strict=True)
                     if not new and c.kind == "budget")


def _retaken(verdict: Verdict, lost: Sequence[Charge]) -> None:
    if isinstance(verdict, Refused):
        log.warning("an in-flight slot expired while its call ran (lease too short, or the "
                    "process was paused) and %s is full now: the call runs over the limit",
                    lost[verdict.index].counter)


def _redrawn(verdict: Verdict, shared: Sequence[Charge]) -> None:
    if isinstance(verdict, Refused):
        log.warning("an applied call's budget entry was refunded by another attempt of its "
                    "intent, and %s is now full: it stays undercounted until its window ends",
                    shared[verdict.index].counter)


def _to_take_back(held: _Held, applied: bool) -> list[Entry]:
    """In-flight slots always; budget entries when the call did not apply. Rates stay counted.

    A replay counts as applied: its entry may be the one another attempt of the
    same intent, running at once, was admitted on (it found it counted), so
    giving it back could leave an applied call drawn on nothing.
    """
    return held.entries(("in_flight",) if applied else ("in_flight", "budget"))


@dataclass(slots=True)
class Admission:
    """What ``Quotas.admit`` counted for one call; ``finish`` once the call is over."""

    backend: QuotaBackend | None = None
    held: _Held = field(default_factory=_Held)

    @property
    def charges(self) -> tuple[Charge, ...]:
        return self.held.charges

    def finish(self, *, applied: bool) -> int:
        """Free the in-flight slots; if the call did not apply, refund its budget. Idempotent.

        ``applied`` is True for an accepted or replayed call, and for an outcome
        that is unknown (it may have applied: fail closed, keep the budget drawn).
        A budget entry this admission found counted by another attempt of the
        intent (a retry while the first still ran) is drawn again when this one
        applied: the other may have failed and been refunded meanwhile (one
        more round trip, only for such a retry; a no-op when it is still there).
        """
        if self.held.done or self.backend is None:
            return 0
        self.held.done = True
        released = self.backend.release(_to_take_back(self.held, applied))
        shared = self.held.shared() if applied else ()
        if shared:  # another attempt counted them, and may have been refunded since: redraw
            _redrawn(self.backend.admit(shared), shared)
        return released

    def renew(self) -> bool:
        """Extend the in-flight slots by their lease (a long call); False if one was lost.

        A slot lost while its call still runs (a renewal late past the lease, a
        paused process) is taken again if it fits, so that the running call is
        counted again; if it does not fit, the call runs over the limit (logged).
        """
        entries = self.held.entries(("in_flight",))
        if self.backend is None or not entries or self.held.done:
            return True
        kept = self.backend.renew(entries, self.held.lease_ms())
        lost = self.held.lost(kept)
        if lost:
            _retaken(self.backend.admit(lost), lost)
        return not lost


@dataclass(slots=True)
class AsyncAdmission:
    """The asyncio twin of ``Admission``."""

    backend: AsyncQuotaBackend | None = None
    held: _Held = field(default_factory=_Held)

    @property
    def charges(self) -> tuple[Charge, ...]:
        return self.held.charges

    async def finish(self, *, applied: bool) -> int:
        if self.held.done or self.backend is None:
            return 0
        self.held.done = True
        released = await self.backend.release(_to_take_back(self.held, applied))
        shared = self.held.shared() if applied else ()
        if shared:
            _redrawn(await self.backend.admit(shared), shared)
        return released

    async def renew(self) -> bool:
        entries = self.held.entries(("in_flight",))
        if self.backend is None or not entries or self.held.done:
            return True
        kept = await self.backend.renew(entries, self.held.lease_ms())
        lost = self.held.lost(kept)
        if lost:
            _retaken(await self.backend.admit(lost), lost)
        return not lost


def _raise_refused(todo: Sequence[Charge], verdict: Refused, facts: CallFacts) -> None:
    raise refusal(todo[verdict.index], verdict.retry_after_s, facts)


class Quotas:
    """The quota step (sync): ``admit(rule, facts)`` counts the call or raises the refusal."""

    def __init__(self, backend: QuotaBackend) -> None:
        self.backend = backend

    def admit(self, rule: ToolPolicy, facts: CallFacts) -> Admission:
        """Count ``facts`` against every quota of ``rule``, all or none.

        Raises ``RateLimited``, ``InFlightLimited`` or ``BudgetExceeded`` (with
        ``retry_after_s``), ``InvalidArguments`` for an unusable budget amount,
        ``BackendUnavailable`` when the backend cannot be reached (fail closed).
        A tool without quotas costs nothing: no round trip.
        """
        todo = charges(rule, facts)
        if not todo:
            return Admission()
        verdict = self.backend.admit(todo)
        if isinstance(verdict, Refused):
            _raise_refused(todo, verdict, facts)
        assert isinstance(verdict, Admitted)
        return Admission(self.backend, _Held(todo, verdict.fresh))


class AsyncQuotas:
    """The quota step (asyncio)."""

    def __init__(self, backend: AsyncQuotaBackend) -> None:
        self.backend = backend

    async def admit(self, rule: ToolPolicy, facts: CallFacts) -> AsyncAdmission:
        todo = charges(rule, facts)
        if not todo:
            return AsyncAdmission()
        verdict = await self.backend.admit(todo)
        if isinstance(verdict, Refused):
            _raise_refused(todo, verdict, facts)
        assert isinstance(verdict, Admitted)
        return AsyncAdmission(self.backend, _Held(todo, verdict.fresh))


def quota_backend(target: Any, **options: Any) -> QuotaBackend:
    """A sync backend for a store (PostgreSQL or SQLite) or a Redis URL / client.

    Quotas on a store need its schema version 4 (PostgreSQL) / 2 (SQLite):
    ``toolguard db init``. Redis options: ``prefix`` (default ``tgq``).
    """
    if isinstance(target, str):
        scheme = urlparse(target).scheme
        if scheme in ("redis", "rediss", "unix"):
            require("redis", "Redis quotas")
            from toolguard.controls.quotas.redis import RedisQuotas

            return RedisQuotas(target, **options)
        msg = (f"quotas live on Redis (redis://...) or in the store (pass the store), got "
               f"{target!r}")
        raise ConfigurationError(msg)
    dialect = getattr(target, "dialect", None)
    if dialect == "postgresql":
        from toolguard.controls.quotas.postgres import PostgresQuotas

        return PostgresQuotas(target)
    if dialect == "sqlite":
        from toolguard.controls.quotas.sqlite import SqliteQuotas

        return SqliteQuotas(target)
    if type(target).__module__.startswith("redis"):
        from toolguard.controls.quotas.redis import RedisQuotas

        return RedisQuotas(target, **options)
    msg = f"no quota backend for {target!r}: give a guarded store or a Redis URL"
    raise ConfigurationError(msg)


def async_quota_backend(target: Any, **options: Any) -> AsyncQuotaBackend:
    """An asyncio backend for an async store or a Redis URL / ``redis.asyncio`` client."""
    if isinstance(target, str):
        scheme = urlparse(target).scheme
        if scheme in ("redis", "rediss", "unix"):
            require("redis", "Redis quotas")
            from toolguard.controls.quotas.redis import AsyncRedisQuotas

            return AsyncRedisQuotas(target, **options)
        msg = (f"quotas live on Redis (redis://...) or in the store (pass the store), got "
               f"{target!r}")
        raise ConfigurationError(msg)
    dialect = getattr(target, "dialect", None)
    if dialect == "postgresql":
        from toolguard.controls.quotas.postgres import AsyncPostgresQuotas

        return AsyncPostgresQuotas(target)
    if dialect == "sqlite":
        from toolguard.controls.quotas.sqlite import AsyncSqliteQuotas

        return AsyncSqliteQuotas(target)
    if type(target).__module__.startswith("redis"):
        from toolguard.controls.quotas.redis import AsyncRedisQuotas

        return AsyncRedisQuotas(target, **options)
    msg = f"no quota backend for {target!r}: give an async guarded store or a Redis URL"
    raise ConfigurationError(msg)
