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
from pathlib import Path
from typing import Any

import psycopg
import pytest

from toolguard.errors import BackendUnavailable, ConfigurationError
from toolguard.locks import connect, connect_async, open_backend
from toolguard.locks.base import new_owner
from toolguard.locks.postgres import (
    SCHEMA_MARK,
    SCHEMA_VERSION,
    PostgresBackend,
    install_lock_schema,
    lock_schema_version,
)

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
    tables = {row[0] for row in sql(postgres_url, "SELECT tablename FROM pg_tables WHERE "
                                                  "schemaname = 'public' AND tablename LIKE "
                                                  "'toolguard_lock%%'")}
    assert tables == {"toolguard_lock_fence", "toolguard_lock_holder", "toolguard_lock_waiter"}
    assert not tables & STORE_TABLES
    assert lock_schema_version(postgres_url) == SCHEMA_VERSION
    mark = sql(postgres_url, "SELECT obj_description(to_regprocedure('public.toolguard_lock_acquire"
                             "(text,text,integer,integer,integer,text)'), 'pg_proc')")
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


# --- schema= and the explicit install step -----------------------------------------------------------

V1_SQL = (Path(__file__).parent / "data" / "lock_schema_v1.sql").read_text()
V2_SQL = (Path(__file__).parent / "data" / "lock_schema_v2.sql").read_text()


