"""Reaching the backends: one small read-only probe per lock server, and the store opened as is.

A ``_LockProbe`` answers what the checks ask of a lock server (ping, its clock,
a key's counter, Redis settings per node) without taking a lock or creating
anything; ``_open_store`` opens the store without creating the embedded file.
Separate from the checks: they judge what these probes read.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from toolguard.cli.checks.report import _reason
from toolguard.errors import BackendUnavailable, ConfigurationError
from toolguard.runtime.extras import require

# --- probes: one small read-only client per lock backend ------------------------------------


#: One Redis node's configuration (name -> value), or why it could not be read.
NodeConfig = dict[str, str] | str


@dataclass
class _LockProbe:
    """What doctor needs from a lock server, without taking a lock or creating anything."""

    kind: str  # redis | sqlite | postgres | etcd (Redis Cluster and Sentinel are "redis")
    url: str
    ping: Callable[[], object]
    server_time_us: Callable[[], int | None]  # None: no clock to compare (same host, etcd)
    current_token: Callable[[str], int | None]  # None: not comparable
    #: Redis: each node's configuration (one node, or every primary of a cluster).
    config: Callable[[], dict[str, NodeConfig]] = dict
    close: Callable[[], None] = lambda: None
    hybrid: bool = True  # tokens are max(last + 1, server time in us)
    same_host: bool = False  # its clock is this host's: nothing to compare
    location: str = ""
    #: What the summaries call it: the kind, or redis-cluster / redis-sentinel.
    label: str = ""
    #: Clocks to compare with this host's, by label; default: ``server_time_us``.
    clocks: list[tuple[str, Callable[[], int | None]]] = field(default_factory=list)
    #: PostgreSQL: the lock schema version installed (0: none).
    lock_schema_version: Callable[[], int] | None = None

    def __post_init__(self) -> None:
        self.label = self.label or self.kind
        if not self.clocks:
            self.clocks = [(f"lock server ({self.label})", self.server_time_us)]


_REDIS_SETTINGS = ("maxmemory-policy", "maxmemory", "appendonly", "appendfsync", "save")


def _redis_config(config_get: Callable[[str], Any], info: Callable[[str], Any]) -> NodeConfig:
    """One node's settings doctor looks at (``CONFIG GET`` and ``INFO replication``), or why
    they could not be read (managed Redis often disables CONFIG)."""
    out: dict[str, str] = {}
    try:
        for name in _REDIS_SETTINGS:
            out.update({str(k): str(v) for k, v in config_get(name).items()})
        replication = info("replication")
    except Exception as error:
        return _reason(error)
    out["role"] = str(replication.get("role", ""))
    out["connected_slaves"] = str(replication.get("connected_slaves", 0))
    return out


def _time_us(reply: Any) -> int:
    seconds, micros = reply
    return int(seconds) * 1_000_000 + int(micros)


def _probe_redis(url: str, timeout: float, prefix: str) -> _LockProbe:
    require("redis", "the Redis lock backend")
    import redis

    from toolguard.locks.redis import RedisBackend

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    backend = RedisBackend(client, prefix=prefix)
    location = (f"{client.connection_pool.connection_kwargs.get('host', '?')}:"
                f"{client.connection_pool.connection_kwargs.get('port', '?')}")

    def config() -> dict[str, NodeConfig]:
        return {location: _redis_config(client.config_get, client.info)}

    return _LockProbe("redis", url, lambda: bool(client.ping()), lambda: _time_us(client.time()),
                      backend.current_token, config, client.close, location=location)


def _node_clock(cluster: Any, node: Any) -> Callable[[], int | None]:
    """One cluster node's clock, in microseconds."""
    return lambda: _time_us(cluster.time(target_nodes=node))


