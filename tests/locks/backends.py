"""The lock backends the contract suite runs against, one registry entry each.

Every test in ``tests/locks/test_contract*.py`` takes the ``backend`` fixture
(``tests/locks/conftest.py``), which is parametrized over ``BACKENDS``: a new
backend passes the same suite by adding one entry, nothing else.

How to add a backend (e.g. "postgres" or "etcd")
-------------------------------------------------
1. Write three small functions:

   * ``make_url(server, tmp_path) -> str``: the URL ``toolguard.locks.connect``
     understands, from the value of the server fixture (or ``None``) and the
     test's private ``tmp_path``.
   * ``drop(url, key)``: delete the lock record of ``key`` behind the holder's
     back, directly in the server (as an operator or a data loss would).
   * ``steal(url, key)``: make ``key`` belong to some other owner, directly in
     the server, keeping it "held" (as a split brain would).

2. Add ``BACKENDS["name"] = BackendFactory(name=..., server_fixture=...,
   make_url=..., drop=..., steal=...)``. ``server_fixture`` names a session
   fixture from ``tests/conftest.py`` (``redis_url``, ``postgres_url``, an etcd
   one...) that skips locally and fails on CI when the server is absent; use
   ``None`` for an embedded backend.

3. For the outage tests (``test_contract_outages.py``), ``outage(tmp_path)``: a
   context manager giving a private server of that backend as an ``Outage``
   whose ``down()`` makes it stop answering and ``up()`` brings it back.

Keys are namespaced per test (``LockEnv.key``) with the ``unique`` fixture, so
tests sharing one server never see each other's locks.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolguard.locks import AsyncLockManager, LockManager, connect, connect_async, sqlite_path

__all__ = ["BACKENDS", "QUIET_OPTIONS", "QUIET_POLL_S", "BackendFactory", "LockEnv", "Outage"]


class Outage:
    """A private server the test can take away and bring back (subclassed per backend)."""

    #: The lock URL of the private server, and extra ``connect`` options for it.
    url: str = ""
    options: Mapping[str, Any] = {}

    def down(self) -> None:
        """From now on the server does not answer (refused connections, a locked file)."""
        raise NotImplementedError

    def up(self) -> None:
        """The server answers again (a Redis without persistence comes back empty)."""
        raise NotImplementedError

    def blip(self) -> None:
        """Down and straight back up: as short an outage as the server allows."""
        self.down()
        self.up()


@dataclass(frozen=True)
class BackendFactory:
    """How the contract suite builds managers for one backend and tampers with its state."""

    name: str
    #: Session fixture giving the server (None: embedded, always available).
    server_fixture: str | None
    #: ``(server fixture value, tmp_path) -> URL`` for ``connect`` / ``connect_async``.
    make_url: Callable[[Any, Path], str]
    #: ``(url, key)``: delete the lock record under the holder.
    drop: Callable[[str, str], None]
    #: ``(url, key)``: give the lock to another owner under the holder.
    steal: Callable[[str, str], None]
    #: Extra keyword arguments for ``connect`` (backend or manager options).
    options: Mapping[str, Any] = field(default_factory=dict)
    #: ``tmp_path -> context manager of an Outage`` on a private server of this backend.
    outage: Callable[[Path], AbstractContextManager[Outage]] | None = None
    #: ``url -> url`` whose client never blocks for less than ``QUIET_POLL_S`` (Redis caps
    #: a BLPOP at half the socket timeout); see ``LockEnv.quiet_manager``.
    quiet_url: Callable[[str], str] = lambda url: url


#: The shortest wait between two tries of a quiet manager's waiter (see ``quiet_manager``).
QUIET_POLL_S = 15.0
#: A presence window of 90 s: PostgreSQL and etcd wait up to a third of it between tries,
#: and a hand-off of a 60 s lease then runs 60 s, so the manager asks every 20 s at most.
QUIET_OPTIONS: Mapping[str, Any] = {"presence_ms": 90_000, "ttl_ms": 60_000}


class LockEnv:
    """One test's view of a backend: namespaced keys, managers closed at teardown."""

    def __init__(self, factory: BackendFactory, url: str, namespace: str) -> None:
        self.factory = factory
        self.name = factory.name
        self.url = url
        self.namespace = namespace
        self._managers: list[LockManager] = []

    def key(self, name: str) -> str:
        """A key private to this test."""
        return f"t{self.namespace}:{name}"

    def manager(self, **options: Any) -> LockManager:
        """A sync manager on the backend (closed when the test ends)."""
        manager = connect(self.url, **{**self.factory.options, **options})
        self._managers.append(manager)
        return manager

    def async_manager(self, **options: Any) -> AsyncLockManager:
        """An asyncio manager; build it inside the running loop and ``aclose`` it there."""
        return connect_async(self.url, **{**self.factory.options, **options})

    def quiet_manager(self, **options: Any) -> LockManager:
        """A sync manager whose fallback polls are all at least ``QUIET_POLL_S`` apart
        (with ``MAX_POLL_S`` raised and TTLs of a minute): only a wake-up hands over sooner."""
        manager = connect(self.factory.quiet_url(self.url),
                          **{**self.factory.options, **QUIET_OPTIONS, **options})
        self._managers.append(manager)
        return manager

    def quiet_async_manager(self, **options: Any) -> AsyncLockManager:
        """The asyncio twin of ``quiet_manager``."""
        return connect_async(self.factory.quiet_url(self.url),
                             **{**self.factory.options, **QUIET_OPTIONS, **options})

    def drop(self, key: str) -> None:
        self.factory.drop(self.url, key)

    def steal(self, key: str) -> None:
        self.factory.steal(self.url, key)

    def close(self) -> None:
        for manager in self._managers:
            manager.close()
        self._managers.clear()


