"""Quotas in the PostgreSQL store: one function call per step (``sql/004_controls.sql``).

``toolguard_quota_admit`` locks the call's counter rows in one canonical order,
reads the server clock, prunes, checks and counts, in the one statement's
transaction: atomic across processes and machines, and it cannot deadlock
with another admission. Connections come from the store's pool
(``store.connection()``), so the store's schema option applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from toolguard.controls.quotas.base import Admitted, Entry, Refused, Verdict, check_charges
from toolguard.controls.quotas.charges import Charge
from toolguard.store.base import AsyncGuardedStore, GuardedStore

__all__ = ["AsyncPostgresQuotas", "PostgresQuotas"]

ADMIT = ("SELECT refused, retry_ms, fresh FROM toolguard_quota_admit("
         "%s::text[], %s::numeric[], %s::numeric[], %s::bigint[], %s::text[])")
RELEASE = "SELECT toolguard_quota_release(%s::text[], %s::text[])"
RENEW = "SELECT toolguard_quota_renew(%s::text[], %s::text[], %s)"
USAGE = ("SELECT coalesce(sum(amount), 0) FROM toolguard_quota_entry "
         "WHERE scope = %s AND expires_at > clock_timestamp()")


def _admit_params(charges: Sequence[Charge]) -> tuple[Any, ...]:
    check_charges(charges)
    return ([c.scope for c in charges], [c.limit for c in charges], [c.cost for c in charges],
            [c.ttl_ms for c in charges], [c.entry for c in charges])


def _verdict(row: Sequence[Any] | None) -> Verdict:
    assert row is not None
    refused, retry_ms, fresh = row
    if refused == 0:
        return Admitted(tuple(bool(flag) for flag in fresh))
    return Refused(int(refused) - 1, None if retry_ms < 0 else int(retry_ms) / 1000)


def _entries(entries: Sequence[Entry]) -> tuple[list[str], list[str]]:
    return [scope for scope, _ in entries], [entry for _, entry in entries]


class PostgresQuotas:
    """Sync quotas on a ``PostgresStore`` (schema version 4 or later)."""

    name = "postgresql"

    def __init__(self, store: GuardedStore) -> None:
        if store.dialect != "postgresql":
            msg = f"PostgresQuotas needs a PostgreSQL store, got {store!r}"
            raise TypeError(msg)
        self.store = store

    def admit(self, charges: Sequence[Charge]) -> Verdict:
        """Count every charge or none (one statement)."""
        params = _admit_params(charges)
        with self.store.connection() as conn:
            return _verdict(conn.execute(ADMIT, params).fetchone())

    def release(self, entries: Sequence[Entry]) -> int:
        if not entries:
            return 0
        with self.store.connection() as conn:
            row = conn.execute(RELEASE, _entries(entries)).fetchone()
        return int(row[0]) if row else 0

    def renew(self, entries: Sequence[Entry], ttl_ms: int) -> list[bool]:
        if not entries:
            return []
        with self.store.connection() as conn:
            row = conn.execute(RENEW, (*_entries(entries), ttl_ms)).fetchone()
        return [bool(flag) for flag in row[0]] if row else []

    def usage(self, scope: str) -> float:
        with self.store.connection() as conn:
            row = conn.execute(USAGE, (scope,)).fetchone()
        return float(row[0]) if row else 0.0

    def close(self) -> None:
        """The store belongs to the caller: nothing to close here."""


class AsyncPostgresQuotas:
    """asyncio quotas on an ``AsyncPostgresStore``."""

    name = "postgresql"

    def __init__(self, store: AsyncGuardedStore) -> None:
        if store.dialect != "postgresql":
            msg = f"AsyncPostgresQuotas needs a PostgreSQL store, got {store!r}"
            raise TypeError(msg)
        self.store = store

    async def admit(self, charges: Sequence[Charge]) -> Verdict:
        params = _admit_params(charges)
        async with self.store.connection() as conn:
            cursor = await conn.execute(ADMIT, params)
            return _verdict(await cursor.fetchone())

    async def release(self, entries: Sequence[Entry]) -> int:
        if not entries:
            return 0
        async with self.store.connection() as conn:
            row = await (await conn.execute(RELEASE, _entries(entries))).fetchone()
        return int(row[0]) if row else 0

    async def renew(self, entries: Sequence[Entry], ttl_ms: int) -> list[bool]:
        if not entries:
            return []
        async with self.store.connection() as conn:
            row = await (await conn.execute(RENEW, (*_entries(entries), ttl_ms))).fetchone()
        return [bool(flag) for flag in row[0]] if row else []

    async def usage(self, scope: str) -> float:
        async with self.store.connection() as conn:
            row = await (await conn.execute(USAGE, (scope,))).fetchone()
        return float(row[0]) if row else 0.0

    async def aclose(self) -> None:
        """The store belongs to the caller."""
