"""Fenced distributed locks: one contract, several backends, sync and asyncio.

>>> from toolguard.locks import connect
>>> locks = connect("redis://127.0.0.1:6379/0")       # or "sqlite:///path/to.db"
>>> with locks.acquire(["lead:1", "lead:2"], ttl_ms=10_000, timeout_s=5) as lease:
...     lease.tokens        # {"lead:1": 17..., "lead:2": 17...}: pass them to the store
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlparse

from toolguard.errors import ConfigurationError, LockError, LockLost, LockTimeout, NotOwned
from toolguard.locks.base import AsyncLockBackend, Attempt, BackendInfo, LockBackend
from toolguard.locks.lease import Lease, heartbeat
from toolguard.locks.manager import AsyncLockManager, LockManager
from toolguard.runtime.extras import require

__all__ = [
    "AsyncLockBackend",
    "AsyncLockManager",
    "Attempt",
    "BackendInfo",
    "Lease",
    "LockBackend",
    "LockError",
    "LockLost",
    "LockManager",
    "LockTimeout",
    "NotOwned",
    "connect",
    "connect_async",
    "heartbeat",
    "open_backend",
    "sqlite_path",
]

#: Redis Cluster and Sentinel (``toolguard.locks.redis_ha``): the Redis scripts, other clients.
REDIS_HA_SCHEMES = ("redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel")
SCHEMES = ("redis", "rediss", "unix", "sqlite", "postgresql", "postgres", "etcd",
           *REDIS_HA_SCHEMES)

T = TypeVar("T")


def sqlite_path(url: str) -> str:
    """``sqlite:///rel.db`` is relative, ``sqlite:////abs/x.db`` absolute (as in SQLAlchemy)."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or len(url) == len(prefix):
        msg = f"a SQLite URL looks like sqlite:///relative.db or sqlite:////abs/path.db, got {url!r}"
        raise ConfigurationError(msg)
    return url[len(prefix):]


def open_backend(url: str, **options: Any) -> LockBackend:
    """The sync backend for ``url``, chosen by scheme.

    An option the backend does not take is a ``ConfigurationError`` naming it (and
    the options it does take), as is an option with a value it cannot use.
    """
    return _open_backend(url, options, prepare=True)