# --- redis ----------------------------------------------------------------------------------


def _redis_drop(url: str, key: str) -> None:
    import redis

    from toolguard.locks.redis import redis_keys

    with redis.Redis.from_url(url) as client:
        client.delete(redis_keys(key)[0][0])


def _redis_steal(url: str, key: str) -> None:
    import redis

    from toolguard.locks.redis import redis_keys

    with redis.Redis.from_url(url) as client:
        client.set(redis_keys(key)[0][0], "intruder:60000", px=60_000)


def _redis_ha_client(url: str) -> Any:
    """A client of the node(s) behind a Cluster or Sentinel URL (not through the backend)."""
    from toolguard.locks.redis_ha import cluster_client, parse_redis_ha_url, sentinel_client

    parsed = parse_redis_ha_url(url)
    return cluster_client(parsed) if parsed.service is None else sentinel_client(parsed)


def _redis_ha_drop(url: str, key: str) -> None:
    from toolguard.locks.redis import redis_keys

    client = _redis_ha_client(url)
    try:
        client.delete(redis_keys(key)[0][0])
    finally:
        client.close()


def _redis_ha_steal(url: str, key: str) -> None:
    from toolguard.locks.redis import redis_keys

    client = _redis_ha_client(url)
    try:
        client.set(redis_keys(key)[0][0], "intruder:60000", px=60_000)
    finally:
        client.close()


class _RedisOutage(Outage):
    def __init__(self, server: Any) -> None:
        self.server = server
        self.url = server.url

    def down(self) -> None:
        self.server.kill()

    def up(self) -> None:
        self.server.start()


@contextlib.contextmanager
def _redis_outage(_tmp: Path) -> Iterator[Outage]:
    from servers import REDIS_SERVER, RedisServer

    _require_binary("redis-server", REDIS_SERVER)
    with RedisServer() as server:
        yield _RedisOutage(server)


def _require_binary(name: str, path: str) -> None:
    import os

    import pytest
    from servers import ON_CI

    if not os.access(path, os.X_OK):
        message = f"{name} binary not found at {path}"
        if ON_CI:
            pytest.fail(f"{message}; CI must provide it", pytrace=False)
        pytest.skip(message)


# --- sqlite ---------------------------------------------------------------------------------


def _sqlite_exec(url: str, sql: str, *params: Any) -> None:
    db = sqlite3.connect(sqlite_path(url), timeout=30, isolation_level=None)
    try:
        db.execute(sql, params)
    finally:
        db.close()


def _sqlite_drop(url: str, key: str) -> None:
    _sqlite_exec(url, "DELETE FROM tg_lock WHERE key = ?", key)


def _sqlite_steal(url: str, key: str) -> None:
    _sqlite_exec(url, "UPDATE tg_lock SET owner = 'intruder:60000' WHERE key = ?", key)


