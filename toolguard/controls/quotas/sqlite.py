"""Quotas in the SQLite store: each step is one ``BEGIN IMMEDIATE`` transaction.

SQLite has one writer per file, so the transaction serializes admissions
outright, across every process on the machine; the clock is read after
``BEGIN IMMEDIATE`` returns (once this process is the writer). Tables come from
``sql/sqlite/002_controls.sql``. An admission waits while a fenced write holds
the store's write lock, as every write to the file does: keep fenced bodies
short.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Sequence

from toolguard.controls.quotas.base import Admitted, Entry, Refused, Verdict, check_charges
from toolguard.controls.quotas.charges import Charge
from toolguard.store.base import AsyncGuardedStore, GuardedStore

__all__ = ["AsyncSqliteQuotas", "SqliteQuotas"]

_EPSILON = 1e-9


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _used(conn: sqlite3.Connection, scope: str, now: int) -> float:
    """Prune ``scope``'s expired entries (subtracting them) and return its live sum."""
    row = conn.execute("SELECT used FROM toolguard_quota WHERE scope = ?", (scope,)).fetchone()
    used = float(row[0]) if row else 0.0
    gone = conn.execute("SELECT coalesce(sum(amount), 0), count(*) FROM toolguard_quota_entry "
                        "WHERE scope = ? AND expires_ms <= ?", (scope, now)).fetchone()
    if gone[1]:
        conn.execute("DELETE FROM toolguard_quota_entry WHERE scope = ? AND expires_ms <= ?",
                     (scope, now))
        used = max(used - float(gone[0]), 0.0)
        if used < _EPSILON:
            used = 0.0
        conn.execute("UPDATE toolguard_quota SET used = ?, updated_ms = ? WHERE scope = ?",
                     (used, now, scope))
    return used


def _retry_ms(conn: sqlite3.Connection, scope: str, need: float, now: int) -> int:
    freed = 0.0
    for amount, expires in conn.execute("SELECT amount, expires_ms FROM toolguard_quota_entry "
                                        "WHERE scope = ? ORDER BY expires_ms, entry", (scope,)):
        freed += float(amount)
        if freed >= need - _EPSILON:
            return max(1, int(expires) - now)
    return 1


def admit_sync(conn: sqlite3.Connection, charges: Sequence[Charge]) -> Verdict:
    """The admission on one autocommit connection (its own BEGIN IMMEDIATE transaction)."""
    check_charges(charges)
    conn.execute("BEGIN IMMEDIATE")
    try:
        now = _now_ms()
        fresh: list[bool] = []
        used: list[float] = []
        refused: Refused | None = None
        for index, charge in enumerate(charges):
            conn.execute("INSERT INTO toolguard_quota (scope, updated_ms) VALUES (?, ?) "
                         "ON CONFLICT (scope) DO NOTHING", (charge.scope, now))
            current = _used(conn, charge.scope, now)
            present = conn.execute("SELECT 1 FROM toolguard_quota_entry WHERE scope = ? AND entry = ?",
                                   (charge.scope, charge.entry)).fetchone() is not None
            if not present and current + charge.cost > charge.limit + _EPSILON:
                if charge.cost > charge.limit:
                    refused = Refused(index, None)
                else:
                    need = current + charge.cost - charge.limit
                    refused = Refused(index, _retry_ms(conn, charge.scope, need, now) / 1000)
                break
            fresh.append(not present)
            used.append(current)
        if refused is None:
            for charge, new, current in zip(charges, fresh, used, strict=True):
                if new:
                    conn.execute("INSERT INTO toolguard_quota_entry (scope, entry, amount, expires_ms) "
                                 "VALUES (?, ?, ?, ?)",
                                 (charge.scope, charge.entry, charge.cost, now + charge.ttl_ms))
                    conn.execute("UPDATE toolguard_quota SET used = ?, updated_ms = ? WHERE scope = ?",
                                 (current + charge.cost, now, charge.scope))
        conn.execute("COMMIT")  # the pruning stays even when refused
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return refused if refused is not None else Admitted(tuple(fresh))


