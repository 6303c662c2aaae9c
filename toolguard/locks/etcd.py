"""etcd v3 backend (etcd3gw, over etcd's HTTP/JSON gateway): a FIFO queue like etcd's Mutex.

Layout under the prefix (default ``toolguard/lock/``; the lock key is percent-encoded,
so no key's queue is a prefix of another's)::

    {prefix}q/{key}/{owner}   one entry per contender, attached to its process lease;
                              the holder is the entry with the lowest create_revision
    {prefix}floor/{key}       re-seed offset added to every token of the key (absent: 0)
    {prefix}epoch             the cluster's epoch, added to every token: the wall clock (us)
                              of the first grant on this cluster (written once)

``try_acquire`` is one transaction: "create my entry unless it exists" (compare
create_revision == 0, put with the lease), plus, in the same step, the reads that
say whether it is first in line and which entry is just ahead of it.

Tokens are etcd revisions: the create_revision of the holder's entry, plus the
cluster's epoch, plus the re-seed offset (0 unless ``raise_floor`` needed it).
The epoch is there for a cluster that lost its data (restored from nothing, a
member restarted with an empty data dir): its revisions start again at 1, so
without it the next tokens would be at or below tokens granted before, equal
ones would be accepted by the store as the same lease's, and a holder from
before could write after a newer one. A new cluster's epoch is the wall clock
of its first grant: above every token of the cluster before it, whose epoch was
older by more than its revision count (etcd commits far fewer than one revision
per microsecond). The revision is fixed when the
contender joins the line and handed out only when it is first; entries are served
in create_revision order, so token order is still grant order. Revisions are
replicated by Raft, so they survive restarts and leader changes. They are global
revisions: compare them only between grants of the same key.

A waiter is woken by the deletion of the entry just ahead of it (only the successor
wakes) and then takes the lock with its next ``try_acquire``: there is no hand-off
by the releaser, which only deletes its entry. Deletions reach waiters through one
watch per backend object on the whole queue prefix (an HTTP stream read by one
thread; etcd3gw's own watcher costs a thread pool per watch and closes its client's
connection pool when stopped), not a watch per wait: like LISTEN on one channel,
every process receives every deletion under the prefix, and a wait sends nothing.

Liveness has two layers:

* Every contender touches its entry on each ``try_acquire`` (a put that keeps the
  lease, so mod_revision moves): a waiter at least every third of its presence
  window (``presence_ms``, carried in its owner id as the hand-off TTL, at most its
  TTL), and the grant marks the entry ``h`` in the same step. A holder touches it
  on every renewal. A contender that sees an entry ahead of it with its
  mod_revision unchanged, measured on its own monotonic clock from when it first
  saw it, deletes it with a compare on that mod_revision once it has been silent
  for the owner's TTL if it is a holder (marked ``h``: its local deadline has passed
  by then, the same clock-rate assumption as every backend's 2% margin), or for the
  owner's presence window if it is a waiter (it holds nothing; it only loses its
  place). A crashed holder's lock frees within its TTL of the first contender's
  sight of it; a crashed waiter holds up the line no longer than its presence
  window. Contenders look at the first entry and the few just ahead of them.
* Every entry is attached to a process lease, the backstop that removes the entries
  of a dead process when nobody contends. There is one etcd lease per process and
  TTL class rather than one per lock, so ``renew`` is one keepalive per class plus
  one transaction touching every held entry, however many locks are held. etcd
  lease TTLs are whole seconds, at least 1 s (and at least etcd's own minimum, 1.5 x
  the election timeout, 2 s by default): the class is ``ceil(1.5 x TTL)`` seconds, so
  the heartbeat's keepalive (every third of the TTL) keeps the lease more than one
  TTL ahead and a grant needs no keepalive of its own. When the lease is not that far
  ahead (an idle process), ``try_acquire`` sends a keepalive first: the server never
  drops an entry before its holder's local deadline.

Keep etcd's history compacted (``--auto-compaction-retention``): every grant,
release and renewal is a revision. The watch survives compaction by waking every
waiter once.

The parts: ``toolguard.locks.etcd_wire`` holds the key layout and the gateway's
JSON (built and read by small pure helpers), ``toolguard.locks.etcd_watch`` the
deletion watch and the waiters' doorbells. This module holds the two backends,
their process leases, and re-exports the public names of the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlparse

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception
from requests.adapters import HTTPAdapter

from toolguard.errors import BackendUnavailable, ConfigurationError
from toolguard.locks.base import MIN_TTL_MS, Attempt, BackendInfo, check_ms, check_seconds
from toolguard.locks.etcd_watch import _DeletionWatch, _Wake

# Re-exported: tests and benchmarks import DEFAULT_PREFIX from this module.
from toolguard.locks.etcd_wire import DEFAULT_PREFIX as DEFAULT_PREFIX
from toolguard.locks.etcd_wire import (
    HELD,
    _b64,
    _epoch,
    _kvs,
    _mark_held,
    _Names,
    _offset,
    _range,
    _Seen,
    _touch,
    _unb64,
    etcd_keys,
)
from toolguard.runtime.connection_errors import refuse_misconfigured

__all__ = ["AsyncEtcdBackend", "EtcdBackend", "etcd_keys", "lease_seconds", "parse_etcd_url"]

INFO = BackendInfo(
    name="etcd",
    durable_tokens=True,
    server_wakeup=True,
    fair=True,
    note="Raft consensus: a grant survives leader changes; tokens are etcd revisions "
         "(compare them within one key); a holder silent for its TTL is expired by the "
         "next contender, a dead process's entries by its whole-second lease",
)

DEFAULT_PRESENCE_MS = 2_000
#: How many entries just ahead of a waiter it reads (and may expire) on each try.
AHEAD_SEEN = 8
#: Silence clocks remembered per process (entries long gone drop out first).
SILENCE_SEEN = 4096
#: The process lease of a lock lasts this many TTLs, rounded up to whole seconds.
LEASE_FACTOR = 1.5
#: etcd's default ``--max-txn-ops``: renew touches at most this many entries per transaction.
MAX_TXN_OPS = 128

T = TypeVar("T")


def lease_seconds(ttl_ms: int) -> int:
    """The etcd lease TTL (whole seconds) that carries a lock of ``ttl_ms``: 1.5 x the TTL,
    rounded up, so that the heartbeat (every third of the TTL) keeps the shared lease
    at least one TTL ahead and a grant needs no keepalive of its own."""
    return max(1, math.ceil(ttl_ms * LEASE_FACTOR / 1000))


def parse_etcd_url(url: str) -> tuple[list[tuple[str, int]], str | None]:
    """``etcd://host:port[,host:port...][/prefix]`` -> endpoints and key prefix."""
    parsed = urlparse(url)
    if parsed.scheme != "etcd" or not parsed.netloc:
        msg = f"an etcd URL looks like etcd://host:2379[,host2:2379][/prefix], got {url!r}"
        raise ConfigurationError(msg)
    endpoints = []
    for part in parsed.netloc.split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            host, port = part, "2379"
        endpoints.append((host.strip("[]"), int(port)))
    prefix = parsed.path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return endpoints, prefix or None


