"""Redis beyond one server: Redis Cluster and a primary watched by Sentinel.

Both run the single-server backend's scripts unchanged (``toolguard.locks.redis``):
every lock's keys share one hash tag, so each script touches one slot of one
primary, and a multi-key lease is taken key by key by the lock manager, as on
one server. Only the client differs:

* ``redis+cluster://host:port[,host:port...]`` uses redis-py's ``RedisCluster``,
  which learns the slot map from any node it is given and follows ``MOVED`` and
  ``ASK`` (and retries ``TRYAGAIN``) during a resharding.
* ``redis+sentinel://host:port[,host:port...]/service[/db]`` asks the sentinels
  where the primary of ``service`` is and asks again after a failover.

What failover does to a lock: replication is asynchronous, so a grant the old
primary acknowledged may be missing on the promoted replica, which then grants
the same lock again. For a moment two agents both believe they hold it. The
store's fence refuses the stale one (its token is below the newer holder's), and
the tokens keep growing: they are hybrid-clock values, and where the new
primary's clock or counter is behind the store's high-water marks,
``toolguard.store.recovery.run_fenced`` re-seeds it. ``min-replicas-to-write``
and ``WAIT`` narrow that window but cannot close it; the fence is what keeps the
data exact (see docs/deployment.md).

Query options (both schemes): ``socket_timeout`` and ``socket_connect_timeout``
in seconds (default ``SOCKET_TIMEOUT_S``); for Sentinel also
``sentinel_username`` and ``sentinel_password`` (the URL's own user and password
are the primary's). ``rediss+cluster`` / ``rediss+sentinel`` connect with TLS.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.asyncio as aredis
import redis.asyncio.cluster as acluster
import redis.asyncio.sentinel as asentinel
import redis.cluster
import redis.sentinel
from redis.exceptions import RedisClusterException, RedisError

from toolguard.errors import BackendUnavailable, ConfigurationError
from toolguard.locks import redis as single
from toolguard.locks.base import Attempt, BackendInfo

__all__ = [
    "CLUSTER_INFO",
    "CLUSTER_SCHEMES",
    "SENTINEL_INFO",
    "SENTINEL_SCHEMES",
    "AsyncRedisClusterBackend",
    "AsyncRedisSentinelBackend",
    "RedisClusterBackend",
    "RedisSentinelBackend",
    "RedisUrl",
    "parse_redis_ha_url",
]

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")

CLUSTER_INFO = BackendInfo(
    name="redis-cluster",
    durable_tokens=False,
    server_wakeup=True,
    fair=True,
    note="one hash tag per lock, so every step is one slot on one primary; a failover can "
         "lose a grant (asynchronous replication): the store's fence refuses the stale holder",
)

SENTINEL_INFO = BackendInfo(
    name="redis-sentinel",
    durable_tokens=False,
    server_wakeup=True,
    fair=True,
    note="a primary found through Sentinel; a failover can lose a grant (asynchronous "
         "replication): the store's fence refuses the stale holder",
)

_FLOAT_OPTIONS = ("socket_timeout", "socket_connect_timeout")
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")


@dataclass(frozen=True)
class RedisUrl:
    """A parsed ``redis+cluster://`` or ``redis+sentinel://`` URL."""

    scheme: str
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    service: str | None = None  # Sentinel: the monitored primary's name
    db: int = 0
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def tls(self) -> bool:
        return self.scheme.startswith("rediss")

    def connection_options(self) -> dict[str, Any]:
        """Keyword arguments for every connection to a Redis node (not to a sentinel)."""
        found: dict[str, Any] = single.client_options()
        found.update({k: v for k, v in self.options.items() if k in _FLOAT_OPTIONS})
        if self.username:
            found["username"] = self.username
        if self.password:
            found["password"] = self.password
        if self.tls:
            found["ssl"] = True
        return found


