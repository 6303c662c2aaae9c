"""A lock server (or the store) restarted empty: its state is gone, toolguard must stay safe.

Each scenario starts its own server on a free port (or uses files under ``tmp_path``)
and wipes it while a holder holds a key, or between two calls on the same key:

* the next call applies (never refused forever), with a token above the store's marks;
* a holder from before the loss never has its late write accepted after a newer one
  (it is refused, or its lease is lost);
* no two holders are granted one key at once.

A holder whose renewal has not run yet is modelled by taking its lease off the
heartbeat: it still believes it holds the lock until its local deadline.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pg_server import ON_CI, PgServer, pg_available
from servers import RedisServer

from toolguard.errors import (
    BackendUnavailable,
    LockLost,
    LockTimeout,
    StaleFencingToken,
    StoreError,
    ToolGuardError,
)
from toolguard.locks import LockManager, connect, heartbeat
from toolguard.store import GuardedStore, open_store
from toolguard.store.recovery import run_fenced

pytestmark = pytest.mark.fault

TTL_MS = 1_500
FUTURE_US = 3600 * 1_000_000  # a lock server whose clock ran an hour ahead


def now_us() -> int:
    return time.time_ns() // 1000


@pytest.fixture
def store(tmp_path: Path) -> Iterator[GuardedStore]:
    opened = open_store(f"sqlite:///{tmp_path}/store.db", install=True)
    try:
        yield opened
    finally:
        opened.close()


def call(locks: LockManager, store: GuardedStore, key: str) -> Any:
    return run_fenced(locks, store, [key], lambda tx: "applied", timeout_s=5)


def late_write_refused(store: GuardedStore, holder: Any, key: str) -> BaseException | None:
    """The pre-loss holder writes now; returns the refusal (None: it was accepted)."""
    before = store.high_water(key)
    try:
        with store.fenced(holder):
            pass
    except (StaleFencingToken, LockLost) as refused:
        assert store.high_water(key) == before
        return refused
    return None


def hold_without_renewal(locks: LockManager, key: str) -> Any:
    lease = locks.acquire([key], timeout_s=5)
    heartbeat().remove(lease)  # its renewal has not run yet: it believes it holds the lock
    return lease


# --- Redis ----------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_redis_restarted_empty_between_calls(private_redis: RedisServer,
                                             store: GuardedStore) -> None:
    key = f"acct:{uuid.uuid4().hex[:8]}"
    locks = connect(private_redis.url, ttl_ms=TTL_MS, timeout_s=5)
    try:
        first = call(locks, store, key)
        private_redis.restart()
        second = call(locks, store, key)
        assert second.value == "applied"
        assert second.tokens[key] > first.tokens[key]
        assert store.high_water(key) == second.tokens[key]
    finally:
        locks.close()


@pytest.mark.timeout(30)
def test_redis_restarted_empty_under_a_holder(private_redis: RedisServer,
                                              store: GuardedStore) -> None:
    key = f"acct:{uuid.uuid4().hex[:8]}"
    locks = connect(private_redis.url, ttl_ms=TTL_MS, timeout_s=5)
    try:
        call(locks, store, key)
        holder = hold_without_renewal(locks, key)
        private_redis.restart()
        after = call(locks, store, key)
        assert after.value == "applied" and after.tokens[key] > holder.tokens[key]
        assert late_write_refused(store, holder, key) is not None
        holder.release()
    finally:
        locks.close()


@pytest.mark.timeout(30)
def test_redis_ahead_of_its_clock_restarted_empty_under_a_holder(private_redis: RedisServer,
                                                                  store: GuardedStore) -> None:
    """Floors above the server's clock (an earlier re-seed) vanish with the restart: the
    re-seed from the store's marks alone would hand out the pre-loss holder's own token."""
    key = f"acct:{uuid.uuid4().hex[:8]}"
    locks = connect(private_redis.url, ttl_ms=TTL_MS, timeout_s=5)
    try:
        locks.raise_floor(key, now_us() + FUTURE_US)
        first = call(locks, store, key)
        holder = hold_without_renewal(locks, key)
        assert holder.tokens[key] > first.tokens[key]
        private_redis.restart()
        after = call(locks, store, key)  # regressed: re-seeded, then applied
        assert after.value == "applied" and after.reseeded
        assert after.tokens[key] > first.tokens[key]
        refused = late_write_refused(store, holder, key)
        assert refused is not None, (
            f"the pre-loss holder's token {holder.tokens[key]} was accepted after the "
            f"newer grant's {after.tokens[key]}")
        holder.release()
        assert call(locks, store, key).tokens[key] > after.tokens[key]
    finally:
        locks.close()


# --- etcd -----------------------------------------------------------------------------------


@pytest.fixture
def etcd_member() -> Iterator[Any]:
    """A private one-member etcd whose data directory the test may wipe."""
    from etcd_server import EtcdCluster, require_etcd

    require_etcd()
    cluster = EtcdCluster(1).start()
    try:
        yield cluster.members[0]
    finally:
        cluster.stop()


def restart_etcd_empty(member: Any) -> None:
    """Stop, wipe the data dir, start a new cluster on the same ports (revisions restart at 1)."""
    member.stop()
    shutil.rmtree(member.data_dir, ignore_errors=True)
    member.launch(member._cluster[0], f"tg-fresh-{uuid.uuid4().hex[:8]}")
    member.wait_healthy()


@pytest.mark.timeout(60)
def test_etcd_restarted_empty_between_calls(etcd_member: Any, store: GuardedStore) -> None:
    key = f"acct:{uuid.uuid4().hex[:8]}"
    locks = connect(etcd_member.url, ttl_ms=TTL_MS, timeout_s=5)
    try:
        for _ in range(20):  # revisions move with every grant, on every key
            call(locks, store, key)
        mark = store.high_water(key)
        restart_etcd_empty(etcd_member)  # revisions start again at 1
        after = call(locks, store, key)
        # The new cluster's epoch keeps its tokens above the old cluster's: no re-seed needed.
        assert after.value == "applied" and after.tokens[key] > mark
        assert call(locks, store, key).tokens[key] > after.tokens[key]
    finally:
        locks.close()


@pytest.mark.timeout(60)
def test_etcd_with_raised_floors_restarted_empty(etcd_member: Any, store: GuardedStore) -> None:
    """Floors raised above the clock go with the data: the store's marks re-seed them."""
    key = f"acct:{uuid.uuid4().hex[:8]}"
    locks = connect(etcd_member.url, ttl_ms=TTL_MS, timeout_s=5)
    try:
        locks.raise_floor(key, now_us() + FUTURE_US)
        call(locks, store, key)
        mark = store.high_water(key)
        restart_etcd_empty(etcd_member)
        after = call(locks, store, key)
        assert after.value == "applied" and after.reseeded and after.tokens[key] > mark
        assert call(locks, store, key).tokens[key] > after.tokens[key]
    finally:
        locks.close()