def _open_backend(url: str, options: dict[str, Any], *, prepare: bool) -> LockBackend:
    """``open_backend``; ``prepare=False`` leaves what blocks (a SQLite file's setup, a
    Redis Cluster's slot map) to the first use, which the asyncio paths make in a thread."""
    given: object = url  # untyped callers may pass anything
    if not isinstance(given, str):
        msg = f"a lock URL must be a string, got {given!r}"
        raise ConfigurationError(msg)
    scheme = urlparse(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        require("redis", "the Redis lock backend")
        from toolguard.locks.redis import RedisBackend

        return _construct(RedisBackend, scheme, url, options)
    if scheme in REDIS_HA_SCHEMES:
        require("redis", "the Redis Cluster/Sentinel lock backend")
        from toolguard.locks.redis import RedisBackend
        from toolguard.locks.redis_ha import CLUSTER_SCHEMES, DeferredClusterBackend, open_sync

        _check_options(RedisBackend, scheme, options)  # the same options as one Redis server
        if not prepare and scheme in CLUSTER_SCHEMES:
            return DeferredClusterBackend(url, **options)
        return open_sync(url, **options)
    if scheme == "sqlite":
        from toolguard.locks.sqlite import SqliteBackend

        backend = _construct(SqliteBackend, scheme, sqlite_path(url), options)
        if prepare:
            backend.prepare()
        return backend
    if scheme in ("postgresql", "postgres"):
        require("postgres", "the PostgreSQL lock backend")
        from toolguard.locks.postgres import PostgresBackend

        return _construct(PostgresBackend, scheme, url, options)
    if scheme == "etcd":
        require("etcd", "the etcd lock backend")
        from toolguard.locks.etcd import EtcdBackend

        return _construct(EtcdBackend, scheme, url, options)
    msg = f"unknown lock backend URL scheme {scheme!r} in {url!r}; expected one of {SCHEMES}"
    raise ConfigurationError(msg)


def _construct(cls: Callable[..., T], scheme: str, target: str, options: dict[str, Any]) -> T:
    """``cls(target, **options)``, with unknown options reported as configuration errors."""
    _check_options(cls, scheme, options)
    return cls(target, **options)


def _check_options(cls: Callable[..., Any], scheme: str, options: dict[str, Any]) -> None:
    """Raise ``ConfigurationError`` naming every option ``cls`` does not take."""
    parameters = list(inspect.signature(cls).parameters.values())[1:]
    known = sorted(p.name for p in parameters
                   if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
    unknown = sorted(set(options) - set(known))
    if unknown:
        msg = (f"unknown lock option{'s' if len(unknown) > 1 else ''} "
               f"{', '.join(map(repr, unknown))} for {scheme}:// URLs; the backend takes "
               f"{', '.join(known)}, and every manager {', '.join(sorted(_MANAGER_OPTIONS))}")
        raise ConfigurationError(msg)


def _async_backend(url: str, sync: LockBackend, **options: Any) -> AsyncLockBackend:
    scheme = urlparse(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        from toolguard.locks.redis import AsyncRedisBackend

        return AsyncRedisBackend(url, **options)
    if scheme in REDIS_HA_SCHEMES:
        from toolguard.locks.redis_ha import open_async

        return open_async(url, **options)
    if scheme in ("postgresql", "postgres"):
        from toolguard.locks.postgres import AsyncPostgresBackend, PostgresBackend

        assert isinstance(sync, PostgresBackend)
        return AsyncPostgresBackend(sync)
    if scheme == "etcd":
        from toolguard.locks.etcd import AsyncEtcdBackend, EtcdBackend

        assert isinstance(sync, EtcdBackend)
        return AsyncEtcdBackend(sync)
    from toolguard.locks.sqlite import AsyncSqliteBackend, SqliteBackend

    assert isinstance(sync, SqliteBackend)
    return AsyncSqliteBackend(sync)


def connect(url: str | None = None, **options: Any) -> LockManager:
    """A ``LockManager`` for ``url`` (default: settings, i.e. the embedded SQLite file)."""
    backend_options, manager_options = _split(options)
    if url is None:
        from toolguard.config import Settings

        settings = Settings()
        url = settings.resolved_lock_url()
        manager_options.setdefault("ttl_ms", settings.ttl_ms)
        manager_options.setdefault("timeout_s", settings.wait_timeout_s)
    return LockManager(open_backend(url, **backend_options), space=lock_space(url, backend_options),
                       **manager_options)


def connect_async(url: str | None = None, **options: Any) -> AsyncLockManager:
    """An ``AsyncLockManager`` for ``url``; renewals share the process heartbeat."""
    backend_options, manager_options = _split(options)
    if url is None:  # the same defaults as ``connect``: settings apply to async code too
        from toolguard.config import Settings

        settings = Settings()
        url = settings.resolved_lock_url()
        manager_options.setdefault("ttl_ms", settings.ttl_ms)
        manager_options.setdefault("timeout_s", settings.wait_timeout_s)
    sync = _open_backend(url, backend_options, prepare=False)  # no file I/O in the caller's loop
    return AsyncLockManager(_async_backend(url, sync, **backend_options), sync,
                            space=lock_space(url, backend_options), **manager_options)


def lock_space(url: str, backend_options: dict[str, Any]) -> str:
    """The lock space a URL and its backend options name (the server, its namespace): every
    manager of this process made for it shares one set of claims (sync and asyncio alike)."""
    shown = ",".join(f"{name}={backend_options[name]!r}" for name in sorted(backend_options))
    return f"{url}|{shown}"


_MANAGER_OPTIONS = {"ttl_ms", "timeout_s", "round_wait_s", "backoff_base_s", "backoff_cap_s"}


def _split(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    manager = {k: v for k, v in options.items() if k in _MANAGER_OPTIONS}
    backend = {k: v for k, v in options.items() if k not in _MANAGER_OPTIONS}
    return backend, manager