def _bad(url: str, why: str) -> ConfigurationError:
    shape = ("redis+cluster://host:port[,host:port...]" if "cluster" in url.split("://")[0]
             else "redis+sentinel://host:port[,host:port...]/service[/db]")
    return ConfigurationError(f"{why} in lock URL {_redact(url)!r}; expected {shape}")


def _redact(url: str) -> str:
    head, sep, tail = url.partition("://")
    if "@" not in tail.split("/", 1)[0]:
        return url
    credentials, _, rest = tail.partition("@")
    user = credentials.split(":", 1)[0]
    return f"{head}{sep}{user}:***@{rest}"


def parse_redis_ha_url(url: str) -> RedisUrl:
    """Parse and check a Cluster or Sentinel URL; a mistake raises ``ConfigurationError``."""
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme not in (*CLUSTER_SCHEMES, *SENTINEL_SCHEMES):
        raise _bad(url, f"unknown scheme {scheme!r}")
    credentials, _, hosts = parts.netloc.rpartition("@")
    username, _, password = credentials.partition(":")
    nodes = []
    for part in hosts.split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise _bad(url, f"node {part!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    path = [unquote(p) for p in parts.path.split("/") if p]
    service, db = None, 0
    if scheme in SENTINEL_SCHEMES:
        if not path or len(path) > 2:
            raise _bad(url, "the path must name the monitored primary (and maybe a db number)")
        service = path[0]
        if len(path) == 2:
            if not path[1].isdigit():
                raise _bad(url, f"db {path[1]!r} is not a number")
            db = int(path[1])
    elif path:
        raise _bad(url, "a cluster has one keyspace: no path or db number")
    options: dict[str, Any] = {}
    allowed = _FLOAT_OPTIONS + (_SENTINEL_OPTIONS if scheme in SENTINEL_SCHEMES else ())
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in allowed:
            raise _bad(url, f"unknown option {name!r} (known: {', '.join(allowed)})")
        if name in _FLOAT_OPTIONS:
            try:
                options[name] = float(value)
            except ValueError:
                raise _bad(url, f"option {name}={value!r} is not a number of seconds") from None
            if options[name] <= 0:
                raise _bad(url, f"option {name} must be positive")
        else:
            options[name] = value
    return RedisUrl(scheme=scheme, nodes=tuple(nodes), username=unquote(username) or None,
                    password=unquote(password) or None, service=service, db=db, options=options)


def _block_cap(socket_timeout: float | None) -> float | None:
    """The longest BLPOP that cannot trip the client's own socket timeout (as on one server)."""
    return max(0.001, float(socket_timeout) / 2) if socket_timeout else None


# --- Redis Cluster --------------------------------------------------------------------------


def cluster_client(url: str | RedisUrl) -> redis.cluster.RedisCluster:
    """A sync ``RedisCluster`` for a ``redis+cluster://`` URL."""
    parsed = parse_redis_ha_url(url) if isinstance(url, str) else url
    # redis-py leaves the sync ClusterNode.__init__ unannotated
    nodes = [redis.cluster.ClusterNode(host, port)  # type: ignore[no-untyped-call]
             for host, port in parsed.nodes]
    try:  # unlike a single-server client, it reads the slot map at once
        return redis.cluster.RedisCluster(startup_nodes=nodes, **parsed.connection_options())
    except (RedisError, RedisClusterException, OSError) as error:
        nodes_text = ",".join(f"{h}:{p}" for h, p in parsed.nodes)
        msg = f"redis cluster at {nodes_text}: {error}"
        raise BackendUnavailable(msg) from error


def async_cluster_client(url: str | RedisUrl) -> acluster.RedisCluster:
    """An asyncio ``RedisCluster`` for a ``redis+cluster://`` URL."""
    parsed = parse_redis_ha_url(url) if isinstance(url, str) else url
    nodes = [acluster.ClusterNode(host, port) for host, port in parsed.nodes]
    return acluster.RedisCluster(startup_nodes=nodes, **parsed.connection_options())


class RedisClusterBackend(single.RedisBackend):
    """The Redis backend on a Redis Cluster: the same scripts, routed by slot.

    Cluster replies that mean "not now" (``CLUSTERDOWN`` during an election,
    ``TRYAGAIN`` while a slot moves, redirections past redis-py's limit, ``UNBLOCKED``
    from a primary demoted under a waiter) become ``BackendUnavailable``, like a dropped
    connection (``single.typed_error``): the lock manager asks again, and redis-py follows
    the ``MOVED`` of the demoted primary to the new one.
    """

    info = CLUSTER_INFO
    failure_label = "redis cluster"

    def __init__(self, client: redis.cluster.RedisCluster | str, **options: Any) -> None:
        # Not RedisBackend.__init__: a cluster client has no single connection pool to read
        # the socket timeout from. The attributes set are the same (a test compares them).
        single._RedisShared.__init__(self, **options)
        self.client = cluster_client(client) if isinstance(client, str) else client
        # redis-py leaves the sync RedisCluster.get_connection_kwargs unannotated
        connection = self.client.get_connection_kwargs()  # type: ignore[no-untyped-call]
        self._max_block_s = _block_cap(connection.get("socket_timeout"))
        # redis-py annotates register_script's self as Redis; RedisCluster inherits the method
        # from the same mixin and its scripts run through the cluster client.
        scripts = cast(redis.Redis, self.client)
        self._acquire = scripts.register_script(single.ACQUIRE)
        self._release = scripts.register_script(single.RELEASE)
        self._renew = scripts.register_script(single.RENEW)
        self._raise_floor = scripts.register_script(single.RAISE_FLOOR)
        self._pool = None  # every command takes the cluster client's own path
        self._idle: list[Any] = []
        self._pid = os.getpid()


class AsyncRedisClusterBackend(single.AsyncRedisBackend):
    """The asyncio twin of ``RedisClusterBackend``."""

    info = CLUSTER_INFO
    failure_label = "redis cluster"

    def __init__(self, client: acluster.RedisCluster | str, **options: Any) -> None:
        single._RedisShared.__init__(self, **options)
        self.client = async_cluster_client(client) if isinstance(client, str) else client
        self._max_block_s = _block_cap(self.client.get_connection_kwargs().get("socket_timeout"))
        # redis-py annotates register_script's self as Redis; RedisCluster inherits the method
        # from the same mixin and its scripts run through the cluster client.
        scripts = cast(aredis.Redis, self.client)
        self._acquire = scripts.register_script(single.ACQUIRE)
        self._release = scripts.register_script(single.RELEASE)
        self._raise_floor = scripts.register_script(single.RAISE_FLOOR)


# --- Sentinel -------------------------------------------------------------------------------


def _sentinel_kwargs(parsed: RedisUrl) -> dict[str, Any]:
    timeout = parsed.options.get("socket_timeout", single.SOCKET_TIMEOUT_S)
    found: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout,
                             **single.version_options()}
    if "sentinel_username" in parsed.options:
        found["username"] = parsed.options["sentinel_username"]
    if "sentinel_password" in parsed.options:
        found["password"] = parsed.options["sentinel_password"]
    if parsed.tls:
        found["ssl"] = True
    return found


