"""etcd-only guarantees: tokens are revisions (plus the cluster's epoch), FIFO by create_revision,
watch wake-ups, whole-second leases shared per process, and failover between members.

The contract suite (``test_contract*.py``) covers the rest. These tests drive the
backend's single-key primitives directly, on the session's private etcd member
(``etcd_url``); the last one runs its own three-member cluster.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from urllib.parse import quote

import pytest
from etcd3gw.client import Etcd3Client
from etcd_server import EtcdCluster, require_etcd, shared_etcd_url

from toolguard.errors import BackendUnavailable, ConfigurationError
from toolguard.locks import connect, open_backend
from toolguard.locks.base import new_owner
from toolguard.locks.etcd import EtcdBackend, etcd_keys, lease_seconds, parse_etcd_url

SLACK_S = 1.0


@pytest.fixture
def url() -> str:
    """The session's private etcd member (the ``etcd_url`` fixture's server)."""
    return shared_etcd_url()


@pytest.fixture
def backends(url: str) -> Iterator[list[EtcdBackend]]:
    """Three independent backend objects, as three processes would have.

    Their presence window is long (a wait is capped at a third of it), so that a
    wait here returns early only when the watch wakes it.
    """
    made = [EtcdBackend(url, presence_ms=30_000) for _ in range(3)]
    yield made
    for backend in made:
        backend.close()


def raw(url: str) -> Etcd3Client:
    host, port = parse_etcd_url(url)[0][0]
    return Etcd3Client(host=host, port=port, timeout=5)


def queue_of(url: str, key: str) -> list[tuple[bytes, int, int]]:
    """(etcd key, create_revision, lease id) of every entry in line for ``key``, first first."""
    entries = raw(url).get_prefix(etcd_keys(key)[0], sort_order="ascend", sort_target="create")
    return [(meta["key"], int(meta["create_revision"]), int(meta.get("lease", 0)))
            for _, meta in entries]


def store_revision(url: str) -> int:
    return int(raw(url).status()["header"]["revision"])


# --- URLs and TTL rounding ----------------------------------------------------------------------


def test_url_names_endpoints_and_prefix() -> None:
    assert parse_etcd_url("etcd://10.0.0.1:2379") == ([("10.0.0.1", 2379)], None)
    assert parse_etcd_url("etcd://a:1,b:2/team/locks") == ([("a", 1), ("b", 2)], "team/locks/")
    assert parse_etcd_url("etcd://host") == ([("host", 2379)], None)
    with pytest.raises(ConfigurationError):
        parse_etcd_url("http://a:1")
    assert isinstance(open_backend("etcd://127.0.0.1:1"), EtcdBackend)  # connects lazily


@pytest.mark.parametrize(("ttl_ms", "seconds"), [(100, 1), (666, 1), (667, 2), (1_000, 2),
                                                 (2_000, 3), (10_000, 15)])
def test_lease_ttl_is_one_and_a_half_ttls_rounded_up_to_whole_seconds(ttl_ms: int,
                                                                      seconds: int) -> None:
    assert lease_seconds(ttl_ms) == seconds


def test_entries_share_one_lease_per_process_and_ttl_class(url: str, unique: str,
                                                          backends: list[EtcdBackend]) -> None:
    mine, other, _ = backends
    first = mine.try_acquire(f"{unique}:a", new_owner(300), 300)
    second = mine.try_acquire(f"{unique}:b", new_owner(600), 600)
    third = mine.try_acquire(f"{unique}:c", new_owner(2_500), 2_500)
    elsewhere = other.try_acquire(f"{unique}:d", new_owner(300), 300)
    assert all(attempt.granted for attempt in (first, second, third, elsewhere))
    leases = {name: queue_of(url, f"{unique}:{name}")[0][2] for name in "abcd"}
    assert leases["a"] == leases["b"]  # 300 ms and 600 ms both ride the 1 s lease
    assert leases["c"] != leases["a"]  # 2.5 s rides a 4 s lease
    assert leases["d"] != leases["a"]  # another process, another lease
    granted = raw(url).post(raw(url).get_url("/lease/timetolive"),
                                 json={"ID": leases["c"]})
    assert int(granted["grantedTTL"]) == 4


# --- tokens are revisions ------------------------------------------------------------------------


def test_token_is_the_create_revision_of_the_holders_entry(url: str, unique: str,
                                                          backends: list[EtcdBackend]) -> None:
    holder, waiter, _ = backends
    key = f"{unique}:rev"
    before = store_revision(url)
    owner, late = new_owner(5_000), new_owner(5_000)
    first = holder.try_acquire(key, owner, 5_000)
    epoch = holder.epoch()
    assert epoch is not None and epoch > 0  # written by the cluster's first grant
    assert first.token is not None and first.token - epoch > before
    assert queue_of(url, key)[0][1] + epoch == first.token
    assert holder.current_token(key) == first.token

    queued = waiter.try_acquire(key, late, 5_000)
    assert not queued.granted
    waiting_revision = queue_of(url, key)[1][1]
    holder.release(key, owner)
    second = waiter.try_acquire(key, late, 5_000)
    # The waiter's token is its entry's create_revision (plus the cluster's epoch): minted
    # when it queued, but served strictly in that order, so token order is still grant order.
    assert second.token == waiting_revision + epoch > first.token
    waiter.release(key, late)


def test_revisions_are_global_so_tokens_of_two_keys_interleave(unique: str,
                                                               backends: list[EtcdBackend]) -> None:
    backend = backends[0]
    a = backend.try_acquire(f"{unique}:x", new_owner(1_000), 1_000).token
    b = backend.try_acquire(f"{unique}:y", new_owner(1_000), 1_000).token
    c = backend.try_acquire(f"{unique}:x2", new_owner(1_000), 1_000).token
    assert a is not None and b is not None and c is not None
    assert a < b < c  # one revision counter: compare tokens only within one key


def test_raise_floor_covers_entries_already_in_line(url: str, unique: str,
                                                    backends: list[EtcdBackend]) -> None:
    holder, waiter, _ = backends
    key = f"{unique}:floor"
    owner, late = new_owner(5_000), new_owner(5_000)
    token = holder.try_acquire(key, owner, 5_000).token
    assert not waiter.try_acquire(key, late, 5_000).granted
    floor = (token or 0) + 10**9
    holder.raise_floor(key, floor)
    holder.raise_floor(key, floor - 5)  # lower: no change
    holder.release(key, owner)
    handed = waiter.try_acquire(key, late, 5_000).token
    assert handed is not None and handed > floor  # queued before the floor rose, still above it
    waiter.release(key, late)
    again = holder.try_acquire(key, new_owner(5_000), 5_000).token
    assert again is not None and again > handed
    assert raw(url).get(etcd_keys(key)[1])  # the offset is stored, durable, per key


# --- FIFO and wake-ups by watch --------------------------------------------------------------------


def test_only_the_next_in_line_is_woken(unique: str, backends: list[EtcdBackend]) -> None:
    holder, waiter, third = backends
    key = f"{unique}:herd"
    holder_owner = new_owner(10_000)
    assert holder.try_acquire(key, holder_owner, 10_000).granted
    second_owner, third_owner = new_owner(10_000), new_owner(10_000)
    assert not waiter.try_acquire(key, second_owner, 10_000).granted
    assert not third.try_acquire(key, third_owner, 10_000).granted
    woken: dict[str, float] = {}

    def wait(name: str, backend: EtcdBackend, owner: str) -> None:
        started = time.monotonic()
        backend.wait(key, owner, 2.0)
        woken[name] = time.monotonic() - started

    threads = [threading.Thread(target=wait, args=("second", waiter, second_owner)),
               threading.Thread(target=wait, args=("third", third, third_owner))]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    holder.release(key, holder_owner)
    for thread in threads:
        thread.join(5)
    assert woken["second"] < 0.2 + 0.5, "the next waiter was not woken by the deletion"
    assert woken["third"] >= 1.9, "a waiter further back was woken too (thundering herd)"
    assert waiter.try_acquire(key, second_owner, 10_000).granted
    assert not third.try_acquire(key, third_owner, 10_000).granted


def test_wait_without_polling_is_woken_within_a_round_trip(unique: str,
                                                           backends: list[EtcdBackend]) -> None:
    holder, waiter, _ = backends
    key = f"{unique}:wake"
    delays = []
    for _ in range(5):
        owner, late = new_owner(20_000), new_owner(20_000)
        assert holder.try_acquire(key, owner, 20_000).granted
        assert not waiter.try_acquire(key, late, 20_000).granted
        done = threading.Event()
        thread = threading.Thread(target=lambda late=late, done=done: (
            waiter.wait(key, late, 6.0), done.set()))
        thread.start()
        time.sleep(0.05)
        released = time.monotonic()
        holder.release(key, owner)
        assert done.wait(5)
        delays.append(time.monotonic() - released)
        thread.join()
        assert waiter.try_acquire(key, late, 20_000).granted
        waiter.release(key, late)
    assert sorted(delays)[len(delays) // 2] < 0.1, delays


def test_a_waiter_that_leaves_wakes_the_one_behind_it(unique: str,
                                                      backends: list[EtcdBackend]) -> None:
    holder, leaver, stayer = backends
    key = f"{unique}:leave"
    assert holder.try_acquire(key, new_owner(10_000), 10_000).granted
    leaving, staying = new_owner(10_000), new_owner(10_000)
    assert not leaver.try_acquire(key, leaving, 10_000).granted
    assert not stayer.try_acquire(key, staying, 10_000).granted
    done = threading.Event()
    thread = threading.Thread(target=lambda: (stayer.wait(key, staying, 5.0), done.set()))
    thread.start()
    time.sleep(0.05)
    leaver.release(key, leaving)
    assert done.wait(1.0)
    thread.join()
    # Still behind the holder: the stayer now watches the holder's entry instead.
    assert not stayer.try_acquire(key, staying, 10_000).granted


# --- liveness: leases ----------------------------------------------------------------------------


def take(backend: EtcdBackend, key: str, owner: str, ttl_ms: int, limit_s: float) -> float:
    """Wait in line (by the manager's rules: retry hints, watch wake-ups) until granted."""
    started = time.monotonic()
    attempt = backend.try_acquire(key, owner, ttl_ms)
    while not attempt.granted:
        assert time.monotonic() - started < limit_s, "not granted in time"
        backend.wait(key, owner, (attempt.retry_ms or 500) / 1000)
        attempt = backend.try_acquire(key, owner, ttl_ms)
    return time.monotonic() - started


def test_silent_holder_is_expired_by_a_contender_after_its_ttl_never_sooner(
        url: str, unique: str, backends: list[EtcdBackend]) -> None:
    crashed, waiter, _ = backends
    key = f"{unique}:crash"
    ttl_ms = 700  # its lease is 2 s: the contender, not the lease, frees the lock
    granted_at = time.monotonic()
    assert crashed.try_acquire(key, new_owner(ttl_ms), ttl_ms).granted
    # The holder's process stops: no renewal touches its entry any more.
    late = new_owner(5_000)
    take(waiter, key, late, 5_000, limit_s=ttl_ms / 1000 + SLACK_S)
    assert time.monotonic() - granted_at >= ttl_ms / 1000 * 0.98, "freed before its deadline"
    waiter.release(key, late)


def test_renewing_holder_is_never_expired(unique: str, backends: list[EtcdBackend]) -> None:
    holder, waiter, _ = backends
    key = f"{unique}:alive"
    ttl_ms, owner, late = 300, new_owner(300), new_owner(5_000)
    assert holder.try_acquire(key, owner, ttl_ms).granted
    assert not waiter.try_acquire(key, late, 5_000).granted
    until = time.monotonic() + 4 * ttl_ms / 1000
    while time.monotonic() < until:
        assert holder.renew([(key, owner, ttl_ms)]) == [True]  # each renewal is a touch
        time.sleep(ttl_ms / 1000 / 3)
        assert not waiter.try_acquire(key, late, 5_000).granted
    holder.release(key, owner)
    assert waiter.try_acquire(key, late, 5_000).granted


def test_crashed_waiter_that_reaches_the_front_is_skipped(unique: str,
                                                          backends: list[EtcdBackend]) -> None:
    holder, ghost, waiter = backends
    key = f"{unique}:ghost"
    owner = new_owner(5_000)
    assert holder.try_acquire(key, owner, 5_000).granted
    assert not ghost.try_acquire(key, new_owner(400), 400).granted  # then it dies
    late = new_owner(5_000)
    assert not waiter.try_acquire(key, late, 5_000).granted
    holder.release(key, owner)
    assert take(waiter, key, late, 5_000, limit_s=0.4 + SLACK_S) >= 0.4 * 0.98
    waiter.release(key, late)


def test_uncontended_dead_entries_vanish_with_the_process_lease(url: str, unique: str,
                                                                backends: list[EtcdBackend]) -> None:
    key = f"{unique}:backstop"
    assert backends[0].try_acquire(key, new_owner(300), 300).granted
    deadline = time.monotonic() + lease_seconds(300) + 0.5 + SLACK_S
    while queue_of(url, key):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_renew_is_one_keepalive_per_ttl_class_and_reports_lost_entries(
        url: str, unique: str, backends: list[EtcdBackend], monkeypatch) -> None:
    backend = backends[0]
    held = [(f"{unique}:r{i}", new_owner(ttl), ttl) for i, ttl in enumerate((300, 600, 2_000))]
    for key, owner, ttl in held:
        assert backend.try_acquire(key, owner, ttl).granted
    keepalives = []
    original = backend._keepalive
    monkeypatch.setattr(backend, "_keepalive", lambda lease: keepalives.append(lease.id)
                        or original(lease))
    assert backend.renew(held) == [True, True, True]
    assert len(keepalives) == 2  # the 1 s class and the 3 s class

    raw(url).delete(queue_of(url, held[1][0])[0][0])  # dropped behind its back
    assert backend.renew(held) == [True, False, True]

    lease_id = queue_of(url, held[2][0])[0][2]
    raw(url).post(raw(url).get_url("/lease/revoke"), json={"ID": lease_id})
    assert backend.renew(held) == [True, False, False]
    again = backend.try_acquire(f"{unique}:after", new_owner(2_000), 2_000)
    assert again.granted  # a fresh lease replaces the revoked one transparently


def test_close_revokes_the_process_leases(url: str, unique: str) -> None:
    backend = EtcdBackend(url)
    key = f"{unique}:closed"
    assert backend.try_acquire(key, new_owner(10_000), 10_000).granted
    backend.close()
    assert queue_of(url, key) == []  # gone at once, not after the 10 s lease
    with pytest.raises(BackendUnavailable):
        backend.renew([(key, "x:1", 10_000)])


def test_unreachable_server_is_backend_unavailable() -> None:
    backend = EtcdBackend("etcd://127.0.0.1:1", timeout_s=0.5)
    with pytest.raises(BackendUnavailable):
        backend.try_acquire("k", new_owner(1_000), 1_000)
    with pytest.raises(BackendUnavailable):
        backend.release("k", "o:1")
    backend.close()


# --- a three-member cluster ----------------------------------------------------------------------


@pytest.mark.fault
@pytest.mark.timeout(60)
def test_lock_and_tokens_survive_losing_the_member_in_use(unique: str) -> None:
    require_etcd()
    with EtcdCluster(3) as cluster:
        locks = connect(cluster.url, ttl_ms=5_000, timeout_s=10)
        key = f"{unique}:cluster"
        with locks.acquire(key) as lease:
            before = lease.token
        cluster.members[0].kill()  # the member the backend talks to first
        deadline = time.monotonic() + 20
        while True:
            try:
                lease = locks.acquire(key)
                break
            except BackendUnavailable:  # the failed request moves to the next member
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert lease.token > before
        lease.release()
        locks.close()


# --- presence: grants are marked, waiters touch, silent waiters drop out -------------------------


def entry_value(url: str, key: str, owner: str) -> bytes | None:
    name = etcd_keys(key)[0] + quote(owner, safe="").encode()
    found = raw(url).get(name)
    return found[0] if found else None


def test_the_grant_marks_the_entry_and_waiters_stay_unmarked(url: str, unique: str,
                                                             backends: list[EtcdBackend]) -> None:
    holder, waiter, _ = backends
    key = f"{unique}:marks"
    owner, late = new_owner(5_000), new_owner(5_000)
    assert holder.try_acquire(key, owner, 5_000).granted
    assert not waiter.try_acquire(key, late, 5_000).granted
    assert entry_value(url, key, owner) == b"h"
    assert entry_value(url, key, late) == b""
    holder.renew([(key, owner, 5_000)])
    assert entry_value(url, key, owner) == b"h"  # a renewal keeps the mark
    holder.release(key, owner)
    assert waiter.try_acquire(key, late, 5_000).granted
    assert entry_value(url, key, late) == b"h"
    waiter.release(key, late)


def test_each_try_of_a_waiter_touches_its_entry(url: str, unique: str,
                                               backends: list[EtcdBackend]) -> None:
    holder, waiter, _ = backends
    key = f"{unique}:touch"
    owner, late = new_owner(5_000), new_owner(5_000)
    assert holder.try_acquire(key, owner, 5_000).granted
    revisions = []
    for _ in range(3):
        assert not waiter.try_acquire(key, late, 5_000).granted
        revisions.append(queue_of(url, key)[1][1])  # create_revision stays: the token
    mods = [int(meta["mod_revision"]) for _, meta in raw(url).get_prefix(
        etcd_keys(key)[0], sort_order="ascend", sort_target="create")]
    assert len(set(revisions)) == 1
    assert mods[1] > revisions[0], "the waiter's tries did not touch its entry"
    holder.release(key, owner)
    waiter.release(key, late)


def test_a_silent_waiter_ahead_drops_out_after_its_presence_window_a_holder_does_not(
        url: str, unique: str, backends: list[EtcdBackend]) -> None:
    holder, ghost, waiter = backends
    key = f"{unique}:presence"
    owner = new_owner(20_000)
    assert holder.try_acquire(key, owner, 20_000).granted
    dead = new_owner(20_000, 500)  # 20 s TTL, 500 ms presence window; it never tries again
    assert not ghost.try_acquire(key, dead, 20_000).granted
    late = new_owner(20_000, 500)
    started = time.monotonic()
    while entry_value(url, key, dead) is not None:
        assert not waiter.try_acquire(key, late, 20_000).granted  # the holder stays
        holder.renew([(key, owner, 20_000)])
        assert time.monotonic() - started < 0.5 + SLACK_S, "the silent waiter was not removed"
        time.sleep(0.05)
    assert time.monotonic() - started >= 0.5 * 0.98, "removed before its presence window"
    assert entry_value(url, key, owner) == b"h"
    holder.release(key, owner)
    assert waiter.try_acquire(key, late, 20_000).granted
    waiter.release(key, late)
