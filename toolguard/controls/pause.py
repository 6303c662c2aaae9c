"""The kill switch: ``toolguard pause TOOL|AGENT`` refuses new calls (``paused``) until resumed.

Pauses live in the store (``toolguard_pause``), so every process of every
machine sharing it sees them. Each process keeps the set in memory and reads
it again at most every ``cache_s`` seconds (default 1): a call pays no round
trip, and a pause takes effect everywhere within ``cache_s`` of the command
(``cache_s=0`` reads on every call). If the set cannot be read when it is due,
calls are refused (``backend_unavailable``): a kill switch fails closed.

The guard's step, first of all (before validation: a paused tool costs nothing)::

    board.check(intent.tool, intent.agent)       # raises Paused

A pause names a tool, an agent, or everything (``*``). It is never shadowed:
``mode: shadow`` does not apply to an operator's pause.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from toolguard.call.recording import storable_text
from toolguard.controls._rows import arows, rows
from toolguard.errors import ConfigurationError, Paused
from toolguard.store.base import AsyncGuardedStore, AuditEntry, GuardedStore

__all__ = ["ALL", "AsyncPauseBoard", "PauseBoard", "PauseKind", "PauseRecord", "PauseSet"]

PauseKind = Literal["tool", "agent", "all"]
#: The name of the pause that stops every call.
ALL = "*"
#: The audit decisions of calls (every other row is an operator's).
CALL_DECISIONS = ("accepted", "replayed", "rejected", "failed", "unknown", "shadow")

SELECT = "SELECT kind, name, reason, paused_by, paused_at FROM toolguard_pause ORDER BY kind, name"
UPSERT = ("INSERT INTO toolguard_pause (kind, name, reason, paused_by) VALUES (%s, %s, %s, %s) "
          "ON CONFLICT (kind, name) DO UPDATE SET reason = excluded.reason, "
          "paused_by = excluded.paused_by")
DELETE = "DELETE FROM toolguard_pause WHERE kind = %s AND name = %s RETURNING kind"


@dataclass(frozen=True, slots=True)
class PauseRecord:
    """One pause: what it stops, why, who, since when."""

    kind: PauseKind
    name: str
    reason: str | None = None
    paused_by: str | None = None
    paused_at: datetime | None = None

    def describe(self) -> str:
        what = "every call" if self.kind == "all" else f"{self.kind} {self.name!r}"
        who = f" by {self.paused_by}" if self.paused_by else ""
        why = f": {self.reason}" if self.reason else ""
        return f"{what} is paused{who}{why}"


@dataclass(frozen=True, slots=True)
class PauseSet:
    """The pauses in force, as one immutable value (what a call is checked against)."""

    records: tuple[PauseRecord, ...] = ()
    _index: dict[tuple[str, str], PauseRecord] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {(r.kind, r.name): r for r in self.records})

    def refusal(self, tool: str, agent: str | None) -> Paused | None:
        """The ``Paused`` error for a call of ``tool`` by ``agent``, or None if it may run."""
        index = self._index
        if not index:
            return None
        found = (index.get(("all", ALL)) or index.get(("tool", tool))
                 or (index.get(("agent", agent)) if agent is not None else None))
        if found is None:
            return None
        return Paused(f"{found.describe()}; new calls are refused until `toolguard resume`")


def _kind(kind: str) -> PauseKind:
    if kind not in ("tool", "agent", "all"):
        msg = f"a pause names a tool, an agent or all, got {kind!r}"
        raise ConfigurationError(msg)
    return kind  # type: ignore[return-value]


def _record(row: tuple[Any, ...]) -> PauseRecord:
    kind, name, reason, by, at = row
    moment = at if isinstance(at, datetime) or at is None else datetime.fromisoformat(at)
    if moment is not None and moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return PauseRecord(_kind(kind), name, reason, by, moment)


def _target(kind: str, name: str) -> tuple[PauseKind, str]:
    checked = _kind(kind)
    if checked == "all":
        return "all", ALL
    if not isinstance(name, str) or not name or len(name) > 256:
        msg = f"a pause needs the {checked}'s name (1 to 256 characters), got {name!r}"
        raise ConfigurationError(msg)
    if storable_text(name) != name or name != name.strip():
        msg = (f"a pause names a {checked} exactly as its calls do: no NUL, no lone surrogates, "
               f"no leading or trailing spaces, got {name!r}")
        raise ConfigurationError(msg)
    return checked, name


def _audit_entry(action: str, kind: PauseKind, name: str, by: str | None,
                 reason: str | None) -> AuditEntry:
    who = f" by {by}" if by else ""
    what = "every call" if kind == "all" else f"{kind} {name}"
    return AuditEntry(decision="operator", reason=action,
                      tool=name if kind == "tool" else None,
                      agent=name if kind == "agent" else None,
                      args={"kind": kind, "name": name, "by": by},
                      detail=f"{what} {action}{who}{f': {reason}' if reason else ''}")


class _Cache:
    """The last set read, and when; refreshed by one caller at a time."""

    def __init__(self, cache_s: float, clock: Callable[[], float]) -> None:
        if cache_s < 0:
            msg = f"cache_s must be >= 0, got {cache_s!r}"
            raise ConfigurationError(msg)
        self.cache_s = cache_s
        self.clock = clock
        self.value: PauseSet | None = None
        self.read_at = float("-inf")

    def fresh(self) -> PauseSet | None:
        if self.value is not None and self.clock() - self.read_at < self.cache_s:
            return self.value
        return None

    def keep(self, value: PauseSet, started: float) -> PauseSet:
        # a pause written after ``started`` may be missing: count the age from before the read
        self.value, self.read_at = value, started
        return value


class PauseBoard:
    """Pauses in a sync store: ``pause``, ``resume``, ``records`` and the step ``check``."""

    def __init__(self, store: GuardedStore, *, cache_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self._cache = _Cache(cache_s, clock)
        self._lock = threading.Lock()

    def check(self, tool: str, agent: str | None) -> None:
        """Raise ``Paused`` if the tool, the agent or everything is paused."""
        error = self.current().refusal(tool, agent)
        if error is not None:
            raise error

    def current(self) -> PauseSet:
        """The pauses in force, read again when the cached set is older than ``cache_s``."""
        cached = self._cache.fresh()
        if cached is not None:
            return cached
        with self._lock:
            cached = self._cache.fresh()
            if cached is not None:
                return cached
            started = self._cache.clock()
            return self._cache.keep(PauseSet(self.records()), started)

    def records(self) -> tuple[PauseRecord, ...]:
        """Every pause, read now."""
        return tuple(_record(row) for row in rows(self.store, SELECT))

    def known(self, kind: str, name: str) -> bool:
        """True if the audit log holds a call of this tool (or by this agent).

        A pause of a name no call ever had (a typo) stops nothing: the CLI warns.
        """
        checked, target = _target(kind, name)
        if checked == "all":
            return True
        return bool(self.store.query_audit(**{checked: target}, decision=list(CALL_DECISIONS),
                                           limit=1))

    def pause(self, kind: str, name: str = ALL, *, by: str | None = None,
              reason: str | None = None) -> PauseRecord:
        """Pause ``kind`` (tool, agent, all) ``name``; audited. Pausing twice updates the reason."""
        checked, target = _target(kind, name)
        rows(self.store, UPSERT, (checked, target, reason, by))
        self.store.audit(_audit_entry("paused", checked, target, by, reason))
        self._forget()
        return next(r for r in self.records() if (r.kind, r.name) == (checked, target))

    def resume(self, kind: str, name: str = ALL, *, by: str | None = None) -> bool:
        """Lift a pause; False if there was none. Audited when it lifted one."""
        checked, target = _target(kind, name)
        lifted = bool(rows(self.store, DELETE, (checked, target)))
        if lifted:
            self.store.audit(_audit_entry("resumed", checked, target, by, None))
        self._forget()
        return lifted

    def _forget(self) -> None:
        with self._lock:
            self._cache.value = None


class AsyncPauseBoard:
    """The asyncio twin of ``PauseBoard``."""

    def __init__(self, store: AsyncGuardedStore, *, cache_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self._cache = _Cache(cache_s, clock)
        self._lock = asyncio.Lock()

    async def check(self, tool: str, agent: str | None) -> None:
        error = (await self.current()).refusal(tool, agent)
        if error is not None:
            raise error

    async def current(self) -> PauseSet:
        cached = self._cache.fresh()
        if cached is not None:
            return cached
        async with self._lock:
            cached = self._cache.fresh()
            if cached is not None:
                return cached
            started = self._cache.clock()
            return self._cache.keep(PauseSet(await self.records()), started)

    async def records(self) -> tuple[PauseRecord, ...]:
        return tuple(_record(row) for row in await arows(self.store, SELECT))

    async def pause(self, kind: str, name: str = ALL, *, by: str | None = None,
                    reason: str | None = None) -> PauseRecord:
        checked, target = _target(kind, name)
        await arows(self.store, UPSERT, (checked, target, reason, by))
        await self.store.audit(_audit_entry("paused", checked, target, by, reason))
        self._cache.value = None
        return next(r for r in await self.records() if (r.kind, r.name) == (checked, target))

    async def resume(self, kind: str, name: str = ALL, *, by: str | None = None) -> bool:
        checked, target = _target(kind, name)
        lifted = bool(await arows(self.store, DELETE, (checked, target)))
        if lifted:
            await self.store.audit(_audit_entry("resumed", checked, target, by, None))
        self._cache.value = None
        return lifted