def sentinel_client(url: str | RedisUrl) -> redis.Redis:
    """A sync client of the primary named in a ``redis+sentinel://`` URL."""
    parsed = parse_redis_ha_url(url) if isinstance(url, str) else url
    # redis-py leaves the sync Sentinel and master_for unannotated
    sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        list(parsed.nodes), sentinel_kwargs=_sentinel_kwargs(parsed))
    assert parsed.service is not None
    primary: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        parsed.service, db=parsed.db, **parsed.connection_options())
    return primary


def async_sentinel_client(url: str | RedisUrl) -> aredis.Redis:
    """An asyncio client of the primary named in a ``redis+sentinel://`` URL."""
    parsed = parse_redis_ha_url(url) if isinstance(url, str) else url
    # redis-py leaves the asyncio Sentinel's __init__ unannotated, and master_for returns Any
    sentinel = asentinel.Sentinel(  # type: ignore[no-untyped-call]
        list(parsed.nodes), sentinel_kwargs=_sentinel_kwargs(parsed))
    assert parsed.service is not None
    primary: aredis.Redis = sentinel.master_for(parsed.service, db=parsed.db,
                                                **parsed.connection_options())
    return primary


class RedisSentinelBackend(single.RedisBackend):
    """The Redis backend on the primary that Sentinel names.

    Each new connection asks the sentinels for the primary; a connection to a
    primary that was demoted fails (``READONLY`` becomes a connection error in
    redis-py; Sentinel drops the demoted server's clients), so the next call reaches
    the new one. Every answer of a failover is ``BackendUnavailable`` meanwhile.
    """

    info = SENTINEL_INFO
    failure_label = "redis sentinel"

    def __init__(self, client: redis.Redis | str, **options: Any) -> None:
        super().__init__(sentinel_client(client) if isinstance(client, str) else client, **options)