class _SqliteOutage(Outage):
    """The file stays locked (``BEGIN EXCLUSIVE``) by another connection while "down"."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.url = f"sqlite:///{path}"
        self.options = {"busy_timeout_ms": 100}  # a locked file fails a call in 100 ms
        self._release: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def down(self) -> None:
        locked, self._release = threading.Event(), threading.Event()

        def hold(release: threading.Event = self._release) -> None:
            db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            try:
                db.execute("BEGIN EXCLUSIVE")
                locked.set()
                release.wait(60)
                db.execute("ROLLBACK")
            finally:
                db.close()

        self._thread = threading.Thread(target=hold, daemon=True)
        self._thread.start()
        assert locked.wait(30), "could not lock the SQLite file"

    def up(self) -> None:
        if self._release is not None and self._thread is not None:
            self._release.set()
            self._thread.join(30)

    def blip(self) -> None:
        """Locked for half a second: five times the busy timeout."""
        self.down()
        time.sleep(0.5)
        self.up()


@contextlib.contextmanager
def _sqlite_outage(tmp: Path) -> Iterator[Outage]:
    outage = _SqliteOutage(tmp / "outage-locks.db")
    try:
        yield outage
    finally:
        outage.up()


# --- postgres -------------------------------------------------------------------------------


def _postgres_exec(url: str, sql: str, *params: Any) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql, params)


def _postgres_drop(url: str, key: str) -> None:
    _postgres_exec(url, "DELETE FROM toolguard_lock_holder WHERE key = %s", key)


def _postgres_steal(url: str, key: str) -> None:
    _postgres_exec(url, "UPDATE toolguard_lock_holder SET owner = 'intruder:60000', "
                        "expires_at = clock_timestamp() + interval '60 seconds' WHERE key = %s", key)


class _PostgresOutage(Outage):
    def __init__(self, server: Any) -> None:
        self.server = server
        self.url = server.url

    def down(self) -> None:
        self.server.stop("fast")  # every connection is terminated at once

    def up(self) -> None:
        self.server.start()


@contextlib.contextmanager
def _postgres_outage(_tmp: Path) -> Iterator[Outage]:
    import pytest
    from pg_server import PgServer, pg_available
    from servers import ON_CI

    problem = pg_available()
    if problem is not None:
        if ON_CI:
            pytest.fail(f"{problem}; CI must provide it", pytrace=False)
        pytest.skip(problem)
    with PgServer() as server:
        yield _PostgresOutage(server)


# --- etcd -----------------------------------------------------------------------------------


def _etcd_url(_server: Any, _tmp: Path) -> str:
    # The session's private etcd; started here because tests/conftest.py has no etcd fixture.
    from etcd_server import shared_etcd_url

    return shared_etcd_url()


def _etcd_client(url: str) -> Any:
    from etcd3gw.client import Etcd3Client

    from toolguard.locks.etcd import parse_etcd_url

    host, port = parse_etcd_url(url)[0][0]
    return Etcd3Client(host=host, port=port, timeout=5)


def _etcd_drop(url: str, key: str) -> None:
    from toolguard.locks.etcd import etcd_keys

    client, queue = _etcd_client(url), etcd_keys(key)[0]
    holder = client.get_prefix(queue, sort_order="ascend", sort_target="create")[:1]
    for _, meta in holder:
        client.delete(meta["key"])


def _etcd_steal(url: str, key: str) -> None:
    from toolguard.locks.etcd import etcd_keys

    client, queue = _etcd_client(url), etcd_keys(key)[0]
    client.delete_prefix(queue)  # the intruder's entry must be first in line
    client.put(queue + b"intruder%3A60000", "", lease=client.lease(60))


class _EtcdOutage(Outage):
    def __init__(self, cluster: Any) -> None:
        self.member = cluster.members[0]
        self.url = cluster.url

    def down(self) -> None:
        self.member.kill()

    def up(self) -> None:
        self.member.launch(*self.member._cluster)  # same ports, same data
        self.member.wait_healthy()


@contextlib.contextmanager
def _etcd_outage(_tmp: Path) -> Iterator[Outage]:
    from etcd_server import EtcdCluster, require_etcd

    require_etcd()
    with EtcdCluster(1) as cluster:
        yield _EtcdOutage(cluster)


BACKENDS: dict[str, BackendFactory] = {
    "redis": BackendFactory(
        name="redis",
        server_fixture="redis_url",
        make_url=lambda server, _tmp: str(server),
        drop=_redis_drop,
        steal=_redis_steal,
        outage=_redis_outage,
        quiet_url=lambda url: url + ("&" if "?" in url else "?") + "socket_timeout=60",
    ),
    "redis-cluster": BackendFactory(
        name="redis-cluster",
        server_fixture="redis_cluster_url",  # a private cluster: tests/redis_ha.py
        make_url=lambda server, _tmp: str(server),
        drop=_redis_ha_drop,
        steal=_redis_ha_steal,
    ),
    "redis-sentinel": BackendFactory(
        name="redis-sentinel",
        server_fixture="redis_sentinel_url",  # a private Sentinel group: tests/redis_ha.py
        make_url=lambda server, _tmp: str(server),
        drop=_redis_ha_drop,
        steal=_redis_ha_steal,
    ),
    "sqlite": BackendFactory(
        name="sqlite",
        server_fixture=None,
        make_url=lambda _server, tmp: f"sqlite:///{tmp / 'locks.db'}",
        drop=_sqlite_drop,
        steal=_sqlite_steal,
        outage=_sqlite_outage,
    ),
    "postgres": BackendFactory(
        name="postgres",
        server_fixture="postgres_url",
        make_url=lambda server, _tmp: str(server),
        drop=_postgres_drop,
        steal=_postgres_steal,
        outage=_postgres_outage,
    ),
    "etcd": BackendFactory(
        name="etcd",
        server_fixture=None,  # a private server: see _etcd_url
        make_url=_etcd_url,
        drop=_etcd_drop,
        steal=_etcd_steal,
        outage=_etcd_outage,
    ),
}