@pytest.mark.timeout(60)
def test_etcd_restarted_empty_under_a_holder(etcd_member: Any, store: GuardedStore) -> None:
    key = f"acct:{uuid.uuid4().hex[:8]}"
    locks = connect(etcd_member.url, ttl_ms=TTL_MS, timeout_s=5)
    try:
        call(locks, store, key)
        mark = store.high_water(key)
        for i in range(20):  # other keys' grants move the global revision
            with locks.acquire([f"{key}:other{i}"]):
                pass
        holder = hold_without_renewal(locks, key)
        assert holder.tokens[key] > mark + 1
        restart_etcd_empty(etcd_member)
        after = call(locks, store, key)
        assert after.value == "applied" and after.tokens[key] > holder.tokens[key] > mark
        refused = late_write_refused(store, holder, key)
        assert refused is not None, (
            f"the pre-loss holder's token {holder.tokens[key]} was accepted after the "
            f"newer grant's {after.tokens[key]}")
        holder.release()
        assert call(locks, store, key).tokens[key] > after.tokens[key]
    finally:
        locks.close()


# --- SQLite ---------------------------------------------------------------------------------


def remove_sqlite(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        with_suffix = Path(f"{path}{suffix}")
        if with_suffix.exists():
            os.unlink(with_suffix)


@pytest.mark.timeout(30)
def test_sqlite_lock_file_deleted_while_held(tmp_path: Path, store: GuardedStore) -> None:
    """Two lock managers on one file (as two processes): the file is deleted while one holds.

    The holder's open connection would keep the deleted file alive: it must not go on
    granting (or renewing) from it while the other manager grants from the new file.
    """
    path = tmp_path / "locks.db"
    key = "acct:a"
    first = connect(f"sqlite:///{path}", ttl_ms=TTL_MS, timeout_s=5)
    second = connect(f"sqlite:///{path}", ttl_ms=TTL_MS, timeout_s=5)
    try:
        call(first, store, key)
        call(second, store, key)
        holder = first.acquire([key])
        renewed_from = holder.deadline
        deadline = time.monotonic() + 5
        while holder.deadline == renewed_from and time.monotonic() < deadline:
            time.sleep(0.02)  # one renewal first: the renewer has a connection to the old file
        assert holder.deadline != renewed_from, "the holder was never renewed"
        remove_sqlite(path)
        newer = second.acquire([key], timeout_s=5)  # the lock state is gone: granted anew
        assert newer.tokens[key] > holder.tokens[key]
        deadline = time.monotonic() + 5
        while not holder.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert holder.lost, "the holder kept renewing a lock of a deleted file"
        holder.release()
        with pytest.raises(LockTimeout):  # and ``first`` grants no second holder
            first.acquire([key], timeout_s=0.3)
        newer.release()
        assert call(first, store, key).value == "applied"
        assert call(second, store, key).tokens[key] == store.high_water(key)
    finally:
        first.close()
        second.close()


@pytest.mark.timeout(30)
def test_sqlite_lock_file_deleted_between_calls(tmp_path: Path, store: GuardedStore) -> None:
    path = tmp_path / "locks.db"
    key = "acct:a"
    locks = connect(f"sqlite:///{path}", ttl_ms=TTL_MS, timeout_s=5)
    try:
        locks.raise_floor(key, now_us() + FUTURE_US)  # the floor rows go with the file
        first = call(locks, store, key)
        remove_sqlite(path)
        assert not path.exists()
        after = call(locks, store, key)
        assert after.value == "applied" and after.tokens[key] > first.tokens[key]
        assert path.exists(), "the lock manager kept using a deleted file"
    finally:
        locks.close()


# --- PostgreSQL lock backend ----------------------------------------------------------------


def recreate_database(server: Any, name: str) -> None:
    """Drop the lock database (ending its sessions) and create it again, empty."""
    import psycopg

    with psycopg.connect(server.url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')


def fresh_cluster(server: Any) -> None:
    """A new cluster on the same port: stop, wipe the data directory, initdb, start."""
    server.stop()
    shutil.rmtree(server.data, ignore_errors=True)
    server.init()
    server.start()


@pytest.fixture
def pg_locks_server() -> Iterator[tuple[PgServer, str]]:
    """A private PostgreSQL and the URL of a database of its own for the lock tables."""
    problem = pg_available()
    if problem is not None:  # skip locally, fail on CI
        if ON_CI:
            pytest.fail(f"{problem}; CI must provide it", pytrace=False)
        pytest.skip(problem)
    server = PgServer().start()
    try:
        recreate_database(server, "locks")
        yield server, server.url.rsplit("/", 1)[0] + "/locks"
    finally:
        server.cleanup()


@pytest.mark.timeout(60)
def test_postgres_lock_database_recreated_under_a_holder(pg_locks_server: tuple[PgServer, str],
                                                         store: GuardedStore) -> None:
    server, url = pg_locks_server
    key = f"acct:{uuid.uuid4().hex[:8]}"
    locks = connect(url, ttl_ms=TTL_MS, timeout_s=5)
    try:
        locks.raise_floor(key, now_us() + FUTURE_US)  # floors above the database clock
        first = call(locks, store, key)
        holder = hold_without_renewal(locks, key)
        recreate_database(server, "locks")  # the lock schema is gone with it
        after = call(locks, store, key)  # re-installed, regressed, re-seeded, applied
        assert after.value == "applied" and after.reseeded
        assert after.tokens[key] > first.tokens[key]
        assert late_write_refused(store, holder, key) is not None
        holder.release()
        assert call(locks, store, key).tokens[key] > after.tokens[key]
    finally:
        locks.close()


@pytest.mark.timeout(60)
def test_postgres_lock_server_replaced_by_a_fresh_cluster(pg_locks_server: tuple[PgServer, str],
                                                          store: GuardedStore) -> None:
    """A new cluster on the same port has no ``locks`` database at all: a clear error, never a
    refusal; once the database is there again, the next call applies above the store's mark."""
    server, url = pg_locks_server
    key = f"acct:{uuid.uuid4().hex[:8]}"
    locks = connect(url, ttl_ms=TTL_MS, timeout_s=2)
    try:
        first = call(locks, store, key)
        fresh_cluster(server)
        with pytest.raises(ToolGuardError) as caught:
            call(locks, store, key)
        # the lock server is not there as configured: unavailable, not a stale write
        assert isinstance(caught.value, BackendUnavailable), caught.value
        assert 'database "locks" does not exist' in str(caught.value)
        assert store.high_water(key) == first.tokens[key]
        recreate_database(server, "locks")
        after = call(locks, store, key)
        assert after.value == "applied" and after.tokens[key] > first.tokens[key]
    finally:
        locks.close()


# --- the store restarted empty --------------------------------------------------------------


def assert_schema_gone(error: BaseException) -> None:
    assert isinstance(error, StoreError), error
    assert error.reason == "schema_not_installed"
    assert "toolguard db init" in str(error)


@pytest.mark.timeout(30)
def test_sqlite_store_file_deleted_mid_run(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = open_store(f"sqlite:///{path}", install=True)
    locks = connect(f"sqlite:///{tmp_path}/locks.db", ttl_ms=TTL_MS, timeout_s=5)
    key = "acct:a"
    try:
        call(locks, store, key)
        remove_sqlite(path)
        with pytest.raises(ToolGuardError) as caught:
            call(locks, store, key)  # never applied to the deleted file
        assert_schema_gone(caught.value)
        store.install()  # the operator re-installs: an empty store, no audit row guessed
        assert store.query_audit() == []
        assert call(locks, store, key).value == "applied"  # the lock was released
        assert len(store.query_audit()) == 1
    finally:
        locks.close()
        store.close()


@pytest.mark.timeout(30)
def test_postgres_store_schema_dropped_mid_run(postgres_url: str, pg_schema: str,
                                               tmp_path: Path) -> None:
    from store.envs import drop_schema

    store = open_store(postgres_url, install=True, schema=pg_schema, timeout_s=3, max_size=2)
    locks = connect(f"sqlite:///{tmp_path}/locks.db", ttl_ms=TTL_MS, timeout_s=5)
    key = f"acct:{uuid.uuid4().hex[:8]}"
    try:
        call(locks, store, key)
        drop_schema(postgres_url, pg_schema)
        with pytest.raises(ToolGuardError) as caught:
            call(locks, store, key)
        assert_schema_gone(caught.value)
        with pytest.raises(ToolGuardError) as again:  # stays failed closed: not re-created
            call(locks, store, key)
        assert_schema_gone(again.value)
        store.install()
        assert store.query_audit() == []
        assert call(locks, store, key).value == "applied"
    finally:
        locks.close()
        store.close()


# --- two processes, one sees the empty server first -----------------------------------------


def _hold_then_write(lock_url: str, store_url: str, key: str, held: Any, go: Any,
                     outcome: Any) -> None:
    """In a process of its own: hold ``key`` (renewal not run yet), wait for ``go``, write."""
    store = open_store(store_url)
    locks = connect(lock_url, ttl_ms=TTL_MS, timeout_s=5)
    try:
        lease = hold_without_renewal(locks, key)
        held.put(lease.tokens[key])
        go.wait(20)
        try:
            with store.fenced(lease):
                pass
            outcome.put("accepted")
        except (StaleFencingToken, LockLost) as refused:
            outcome.put(type(refused).__name__)
        lease.release()
    finally:
        locks.close()
        store.close()


@pytest.mark.timeout(60)
def test_two_processes_one_sees_the_empty_server_first(private_redis: RedisServer,
                                                       tmp_path: Path) -> None:
    """A process holds the key when Redis restarts empty; another process meets the empty
    server first (regressed: re-seeded from the store). The holder's write comes last: it must
    not be accepted, and no accepted token is ever below one accepted before it."""
    store_url = f"sqlite:///{tmp_path}/store.db"
    store = open_store(store_url, install=True)
    key = f"acct:{uuid.uuid4().hex[:8]}"
    locks = connect(private_redis.url, ttl_ms=TTL_MS, timeout_s=5)
    spawn = multiprocessing.get_context("spawn")
    held, outcome, go = spawn.Queue(), spawn.Queue(), spawn.Event()
    process = spawn.Process(target=_hold_then_write, daemon=True,
                            args=(private_redis.url, store_url, key, held, go, outcome))
    try:
        locks.raise_floor(key, now_us() + FUTURE_US)
        call(locks, store, key)
        process.start()
        holder_token = held.get(timeout=20)
        private_redis.restart()
        after = call(locks, store, key)  # this process sees the empty server first
        assert after.value == "applied" and after.reseeded
        go.set()
        assert outcome.get(timeout=20) != "accepted", (
            f"the other process's pre-loss token {holder_token} was accepted after "
            f"{after.tokens[key]}")
        accepted = [e.tokens[key] for e in store.query_audit(newest_first=False)
                    if e.decision == "accepted"]
        assert accepted == sorted(set(accepted)) and accepted[-1] == after.tokens[key]
    finally:
        go.set()
        process.join(20)
        if process.is_alive():
            process.kill()
        locks.close()
        store.close()
