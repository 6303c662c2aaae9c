"""Check a deployment against toolguard's operating checklist.

``run_checks(lock_url=..., store_url=...)`` returns one ``Check`` per item, each
``pass``, ``warn``, ``fail`` or ``skip`` with what was found and why it matters
(``toolguard doctor`` prints them). Every probe is read-only, except
``reseed=True``, which raises the lock server's counters to the store's
high-water marks where they lag (``toolguard.store.recovery.reseed``).

The checklist:

1. the lock server answers;
2. the store answers;
3. Redis: no ``maxmemory-policy`` that may evict lock keys;
4. persistence of the lock server (Redis ``appendonly``/``save``) and what a
   restart means for held locks and tokens;
5. clock sanity: the lock server's and the store's clocks against this host;
6. the store's schema at this toolguard's version;
7. a PostgreSQL lock backend's schema (``toolguard_lock_*``) at this toolguard's version;
8. TTL against the renewal interval and the measured round trip;
9. fences: for every fenced key in the store (the most recent ``sample``), the
   next token the lock server can grant is above the store's high-water mark;
10. a PostgreSQL store: its role may end a paused holder's transaction (the
    next holder does, with ``pg_terminate_backend``; without the permission it
    waits, fail safe);
11. fence claims: the signing and verifying keys in ``TOOLGUARD_FENCE_*`` can be read,
    and what a fenced service without them (unsigned mode) lets any caller do.

Redis Cluster (``redis+cluster://``) is probed on every primary: its
configuration, persistence and clock are reported per node. Sentinel
(``redis+sentinel://``) is probed on the primary the sentinels name.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sqlite3
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from toolguard.errors import BackendUnavailable, ConfigurationError, ToolGuardError
from toolguard.extras import require

__all__ = ["Check", "Status", "exit_code", "run_checks"]

Status = Literal["pass", "warn", "fail", "skip"]

#: Clock skew thresholds (seconds) between this host and a server.
SKEW_WARN_S = 0.5
SKEW_FAIL_S = 5.0
#: A renewal (at ttl/3) should leave room for this many round trips.
RENEWAL_ROUND_TRIPS = 10
#: Below this TTL, a pause of the holder (GC, a long synchronous call) loses the lease.
SHORT_TTL_MS = 1000


@dataclass(frozen=True, slots=True)
class Check:
    """One item of the checklist: what was found, and why it matters."""

    name: str
    title: str
    status: Status
    summary: str
    why: str
    fix: str | None = None
    unreachable: bool = False  # a failure because a backend did not answer (exit 3)
    refused: bool = False  # a failure because a backend answered no (role, database, auth: exit 4)
    data: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def exit_code(checks: Sequence[Check], *, strict: bool = False) -> int:
    """3 if a backend is unreachable, 4 if one refused us, 1 if a check failed (or warned, with
    ``strict``), else 0."""
    if any(c.unreachable for c in checks):
        return 3
    if any(c.refused for c in checks):
        return 4
    if any(c.status == "fail" for c in checks) or (strict and any(c.status == "warn" for c in checks)):
        return 1
    return 0


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
    from toolguard.store.cli import classify_postgres_error

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
    from toolguard.store import open_store
    from toolguard.store.cli import is_postgres_url, probe_postgres

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
    from toolguard.store.cli import BackendRefused

    return isinstance(error, BackendRefused)


def _reason(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


# --- the checks -------------------------------------------------------------------------------


_UNSIGNED = ("unsigned mode: a fenced service built without claims=ClaimVerifier(...) takes "
             "every Fencing-Token, agent and Idempotency-Key its network sends: one request with "
             "a huge token refuses every genuine holder of that key until `toolguard fence "
             "reset`, and any caller can write under any key or pass for any agent")


def _fence_claims(environ: Mapping[str, str]) -> Check:
    """Signed or unsigned fences: the keys configured here, or what their absence allows."""
    from toolguard.fences.keys import (
        SIGNING_KEY_ENV,
        SIGNING_KEY_FILE_ENV,
        VERIFY_KEYS_ENV,
        VERIFY_KEYS_FILE_ENV,
        load_keyring,
        load_signing_key,
    )

    title, why = ("Fence claims (signed mode)",
                  "a service trusts a fencing token only when a guard's key signed it for that "
                  "service; without keys it trusts its whole network")
    found = []
    try:
        if environ.get(SIGNING_KEY_ENV) or environ.get(SIGNING_KEY_FILE_ENV):
            key = load_signing_key(environ=environ)
            found.append(f"signs as {key.key_id!r} ({key.algorithm})")
        if environ.get(VERIFY_KEYS_ENV) or environ.get(VERIFY_KEYS_FILE_ENV):
            ring = load_keyring(environ=environ)
            found.append(f"verifies key ids {', '.join(sorted(ring))}")
    except ConfigurationError as error:
        return Check("fence_claims", title, "fail", str(error), why,
                     fix="fix the key file or variable, or make a key with `toolguard keys new`")
    if not found:
        return Check("fence_claims", title, "skip",
                     f"no TOOLGUARD_FENCE_* keys in this environment; {_UNSIGNED}", why,
                     fix="on an untrusted network: `toolguard keys new`, FenceSigner on the "
                         "clients, ClaimVerifier on the services (docs/fences.md)",
                     data={"mode": "unsigned"})
    return Check("fence_claims", title, "pass", "; ".join(found), why, data={"mode": "signed"})


def run_checks(
    *,
    lock_url: str | None = None,
    store_url: str | None = None,
    schema: str | None = None,
    ttl_ms: Iterable[int] | None = None,
    wait_timeout_s: float | None = None,
    timeout_s: float = 3.0,
    sample: int = 1000,
    reseed: bool = False,
    redis_prefix: str = "tg",
    lock_schema: str | None = None,
) -> list[Check]:
    """Run the checklist; URLs default to the settings (``TOOLGUARD_*``, else embedded SQLite).

    ``ttl_ms`` lists the TTLs in use (e.g. every tool's of a policy); default the
    settings' ``ttl_ms``. ``lock_schema``: the PostgreSQL lock backend's
    ``schema=`` (default: the search_path).
    """
    from toolguard.config import Settings

    settings = Settings()
    lock_url = lock_url or settings.resolved_lock_url()
    store_url = store_url or settings.resolved_store_url()
    ttls = sorted(set(ttl_ms or [settings.ttl_ms]))
    wait = settings.wait_timeout_s if wait_timeout_s is None else wait_timeout_s
    checks: list[Check] = []

    probe: _LockProbe | None = None
    rtts: list[float] = []
    try:
        probe = _lock_probe(lock_url, timeout_s, redis_prefix, lock_schema)
        probe.ping()
        rtts = _round_trips(probe.ping)
        checks.append(Check(
            "lock_server", "Lock server reachable", "pass",
            f"{probe.label} at {probe.location or _redact(lock_url)} answered; round trip "
            f"{statistics.median(rtts):.2f} ms (max {max(rtts):.2f} ms of {len(rtts)})",
            "every guarded call takes its locks there: without it nothing runs", data={
                "kind": probe.label, "url": _redact(lock_url), "rtt_ms": rtts}))
    except ConfigurationError:
        raise
    except Exception as error:
        checks.append(Check(
            "lock_server", "Lock server reachable", "fail",
            f"{_redact(lock_url)}: {_reason(error)}",
            "every guarded call takes its locks there: without it nothing runs",
            fix="start the server or fix TOOLGUARD_LOCK_URL / TOOLGUARD_REDIS_URL",
            unreachable=not _is_refusal(error), refused=_is_refusal(error)))
        probe = None

    store = None
    installed = 0
    try:
        store = _open_store(store_url, schema, timeout_s)
        installed = store.schema_version()
        answered = ("not created yet (the first guarded call or `toolguard db init` creates it)"
                    if isinstance(store, _NotCreatedStore) else "answered")
        checks.append(Check("store", "Store reachable", "pass",
                            f"{store.dialect} store at {_redact(store_url)} {answered}",
                            "fenced writes, idempotency records and the audit log live there",
                            data={"dialect": store.dialect, "url": _redact(store_url)}))
    except ConfigurationError:
        raise
    except Exception as error:
        checks.append(Check(
            "store", "Store reachable", "fail", f"{_redact(store_url)}: {_reason(error)}",
            "fenced writes, idempotency records and the audit log live there",
            fix="start the database or fix TOOLGUARD_DATABASE_URL",
            unreachable=not _is_refusal(error), refused=_is_refusal(error)))
        if store is not None:
            store.close()
        store = None

    try:
        configs: dict[str, NodeConfig] = {}
        if probe is not None and probe.kind == "redis":
            try:
                configs = probe.config()
            except Exception as error:  # e.g. a node stopped answering after the ping
                configs = {probe.location: _reason(error)}
        checks.append(_eviction(probe, configs))
        checks.append(_persistence(probe, configs))
        checks.append(_clocks(probe, store))
        checks.append(_schema(store, installed))
        checks.append(_lock_schema(probe, lock_url, lock_schema))
        checks.append(_ttls(probe, rtts, ttls, wait))
        checks.append(_fences(probe, store, installed, lock_url, sample, reseed, redis_prefix))
        checks.append(_signal(store, installed))
        checks.append(_fence_claims(os.environ))
    finally:
        if probe is not None:
            with contextlib.suppress(Exception):
                probe.close()
        if store is not None:
            store.close()
    return checks


_EVICTION_WHY = ("an evicted lock key frees a lock its holder still uses: two agents then hold it "
                 "at once (fencing still refuses the older one's writes, but its work is lost); an "
                 "evicted counter falls back to the clock")


def _eviction(probe: _LockProbe | None, configs: Mapping[str, NodeConfig]) -> Check:
    title = "Redis eviction policy"
    if probe is None:
        return Check("redis_eviction", title, "skip", "the lock server did not answer", _EVICTION_WHY)
    if probe.kind != "redis":
        return Check("redis_eviction", title, "skip", f"not Redis ({probe.kind}): nothing is evicted",
                     _EVICTION_WHY)
    return _per_node(configs, _eviction_of)


def _eviction_of(config: NodeConfig) -> Check:
    """The eviction check for one Redis node."""
    title = "Redis eviction policy"
    if isinstance(config, str):
        return Check("redis_eviction", title, "warn", f"cannot read the configuration: {config}",
                     _EVICTION_WHY, fix="check maxmemory-policy with your provider: noeviction")
    policy = config.get("maxmemory-policy", "?")
    maxmemory = int(config.get("maxmemory", "0") or 0)
    data = {"maxmemory_policy": policy, "maxmemory": maxmemory}
    if policy == "noeviction":
        return Check("redis_eviction", title, "pass",
                     "maxmemory-policy noeviction: a full Redis refuses writes instead of evicting",
                     _EVICTION_WHY, data=data)
    if maxmemory == 0:
        return Check("redis_eviction", title, "warn",
                     f"maxmemory-policy {policy}, but no maxmemory limit: nothing is evicted until "
                     f"someone sets one", _EVICTION_WHY,
                     fix="CONFIG SET maxmemory-policy noeviction (and in redis.conf)", data=data)
    if policy.startswith("volatile-"):
        return Check("redis_eviction", title, "warn",
                     f"maxmemory-policy {policy} with maxmemory {maxmemory}: lock keys carry a TTL, "
                     f"so they are eviction candidates when memory runs out", _EVICTION_WHY,
                     fix="use noeviction, or a Redis of its own for locks", data=data)
    return Check("redis_eviction", title, "fail",
                 f"maxmemory-policy {policy} with maxmemory {maxmemory}: any lock key may be "
                 f"evicted under memory pressure", _EVICTION_WHY,
                 fix="CONFIG SET maxmemory-policy noeviction (and in redis.conf)", data=data)


_SEVERITY: Mapping[Status, int] = {"skip": 0, "pass": 1, "warn": 2, "fail": 3}


def _per_node(configs: Mapping[str, NodeConfig], judge: Callable[[NodeConfig], Check]) -> Check:
    """``judge`` on every node: one node's check as it is; for several (a cluster's primaries)
    the worst status, each node's summary, and each node's data under ``nodes``."""
    judged = {node: judge(config) for node, config in configs.items()}
    if len(judged) == 1:
        return next(iter(judged.values()))
    if not judged:
        return replace(judge("no node answered"), status="fail", unreachable=True)
    worst = max(judged.values(), key=lambda c: _SEVERITY[c.status])
    alike: dict[str, list[str]] = {}  # nodes with the same finding are named together
    for node, found in judged.items():
        alike.setdefault(found.summary, []).append(node)
    if len(alike) == 1:
        summary = f"all {len(judged)} nodes: {worst.summary}"
    else:
        summary = "; ".join(f"{', '.join(nodes)}: {text}" for text, nodes in alike.items())
    return replace(worst, summary=summary,
                   data={"nodes": {node: dict(c.data) for node, c in judged.items()}})


_PERSISTENCE_WHY = ("tokens stay safe across a restart (hybrid-clock values, re-seeded from the "
                    "store), but a restart without AOF forgets every held lock: another agent can "
                    "take one its holder still uses until the holder's renewal fails")


def _persistence(probe: _LockProbe | None, configs: Mapping[str, NodeConfig]) -> Check:
    title = "Lock server persistence"
    if probe is None:
        return Check("persistence", title, "skip", "the lock server did not answer", _PERSISTENCE_WHY)
    if probe.kind == "sqlite":
        return Check("persistence", title, "pass",
                     "embedded SQLite: locks and counters are in a file (one machine only)",
                     _PERSISTENCE_WHY)
    if probe.kind == "postgres":
        return Check("persistence", title, "pass",
                     "PostgreSQL: locks and counters are durable (WAL)", _PERSISTENCE_WHY)
    if probe.kind == "etcd":
        return Check("persistence", title, "pass",
                     "etcd: a grant is committed to a Raft quorum before it is returned",
                     _PERSISTENCE_WHY)
    return _per_node(configs, _persistence_of)


def _persistence_of(config: NodeConfig) -> Check:
    """The persistence check for one Redis node."""
    title = "Lock server persistence"
    if isinstance(config, str):
        return Check("persistence", title, "warn", f"cannot read the configuration: {config}",
                     _PERSISTENCE_WHY, fix="ask your provider whether AOF (appendonly) is on")
    aof = config.get("appendonly", "no") == "yes"
    fsync = config.get("appendfsync", "?")
    save = config.get("save", "").strip()
    replicas = int(config.get("connected_slaves", "0") or 0)
    data = {"appendonly": aof, "appendfsync": fsync, "save": save, "replicas": replicas}
    replication = (f"; {replicas} async replica(s): a failover can lose the newest grants"
                   if replicas else "")
    if aof and fsync == "always":
        return Check("persistence", title, "pass",
                     f"appendonly yes, appendfsync always: a restart keeps every lock{replication}",
                     _PERSISTENCE_WHY, data=data)
    if aof:
        return Check("persistence", title, "pass" if not replicas else "warn",
                     f"appendonly yes, appendfsync {fsync}: a crash loses at most ~1 s of grants"
                     f"{replication}", _PERSISTENCE_WHY, data=data,
                     fix="for locks that must never be lost, use etcd" if replicas else None)
    snapshots = f"RDB snapshots only (save {save!r})" if save else "no persistence at all"
    return Check("persistence", title, "warn",
                 f"appendonly no, {snapshots}: a restart loses every held lock{replication}",
                 _PERSISTENCE_WHY, data=data,
                 fix="CONFIG SET appendonly yes (and in redis.conf), or etcd/PostgreSQL for locks")


_CLOCK_WHY = ("tokens are server time in microseconds: a lock server whose clock is behind the one "
              "before it (a failover, a restart elsewhere) grants tokens the store refuses until "
              "re-seeded; audit times and --since windows come from the store's clock")


def _clocks(probe: _LockProbe | None, store: Any) -> Check:
    title = "Clock sanity"
    found: list[str] = []
    worst = 0.0
    data: dict[str, Any] = {}
    targets: list[tuple[str, Callable[[], int | None]]] = []
    if probe is not None and not probe.same_host:
        targets.extend(probe.clocks)
    if store is not None and getattr(store, "dialect", "") == "postgresql":
        def store_time() -> int:
            with store.connection() as conn:
                row = conn.execute("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
                                   ).fetchone()
            return int(row[0])

        targets.append(("store (postgresql)", store_time))
    for label, reader in targets:
        try:
            measured = _skew_s(reader)
        except Exception as error:
            found.append(f"{label}: cannot read its clock ({_reason(error)})")
            continue
        if measured is None:
            continue
        skew, uncertainty = measured
        worst = max(worst, abs(skew) - uncertainty)
        data[label] = round(skew, 6)
        found.append(f"{label} {skew * 1000:+.1f} ms (±{uncertainty * 1000:.1f})")
    if not data:
        if probe is None and not targets:
            return Check("clock", title, "skip", "the lock server did not answer", _CLOCK_WHY)
        return Check("clock", title, "pass",
                     "; ".join(found) or "everything runs on this host's clock", _CLOCK_WHY)
    summary = "vs this host: " + "; ".join(found)
    if worst >= SKEW_FAIL_S:
        return Check("clock", title, "fail", summary, _CLOCK_WHY, data=data,
                     fix="run NTP (chrony, systemd-timesyncd) on every host")
    if worst >= SKEW_WARN_S:
        return Check("clock", title, "warn", summary, _CLOCK_WHY, data=data,
                     fix="run NTP (chrony, systemd-timesyncd) on every host")
    return Check("clock", title, "pass", summary, _CLOCK_WHY, data=data)


_SCHEMA_WHY = "the fence check, idempotency records and the append-only audit log are SQL in the store"


def _schema(store: Any, installed: int) -> Check:
    title = "Store schema version"
    if store is None:
        return Check("schema", title, "skip", "the store did not answer", _SCHEMA_WHY)
    from toolguard.store import latest_version

    latest = latest_version("sqlite" if store.dialect == "sqlite" else "postgresql")
    data = {"installed": installed, "latest": latest}
    if installed == 0:
        return Check("schema", title, "fail", "not installed", _SCHEMA_WHY,
                     fix="toolguard db init", data=data)
    if installed < latest:
        return Check("schema", title, "fail", f"version {installed}, this toolguard needs {latest}",
                     _SCHEMA_WHY, fix="toolguard db init", data=data)
    if installed > latest:
        return Check("schema", title, "warn",
                     f"version {installed}, newer than this toolguard's {latest}", _SCHEMA_WHY,
                     fix="upgrade toolguard on this host", data=data)
    return Check("schema", title, "pass", f"version {installed} (latest)", _SCHEMA_WHY, data=data)


_LOCK_SCHEMA_WHY = ("every acquire, renewal and release of the PostgreSQL lock backend is one of "
                    "its SQL functions (toolguard_lock_*); the first lock call installs or "
                    "upgrades them, which needs CREATE on the schema")


def _lock_schema(probe: _LockProbe | None, lock_url: str, lock_schema: str | None) -> Check:
    title = "Lock schema version (PostgreSQL locks)"
    if probe is None:
        return Check("lock_schema", title, "skip", "the lock server did not answer",
                     _LOCK_SCHEMA_WHY)
    if probe.lock_schema_version is None:
        return Check("lock_schema", title, "skip",
                     f"not PostgreSQL ({probe.label}): no lock tables to install", _LOCK_SCHEMA_WHY)
    from toolguard.locks.postgres import SCHEMA_VERSION

    where = f" (schema {lock_schema})" if lock_schema else ""
    fix = f"toolguard db init --lock-url {_redact(lock_url)}" + (
        f" --lock-schema {lock_schema}" if lock_schema else "")
    try:
        installed = probe.lock_schema_version()
    except Exception as error:
        return Check("lock_schema", title, "fail", f"cannot read it{where}: {_reason(error)}",
                     _LOCK_SCHEMA_WHY, refused=True)
    data = {"installed": installed, "latest": SCHEMA_VERSION, "schema": lock_schema}
    if installed == 0:
        return Check("lock_schema", title, "warn",
                     f"not installed{where}: the first lock call installs it", _LOCK_SCHEMA_WHY,
                     fix=fix, data=data)
    if installed < SCHEMA_VERSION:
        return Check("lock_schema", title, "warn",
                     f"version {installed}{where}, this toolguard's is {SCHEMA_VERSION}: the first "
                     f"lock call upgrades it", _LOCK_SCHEMA_WHY, fix=fix, data=data)
    if installed > SCHEMA_VERSION:
        return Check("lock_schema", title, "warn",
                     f"version {installed}{where}, newer than this toolguard's {SCHEMA_VERSION}",
                     _LOCK_SCHEMA_WHY, fix="upgrade toolguard on this host", data=data)
    return Check("lock_schema", title, "pass", f"version {installed}{where} (latest)",
                 _LOCK_SCHEMA_WHY, data=data)


_TTL_WHY = ("a lease is renewed every ttl/3; each renewal is one round trip, and a lease whose "
            "renewals cannot land in time is lost: its holder's writes are then refused")


def _ttls(probe: _LockProbe | None, rtts: Sequence[float], ttls: Sequence[int],
          wait_timeout_s: float) -> Check:
    title = "TTL vs renewal interval"
    from toolguard.locks.base import MIN_TTL_MS

    shortest = min(ttls)
    rtt = max(rtts) if rtts else None
    data: dict[str, Any] = {"ttl_ms": list(ttls), "renew_every_ms": [round(t / 3) for t in ttls],
                            "rtt_ms": rtt, "wait_timeout_s": wait_timeout_s}
    listed = ", ".join(f"{t} ms" for t in ttls)
    if shortest < MIN_TTL_MS:
        return Check("ttl", title, "fail", f"TTL {shortest} ms is below the minimum {MIN_TTL_MS} ms",
                     _TTL_WHY, fix="raise ttl_ms", data=data)
    if rtt is None:
        return Check("ttl", title, "skip", f"TTL {listed}; no round trip measured (lock server "
                     "unreachable)", _TTL_WHY, data=data)
    basis = f"TTL {listed} (renewal every {shortest / 3:.0f} ms), round trip up to {rtt:.2f} ms"
    if shortest < 3 * rtt:
        return Check("ttl", title, "fail", f"{basis}: a renewal cannot complete before expiry",
                     _TTL_WHY, fix=f"raise ttl_ms above {int(RENEWAL_ROUND_TRIPS * 3 * rtt)} ms",
                     data=data)
    notes = []
    if shortest / 3 < RENEWAL_ROUND_TRIPS * rtt:
        notes.append(f"a renewal has room for fewer than {RENEWAL_ROUND_TRIPS} round trips")
    if shortest < SHORT_TTL_MS:
        notes.append(f"a pause of the holder longer than {shortest} ms (GC, a long synchronous "
                     f"call) loses the lease")
    if wait_timeout_s * 1000 < shortest:
        basis += (f"; note: waiters give up after {wait_timeout_s:g} s, so while a crashed "
                  f"holder's lock runs out its TTL they get lock_timeout")
    if notes:
        return Check("ttl", title, "warn", f"{basis}; " + "; ".join(notes), _TTL_WHY,
                     fix="use TTLs of a few seconds unless a short one is the point", data=data)
    return Check("ttl", title, "pass", basis, _TTL_WHY, data=data)


_FENCE_WHY = ("the store refuses every token below its high-water mark for a key: a lock server "
              "whose counter is behind (restarted empty with a clock behind, restored from an old "
              "backup) grants tokens that can never write, until re-seeded")


def _fences(probe: _LockProbe | None, store: Any, installed: int, lock_url: str, sample: int,
            reseed: bool, redis_prefix: str) -> Check:
    title = "Fences vs lock server counters"
    if probe is None or store is None:
        return Check("fences", title, "skip", "a backend did not answer", _FENCE_WHY)
    if not probe.hybrid:
        return Check("fences", title, "pass", f"{probe.kind} tokens are revisions of its Raft log: "
                     "they only grow and survive restarts", _FENCE_WHY)
    if installed == 0:
        return Check("fences", title, "skip", "the store's schema is not installed", _FENCE_WHY)
    marks = _recent_marks(store, sample)
    if not marks:
        return Check("fences", title, "pass", "no fenced key in the store yet", _FENCE_WHY)
    now_us = probe.server_time_us() or 0
    behind: dict[str, tuple[int, int]] = {}
    counters = 0
    for key, mark in marks:
        counter = probe.current_token(key) or 0
        counters += counter > 0
        next_token = max(counter + 1, now_us)
        if next_token <= mark:
            behind[key] = (mark, next_token)
    data: dict[str, Any] = {"keys_checked": len(marks), "counters_present": counters,
                            "behind": {k: {"store": m, "next": n} for k, (m, n) in behind.items()}}
    scope = (f"{len(marks)} fenced key{'s' if len(marks) != 1 else ''}"
             f"{' (the most recently written)' if len(marks) >= sample else ''}")
    if not behind:
        return Check("fences", title, "pass",
                     f"{scope}: every next token is above the store's high-water mark "
                     f"({counters} with a live counter, the rest covered by the server clock)",
                     _FENCE_WHY, data=data)
    shown = ", ".join(f"{k} (store {m}, next {n})" for k, (m, n) in list(behind.items())[:3])
    more = f" and {len(behind) - 3} more" if len(behind) > 3 else ""
    if reseed:
        try:
            from toolguard.locks import connect
            from toolguard.store.recovery import reseed as do_reseed

            options = {"prefix": redis_prefix} if probe.kind == "redis" else {}
            locks = connect(lock_url, **options)
            try:
                floors = do_reseed(locks, store, list(behind))
            finally:
                locks.close()
        except ToolGuardError as error:
            return Check("fences", title, "fail", f"{scope}: {len(behind)} behind ({shown}{more}); "
                         f"re-seeding failed: {error}", _FENCE_WHY, data=data,
                         unreachable=isinstance(error, BackendUnavailable))
        return Check("fences", title, "pass",
                     f"{scope}: {len(behind)} were behind ({shown}{more}); re-seeded "
                     f"{len(floors)} from the store", _FENCE_WHY, data={**data, "reseeded": floors})
    return Check("fences", title, "fail",
                 f"{scope}: {len(behind)} behind the store ({shown}{more}); their next grants "
                 f"would be refused", _FENCE_WHY, data=data,
                 fix="toolguard doctor --reseed (runs toolguard.store.recovery.reseed for them)")


def _recent_marks(store: Any, sample: int) -> list[tuple[str, int]]:
    sql = "SELECT key, token FROM toolguard_high_water ORDER BY updated_at DESC LIMIT %s"
    with store.connection() as conn:
        if store.dialect == "sqlite":
            rows = conn.execute(sql.replace("%s", "?"), (sample,)).fetchall()
        else:
            rows = conn.execute(sql, (sample,)).fetchall()
    return [(str(key), int(token)) for key, token in rows]


_SIGNAL_WHY = ("a holder stopped inside its fenced transaction keeps its fence rows locked; the next "
               "holder, with a newer token, ends that transaction once the stopped holder's lease "
               "is gone (pg_terminate_backend). That needs the same role for every client or "
               "pg_signal_backend; without it the next holder waits until the stopped one wakes or "
               "dies (fail safe, but unbounded)")

#: The store's role, whether it is a superuser or in pg_signal_backend, and the other login
#: roles that may fence in this store (UPDATE on toolguard_high_water) whose sessions it may
#: not end. Superusers are left out: only a superuser may end a superuser's session.
_SIGNAL_QUERY = """
SELECT current_user, r.rolsuper, pg_has_role(current_user, 'pg_signal_backend', 'USAGE'),
       ARRAY(SELECT o.rolname::text FROM pg_roles o
              WHERE o.rolcanlogin AND NOT o.rolsuper AND o.rolname <> current_user
                AND has_table_privilege(o.oid, 'toolguard_high_water', 'UPDATE')
                AND NOT pg_has_role(current_user, o.oid, 'USAGE')
              ORDER BY 1)
  FROM pg_roles r WHERE r.rolname = current_user
