"""What a Redis server answers while a deployment fails over, demotes, restarts or moves a
slot, and what the lock backend makes of it: ``BackendUnavailable`` (which the lock manager
retries until the caller's deadline), never a raw redis-py exception.

Each answer is provoked on a private ``redis-server`` as a failover would: ``UNBLOCKED`` by
``REPLICAOF`` under a blocked ``BLPOP`` (and by ``CLIENT UNBLOCK ... ERROR``), ``READONLY``
on a replica, ``MASTERDOWN`` on a replica cut from its primary, ``NOREPLICAS`` on a primary
short of replicas, ``LOADING`` during a restart that reads its data back, ``CLUSTERDOWN`` on
a cluster node that serves no slot, a connection reset by ``CLIENT KILL``. The Cluster's
redirections and the scenarios of whole failovers are in ``tests/fault/cluster``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aredis
from redis._parsers.base import BaseParser
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis_ha import RedisNode, require_redis_server
from servers import free_port

from toolguard.errors import BackendUnavailable, ConfigurationError
from toolguard.locks import LockManager
from toolguard.locks.redis import AsyncRedisBackend, RedisBackend, typed_error, version_options

MODES = ["sync", "asyncio"]
HOLDER = "holder0000000000:60000"
WAITER = "waiter0000000000:60000"


@pytest.fixture
def root() -> Iterator[Path]:
    require_redis_server()
    with tempfile.TemporaryDirectory(prefix="toolguard-answers-") as path:
        yield Path(path)


@contextlib.contextmanager
def node(root: Path, name: str, *args: str) -> Iterator[RedisNode]:
    server = RedisNode(name, root, args=args).start()
    try:
        yield server
    finally:
        server.stop()


def step(mode: str, url: str, name: str, *args: Any, **client: Any) -> Any:
    """Run one backend step (``try_acquire``, ``wait``, ...) on a fresh backend of ``mode``
    (on a client with options ``client``, if given)."""
    if mode == "sync":
        backend = RedisBackend(redis.Redis.from_url(url, **version_options(), **client)
                               if client else url)
        try:
            return getattr(backend, name)(*args)
        finally:
            backend.close()

    async def run() -> Any:
        abackend = AsyncRedisBackend(aredis.Redis.from_url(url, **version_options(), **client)
                                     if client else url)
        try:
            return await getattr(abackend, name)(*args)
        finally:
            await abackend.aclose()

    return asyncio.run(run())


def answer(error: BaseException) -> str:
    """The Redis error code behind a ``BackendUnavailable``."""
    cause = error.__cause__
    assert isinstance(cause, redis.RedisError), f"not from a redis error: {error!r}"
    return getattr(cause, "status_code", None) or str(cause).split(" ", 1)[0]


def refused(mode: str, url: str, name: str, *args: Any, **client: Any) -> str:
    """Run a step that must fail as ``BackendUnavailable``; return the answer's code."""
    with pytest.raises(BackendUnavailable) as caught:
        step(mode, url, name, *args, **client)
    return answer(caught.value)


def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s}s"
        time.sleep(0.01)


def blocked_ids(server: RedisNode, timeout_s: float = 10.0) -> list[int]:
    """The ids of the clients blocked in BLPOP, once there is one."""
    deadline = time.monotonic() + timeout_s
    while True:
        with server.client() as client:
            ids = [int(c["id"]) for c in client.client_list() if c["cmd"] == "blpop"
                   and "b" in c["flags"]]
        if ids:
            return ids
        assert time.monotonic() < deadline, f"nobody blocked in BLPOP within {timeout_s}s"
        time.sleep(0.01)


def blocked_wait(mode: str, server: RedisNode, act: Callable[[list[int]], None]) -> BaseException:
    """Block a waiter in the backend's ``wait`` (BLPOP), ``act`` on it, return what it raised."""
    url = f"redis://127.0.0.1:{server.port}/0?socket_timeout=60"  # one BLPOP: up to 30 s
    outcome: list[BaseException | None] = []

    def waiter() -> None:
        try:
            step(mode, url, "wait", "k", WAITER, 30.0)
            outcome.append(None)
        except BaseException as error:  # what the test checks
            outcome.append(error)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    act(blocked_ids(server))
    thread.join(timeout=20)
    assert outcome, "the waiter did not return"
    assert outcome[0] is not None, "the waiter returned without an error"
    return outcome[0]


