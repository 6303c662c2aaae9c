"""The contract every quota backend keeps (Redis, PostgreSQL, SQLite; sync and asyncio).

``admit(charges)`` is one atomic step on the server: every charge's expired
entries are pruned, every charge is checked, and only if all fit are their
entries added, counted from the server's clock read once the step holds its
locks. Nothing is counted when one refuses, so a call refused by its budget
does not use up its rate. An entry already present (same scope, same id) is
not counted again: ``Admitted.fresh`` says which ones this call added, and
only those may be released.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from toolguard.controls.quotas.charges import Charge

__all__ = ["Admitted", "AsyncQuotaBackend", "Entry", "QuotaBackend", "Refused", "Verdict"]

#: ``(scope, entry id)``: one counted entry.
Entry = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Admitted:
    """Every charge fits; ``fresh[i]`` is False where the entry was counted before."""

    fresh: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class Refused:
    """``charges[index]`` does not fit; ``retry_after_s`` None: its cost alone is over its limit."""

    index: int
    retry_after_s: float | None


Verdict = Admitted | Refused


@runtime_checkable
class QuotaBackend(Protocol):
    """Sync quota backend."""

    name: str

    def admit(self, charges: Sequence[Charge]) -> Verdict: ...

    def release(self, entries: Sequence[Entry]) -> int: ...

    def renew(self, entries: Sequence[Entry], ttl_ms: int) -> list[bool]: ...

    def usage(self, scope: str) -> float: ...

    def close(self) -> None: ...


@runtime_checkable
class AsyncQuotaBackend(Protocol):
    """asyncio quota backend: the same steps, awaited."""

    name: str

    async def admit(self, charges: Sequence[Charge]) -> Verdict: ...

    async def release(self, entries: Sequence[Entry]) -> int: ...

    async def renew(self, entries: Sequence[Entry], ttl_ms: int) -> list[bool]: ...

    async def usage(self, scope: str) -> float: ...

    async def aclose(self) -> None: ...


def check_charges(charges: Sequence[Charge]) -> None:
    """Backends refuse what the SQL function refuses: distinct scopes, positive limits and TTLs."""
    scopes = [c.scope for c in charges]
    if not charges or len(set(scopes)) != len(scopes):
        msg = "admit() needs at least one charge and distinct scopes"
        raise ValueError(msg)
    for charge in charges:
        if charge.limit <= 0 or charge.cost < 0 or charge.ttl_ms <= 0 or not charge.entry:
            msg = f"unusable charge {charge!r}"
            raise ValueError(msg)
