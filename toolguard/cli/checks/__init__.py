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

The checks live by what they look at: ``probes`` (reaching the backends),
``lock_server``, ``database``, ``fences``; ``report`` holds the ``Check`` they
return. This module runs them in order.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Iterable

from toolguard.cli.checks.database import _lock_schema, _schema, _signal
from toolguard.cli.checks.fences import _fence_claims, _fences
from toolguard.cli.checks.lock_server import _clocks, _eviction, _persistence, _ttls
from toolguard.cli.checks.probes import (
    NodeConfig,
    _is_refusal,
    _lock_probe,
    _LockProbe,
    _NotCreatedStore,
    _open_store,
    _redact,
    _round_trips,
)
from toolguard.cli.checks.report import Check, Status, _reason, exit_code
from toolguard.errors import ConfigurationError

__all__ = ["Check", "Status", "exit_code", "run_checks"]


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
