"""Keeping lock state for idle resources from piling up on the PostgreSQL and etcd backends.

Redis needs nothing: every key of a lock expires by itself (the counter after
``counter_ttl_ms``), so memory returns to its baseline once resources go idle.
The other two keep something per resource or per change unless told otherwise:

* PostgreSQL keeps one ``toolguard_lock_fence`` row per key ever locked, and the
  holder or waiter rows that a crashed process left behind until that key is
  locked again. ``sweep_postgres_locks`` deletes what belongs to idle keys.
* etcd deletes a lock's entries on release, but keeps every revision in its
  history until compacted, and its database file keeps its size until
  defragmented. ``compact_etcd`` does both; etcd's own
  ``--auto-compaction-mode`` / ``--auto-compaction-retention`` can do the first.

Run either from a cron job or a periodic task; both are safe at any time:

>>> sweep_postgres_locks("postgresql://localhost/app", idle_s=24 * 3600)  # doctest: +SKIP
>>> compact_etcd("etcd://etcd1:2379,etcd2:2379", keep_revisions=10_000)   # doctest: +SKIP

Why deleting a fence row is safe: tokens are hybrid-clock values, ``max(last + 1,
database time in µs)``. A key whose last token was minted more than ``idle_s`` ago
has a token below ``now - idle_s``; without its row the next grant mints the
database time, still above it unless the clock went back by more than ``idle_s``.
Rows holding a re-seeded floor above the clock are never idle by that test, and
the store's high-water marks stay the backstop either way (``run_fenced``
re-seeds). The store's own tables are not touched: its fence marks are the
durable record of what was accepted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from toolguard.errors import BackendUnavailable, ConfigurationError

__all__ = ["EtcdCompaction", "PostgresSweep", "compact_etcd", "sweep_postgres_locks"]


@dataclass(frozen=True, slots=True)
class PostgresSweep:
    """What one ``sweep_postgres_locks`` deleted."""

    fences: int
    holders: int
    waiters: int


# Holders whose lease ran out idle_s ago: nobody renews them any more (renew and release
# both require an unexpired lease to say "yours"), and acquire would delete them anyway.
_SWEEP_HOLDERS = """
DELETE FROM toolguard_lock_holder
 WHERE expires_at < clock_timestamp() - %(idle_s)s * interval '1 second'
"""
# Waiters whose presence deadline lapsed idle_s ago (a crashed or gone process).
_SWEEP_WAITERS = """
DELETE FROM toolguard_lock_waiter
 WHERE present_until < clock_timestamp() - %(idle_s)s * interval '1 second'
"""
# Fence rows of keys without holder or waiter whose last token is older than idle_s.
# SKIP LOCKED: a key being acquired or released right now is left for the next sweep.
_SWEEP_FENCES = """
DELETE FROM toolguard_lock_fence
 WHERE key IN (
    SELECT f.key FROM toolguard_lock_fence f
     WHERE f.token < (extract(epoch FROM clock_timestamp()) - %(idle_s)s) * 1000000
       AND NOT EXISTS (SELECT 1 FROM toolguard_lock_holder h WHERE h.key = f.key)
       AND NOT EXISTS (SELECT 1 FROM toolguard_lock_waiter w WHERE w.key = f.key)
     LIMIT %(batch)s
       FOR UPDATE OF f SKIP LOCKED)
"""


@contextlib.contextmanager
def _connection(target: str | psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    if isinstance(target, psycopg.Connection):
        yield target
        return
    try:
        conn = psycopg.connect(target, autocommit=True, connect_timeout=10)
    except psycopg.Error as error:
        msg = f"postgres: {error}"
        raise BackendUnavailable(msg) from error
    with conn:
        yield conn


def sweep_postgres_locks(target: str | psycopg.Connection[Any], *, idle_s: float = 24 * 3600,
                         batch: int = 10_000, schema: str | None = None) -> PostgresSweep:
    """Delete the lock rows of keys idle for ``idle_s`` seconds; returns the counts.

    ``target`` is the lock backend's URL or an open (autocommit) connection;
    ``schema`` the schema of the lock tables if not on the search path. Fence
    rows go in batches of ``batch``, each its own short transaction, so a sweep
    of millions of keys never holds many row locks at once.

    A key acquired while the sweep runs is safe: since lock schema 3 acquire
    creates or locks its row in one statement, so the sweep skips a locked row,
    or deletes it before the acquire creates it again with a fresh token. Sweep
    with an ``idle_s`` far above your lock TTLs (the default is a day).
    """
    if idle_s < 0 or batch < 1:
        msg = f"idle_s must be >= 0 and batch >= 1, got idle_s={idle_s!r}, batch={batch!r}"
        raise ConfigurationError(msg)
    params = {"idle_s": float(idle_s), "batch": int(batch)}
    with _connection(target) as conn:
        try:
            if schema is not None:
                conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
            holders = conn.execute(_SWEEP_HOLDERS, params).rowcount
            waiters = conn.execute(_SWEEP_WAITERS, params).rowcount
            fences = 0
            while True:
                deleted = conn.execute(_SWEEP_FENCES, params).rowcount
                fences += deleted
                if deleted < batch:
                    break
        except psycopg.OperationalError as error:
            msg = f"postgres: {error}"
            raise BackendUnavailable(msg) from error
    return PostgresSweep(fences=fences, holders=holders, waiters=waiters)


@dataclass(frozen=True, slots=True)
class EtcdCompaction:
    """What one ``compact_etcd`` did: the revision compacted to (0: nothing to do) and
    each member's database size before and after, in bytes."""

    revision: int
    sizes: dict[str, tuple[int, int]]


def _members(url: str) -> list[Any]:
    from etcd3gw.client import Etcd3Client

    from toolguard.locks.etcd import parse_etcd_url

    endpoints, _ = parse_etcd_url(url)
    return [Etcd3Client(host=host, port=port, timeout=30) for host, port in endpoints]


def compact_etcd(url: str, *, keep_revisions: int = 10_000,
                 defragment: bool = True) -> EtcdCompaction:
    """Compact etcd's history to the last ``keep_revisions`` revisions, then defragment
    every member named in ``url`` (so the file shrinks too).

    Waiters' watches survive a compaction (they are woken once and look again).
    Defragmenting blocks a member for a moment: name members one at a time in
    ``url`` if that matters, or pass ``defragment=False`` and rely on the space
    being reused.
    """
    if keep_revisions < 0:
        msg = f"keep_revisions must be >= 0, got {keep_revisions!r}"
        raise ConfigurationError(msg)
    from etcd3gw.exceptions import Etcd3Exception
    from requests import RequestException

    members = _members(url)
    try:
        before = {f"{m.host}:{m.port}": int(m.status()["dbSize"]) for m in members}
        head = int(members[0].status()["header"]["revision"])
        revision = head - keep_revisions
        if revision > 1:
            try:
                members[0].post(members[0].get_url("/kv/compaction"),
                                json={"revision": revision, "physical": True})
            except Exception as error:  # already compacted past it: nothing to do
                if "compacted" not in str(error):
                    raise
        else:
            revision = 0
        if defragment:
            for member in members:
                member.post(member.get_url("/maintenance/defragment"), json={})
        after = {f"{m.host}:{m.port}": int(m.status()["dbSize"]) for m in members}
    except (OSError, KeyError, Etcd3Exception, RequestException) as error:
        msg = f"etcd {url}: {error}"
        raise BackendUnavailable(msg) from error
    finally:
        for member in members:
            with contextlib.suppress(Exception):
                member.session.close()
    return EtcdCompaction(revision=revision,
                          sizes={name: (before[name], after[name]) for name in before})