"""


def _signal(store: Any, installed: int) -> Check:
    title = "Paused-holder bound (PostgreSQL store)"
    if store is None:
        return Check("pg_signal", title, "skip", "the store did not answer", _SIGNAL_WHY)
    if store.dialect != "postgresql":
        return Check("pg_signal", title, "skip",
                     "SQLite store: nothing can end another process's transaction (a stopped "
                     "holder blocks writers until it wakes; see toolguard/sql/README.md)",
                     _SIGNAL_WHY)
    if installed < 3:
        return Check("pg_signal", title, "skip", "the store's schema is not installed (version 3 "
                     "brings the bound)", _SIGNAL_WHY)
    try:
        with store.connection() as conn:
            row = conn.execute(_SIGNAL_QUERY).fetchone()
    except Exception as error:
        return Check("pg_signal", title, "warn", f"cannot read the role's permissions: "
                     f"{_reason(error)}", _SIGNAL_WHY)
    role, superuser, signaller, others = row[0], bool(row[1]), bool(row[2]), list(row[3] or [])
    data = {"role": role, "superuser": superuser, "pg_signal_backend": signaller,
            "unsignalable_roles": others}
    if superuser:
        return Check("pg_signal", title, "pass",
                     f"role {role} is a superuser: it may end any paused holder's transaction",
                     _SIGNAL_WHY, data=data)
    if signaller:
        return Check("pg_signal", title, "pass",
                     f"role {role} is a member of pg_signal_backend: it may end a paused holder's "
                     f"transaction (a superuser's excepted)", _SIGNAL_WHY, data=data)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        return Check("pg_signal", title, "warn",
                     f"role {role} may not end the sessions of {shown}, which may fence here too, "
                     f"and is not in pg_signal_backend: a paused holder of theirs makes the next "
                     f"holder wait until it wakes", _SIGNAL_WHY, data=data,
                     fix=f"GRANT pg_signal_backend TO {_ident(role)} (or one role for every client)")
    return Check("pg_signal", title, "pass",
                 f"role {role} is the only role that may fence here (others it may not signal: "
                 f"none): one role for every client", _SIGNAL_WHY, data=data)


def _ident(name: str) -> str:
    """A role name as SQL would need it in a GRANT (quoted unless plain)."""
    if re.fullmatch(r"[a-z_][a-z0-9_$]*", name):
        return name
    return '"' + name.replace('"', '""') + '"'