@pytest.mark.parametrize("mode", MODES)
def test_a_waiter_unblocked_by_a_demotion_gets_backend_unavailable(mode: str, root: Path) -> None:
    """``-UNBLOCKED force unblock ... (master -> replica?)``: what a primary demoted by a
    failover answers a blocked BLPOP; the server closes that connection after it."""
    with node(root, "old") as old, node(root, "new") as new:
        def demote(_ids: list[int]) -> None:
            with old.client() as client:
                client.execute_command("REPLICAOF", "127.0.0.1", new.port)

        error = blocked_wait(mode, old, demote)
        assert isinstance(error, BackendUnavailable), repr(error)
        assert answer(error) == "UNBLOCKED" and "master -> replica" in str(error)


@pytest.mark.parametrize("mode", MODES)
def test_a_waiter_unblocked_with_an_error_gets_backend_unavailable(mode: str, root: Path) -> None:
    with node(root, "one") as server:
        def unblock(ids: list[int]) -> None:
            with server.client() as client:
                client.execute_command("CLIENT", "UNBLOCK", ids[0], "ERROR")

        error = blocked_wait(mode, server, unblock)
        assert isinstance(error, BackendUnavailable), repr(error)
        assert answer(error) == "UNBLOCKED"


@pytest.mark.parametrize("mode", MODES)
def test_a_waiter_whose_connection_is_reset_gets_backend_unavailable(mode: str,
                                                                     root: Path) -> None:
    with node(root, "one") as server:
        def kill(ids: list[int]) -> None:
            with server.client() as client:
                client.client_kill_filter(_id=ids[0])

        error = blocked_wait(mode, server, kill)
        assert isinstance(error, BackendUnavailable), repr(error)


def acquire_refused(url: str) -> BackendUnavailable:
    """The lock manager's acquire on that server, with a short deadline: it retries the
    answer until then, and ends in ``BackendUnavailable``."""
    locks = LockManager(RedisBackend(url), ttl_ms=2_000, timeout_s=0.3)
    try:
        with pytest.raises(BackendUnavailable) as caught:
            locks.acquire("k")
        return caught.value
    finally:
        locks.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_demoted_primary_answers_readonly_as_backend_unavailable(mode: str, root: Path) -> None:
    with node(root, "old") as old, node(root, "new") as new:
        url = f"redis://127.0.0.1:{old.port}/0"
        step(mode, url, "try_acquire", "k", HOLDER, 60_000)
        with old.client() as client:
            client.execute_command("REPLICAOF", "127.0.0.1", new.port)
        until(lambda: old.info("replication").get("master_link_status") == "up",
              "the old primary following the new one")
        assert refused(mode, url, "try_acquire", "k", WAITER, 60_000) == "READONLY"
        assert refused(mode, url, "release", "k", HOLDER) == "READONLY"
        assert refused(mode, url, "raise_floor", "k", 10**17) == "READONLY"
        if mode == "sync":
            acquire_refused(url)


@pytest.mark.parametrize("mode", MODES)
def test_a_replica_cut_from_its_primary_answers_masterdown_as_backend_unavailable(
        mode: str, root: Path) -> None:
    """``replica-serve-stale-data no``: a replica whose primary went away refuses commands."""
    with node(root, "stale") as server:
        with server.client() as client:
            client.config_set("replica-serve-stale-data", "no")
            client.execute_command("REPLICAOF", "127.0.0.1", free_port())  # nobody there
        url = f"redis://127.0.0.1:{server.port}/0"
        assert refused(mode, url, "try_acquire", "k", WAITER, 60_000) == "MASTERDOWN"
        assert refused(mode, url, "release", "k", WAITER) == "MASTERDOWN"
        if mode == "sync":
            acquire_refused(url)


@pytest.mark.parametrize("mode", MODES)
def test_a_primary_short_of_replicas_answers_noreplicas_as_backend_unavailable(
        mode: str, root: Path) -> None:
    """``min-replicas-to-write``: a primary whose replicas dropped away refuses writes."""
    with node(root, "alone", "--min-replicas-to-write", "1") as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        assert refused(mode, url, "try_acquire", "k", WAITER, 60_000) == "NOREPLICAS"
        assert refused(mode, url, "wait", "k", WAITER, 0.1) == "NOREPLICAS"
        assert refused(mode, url, "release", "k", WAITER) == "NOREPLICAS"
        if mode == "sync":
            acquire_refused(url)