class AsyncRedisSentinelBackend(single.AsyncRedisBackend):
    """The asyncio twin of ``RedisSentinelBackend``."""

    info = SENTINEL_INFO
    failure_label = "redis sentinel"

    def __init__(self, client: aredis.Redis | str, **options: Any) -> None:
        super().__init__(async_sentinel_client(client) if isinstance(client, str) else client,
                         **options)


def open_sync(url: str, **options: Any) -> single.RedisBackend:
    """The sync backend for a Cluster or Sentinel URL (``toolguard.locks.connect``)."""
    parsed = parse_redis_ha_url(url)
    if parsed.scheme in CLUSTER_SCHEMES:
        return RedisClusterBackend(cluster_client(parsed), **options)
    return RedisSentinelBackend(sentinel_client(parsed), **options)


class DeferredClusterBackend:
    """The sync twin of an asyncio Cluster backend (the heartbeat renews through it), made
    on first use: a sync ``RedisCluster`` reads the slot map when it is made, and
    ``connect_async()`` runs in the caller's event loop; first use is on a worker thread."""

    info = CLUSTER_INFO

    def __init__(self, url: str, **options: Any) -> None:
        self._url, self._options = url, options
        self._made: RedisClusterBackend | None = None
        self._making = threading.Lock()
        self.presence_ms: int = single._RedisShared(**options).presence_ms

    def _backend(self) -> RedisClusterBackend:
        if self._made is None:
            with self._making:
                if self._made is None:
                    self._made = RedisClusterBackend(cluster_client(self._url), **self._options)
        return self._made

    def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        return self._backend().try_acquire(key, owner, ttl_ms)

    def wait(self, key: str, owner: str, timeout_s: float) -> int | None:
        return self._backend().wait(key, owner, timeout_s)

    def release(self, key: str, owner: str) -> bool:
        return self._backend().release(key, owner)

    def renew(self, held: Sequence[tuple[str, str, int]]) -> list[bool]:
        return self._backend().renew(held)

    def raise_floor(self, key: str, token: int) -> None:
        self._backend().raise_floor(key, token)

    def current_token(self, key: str) -> int:
        return self._backend().current_token(key)

    def close(self) -> None:
        if self._made is not None:
            self._made.close()


def open_async(url: str, **options: Any) -> single.AsyncRedisBackend:
    """The asyncio backend for a Cluster or Sentinel URL (``toolguard.locks.connect_async``)."""
    parsed = parse_redis_ha_url(url)
    if parsed.scheme in CLUSTER_SCHEMES:
        return AsyncRedisClusterBackend(async_cluster_client(parsed), **options)
    return AsyncRedisSentinelBackend(async_sentinel_client(parsed), **options)
