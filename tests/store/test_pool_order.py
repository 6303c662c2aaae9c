"""The PostgreSQL pools hand out the connection returned last (``toolguard.runtime.postgres_pool``).

psycopg_pool's own order is the connection idle longest: one caller at a time then
goes round every connection, and meets a server process whose caches went cold. These
tests see the order from the server's side (``pg_backend_pid``), for the store's pools
and the PostgreSQL lock backend's, so a psycopg_pool release that changes how it keeps
its idle connections fails here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest

from toolguard.locks import connect, connect_async
from toolguard.runtime.postgres_pool import AsyncRecentFirstPool, RecentFirstPool
from toolguard.store import open_async_store, open_store

from .envs import drop_schema

SIZE = 4


@pytest.fixture
def schema(postgres_url: str, unique: str) -> Iterator[str]:
    name = f"tg_pool_{unique}"
    yield name
    drop_schema(postgres_url, name)


def test_one_caller_at_a_time_keeps_getting_the_connection_it_returned(postgres_url, schema):
    with open_store(postgres_url, install=True, schema=schema, min_size=SIZE,
                    max_size=SIZE) as store:
        with contextlib.ExitStack() as held:  # every connection open and used once
            busy = [held.enter_context(store.connection()) for _ in range(SIZE)]
            assert len({conn.info.backend_pid for conn in busy}) == SIZE
        last = busy[0].info.backend_pid  # returned last (the exit stack unwinds)
        seen = []
        for _ in range(3 * SIZE):
            with store.connection() as conn:
                seen.append(conn.execute("SELECT pg_backend_pid()").fetchone()[0])
        assert seen == [last] * len(seen)
        # two callers at once still get two connections, the second newest the second
        with store.connection() as first, store.connection() as second:
            assert first.info.backend_pid == last
            assert second.info.backend_pid != last


def test_the_async_store_keeps_getting_the_connection_it_returned(postgres_url, schema):
    async def main() -> None:
        store = open_async_store(postgres_url, schema=schema, min_size=SIZE, max_size=SIZE)
        try:
            await store.install()
            async with contextlib.AsyncExitStack() as held:
                busy = [await held.enter_async_context(store.connection()) for _ in range(SIZE)]
            last = busy[0].info.backend_pid
            seen = []
            for _ in range(3 * SIZE):
                async with store.connection() as conn:
                    row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
                    seen.append(row[0])
            assert seen == [last] * len(seen)
        finally:
            await store.aclose()

    asyncio.run(main())


def test_the_lock_backends_pools_are_recent_first(postgres_url, unique):
    """The PostgreSQL lock backend builds its pools from the same classes (sync and asyncio)."""
    with connect(postgres_url) as locks, locks.acquire([f"pool:{unique}"], ttl_ms=5_000):
        assert isinstance(locks.backend._pool, RecentFirstPool)

    async def main() -> None:
        locks = connect_async(postgres_url)
        try:
            async with locks.acquire([f"pool:{unique}"], ttl_ms=5_000):
                assert isinstance(locks.backend._pool, AsyncRecentFirstPool)
        finally:
            await locks.aclose()

    asyncio.run(main())