def release_sync(conn: sqlite3.Connection, entries: Sequence[Entry]) -> int:
    conn.execute("BEGIN IMMEDIATE")
    try:
        removed = 0
        for scope, entry in entries:
            row = conn.execute("DELETE FROM toolguard_quota_entry WHERE scope = ? AND entry = ? "
                               "RETURNING amount", (scope, entry)).fetchone()
            if row is not None:
                removed += 1
                conn.execute("UPDATE toolguard_quota SET used = max(used - ?, 0) WHERE scope = ?",
                             (float(row[0]), scope))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return removed


def renew_sync(conn: sqlite3.Connection, entries: Sequence[Entry], ttl_ms: int) -> list[bool]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        now = _now_ms()
        found = []
        for scope, entry in entries:
            cursor = conn.execute("UPDATE toolguard_quota_entry SET expires_ms = ? "
                                  "WHERE scope = ? AND entry = ? AND expires_ms > ?",
                                  (now + ttl_ms, scope, entry, now))
            found.append(cursor.rowcount == 1)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return found


def usage_sync(conn: sqlite3.Connection, scope: str) -> float:
    row = conn.execute("SELECT coalesce(sum(amount), 0) FROM toolguard_quota_entry "
                       "WHERE scope = ? AND expires_ms > ?", (scope, _now_ms())).fetchone()
    return float(row[0])


class SqliteQuotas:
    """Sync quotas on a ``SqliteStore`` (schema version 3 or later)."""

    name = "sqlite"

    def __init__(self, store: GuardedStore) -> None:
        if store.dialect != "sqlite":
            msg = f"SqliteQuotas needs a SQLite store, got {store!r}"
            raise TypeError(msg)
        self.store = store

    def admit(self, charges: Sequence[Charge]) -> Verdict:
        with self.store.connection() as conn:
            return admit_sync(conn, charges)

    def release(self, entries: Sequence[Entry]) -> int:
        if not entries:
            return 0
        with self.store.connection() as conn:
            return release_sync(conn, entries)

    def renew(self, entries: Sequence[Entry], ttl_ms: int) -> list[bool]:
        if not entries:
            return []
        with self.store.connection() as conn:
            return renew_sync(conn, entries, ttl_ms)

    def usage(self, scope: str) -> float:
        with self.store.connection() as conn:
            return usage_sync(conn, scope)

    def close(self) -> None:
        """The store belongs to the caller."""


class AsyncSqliteQuotas:
    """asyncio quotas on an ``AsyncSqliteStore``: each step in a worker thread.

    The thread takes and gives back its own connection, so a cancelled await
    never hands a connection in mid-transaction to someone else; the step
    itself still completes (a cancelled admission may have counted: its
    entries expire with their window or lease).
    """

    name = "sqlite"

    def __init__(self, store: AsyncGuardedStore) -> None:
        sync = getattr(store, "sync", None)
        if store.dialect != "sqlite" or sync is None:
            msg = f"AsyncSqliteQuotas needs an AsyncSqliteStore, got {store!r}"
            raise TypeError(msg)
        self.sync = SqliteQuotas(sync)

    async def admit(self, charges: Sequence[Charge]) -> Verdict:
        return await asyncio.to_thread(self.sync.admit, charges)

    async def release(self, entries: Sequence[Entry]) -> int:
        return await asyncio.to_thread(self.sync.release, entries)

    async def renew(self, entries: Sequence[Entry], ttl_ms: int) -> list[bool]:
        return await asyncio.to_thread(self.sync.renew, entries, ttl_ms)

    async def usage(self, scope: str) -> float:
        return await asyncio.to_thread(self.sync.usage, scope)

    async def aclose(self) -> None:
        """The store belongs to the caller."""
