"""Redis quotas on a server in a failover's states: a demoted primary (``READONLY``), a
replica cut from its primary (``MASTERDOWN``), a primary short of replicas
(``NOREPLICAS``) refuse the charge as ``BackendUnavailable`` (fail closed), never as a raw
redis-py error, sync and asyncio alike. The lock backend's side is
``tests/locks/test_redis_failover_answers.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis_ha import RedisNode, require_redis_server
from servers import free_port

from quotas.envs import facts, rule
from toolguard.controls.quotas import AsyncQuotas, Quotas, async_quota_backend, quota_backend
from toolguard.errors import BackendUnavailable

RATE = rule([{"calls": 100, "window": "1m"}])


@contextlib.contextmanager
def server(*args: str) -> Iterator[RedisNode]:
    require_redis_server()
    with tempfile.TemporaryDirectory(prefix="toolguard-quota-answers-") as root:
        node = RedisNode("quotas", Path(root), args=args).start()
        try:
            yield node
        finally:
            node.stop()


def demoted(node: RedisNode, other: RedisNode) -> None:
    with node.client() as client:
        client.execute_command("REPLICAOF", "127.0.0.1", other.port)


def cut_off(node: RedisNode, _other: RedisNode) -> None:
    with node.client() as client:
        client.config_set("replica-serve-stale-data", "no")
        client.execute_command("REPLICAOF", "127.0.0.1", free_port())  # nobody there


def short_of_replicas(node: RedisNode, _other: RedisNode) -> None:
    with node.client() as client:
        client.config_set("min-replicas-to-write", 1)


@pytest.mark.parametrize(("state", "code"), [(demoted, "READONLY"), (cut_off, "MASTERDOWN"),
                                             (short_of_replicas, "NOREPLICAS")])
@pytest.mark.parametrize("mode", ["sync", "asyncio"])
def test_a_charge_on_a_server_in_a_failover_state_is_backend_unavailable(
        mode: str, state: Callable[[RedisNode, RedisNode], None], code: str) -> None:
    with server() as node, server() as other:
        url = f"redis://127.0.0.1:{node.port}/0"
        state(node, other)
        with pytest.raises(BackendUnavailable) as caught:
            if mode == "sync":
                backend = quota_backend(url)
                try:
                    Quotas(backend).admit(RATE, facts())
                finally:
                    backend.close()
            else:
                async def admit() -> None:
                    abackend = async_quota_backend(url)
                    try:
                        await AsyncQuotas(abackend).admit(RATE, facts())
                    finally:
                        await abackend.aclose()

                asyncio.run(admit())
        cause = caught.value.__cause__
        assert isinstance(cause, redis.RedisError)
        assert (getattr(cause, "status_code", None) or str(cause).split(" ", 1)[0]) == code
