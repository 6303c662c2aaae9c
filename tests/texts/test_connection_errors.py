"""A typo in a backend URL is a configuration error, raised at once; an outage stays an outage.

Issue 23, point 5: ``open_store("postgresql://…/nosuchdb")`` took 10.5 s, logged
8 pool lines and raised ``BackendUnavailable`` ("temporarily down"), so a retry
loop retried a typo forever. Definitive answers (a database or role that does
not exist, a wrong password, a host name DNS does not know, a Redis database
index past ``databases``, a Redis user or password it refuses) now raise
``ConfigurationError`` on the first contact, with at most one log line; a
closed port stays ``BackendUnavailable``. Real servers throughout: the shared
PostgreSQL and Redis, a private PostgreSQL with password auth, etcd.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pg_server import PgServer, pg_available

from toolguard.controls.quotas.redis import AsyncRedisQuotas, RedisQuotas
from toolguard.errors import BackendUnavailable, ConfigurationError
from toolguard.locks import connect, connect_async
from toolguard.store import open_async_store, open_store

NO_HOST = "nosuchhost.invalid"
PASSWORD = "s3cret-" + uuid.uuid4().hex[:8]


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pg_base(postgres_url: str) -> str:
    """``postgresql://user@host:port`` of the shared server (its URL without the database)."""
    return postgres_url.rsplit("/", 1)[0]


@pytest.fixture(scope="module")
def password_postgres() -> Iterator[PgServer]:
    """A private PostgreSQL that asks every client for a password (scram-sha-256)."""
    problem = pg_available()
    if problem is not None:
        pytest.skip(problem)
    server = PgServer(password=PASSWORD).start()
    try:
        yield server
    finally:
        server.cleanup()


# Each helper closes what it opened: a pool left to the garbage collector is torn down
# in whichever later test's event loop the collection happens to run (a blocking join).


#: How long a user here waits for a server: a refusal is immediate, an outage takes this long.
SHORT_S = 3


def _acquire(url: str) -> None:
    with connect(url, timeout_s=SHORT_S) as locks, locks.acquire(["texts:k"], ttl_ms=5_000):
        pass


def _aacquire(url: str) -> None:
    async def main() -> None:
        locks = connect_async(url, timeout_s=SHORT_S)
        try:
            async with locks.acquire(["texts:k"], ttl_ms=5_000):
                pass
        finally:
            await locks.aclose()

    asyncio.run(main())


def _store(url: str) -> None:
    with open_store(url, timeout_s=SHORT_S) as store:
        store.schema_version()


def _astore(url: str) -> None:
    async def main() -> None:
        store = open_async_store(url, timeout_s=SHORT_S)
        try:
            await store.schema_version()
        finally:
            await store.aclose()

    asyncio.run(main())


def _quotas(url: str) -> None:
    RedisQuotas(url).usage("texts/probe")


def _aquotas(url: str) -> None:
    async def main() -> None:
        await AsyncRedisQuotas(url).usage("texts/probe")

    asyncio.run(main())


POSTGRES_USERS: dict[str, Callable[[str], None]] = {
    "store": _store, "async store": _astore, "locks": _acquire, "async locks": _aacquire}
REDIS_USERS: dict[str, Callable[[str], None]] = {
    "locks": _acquire, "async locks": _aacquire, "quotas": _quotas, "async quotas": _aquotas}


def refused(use: Callable[[str], None], url: str, caplog: pytest.LogCaptureFixture
            ) -> ConfigurationError:
    """``use(url)`` raises ``ConfigurationError`` (never ``BackendUnavailable``), logging <= 1 line."""
    caplog.clear()
    with caplog.at_level(logging.INFO), pytest.raises(ConfigurationError) as caught:
        use(url)
    assert not isinstance(caught.value, BackendUnavailable)
    assert "not an outage" in caught.value.message
    # another test's store sealing in its own thread is not this call's output
    lines = [r for r in caplog.records if r.name.startswith(("psycopg", "toolguard", "redis"))
             and not r.threadName.startswith("toolguard-autoseal")]
    assert len(lines) <= 1, [r.getMessage() for r in lines]
    return caught.value