@pytest.fixture
def lock_schema(postgres_url: str, unique: str) -> Iterator[str]:
    """A schema name private to the test (dropped afterwards)."""
    name = f"tg_locks_{unique}"
    yield name
    sql(postgres_url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def objects_in(url: str, schema: str) -> tuple[set[str], set[str]]:
    tables = {row[0] for row in sql(url, "SELECT tablename FROM pg_tables WHERE schemaname = %s",
                                    schema)}
    functions = {row[0] for row in sql(url, "SELECT p.proname FROM pg_proc p JOIN pg_namespace n "
                                            "ON n.oid = p.pronamespace WHERE n.nspname = %s",
                                       schema)}
    return tables, functions


def test_schema_option_keeps_tables_and_functions_in_that_schema(postgres_url: str, unique: str,
                                                                 lock_schema: str) -> None:
    backend = PostgresBackend(postgres_url, schema=lock_schema)
    try:
        assert backend.schema_version() == 0
        assert backend.install() == SCHEMA_VERSION
        assert backend.install() == SCHEMA_VERSION  # idempotent
        assert backend.schema_version() == SCHEMA_VERSION
    finally:
        backend.close()
    tables, functions = objects_in(postgres_url, lock_schema)
    assert tables == {"toolguard_lock_fence", "toolguard_lock_holder", "toolguard_lock_waiter"}
    assert {"toolguard_lock_acquire", "toolguard_lock_release", "toolguard_lock_grant",
            "toolguard_lock_pass"} <= functions
    key = f"{unique}:in-schema"
    with connect(postgres_url, schema=lock_schema) as locks, locks.acquire(key) as lease:
        stored = sql(postgres_url, f'SELECT token FROM "{lock_schema}".toolguard_lock_fence '
                                   "WHERE key = %s", key)
        assert stored == [(lease.token,)]
        assert sql(postgres_url, "SELECT count(*) FROM public.toolguard_lock_fence WHERE key = %s",
                   key) == [(0,)]


def test_the_module_level_install_needs_no_manager(postgres_url: str, lock_schema: str) -> None:
    assert lock_schema_version(postgres_url, schema=lock_schema) == 0
    assert install_lock_schema(postgres_url, schema=lock_schema) == SCHEMA_VERSION
    assert lock_schema_version(postgres_url, schema=lock_schema) == SCHEMA_VERSION
    assert objects_in(postgres_url, lock_schema)[0]


def test_first_use_installs_the_schema_lazily(postgres_url: str, unique: str,
                                              lock_schema: str) -> None:
    with connect(postgres_url, schema=lock_schema) as locks, locks.acquire(f"{unique}:lazy"):
        pass
    assert lock_schema_version(postgres_url, schema=lock_schema) == SCHEMA_VERSION

    async def main() -> None:
        other = f"{lock_schema}_a"
        try:
            manager = connect_async(postgres_url, schema=other)
            try:
                async with manager.acquire(f"{unique}:alazy"):
                    pass
            finally:
                await manager.aclose()
            assert lock_schema_version(postgres_url, schema=other) == SCHEMA_VERSION
        finally:
            sql(postgres_url, f'DROP SCHEMA IF EXISTS "{other}" CASCADE')

    asyncio.run(main())


@pytest.mark.parametrize("bad", ["", "a b", "x;drop table t", 'q"uote', "1abc", "a" * 64, 7])
def test_schema_must_be_a_plain_identifier(postgres_url: str, bad: object) -> None:
    with pytest.raises(ConfigurationError) as caught:
        PostgresBackend(postgres_url, schema=bad)  # type: ignore[arg-type]
    assert repr(bad) in str(caught.value)
    with pytest.raises(ConfigurationError):
        connect(postgres_url, schema=bad)


def test_upgrade_from_lock_schema_1_keeps_the_tokens(postgres_url: str, unique: str,
                                                     lock_schema: str) -> None:
    key = f"{unique}:upgrade"
    high = 10**17  # far above the clock: the next token must come from the kept counter
    with psycopg.connect(postgres_url, autocommit=True) as conn, conn.transaction():
        conn.execute(f'CREATE SCHEMA "{lock_schema}"')
        conn.execute(f'SET LOCAL search_path TO "{lock_schema}"')
        conn.execute(V1_SQL)
        conn.execute("INSERT INTO toolguard_lock_fence (key, token) VALUES (%s, %s)", (key, high))
    assert lock_schema_version(postgres_url, schema=lock_schema) == 1
    assert install_lock_schema(postgres_url, schema=lock_schema) == SCHEMA_VERSION
    assert lock_schema_version(postgres_url, schema=lock_schema) == SCHEMA_VERSION
    with connect(postgres_url, schema=lock_schema) as locks, locks.acquire(key) as lease:
        assert lease.token == high + 1
    # A client of lock schema 1 still running through the upgrade keeps working, on the
    # same tables: its acquire function stays (a separate overload). Its SQL is
    # unqualified: such a client finds the schema through its search_path.
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{lock_schema}"')
        row = conn.execute("SELECT token FROM toolguard_lock_acquire(%s, %s, 1000, 2000, 'x')",
                           (key, "old-client:1000")).fetchone()
    assert row is not None and row[0] > high + 1


def test_a_lock_schema_dropped_under_a_running_backend_is_installed_again(
        postgres_url: str, unique: str, lock_schema: str) -> None:
    with connect(postgres_url, schema=lock_schema) as locks:
        with locks.acquire(f"{unique}:before") as lease:
            before = lease.token
        sql(postgres_url, f'DROP SCHEMA "{lock_schema}" CASCADE')  # e.g. a restore from a backup
        with locks.acquire(f"{unique}:after") as lease:
            assert lease.token > before
        sql(postgres_url, f'DROP TABLE "{lock_schema}".toolguard_lock_waiter')  # one piece only
        with locks.acquire(f"{unique}:after") as lease:
            assert lease.token > before


def test_a_hand_off_lasts_the_waiters_hand_off_ttl(postgres_url: str, unique: str,
                                                   backends: list[PostgresBackend]) -> None:
    holder, waiter, _ = backends
    key = f"{unique}:handoff-ttl"
    owner, late = new_owner(30_000), new_owner(30_000, 700)
    assert holder.try_acquire(key, owner, 30_000).granted
    assert not waiter.try_acquire(key, late, 30_000).granted
    holder.release(key, owner)
    left = sql(postgres_url, "SELECT owner, extract(epoch FROM expires_at - clock_timestamp()) "
                             "FROM toolguard_lock_holder WHERE key = %s", key)
    assert left[0][0] == late and 0 < float(left[0][1]) <= 0.7
    # Asking again while holding extends the grant to the full TTL from now.
    token = waiter.try_acquire(key, late, 30_000).token
    assert token == holder.current_token(key)
    left = sql(postgres_url, "SELECT extract(epoch FROM expires_at - clock_timestamp()) "
                             "FROM toolguard_lock_holder WHERE key = %s", key)
    assert float(left[0][0]) > 29
    waiter.release(key, late)


def test_a_notification_older_than_the_last_queued_answer_is_dropped(
        unique: str, backends: list[PostgresBackend]) -> None:
    holder, waiter, _ = backends
    key = f"{unique}:stale-notify"
    owner, late = new_owner(30_000), new_owner(30_000)
    assert holder.try_acquire(key, owner, 30_000).granted
    assert not waiter.try_acquire(key, late, 30_000).granted
    last = holder.current_token(key)
    listener = waiter._listener
    assert listener is not None
    listener._deliver(f"{late} {last} {key}")  # a hand-off as old as the last grant seen
    assert waiter.wait(key, late, 0.2) is None
    listener._deliver(f"{late} {last + 1} {key}")  # one granted after that answer
    assert waiter.wait(key, late, 0.2) == last + 1
    holder.release(key, owner)
    waiter.release(key, late)


# --- the idle-row sweeper against a concurrent acquire ---------------------------------------------

#: An advisory lock key of the test's own (outside toolguard's range), to pause an acquire.
PAUSE_KEY = 4_242_424_242


def _pause_after_fence_insert(url: str, schema: str) -> None:
    """A trigger that stops every statement inserting into the fence table, once that
    statement is done, until the test's advisory lock is free: an acquire is then paused
    between its fence-row insert and whatever its next statement does."""
    sql(url, f'''
        CREATE FUNCTION "{schema}".pause_after_fence_insert() RETURNS trigger
        LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_advisory_xact_lock({PAUSE_KEY}); RETURN NULL; END $$;
        CREATE TRIGGER pause_after_fence_insert AFTER INSERT ON "{schema}".toolguard_lock_fence
        FOR EACH STATEMENT EXECUTE FUNCTION "{schema}".pause_after_fence_insert();''')


def _wait_until_paused(control: psycopg.Connection[Any], racer: threading.Thread,
                       timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and racer.is_alive():
        row = control.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                              "AND NOT granted AND objid = %s", (PAUSE_KEY & 0xFFFFFFFF,)).fetchone()
        if row and row[0]:
            return
        time.sleep(0.01)
    pytest.fail("the acquire never reached the pause")


@pytest.mark.parametrize("installed", ["current", "upgraded from 2"])
def test_a_sweep_between_the_fence_insert_and_its_lock_cannot_break_an_acquire(
        postgres_url: str, unique: str, lock_schema: str, installed: str) -> None:
    """``sweep_postgres_locks`` deletes idle fence rows. An acquire that found its key's row
    must lock it in the same statement: a row deleted between an insert that found it and a
    separate ``FOR UPDATE`` used to make the grant mint NULL (a raw NOT NULL violation)."""
    from toolguard.locks.upkeep import sweep_postgres_locks

    if installed == "current":
        assert install_lock_schema(postgres_url, schema=lock_schema) == SCHEMA_VERSION
    else:
        with psycopg.connect(postgres_url, autocommit=True) as conn, conn.transaction():
            conn.execute(f'CREATE SCHEMA "{lock_schema}"')
            conn.execute(f'SET LOCAL search_path TO "{lock_schema}"')
            conn.execute(V2_SQL)
        assert lock_schema_version(postgres_url, schema=lock_schema) == 2
    key = f"{unique}:swept"
    sql(postgres_url, f'INSERT INTO "{lock_schema}".toolguard_lock_fence (key, token) '
                      "VALUES (%s, 1000)", key)  # an idle key: its last grant is long past
    backend = PostgresBackend(postgres_url, schema=lock_schema)
    outcome: dict[str, Any] = {}
    try:
        backend.install()  # (the upgrade, where there is one) before the pause is set up
        _pause_after_fence_insert(postgres_url, lock_schema)

        def acquire() -> None:
            try:
                outcome["attempt"] = backend.try_acquire(key, new_owner(5_000), 5_000)
            except Exception as error:  # reported below
                outcome["error"] = error

        with psycopg.connect(postgres_url, autocommit=True) as control:
            control.execute("SELECT pg_advisory_lock(%s)", (PAUSE_KEY,))
            racer = threading.Thread(target=acquire)
            racer.start()
            try:
                _wait_until_paused(control, racer)
                outcome["swept"] = sweep_postgres_locks(postgres_url, idle_s=0, schema=lock_schema)
            finally:
                control.execute("SELECT pg_advisory_unlock(%s)", (PAUSE_KEY,))
                racer.join(10)
    finally:
        backend.close()
    assert "error" not in outcome, f"the acquire failed: {outcome['error']!r}"
    attempt = outcome["attempt"]
    assert attempt.granted and attempt.token > 1000
    assert outcome["swept"].fences == 0  # the row was locked by then: the sweep left it
    assert sql(postgres_url, f'SELECT token FROM "{lock_schema}".toolguard_lock_fence '
                             "WHERE key = %s", key) == [(attempt.token,)]


def test_a_hand_off_on_a_key_whose_fence_row_is_gone_mints_a_token(postgres_url: str, unique: str,
                                                                    lock_schema: str) -> None:
    """The grant never mints NULL: a fence row deleted under a held key (by hand, a sweep
    run with ``idle_s`` below the TTLs) is created again, with the database time."""
    key = f"{unique}:gone"
    backend = PostgresBackend(postgres_url, schema=lock_schema)
    try:
        holder, waiter = new_owner(5_000), new_owner(5_000)
        held = backend.try_acquire(key, holder, 5_000)
        assert held.granted and not backend.try_acquire(key, waiter, 5_000).granted
        sql(postgres_url, f'DELETE FROM "{lock_schema}".toolguard_lock_fence WHERE key = %s', key)
        assert backend.release(key, holder)
        (row,) = sql(postgres_url, f'SELECT h.owner, h.token, f.token '
                                   f'FROM "{lock_schema}".toolguard_lock_holder h '
                                   f'JOIN "{lock_schema}".toolguard_lock_fence f USING (key) '
                                   "WHERE key = %s", key)
        assert row[0] == waiter and row[1] == row[2] > held.token
    finally:
        backend.close()
