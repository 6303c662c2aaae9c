"""The lock server's checks: Redis eviction and persistence (per node), clocks, TTL vs round trip.

What the lock server's configuration and distance mean for held locks and
their tokens; a Redis Cluster is judged node by node (``_per_node``). Separate
from the store's checks (``database``) and from the fence checks (``fences``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from toolguard.cli.checks.probes import NodeConfig, _LockProbe, _skew_s
from toolguard.cli.checks.report import Check, Status, _reason

#: Clock skew thresholds (seconds) between this host and a server.
SKEW_WARN_S = 0.5
SKEW_FAIL_S = 5.0
#: A renewal (at ttl/3) should leave room for this many round trips.
RENEWAL_ROUND_TRIPS = 10
#: Below this TTL, a pause of the holder (GC, a long synchronous call) loses the lease.
SHORT_TTL_MS = 1000


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