def _probe_redis_ha(url: str, timeout: float, prefix: str) -> _LockProbe:
    """Redis Cluster: every primary (CONFIG and INFO go to each, the clock of each is read).
    Sentinel: the primary the sentinels name, probed like one Redis."""
    require("redis", "the Redis Cluster/Sentinel lock backend")
    from toolguard.locks import redis_ha

    parsed = redis_ha.parse_redis_ha_url(url)  # a malformed URL is a usage error (exit 2)
    timeouts = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    parsed = replace(parsed, options={**timeouts, **parsed.options})
    if parsed.scheme in redis_ha.CLUSTER_SCHEMES:
        # reads the slot map: an unreachable cluster fails here
        cluster: Any = redis_ha.cluster_client(parsed)
        backend: Any = redis_ha.RedisClusterBackend(cluster, prefix=prefix)
        primaries = cluster.get_primaries()

        def cluster_config() -> dict[str, NodeConfig]:
            return {node.name: _redis_config(functools.partial(cluster.config_get, target_nodes=node),
                                             functools.partial(cluster.info, target_nodes=node))
                    for node in cluster.get_primaries()}

        clocks = [(f"lock server (redis-cluster {node.name})", _node_clock(cluster, node))
                  for node in primaries]

        def earliest_us() -> int:  # the fence check assumes the slowest clock: never too hopeful
            return min(int(read() or 0) for _, read in clocks)

        return _LockProbe(
            "redis", url, lambda: bool(cluster.ping(target_nodes=cluster.get_primaries())),
            earliest_us, backend.current_token, cluster_config, cluster.close,
            location=f"{len(primaries)} primar{'y' if len(primaries) == 1 else 'ies'} "
                     f"({', '.join(node.name for node in primaries)})",
            label="redis-cluster", clocks=clocks)
    client: Any = redis_ha.sentinel_client(parsed)
    backend = redis_ha.RedisSentinelBackend(client, prefix=prefix)
    host, port = client.connection_pool.get_master_address()  # asks the sentinels
    primary = f"{host}:{port}"

    def sentinel_config() -> dict[str, NodeConfig]:
        return {primary: _redis_config(client.config_get, client.info)}

    return _LockProbe("redis", url, lambda: bool(client.ping()), lambda: _time_us(client.time()),
                      backend.current_token, sentinel_config, client.close,
                      location=f"{primary}, the primary of {parsed.service!r} by its sentinels",
                      label="redis-sentinel")


def _probe_sqlite(url: str) -> _LockProbe:
    from toolguard.locks import sqlite_path

    path = Path(sqlite_path(url))

    def connect() -> sqlite3.Connection:
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)

    def ping() -> None:
        if path.exists():
            connect().close()
            return
        folder = path.parent if str(path.parent) else Path()
        if not (folder.exists() and os.access(folder, os.W_OK)) and not _creatable(folder):
            msg = f"{path}: the file does not exist and {folder} is not writable"
            raise BackendUnavailable(msg)

    def current_token(key: str) -> int | None:
        if not path.exists():
            return 0
        conn = connect()
        try:
            row = conn.execute("SELECT token FROM tg_lock_fence WHERE key = ?", (key,)).fetchone()
        except sqlite3.OperationalError:  # no lock taken yet: no table
            return 0
        finally:
            conn.close()
        return int(row[0]) if row else 0

    return _LockProbe("sqlite", url, ping, lambda: time.time_ns() // 1000, current_token,
                      same_host=True, location=str(path))


def _creatable(folder: Path) -> bool:
    for parent in (folder, *folder.parents):
        if parent.exists():
            return os.access(parent, os.W_OK)
    return False


