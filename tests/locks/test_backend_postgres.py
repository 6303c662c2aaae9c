"""PostgreSQL-only guarantees: the schema, durable tokens minted only on grant,
LISTEN/NOTIFY hand-off, one listening connection per process, database time.

The contract suite (``test_contract*.py``) covers the rest. These tests drive the
backend's single-key primitives on the shared PostgreSQL (``postgres_url``), with
keys private to each test.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from toolguard.errors import BackendUnavailable
from toolguard.locks import connect_async, open_backend
from toolguard.locks.base import new_owner
from toolguard.locks.postgres import SCHEMA_MARK, PostgresBackend

SLACK_S = 1.0
STORE_TABLES = {"toolguard_fence", "toolguard_intent", "toolguard_audit", "toolguard_schema_version"}


def sql(url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(query, params)
        return cursor.fetchall() if cursor.description else []


@pytest.fixture
def app() -> str:
    """An application_name private to the test, to find (and kill) its connections."""
    return f"tg-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def backends(postgres_url: str, app: str) -> Iterator[list[PostgresBackend]]:
    """Three independent backend objects, as three processes would have; the first is ``app``."""
    made = [PostgresBackend(postgres_url, application_name=name)
            for name in (app, f"{app}-b", f"{app}-c")]
    yield made
    for backend in made:
        backend.close()


def test_schema_is_created_once_with_its_own_table_names(postgres_url: str) -> None:
    racers = [PostgresBackend(postgres_url) for _ in range(4)]
    errors: list[BaseException] = []

    def touch(backend: PostgresBackend) -> None:
        try:
            backend.current_token(f"schema-{uuid.uuid4().hex}")
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=touch, args=(b,)) for b in racers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for backend in racers:
        backend.close()
    assert errors == []
    tables = {row[0] for row in sql(postgres_url, "SELECT tablename FROM pg_tables "
                                                  "WHERE tablename LIKE 'toolguard_lock%%'")}
    assert tables == {"toolguard_lock_fence", "toolguard_lock_holder", "toolguard_lock_waiter"}
    assert not tables & STORE_TABLES
    mark = sql(postgres_url, "SELECT obj_description(to_regprocedure("
               "'toolguard_lock_acquire(text,text,integer,integer,text)'), 'pg_proc')")
    assert mark == [(SCHEMA_MARK,)]


def test_url_schemes_and_lazy_connection() -> None:
    for url in ("postgresql://127.0.0.1:1/x", "postgres://127.0.0.1:1/x"):
        backend = open_backend(url, timeout_s=1)
        assert isinstance(backend, PostgresBackend)  # nothing connected yet
        with pytest.raises(BackendUnavailable):
            backend.try_acquire("k", new_owner(1_000), 1_000)
        backend.close()


# --- tokens -----------------------------------------------------------------------------------------


def test_tokens_are_minted_only_on_grant_and_stored_durably(postgres_url: str, unique: str,
                                                           backends: list[PostgresBackend]) -> None:
    holder, waiter, _ = backends
    key = f"{unique}:mint"
    owner = new_owner(5_000)
    token = holder.try_acquire(key, owner, 5_000).token
    assert token is not None
    assert sql(postgres_url, "SELECT token FROM toolguard_lock_fence WHERE key = %s", key) == [
        (token,)]
    late = new_owner(5_000)
    for _ in range(5):  # failed attempts leave the counter alone
        assert not waiter.try_acquire(key, late, 5_000).granted
    assert holder.current_token(key) == token
    holder.release(key, owner)  # hands off to the waiter: exactly one new token
    handed = sql(postgres_url, "SELECT owner, token FROM toolguard_lock_holder WHERE key = %s", key)
    assert handed == [(late, holder.current_token(key))]
    assert handed[0][1] > token


def test_token_is_a_hybrid_clock_on_database_time(postgres_url: str, unique: str,
                                                  backends: list[PostgresBackend]) -> None:
    backend = backends[0]
    db_now_us = sql(postgres_url, "SELECT (extract(epoch FROM clock_timestamp()) * 1e6)::bigint")
    token = backend.try_acquire(f"{unique}:clock", new_owner(1_000), 1_000).token
    assert token is not None and token >= db_now_us[0][0]
    backend.raise_floor(f"{unique}:clock", token + 10**15)  # far ahead of the clock
    following = backend.try_acquire(f"{unique}:clock", new_owner(1_000), 1_000)
    assert following.token is None  # still held by the first owner...
    expires = sql(postgres_url, "SELECT expires_at > clock_timestamp() FROM toolguard_lock_holder "
                                "WHERE key = %s", f"{unique}:clock")
    assert expires == [(True,)]  # ...whose lease runs on database time


# --- waiting and hand-off --------------------------------------------------------------------------


def test_release_hands_the_token_to_the_waiter_through_notify(postgres_url: str, unique: str,
                                                              backends: list[PostgresBackend]
                                                              ) -> None:
    holder, waiter, _ = backends
    key = f"{unique}:notify"
    owner, late = new_owner(20_000), new_owner(20_000)
    first = holder.try_acquire(key, owner, 20_000).token
    assert first is not None
    assert not waiter.try_acquire(key, late, 20_000).granted
    got: list[int | None] = []
    thread = threading.Thread(target=lambda: got.append(waiter.wait(key, late, 10.0)))
    thread.start()
    time.sleep(0.1)
    released = time.monotonic()
    assert holder.release(key, owner)
    thread.join(5)
    assert time.monotonic() - released < 0.5
    assert got and got[0] is not None, "the waiter was not handed the lock directly"
    assert got[0] > first
    assert sql(postgres_url, "SELECT owner, token FROM toolguard_lock_holder WHERE key = %s",
               key) == [(late, got[0])]
    assert waiter.try_acquire(key, late, 20_000).token == got[0]  # the grant is the waiter's
    waiter.release(key, late)


def test_one_listening_connection_per_backend(postgres_url: str, unique: str, app: str,
                                              backends: list[PostgresBackend]) -> None:
    holder, waiter, _ = backends
    waiting_app = f"{app}-b"
    assert holder.try_acquire(f"{unique}:l0", new_owner(5_000), 5_000).granted
    for index in range(5):
        key = f"{unique}:l{index}"
        if index:
            assert holder.try_acquire(key, new_owner(5_000), 5_000).granted
        assert not waiter.try_acquire(key, new_owner(5_000), 5_000).granted
    listening = sql(postgres_url, "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                                  "%s AND query LIKE 'LISTEN%%'", waiting_app)
    assert listening == [(1,)]


def test_fifo_hand_offs_follow_arrival_order(unique: str, backends: list[PostgresBackend]) -> None:
    holder, waiter, _ = backends
    key = f"{unique}:fifo"
    owner = new_owner(5_000)
    assert holder.try_acquire(key, owner, 5_000).granted
    line = [new_owner(5_000) for _ in range(4)]
    for late in line:
        assert not waiter.try_acquire(key, late, 5_000).granted
    served = []
    current = owner
    for expected in line:
        holder.release(key, current) if current == owner else waiter.release(key, current)
        token = waiter.wait(key, expected, 2.0)
        assert token is not None
        served.append(expected)
        current = expected
    assert served == line
    waiter.release(key, current)


def test_a_crashed_waiter_drops_out_of_line(postgres_url: str, unique: str) -> None:
    holder = PostgresBackend(postgres_url)
    ghost = PostgresBackend(postgres_url, presence_ms=300)
    try:
        key = f"{unique}:ghost"
        owner = new_owner(5_000)
        assert holder.try_acquire(key, owner, 5_000).granted
        assert not ghost.try_acquire(key, new_owner(5_000), 5_000).granted
        time.sleep(0.4)  # the ghost stops refreshing its presence
        holder.release(key, owner)
        assert sql(postgres_url, "SELECT count(*) FROM toolguard_lock_holder WHERE key = %s",
                   key) == [(0,)]
        assert holder.try_acquire(key, new_owner(5_000), 5_000).granted
    finally:
        holder.close()
        ghost.close()


def test_async_waiter_gets_the_hand_off_without_a_thread(postgres_url: str, unique: str) -> None:
    key = f"{unique}:async"

    async def main() -> None:
        locks = connect_async(postgres_url)
        tokens: list[int] = []

        async def take() -> None:
            async with locks.acquire(key, ttl_ms=20_000, timeout_s=10) as lease:
                tokens.append(lease.token)

        try:
            lease = await locks.acquire(key, ttl_ms=20_000)
            waiters = [asyncio.create_task(take()) for _ in range(20)]  # > the executor's threads
            await asyncio.sleep(0.2)
            await lease.arelease()
            await asyncio.wait_for(asyncio.gather(*waiters), 10)
            assert len(tokens) == 20 and min(tokens) > lease.token
            assert tokens == sorted(tokens)
        finally:
            await locks.aclose()

    asyncio.run(main())


# --- liveness ---------------------------------------------------------------------------------------


def test_killed_holder_connections_free_the_lock_within_its_ttl(postgres_url: str, unique: str,
                                                                app: str,
                                                                backends: list[PostgresBackend]
                                                                ) -> None:
    crashed, waiter, _ = backends
    key = f"{unique}:killed"
    ttl_ms = 600
    owner = new_owner(ttl_ms)
    granted_at = time.monotonic()
    assert crashed.try_acquire(key, owner, ttl_ms).granted
    killed = sql(postgres_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                               "WHERE application_name = %s", app)
    assert killed and all(row[0] for row in killed)
    late = new_owner(5_000)
    attempt = waiter.try_acquire(key, late, 5_000)
    while not attempt.granted:
        handed = waiter.wait(key, late, attempt.retry_ms / 1000)
        if handed is not None:
            break
        attempt = waiter.try_acquire(key, late, 5_000)
        assert time.monotonic() - granted_at < ttl_ms / 1000 + SLACK_S
    assert time.monotonic() - granted_at >= ttl_ms / 1000 * 0.98, "freed before its TTL"
    # The crashed side reconnects on its next call and learns the lock is gone.
    assert crashed.renew([(key, owner, ttl_ms)]) == [False]
    assert crashed.release(key, owner) is False


def test_renew_is_one_statement_and_uses_database_time(postgres_url: str, unique: str,
                                                       backends: list[PostgresBackend],
                                                       monkeypatch) -> None:
    backend = backends[0]
    held = [(f"{unique}:r{i}", new_owner(2_000), 2_000) for i in range(3)]
    for key, owner, ttl in held:
        assert backend.try_acquire(key, owner, ttl).granted
    calls = []
    original = backend._run
    monkeypatch.setattr(backend, "_run", lambda *args: calls.append(args[0]) or original(*args))
    sql(postgres_url, "DELETE FROM toolguard_lock_holder WHERE key = %s", held[1][0])
    assert backend.renew(held) == [True, False, True]
    assert len(calls) == 1
    left = sql(postgres_url, "SELECT extract(epoch FROM expires_at - clock_timestamp()) "
                             "FROM toolguard_lock_holder WHERE key = %s", held[0][0])
    assert 1.5 < float(left[0][0]) <= 2.0