def raw_reply(port: int, command: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(command)
        return sock.recv(200)


@pytest.mark.parametrize("mode", MODES)
def test_a_restarted_server_reading_its_data_answers_loading_as_backend_unavailable(
        mode: str, root: Path) -> None:
    """A restart with persistence answers ``LOADING`` until its data is read back (slowed
    here, 5 ms per key of 2,000, so the test meets it for seconds). redis-py retries a ``LOADING``
    answer for seconds by default: the clients here do not, so the test stays in that window."""
    with node(root, "restarted", "--loading-process-events-interval-bytes", "1024") as server:
        with server.client() as client:
            client.mset({f"filler:{i}": "x" * 1100 for i in range(2000)})
            client.save()
        server.stop()
        server.args += ("--key-load-delay", "5000")
        server.start(loaded=False)
        try:
            until(lambda: raw_reply(server.port, b"GET k\r\n").startswith(b"-LOADING"),
                  "the server loading its data")
            url = f"redis://127.0.0.1:{server.port}/0"
            once = {"retry": Retry(NoBackoff(), 0) if mode == "sync"
                    else AsyncRetry(NoBackoff(), 0)}
            assert refused(mode, url, "try_acquire", "k", WAITER, 60_000, **once) == "LOADING"
            assert refused(mode, url, "wait", "k", WAITER, 0.1, **once) == "LOADING"
            assert refused(mode, url, "release", "k", WAITER, **once) == "LOADING"
        finally:
            server.kill()  # a server still loading would finish that first on SIGTERM


@pytest.mark.parametrize("mode", MODES)
def test_a_cluster_node_without_the_slot_answers_clusterdown_as_backend_unavailable(
        mode: str, root: Path) -> None:
    """A cluster node that serves no slot (a cluster still electing, or not yet formed)."""
    with node(root, "lonely", "--cluster-enabled", "yes", "--cluster-port", str(free_port()),
              "--cluster-config-file", str(root / "lonely-nodes.conf")) as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        assert refused(mode, url, "try_acquire", "k", WAITER, 60_000) == "CLUSTERDOWN"
        assert refused(mode, url, "wait", "k", WAITER, 0.1) == "CLUSTERDOWN"
        if mode == "sync":
            acquire_refused(url)


# --- the rule itself, on the errors redis-py's own parser makes of each answer --------------

IN_TRANSITION_ANSWERS = [
    "UNBLOCKED force unblock from blocking operation, instance state changed (master -> replica?)",
    "LOADING Redis is loading the dataset in memory",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "READONLY You can't write against a read only replica.",
    "NOREPLICAS Not enough good replicas to write.",
    "CLUSTERDOWN The cluster is down",
    "TRYAGAIN Multiple keys request during rehashing of slot",
    "MOVED 3999 127.0.0.1:6381",
    "ASK 3999 127.0.0.1:6381",
    "NOSCRIPT No matching script. Please use EVAL.",
]


@pytest.mark.parametrize("text", IN_TRANSITION_ANSWERS)
@pytest.mark.parametrize("coded", [True, False], ids=["status_code", "text_only"])
def test_every_answer_of_a_deployment_in_transition_is_backend_unavailable(text: str,
                                                                          coded: bool) -> None:
    error = BaseParser.parse_error(text)
    if not coded:  # redis-py before 7 keeps no status_code
        error.status_code = None
    assert isinstance(typed_error(error, "redis"), BackendUnavailable)


def test_other_answers_stay_what_they_are_and_setup_mistakes_are_configuration_errors() -> None:
    for text in ("ERR Error running script (call to f_0123): @user_script:1: oops",
                 "WRONGTYPE Operation against a key holding the wrong kind of value"):
        assert typed_error(BaseParser.parse_error(text), "redis") is None
    wrong = BaseParser.parse_error("WRONGPASS invalid username-password pair or user is disabled.")
    assert isinstance(typed_error(wrong, "redis"), ConfigurationError)