def _probe_postgres(url: str, timeout: float, schema: str | None = None) -> _LockProbe:
    from toolguard.cli.db import classify_postgres_error

    require("postgres", "the PostgreSQL lock backend")
    import psycopg

    from toolguard.locks.postgres import _installed_version, _Statements, check_schema_name

    statements = _Statements(check_schema_name(schema))

    state: dict[str, Any] = {}

    def conn() -> Any:
        if "conn" not in state:
            try:
                state["conn"] = psycopg.connect(url, connect_timeout=max(1, round(timeout)),
                                                autocommit=True)
            except psycopg.Error as error:
                raise classify_postgres_error(error) from None
        return state["conn"]

    def server_time_us() -> int:
        row = conn().execute("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
                             ).fetchone()
        return int(row[0])

    def current_token(key: str) -> int:
        table = f"{statements.prefix}toolguard_lock_fence"
        present = conn().execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
        if not present or not present[0]:
            return 0
        row = conn().execute(statements.current_token, (key,)).fetchone()
        return int(row[0]) if row else 0

    def close() -> None:
        if "conn" in state:
            with contextlib.suppress(Exception):
                state["conn"].close()

    return _LockProbe("postgres", url, lambda: conn().execute("SELECT 1").fetchone() and None,
                      server_time_us, current_token, close=close,
                      location=_host_of(url),
                      lock_schema_version=lambda: _installed_version(conn(), statements))


def _probe_etcd(url: str, timeout: float) -> _LockProbe:
    require("etcd", "the etcd lock backend")
    from toolguard.locks.etcd import EtcdBackend

    backend = EtcdBackend(url, timeout_s=timeout)
    return _LockProbe("etcd", url, lambda: backend.current_token("toolguard-doctor/probe") and None,
                      lambda: None, lambda _key: None, close=backend.close, hybrid=False,
                      location=_host_of(url))


def _host_of(url: str) -> str:
    parsed = urlparse(url)
    return f"{parsed.hostname or 'localhost'}:{parsed.port or ''}".rstrip(":")


def _lock_probe(url: str, timeout: float, redis_prefix: str,
                lock_schema: str | None = None) -> _LockProbe:
    from toolguard.locks import REDIS_HA_SCHEMES

    scheme = urlparse(url).scheme
    if lock_schema is not None and scheme not in ("postgresql", "postgres"):
        msg = f"a lock schema only applies to a PostgreSQL lock backend, not {scheme}://"
        raise ConfigurationError(msg)
    if scheme in ("redis", "rediss", "unix"):
        return _probe_redis(url, timeout, redis_prefix)
    if scheme in REDIS_HA_SCHEMES:
        return _probe_redis_ha(url, timeout, redis_prefix)
    if scheme == "sqlite":
        return _probe_sqlite(url)
    if scheme in ("postgresql", "postgres"):
        return _probe_postgres(url, timeout, lock_schema)
    if scheme == "etcd":
        return _probe_etcd(url, timeout)
    msg = f"unknown lock backend URL scheme {scheme!r} in {url!r}"
    raise ConfigurationError(msg)


def _round_trips(ping: Callable[[], Any], samples: int = 5) -> list[float]:
    out = []
    for _ in range(samples):
        started = time.perf_counter()
        ping()
        out.append((time.perf_counter() - started) * 1000)
    return out


def _skew_s(server_time_us: Callable[[], int | None]) -> tuple[float, float] | None:
    """(server - local) in seconds, and the uncertainty (half the round trip)."""
    before = time.time()
    server = server_time_us()
    after = time.time()
    if server is None:
        return None
    return server / 1e6 - (before + after) / 2, (after - before) / 2


def _redact(url: str) -> str:
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)


class _NotCreatedStore:
    """The embedded store's file does not exist yet: doctor reports it and must not create it."""

    dialect = "sqlite"

    def schema_version(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing was opened."""


def _open_store(url: str, schema: str | None, timeout_s: float) -> Any:
    from toolguard.cli.db import is_postgres_url, probe_postgres
    from toolguard.store import open_store

    if is_postgres_url(url):
        probe_postgres(url, timeout_s)  # a wrong role, database or sslmode fails here, at once
        return open_store(url, schema=schema, timeout_s=timeout_s, min_size=0, max_size=2)
    if schema:
        msg = "a schema only applies to a PostgreSQL store"
        raise ConfigurationError(msg)
    from toolguard.locks import sqlite_path

    if not Path(sqlite_path(url)).exists():
        return _NotCreatedStore()
    return open_store(url)


def _is_refusal(error: BaseException) -> bool:
    from toolguard.cli.db import BackendRefused

    return isinstance(error, BackendRefused)
