"""One statement on a guarded store, sync or asyncio, PostgreSQL or SQLite.

The production controls keep small tables in the store (``sql/004_controls.sql``)
and reach them only through the store's public ``connection()``. Statements use
psycopg's ``%s`` placeholders; on SQLite they are rewritten to ``?``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from toolguard.store.base import AsyncGuardedStore, GuardedStore, qmark

__all__ = ["arows", "rows"]


def rows(store: GuardedStore, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """Run one statement in autocommit; the rows it returns (none for a plain write)."""
    text = qmark(sql) if store.dialect == "sqlite" else sql
    with store.connection() as conn:
        cursor = conn.execute(text, tuple(params))
        return [tuple(row) for row in cursor.fetchall()] if cursor.description else []


async def arows(store: AsyncGuardedStore, sql: str,
                params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """The asyncio twin of ``rows`` (SQLite: in a worker thread, on the sync store)."""
    if store.dialect == "sqlite":
        sync = getattr(store, "sync", None)
        if sync is None:
            msg = f"an asyncio SQLite store with a .sync store is needed, got {store!r}"
            raise TypeError(msg)
        return await asyncio.to_thread(rows, sync, sql, params)
    async with store.connection() as conn:
        cursor = await conn.execute(sql, tuple(params))
        return [tuple(row) for row in await cursor.fetchall()] if cursor.description else []