# --- PostgreSQL: store (sync and asyncio) and locks -------------------------------------------


@pytest.mark.parametrize("user", POSTGRES_USERS, ids=list(POSTGRES_USERS))
def test_a_database_that_does_not_exist(postgres_url: str, user: str,
                                        caplog: pytest.LogCaptureFixture) -> None:
    url = f"{pg_base(postgres_url)}/nosuchdb_{uuid.uuid4().hex[:8]}"
    error = refused(POSTGRES_USERS[user], url, caplog)
    assert "does not exist" in error.message


@pytest.mark.parametrize("user", POSTGRES_USERS, ids=list(POSTGRES_USERS))
def test_a_host_name_that_does_not_resolve_postgres(user: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    refused(POSTGRES_USERS[user], f"postgresql://postgres@{NO_HOST}:5432/test", caplog)


@pytest.mark.parametrize("user", POSTGRES_USERS, ids=list(POSTGRES_USERS))
def test_a_wrong_password_or_an_unknown_role(password_postgres: PgServer, user: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    base = f"127.0.0.1:{password_postgres.port}/postgres"
    wrong = refused(POSTGRES_USERS[user], f"postgresql://postgres:wrong@{base}", caplog)
    assert "password authentication failed" in wrong.message
    assert "wrong@" not in wrong.message  # the password stays out of the message
    nobody = refused(POSTGRES_USERS[user], f"postgresql://nobody_{user[:1]}:x@{base}", caplog)
    assert "authentication failed" in nobody.message or "does not exist" in nobody.message
    missing = refused(POSTGRES_USERS[user], f"postgresql://postgres@{base}", caplog)
    assert "no password supplied" in missing.message
    POSTGRES_USERS[user](password_postgres.url)  # the right password: it works


@pytest.mark.parametrize("user", ["store", "async store", "locks"])
def test_a_server_that_is_down_is_still_an_outage(user: str) -> None:
    """A closed port may open again: ``BackendUnavailable``, as before (store and locks)."""
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/test"
    with pytest.raises(BackendUnavailable):
        POSTGRES_USERS[user](url)


# --- Redis: locks and quotas, sync and asyncio ------------------------------------------------


@pytest.mark.parametrize("user", REDIS_USERS, ids=list(REDIS_USERS))
def test_redis_database_index_out_of_range(redis_url: str, user: str,
                                           caplog: pytest.LogCaptureFixture) -> None:
    base = redis_url.rsplit("/", 1)[0]
    error = refused(REDIS_USERS[user], f"{base}/9999", caplog)
    assert "DB index is out of range" in error.message


@pytest.mark.parametrize("user", REDIS_USERS, ids=list(REDIS_USERS))
def test_redis_credentials_it_refuses(redis_url: str, user: str,
                                      caplog: pytest.LogCaptureFixture) -> None:
    host = redis_url.split("://", 1)[1].split("/", 1)[0].split("@")[-1]
    url = f"redis://nobody-{uuid.uuid4().hex[:6]}:wrong@{host}/0"
    error = refused(REDIS_USERS[user], url, caplog)
    assert "wrong" not in error.message.split("(")[0]


@pytest.mark.parametrize("user", REDIS_USERS, ids=list(REDIS_USERS))
def test_a_host_name_that_does_not_resolve_redis(user: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    refused(REDIS_USERS[user], f"redis://{NO_HOST}:6379/0", caplog)


def test_a_redis_that_is_down_is_still_an_outage() -> None:
    with pytest.raises(BackendUnavailable):
        _acquire(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(BackendUnavailable):
        _quotas(f"redis://127.0.0.1:{free_port()}/0")


# --- etcd -------------------------------------------------------------------------------------


@pytest.mark.parametrize("use", [_acquire, _aacquire], ids=["sync", "async"])
def test_a_host_name_that_does_not_resolve_etcd(use: Any,
                                                caplog: pytest.LogCaptureFixture) -> None:
    refused(use, f"etcd://{NO_HOST}:2379", caplog)


def test_an_etcd_that_is_down_is_still_an_outage() -> None:
    with pytest.raises(BackendUnavailable):
        _acquire(f"etcd://127.0.0.1:{free_port()}")