@dataclass(slots=True)
class _ProcessLease:
    id: int
    seconds: int
    #: Local monotonic time before which the server cannot have expired it.
    expires_at: float


@dataclass(slots=True)
class _Entry:
    """This process's view of one of its queue entries."""

    revision: int
    lease_seconds: int
    ahead: bytes | None  # the entry just ahead; None when this one is first (the holder)
    seen: int  # store revision at which ``ahead`` was read
    token: int | None = None


class _LeaseNotFound(BackendUnavailable):
    """The process lease expired on the server (the process stalled): grant a new one."""


_TRANSPORT = (ConnectionFailedError, ConnectionTimeoutError, requests.RequestException, OSError)


class EtcdBackend:
    """Sync etcd backend; safe to share between threads, reset in a forked child."""

    info = INFO

    def __init__(self, url: str = "etcd://127.0.0.1:2379", *, prefix: str | None = None,
                 timeout_s: float = 5.0, presence_ms: int = DEFAULT_PRESENCE_MS) -> None:
        self.endpoints, url_prefix = parse_etcd_url(url)
        if prefix is not None and (not isinstance(prefix, str) or not prefix):
            msg = f"prefix must be a non-empty string, got {prefix!r}"
            raise ConfigurationError(msg)
        self.prefix = (prefix or url_prefix or DEFAULT_PREFIX).encode()
        self.timeout_s = check_seconds("timeout_s", timeout_s, positive=True)
        self.presence_ms = check_ms("presence_ms", presence_ms, MIN_TTL_MS)
        self._mutex = threading.Lock()
        self._lease_mutex = threading.Lock()  # one keepalive or grant at a time per process
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._leases: dict[int, _ProcessLease] = {}
        # queue entry -> (its mod_revision, when this process first saw it with that revision)
        self._silence: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self._current = 0
        self._client: Etcd3Client | None = None
        self._api_path: str | None = None
        self._pid = os.getpid()
        self._closed = False
        self._deletions: _DeletionWatch | None = None

    # --- plumbing -------------------------------------------------------------------------

    def _endpoint(self) -> str:
        host, port = self.endpoints[self._current]
        return f"{host}:{port}"

    def _new_client(self, pool_size: int = 32, endpoint: int | None = None) -> Etcd3Client:
        host, port = self.endpoints[self._current if endpoint is None else endpoint]
        session = requests.Session()
        session.mount("http://", HTTPAdapter(pool_connections=1, pool_maxsize=pool_size))
        return Etcd3Client(host=host, port=port, timeout=self.timeout_s, api_path=self._api_path,
                           session=session)

    def _etcd(self) -> Etcd3Client:
        if self._closed:
            msg = "etcd backend is closed"
            raise BackendUnavailable(msg)
        if self._pid != os.getpid():  # a forked child: the parent's leases are not ours
            self._pid = os.getpid()
            self._client = None
            self._deletions = None
            with self._mutex:
                self._entries.clear()
                self._leases.clear()
                self._silence.clear()
        client = self._client
        if client is None:
            client = self._client = self._new_client()
        return client

    def _call(self, what: str, step: Callable[[Etcd3Client], T]) -> T:
        """Run one request; translate etcd3gw and requests errors into ``BackendUnavailable``."""
        client = self._etcd()
        try:
            result = step(client)
            self._api_path = client.api_path
            return result
        except _TRANSPORT as error:
            if len(self.endpoints) == 1:  # with several, one bad name is one member away
                refuse_misconfigured("etcd", error, self._endpoint())
            msg = f"etcd {self._endpoint()}: {what}: {error}"
            self._failover(client)
            raise BackendUnavailable(msg) from error
        except Etcd3Exception as error:
            detail = f"{error.detail_text or ''} {error.args}"
            if "lease not found" in detail:
                raise _LeaseNotFound(f"etcd: {what}: lease not found") from error
            msg = f"etcd {self._endpoint()}: {what}: {detail.strip()}"
            raise BackendUnavailable(msg) from error

    def _failover(self, client: Etcd3Client) -> None:
        """After a transport error, send the next request to the next endpoint."""
        if len(self.endpoints) > 1 and self._client is client:
            self._current = (self._current + 1) % len(self.endpoints)
            self._client = None
            client.session.close()

    def _txn(self, what: str, compare: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        body = {"compare": compare, "success": success, "failure": failure or []}
        return dict(self._call(what, lambda etcd: etcd.transaction(body)))

    # --- process leases ----------------------------------------------------------------------

    def _lease(self, seconds: int, need_s: float) -> _ProcessLease:
        """The process lease of class ``seconds``, alive for at least ``need_s`` more."""
        with self._lease_mutex:
            lease = self._leases.get(seconds)
            now = time.monotonic()
            if lease is not None and lease.expires_at - now >= need_s:
                return lease
            if lease is not None and lease.expires_at > now and self._keepalive(lease):
                return lease
            sent = time.monotonic()
            reply = self._call("lease grant", lambda etcd: etcd.post(
                etcd.get_url("/lease/grant"), json={"TTL": seconds, "ID": 0}))
            lease = _ProcessLease(id=int(reply["ID"]), seconds=seconds,
                                  expires_at=sent + int(reply["TTL"]))
            self._leases[seconds] = lease
            return lease

    def _keepalive(self, lease: _ProcessLease) -> bool:
        """One keepalive; False (and forget the lease) if the server says it expired."""
        sent = time.monotonic()
        reply = self._call("lease keepalive", lambda etcd: etcd.post(
            etcd.get_url("/lease/keepalive"), json={"ID": lease.id}))
        ttl = int(reply.get("result", {}).get("TTL", -1))
        if ttl <= 0:
            if self._leases.get(lease.seconds) is lease:
                del self._leases[lease.seconds]
            return False
        lease.expires_at = sent + ttl
        return True

    def _forget_lease(self, lease: _ProcessLease) -> None:
        with self._lease_mutex:
            if self._leases.get(lease.seconds) is lease:
                del self._leases[lease.seconds]

    # --- the protocol ---------------------------------------------------------------------------

    def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        """Create (or touch) this owner's queue entry and see whether it is first: one txn.

        A keepalive goes first when the process lease could expire within the TTL;
        expiring silent entries ahead (see ``_expire_silent``) costs one more round trip.
        """
        seconds = lease_seconds(ttl_ms)
        names = _Names.of(self.prefix, key, owner)
        # The holder's local deadline starts before this call: the lease must outlive the TTL.
        need_s = ttl_ms / 1000 + 0.01
        attempt = Attempt(token=None)
        for _ in range(3):  # a lease that vanished, an entry made elsewhere, a silent entry
            with self._mutex:
                entry = self._entries.get((key, owner))
            lease = self._lease(seconds, need_s)
            sent = time.monotonic()
            try:
                reply = self._acquire_txn(names, lease.id, entry)
            except _LeaseNotFound:
                self._forget_lease(lease)
                continue
            step = self._read_acquire(key, owner, names, seconds, entry, reply)
            if step is None:  # our entry, unknown to this object: read again knowing it
                continue
            attempt, ahead = step
            if attempt.granted:
                return attempt
            retry_ms = self._expire_silent(ahead, sent)
            if retry_ms is not None:
                return Attempt(token=None, retry_ms=retry_ms)
        return attempt

    def _acquire_txn(self, names: _Names, lease_id: int, entry: _Entry | None) -> dict[str, Any]:
        """Success (a new entry): [put it, marked held if the line was empty; mine and the
        ones just ahead; floor; head]. Failure (already in line): [mine; the ones just
        ahead; floor; head; mark mine held if first, else touch it]."""
        head = _range(names.queue, names.queue_end, limit=1, by_creation=True, values=True)
        epoch = _range(self._epoch_key)
        failure = [_range(names.entry), head, _range(names.floor), head]
        if entry is not None:
            failure[1] = _range(names.queue, names.queue_end, limit=AHEAD_SEEN, by_creation=True,
                                newest_first=True, max_create_revision=max(1, entry.revision - 1),
                                values=True)
            # First in line: the grant, marked on the entry (which restarts its silence
            # clock). Otherwise a touch: this waiter is present.
            failure.append({"request_txn": {
                "compare": [{"key": _b64(names.queue), "range_end": _b64(names.queue_end),
                             "target": "CREATE", "result": "GREATER",
                             "create_revision": entry.revision - 1}],
                "success": [_mark_held(names.entry)], "failure": [_touch(names.entry)]}})
        failure.append(epoch)  # last, as in success
        empty = {"key": _b64(names.queue), "range_end": _b64(names.queue_end),
                 "target": "CREATE", "result": "EQUAL", "create_revision": 0}
        return self._txn(
            "acquire",
            compare=[{"key": _b64(names.entry), "target": "CREATE", "result": "EQUAL",
                      "create_revision": 0}],
            success=[
                {"request_txn": {"compare": [empty], "success": [
                    {"request_put": {"key": _b64(names.entry), "value": _b64(HELD),
                                     "lease": lease_id}}],
                    "failure": [{"request_put": {"key": _b64(names.entry), "value": "",
                                                 "lease": lease_id}}]}},
                _range(names.queue, names.queue_end, limit=AHEAD_SEEN + 1, by_creation=True,
                       newest_first=True, values=True),
                _range(names.floor),
                head,
                epoch,
            ],
            failure=failure,
        )

    def _read_acquire(self, key: str, owner: str, names: _Names, seconds: int,
                      entry: _Entry | None, reply: dict[str, Any]
                      ) -> tuple[Attempt, list[_Seen]] | None:
        """The attempt and the entries seen ahead (the first one, then the ones just ahead
        of ours); None to ask again."""
        revision = int(reply["header"]["revision"])
        responses = reply.get("responses", [])
        offset = _offset(responses[2])
        epoch = _epoch(responses[-1])
        head = _Seen.of(_kvs(responses[3])[0])
        if epoch is None:  # a new cluster: no token before its epoch is written
            if reply.get("succeeded"):
                with self._mutex:
                    self._entries[(key, owner)] = _Entry(revision=revision, lease_seconds=seconds,
                                                         ahead=None, seen=revision)
            self._write_epoch()
            return None
        if reply.get("succeeded"):
            mine = revision
            ahead = [_Seen.of(kv) for kv in _kvs(responses[1])[1:]]  # mine is the newest
        else:
            mine = int(_kvs(responses[0])[0]["create_revision"])
            if entry is None or entry.revision != mine:
                with self._mutex:  # remember it; the next read touches it
                    self._entries[(key, owner)] = _Entry(revision=mine, lease_seconds=seconds,
                                                         ahead=None, seen=revision)
                return None
            ahead = [_Seen.of(kv) for kv in _kvs(responses[1])]
        token = None
        if not ahead:
            known = entry.token if entry is not None and entry.revision == mine else None
            token = known if known is not None else mine + epoch + offset
        with self._mutex:
            self._entries[(key, owner)] = _Entry(revision=mine, lease_seconds=seconds,
                                                 ahead=ahead[0].key if ahead else None,
                                                 seen=revision, token=token)
        seen = [head, *(a for a in ahead if a.key != head.key)] if ahead else []
        return Attempt(token=token), seen

    def _expire_silent(self, seen: list[_Seen], sent: float) -> int | None:
        """Delete the entries ahead that have gone untouched for too long.

        Every live contender touches its entry (a waiter on each try, a holder on each
        renewal and on the grant), so an entry whose mod_revision this process saw
        unchanged from ``first_seen`` (when a reply showed it) until ``sent`` (before
        the request that showed it again) has been silent on the server for longer than
        that. A holder (marked ``h``) may be removed after its TTL, when its local
        deadline has passed; a waiter after its presence window. Each delete is
        conditional on the same mod_revision. Returns None after a delete (ask again),
        else ms until the first of them would be silent long enough.
        """
        now = time.monotonic()
        expired: list[_Seen] = []
        wait_ms: int | None = None
        with self._mutex:
            for entry in seen:
                known = self._silence.get(entry.key)
                if known is None or known[0] != entry.mod_revision:
                    self._silence[entry.key] = (entry.mod_revision, now)
                    self._silence.move_to_end(entry.key)
                    silent_s = 0.0
                else:
                    silent_s = sent - known[1]
                bound_ms = entry.silence_ms()
                if bound_ms is None:
                    continue
                if silent_s * 1000 >= bound_ms:
                    expired.append(entry)
                else:
                    left = max(1, math.ceil(bound_ms - silent_s * 1000))
                    wait_ms = left if wait_ms is None else min(wait_ms, left)
            while len(self._silence) > SILENCE_SEEN:
                self._silence.popitem(last=False)
        if not expired:
            return wait_ms if wait_ms is not None else 0
        self._txn(  # deleted, or touched meanwhile: either way, ask again
            "expire silent entries", [],
            [{"request_txn": {"compare": [{"key": _b64(e.key), "target": "MOD", "result": "EQUAL",
                                           "mod_revision": e.mod_revision}],
                              "success": [{"request_delete_range": {"key": _b64(e.key)}}],
                              "failure": []}} for e in expired],
        )
        with self._mutex:
            for entry in expired:
                self._silence.pop(entry.key, None)
        return None

    def wait(self, key: str, owner: str, timeout_s: float) -> int | None:
        """Sleep until the entry ahead of ours is deleted; the next try_acquire takes the lock.

        Always None: etcd has no hand-off, the woken waiter takes the lock itself.
        """
        plan = self._wait_plan(key, owner, timeout_s)
        if plan is None:
            return None
        ahead, seen, budget = plan
        wake = _Wake()
        deletions = self._watch()
        deletions.subscribe(ahead, seen, wake)
        try:
            wake.event.wait(budget)
        finally:
            deletions.unsubscribe(ahead, wake)
        return None

    def _wait_plan(self, key: str, owner: str, timeout_s: float) -> tuple[bytes, int, float] | None:
        """What to wait for, and how long: at most a third of the lease TTL, so that the
        caller's next try_acquire keeps the lease (and our place in line) alive."""
        self._etcd()
        with self._mutex:
            entry = self._entries.get((key, owner))
        if entry is None or entry.ahead is None:
            return None
        budget = min(timeout_s, entry.lease_seconds / 3, self.presence_ms / 3000)
        return entry.ahead, entry.seen, max(0.001, budget)

    def _watch(self) -> _DeletionWatch:
        deletions = self._deletions
        if deletions is None:
            with self._mutex:
                if self._deletions is None:
                    self._deletions = _DeletionWatch(self, self.prefix + b"q/")
                deletions = self._deletions
        return deletions

    def release(self, key: str, owner: str) -> bool:
        """Delete this owner's entry (held or queued); True if it was first in line. One txn."""
        names = _Names.of(self.prefix, key, owner)
        reply = self._txn("release", [], [
            _range(names.queue, names.queue_end, limit=1, by_creation=True),
            {"request_delete_range": {"key": _b64(names.entry)}},
        ])
        with self._mutex:
            self._entries.pop((key, owner), None)
        head = _kvs(reply["responses"][0])
        return bool(head) and _unb64(head[0]["key"]) == names.entry

    def renew(self, held: Sequence[tuple[str, str, int]]) -> list[bool]:
        """One keepalive per lease class, then one txn touching every entry still ours.

        Each touch is a nested txn (compare the entry's create_revision, then a put
        that keeps value and lease), so the check and the proof of life are one step;
        contenders read the moving mod_revision as "this holder is alive".
        """
        if not held:
            return []
        classes = [lease_seconds(ttl_ms) for _, _, ttl_ms in held]
        alive: dict[int, bool] = {}
        for seconds in sorted(set(classes)):
            with self._lease_mutex:
                lease = self._leases.get(seconds)
                alive[seconds] = lease is not None and self._keepalive(lease)
        touches = []
        for key, owner, _ in held:
            name = _Names.of(self.prefix, key, owner).entry
            with self._mutex:
                entry = self._entries.get((key, owner))
            ours = ({"target": "CREATE", "result": "EQUAL", "create_revision": entry.revision}
                    if entry is not None else
                    {"target": "CREATE", "result": "GREATER", "create_revision": 0})
            touches.append({"request_txn": {"compare": [{"key": _b64(name), **ours}],
                                            "success": [_touch(name)], "failure": []}})
        touched: list[bool] = []
        for start in range(0, len(touches), MAX_TXN_OPS):
            reply = self._txn("renew", [], touches[start:start + MAX_TXN_OPS])
            touched.extend(bool(r.get("response_txn", {}).get("succeeded"))
                           for r in reply.get("responses", []))
        return [alive[seconds] and ok for seconds, ok in zip(classes, touched, strict=True)]

    def raise_floor(self, key: str, token: int) -> None:
        """Raise the key's offset so that even the oldest queued entry's token exceeds ``token``."""
        names = _Names.of(self.prefix, key)
        for _ in range(10):
            reply = self._txn("read floor", [], [
                _range(names.floor),
                _range(names.queue, names.queue_end, limit=1, by_creation=True),
                _range(self._epoch_key),
            ])
            floor_kvs, head = _kvs(reply["responses"][0]), _kvs(reply["responses"][1])
            current = _offset(reply["responses"][0])
            epoch = _epoch(reply["responses"][2])
            if epoch is None:
                self._write_epoch()
                continue
            oldest = int(head[0]["create_revision"]) if head else int(reply["header"]["revision"]) + 1
            needed = token - oldest - epoch + 1
            if needed <= current:
                return
            version = int(floor_kvs[0]["mod_revision"]) if floor_kvs else 0
            written = self._txn(
                "raise floor",
                compare=[{"key": _b64(names.floor), "target": "MOD", "result": "EQUAL",
                          "mod_revision": version}],
                success=[{"request_put": {"key": _b64(names.floor),
                                          "value": _b64(str(needed).encode())}}],
            )
            if written.get("succeeded"):
                return
        msg = f"etcd: could not raise the floor of {key!r} (too much contention)"
        raise BackendUnavailable(msg)

    def current_token(self, key: str) -> int:
        """The token of the current holder of ``key`` (0 when nobody holds it)."""
        names = _Names.of(self.prefix, key)
        reply = self._txn("read holder", [], [
            _range(names.queue, names.queue_end, limit=1, by_creation=True), _range(names.floor),
            _range(self._epoch_key)])
        head = _kvs(reply["responses"][0])
        if not head:
            return 0
        epoch = _epoch(reply["responses"][2]) or 0
        return int(head[0]["create_revision"]) + epoch + _offset(reply["responses"][1])

    @property
    def _epoch_key(self) -> bytes:
        return self.prefix + b"epoch"

    def epoch(self) -> int | None:
        """The cluster's epoch (added to every token); None before the first grant."""
        return _epoch(self._txn("read epoch", [], [_range(self._epoch_key)])["responses"][0])

    def _write_epoch(self) -> None:
        """Write the cluster's epoch unless someone did already: the wall clock, in us."""
        self._txn("write epoch",
                  compare=[{"key": _b64(self._epoch_key), "target": "CREATE", "result": "EQUAL",
                            "create_revision": 0}],
                  success=[{"request_put": {"key": _b64(self._epoch_key),
                                            "value": _b64(str(time.time_ns() // 1000).encode())}}],
                  failure=[])

    def close(self) -> None:
        """Revoke this process's leases (its entries vanish at once) and drop the client."""
        if self._closed:
            return
        with self._lease_mutex:
            leases, self._leases = list(self._leases.values()), {}
        if self._pid == os.getpid():
            for lease in leases:
                def revoke(etcd: Etcd3Client, lid: int = lease.id) -> Any:
                    return etcd.post(etcd.get_url("/lease/revoke"), json={"ID": lid})

                with contextlib.suppress(BackendUnavailable):  # gone: it expires on its own
                    self._call("lease revoke", revoke)
        with self._mutex:
            self._entries.clear()
        self._closed = True
        if self._deletions is not None:
            self._deletions.close()
            self._deletions = None
        if self._client is not None:
            self._client.session.close()
            self._client = None


class AsyncEtcdBackend:
    """The asyncio face of ``EtcdBackend``: etcd3gw is synchronous, so each request runs in a
    worker thread; waiting is a future rung by the backend's watch thread."""

    info = INFO

    def __init__(self, sync: EtcdBackend) -> None:
        self.sync = sync

    @property
    def presence_ms(self) -> int:
        return self.sync.presence_ms

    async def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        return await asyncio.to_thread(self.sync.try_acquire, key, owner, ttl_ms)

    async def wait(self, key: str, owner: str, timeout_s: float) -> int | None:
        """Await the doorbell on the event loop: a waiting task holds no thread."""
        plan = self.sync._wait_plan(key, owner, timeout_s)
        if plan is None:
            return None
        ahead, seen, budget = plan
        wake = _Wake(asyncio.get_running_loop())
        assert wake.future is not None
        deletions = self.sync._watch()
        deletions.subscribe(ahead, seen, wake)
        try:
            await asyncio.wait_for(wake.future, budget)
        except TimeoutError:
            pass
        finally:
            deletions.unsubscribe(ahead, wake)
        return None

    async def release(self, key: str, owner: str) -> bool:
        return await asyncio.to_thread(self.sync.release, key, owner)

    async def raise_floor(self, key: str, token: int) -> None:
        await asyncio.to_thread(self.sync.raise_floor, key, token)

    async def aclose(self) -> None:
        return None  # the sync backend renews this one's leases; the manager closes it
