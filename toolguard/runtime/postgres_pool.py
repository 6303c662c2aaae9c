"""PostgreSQL connection pools that hand out the connection returned last (most recent first).

psycopg_pool hands out the connection that has been idle longest, so a thread
calling one at a time goes round every connection of the pool, and each call
meets a server process whose caches went cold while the others ran. The
store's two messages are parsed and planned on every call, and pay for it
most (``benchmarks/guard_sql.py`` shows the server's CPU per transaction in
both orders). The most recently returned connection is the warm one: these
pools take it first and leave the rest idle, where the pool's own shrinking
(``max_idle``) closes the one idle longest, as before. redis-py's pool already
hands out the connection returned last.

Only the order changes. Waiting clients, checks, growth, shrinking and
reconnection are psycopg_pool's own: before psycopg_pool takes the first idle
connection (under its lock), the idle deque is rotated so that its newest
entry is first. ``tests/store/test_pool_order.py`` fails if a psycopg_pool
release stops calling ``_get_ready_connection`` or keeps its idle connections
otherwise.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool


def _newest_first(pool: ConnectionPool[Any] | AsyncConnectionPool[Any]) -> None:
    idle = getattr(pool, "_pool", None)
    if isinstance(idle, deque) and len(idle) > 1:
        idle.rotate(1)  # the connection returned last (appended on the right) goes first


class RecentFirstPool(ConnectionPool[psycopg.Connection[Any]]):
    """A ``ConnectionPool`` that hands out the connection returned last."""

    def _get_ready_connection(self, timeout: float | None) -> psycopg.Connection[Any] | None:
        _newest_first(self)
        return super()._get_ready_connection(timeout)


class AsyncRecentFirstPool(AsyncConnectionPool[psycopg.AsyncConnection[Any]]):
    """An ``AsyncConnectionPool`` that hands out the connection returned last."""

    async def _get_ready_connection(self, timeout: float | None
                                    ) -> psycopg.AsyncConnection[Any] | None:
        _newest_first(self)
        return await super()._get_ready_connection(timeout)
