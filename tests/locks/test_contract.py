"""The lock contract, sync side: every backend in ``BACKENDS`` must pass it unchanged.

Assertions are on counts and orders, never on speed; the few time bounds are
generous multiples of the TTL (ttl + slack) or of a fallback poll made
deliberately huge, so that only the behaviour under test can meet them.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
import time
from collections import Counter

import pytest

import toolguard.locks.manager as manager_module
from locks.backends import QUIET_POLL_S, LockEnv
from toolguard.errors import ConfigurationError, LockLost, LockTimeout, NotOwned
from toolguard.locks import Lease, LockManager, connect, heartbeat

#: Extra time allowed on top of a TTL or renewal interval for scheduling and round trips.
SLACK_S = 1.0


def run_threads(count: int, target, *args: object) -> None:
    """Start ``count`` threads on ``target(index, *args)``, join them, re-raise the first error."""
    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            target(index, *args)
        except BaseException as error:  # reported to the test thread below
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive(), "a worker thread hung"
    if errors:
        raise errors[0]


def assert_free(manager: LockManager, key: str) -> None:
    """``key`` is free right now: nobody holds it and nobody is queued ahead."""
    with manager.acquire(key, timeout_s=0):
        pass


def assert_held(manager: LockManager, key: str) -> None:
    with pytest.raises(LockTimeout):
        manager.acquire(key, timeout_s=0.05)


# --- mutual exclusion and tokens -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_threads_lose_no_update_and_tokens_follow_grant_order(backend: LockEnv) -> None:
    key = backend.key("counter")
    rounds, workers = 25, 6
    state = {"value": 0, "inside": 0, "max_inside": 0}
    grants: list[int] = []

    def work(_: int, manager: LockManager) -> None:
        for _ in range(rounds):
            with manager.acquire(key, ttl_ms=5_000, timeout_s=30) as lease:
                state["inside"] += 1
                state["max_inside"] = max(state["max_inside"], state["inside"])
                grants.append(lease.token)          # grant order = append order
                value = state["value"]
                time.sleep(random.uniform(0, 0.0005))  # widen the read-modify-write window
                state["value"] = value + 1
                state["inside"] -= 1

    # Two managers (two connections / pools) so the backend, not a client, serializes.
    managers = [backend.manager(), backend.manager()]
    run_threads(workers, lambda i: work(i, managers[i % 2]))

    assert state["max_inside"] == 1
    assert state["value"] == rounds * workers
    assert len(grants) == rounds * workers
    assert all(a < b for a, b in itertools.pairwise(grants)), "tokens not increasing"


def test_token_is_greater_than_every_earlier_token(backend: LockEnv) -> None:
    key = backend.key("mono")
    locks = backend.manager()
    tokens = []
    for _ in range(20):
        with locks.acquire(key, ttl_ms=1_000) as lease:
            tokens.append(lease.token)
            assert lease.tokens == {key: lease.token}
    assert tokens == sorted(set(tokens))


def test_delayed_holder_cannot_hold_a_smaller_token_than_a_later_holder(backend: LockEnv) -> None:
    """A holder paused past its TTL keeps its old token; the next grant is strictly greater."""
    key = backend.key("paused")
    first, second = backend.manager(), backend.manager()
    slow = first.acquire(key, ttl_ms=300)
    heartbeat().remove(slow)  # the holder's process "pauses": nothing renews it any more
    later = second.acquire(key, ttl_ms=5_000, timeout_s=0.3 + SLACK_S)
    try:
        assert later.token > slow.token
        assert slow.lost, "the paused holder must not believe it still holds the lock"
        with pytest.raises(LockLost):
            slow.check()
        slow.release()  # after expiry: no error, and it must not release the new holder's lock
        assert_held(first, key)
        assert not later.lost
    finally:
        later.release()
    assert_free(first, key)


# --- liveness: renewal, loss, expiry ---------------------------------------------------------


@pytest.mark.timeout(30)
def test_long_holder_keeps_the_lock_through_renewals(backend: LockEnv) -> None:
    key = backend.key("long")
    holder, rival = backend.manager(), backend.manager()
    # 2 s: at 1 s one renewal on Redis Cluster missed its window once in a full CI run (2 cores,
    # three xdist workers); renewal runs at ttl/3, so a stall of over ~0.6 s lost the lease
    ttl_ms = 2_000
    stolen = []
    with holder.acquire(key, ttl_ms=ttl_ms) as lease:
        until = time.monotonic() + 3 * ttl_ms / 1000
        while time.monotonic() < until:
            with contextlib.suppress(LockTimeout):
                stolen.append(rival.acquire(key, ttl_ms=ttl_ms, timeout_s=0.05))
            assert not lease.lost
        lease.check()
    for other in stolen:
        other.release()
    assert stolen == [], "another holder got the lock while it was being renewed"
    assert_free(rival, key)


@pytest.mark.parametrize("tamper", ["drop", "steal"])
def test_holder_learns_of_loss_within_one_renewal_interval(backend: LockEnv, tamper: str) -> None:
    key = backend.key("tampered")
    locks = backend.manager()
    ttl_ms = 600
    seen: list[Lease] = []
    with locks.acquire(key, ttl_ms=ttl_ms) as lease:
        lease.on_lost(seen.append)
        assert not lease.lost
        getattr(backend, tamper)(key)
        assert lease.lost_event.wait(ttl_ms / 1000 / 3 + SLACK_S), "loss not noticed"
        assert lease.lost
        with pytest.raises(NotOwned) as caught:
            lease.check()
        assert key in caught.value.keys
        # Callbacks run on the heartbeat's side right after the event is set.
        until = time.monotonic() + SLACK_S
        while not seen and time.monotonic() < until:
            time.sleep(0.01)
        assert seen == [lease]


def test_expired_lock_is_taken_by_the_next_acquirer(backend: LockEnv) -> None:
    key = backend.key("expiring")
    first, second = backend.manager(), backend.manager()
    abandoned = first.acquire(key, ttl_ms=300)
    heartbeat().remove(abandoned)  # as if the holder died without releasing
    lease = second.acquire(key, ttl_ms=2_000, timeout_s=0.3 + SLACK_S)
    assert lease.token > abandoned.token
    lease.release()


# --- deadlock freedom, all-or-nothing, timeouts -----------------------------------------------


@pytest.mark.timeout(120)
def test_opposite_key_orders_never_deadlock(backend: LockEnv) -> None:
    a, b = backend.key("A"), backend.key("B")
    orders = [[a, b], [b, a]]
    done = Counter()
    # etcd commits every grant through Raft and fsync (~100 cycles/s): fewer rounds keep it
    # well inside the join bound on a loaded machine; a deadlock shows in the first few
    rounds = 200 if backend.name == "etcd" else 1_000

    def agent(index: int, manager: LockManager) -> None:
        for _ in range(rounds):
            with manager.acquire(orders[index], ttl_ms=5_000, timeout_s=30) as lease:
                assert set(lease.tokens) == {a, b}
            done[index] += 1

    managers = [backend.manager(), backend.manager()]
    run_threads(2, lambda i: agent(i, managers[i]))
    assert done == {0: rounds, 1: rounds}


def test_timeout_names_the_key(backend: LockEnv) -> None:
    key = backend.key("busy")
    holder, waiter = backend.manager(), backend.manager()
    with holder.acquire(key, ttl_ms=5_000):
        with pytest.raises(LockTimeout) as caught:
            waiter.acquire(key, timeout_s=0.2)
        assert caught.value.keys == (key,)
        assert key in str(caught.value)
    assert_free(waiter, key)  # the timed-out waiter left the queue


def test_multi_key_is_all_or_nothing(backend: LockEnv) -> None:
    a, b, c = backend.key("a"), backend.key("b"), backend.key("c")
    holder, taker, observer = backend.manager(), backend.manager(), backend.manager()
    with holder.acquire(b, ttl_ms=5_000):
        with pytest.raises(LockTimeout) as caught:
            taker.acquire([c, a, b], ttl_ms=5_000, timeout_s=0.5)
        assert caught.value.keys == (b,)
        # Nothing of the set stays held by the failed acquirer...
        assert_free(observer, a)
        assert_free(observer, c)
    # ...nor queued: b goes free on release instead of being handed to the departed waiter.
    assert_free(observer, b)
    with taker.acquire([a, b, c], timeout_s=0) as lease:
        assert set(lease.tokens) == {a, b, c}


def test_multi_key_waiting_on_a_later_key_does_not_lose_the_earlier_one(backend: LockEnv) -> None:
    """Keys taken first are not renewed while a later one is awaited: they must not expire."""
    a, b = backend.key("a"), backend.key("b")
    holder, taker, rival = backend.manager(), backend.manager(), backend.manager()
    ttl_ms = 300
    blocker = holder.acquire(b, ttl_ms=5_000)
    # b goes free after a's TTL but inside one round of waiting for it (round_wait_s = 1 s).
    timer = threading.Timer(0.7, blocker.release)
    timer.start()
    lease = taker.acquire([a, b], ttl_ms=ttl_ms, timeout_s=10)
    timer.join()
    try:
        assert not lease.lost
        time.sleep(ttl_ms / 1000)  # long enough for a renewal to have happened
        lease.check()
        assert_held(rival, a)
        assert_held(rival, b)
    finally:
        lease.release()


def test_release_is_idempotent(backend: LockEnv) -> None:
    key = backend.key("rel")
    locks = backend.manager()
    lease = locks.acquire(key, ttl_ms=1_000)
    lease.release()
    lease.release()
    with lease:  # exiting a released lease is fine too
        pass
    assert_free(locks, key)


def test_release_after_expiry_does_not_release_the_next_holder(backend: LockEnv) -> None:
    key = backend.key("rel-expired")
    first, second = backend.manager(), backend.manager()
    old = first.acquire(key, ttl_ms=300)
    backend.drop(key)  # the lock vanished under the holder
    assert old.lost_event.wait(0.1 + SLACK_S)
    new = second.acquire(key, ttl_ms=5_000, timeout_s=1)
    old.release()
    old.release()
    assert_held(first, key)
    assert not new.lost
    new.release()


def test_no_lock_without_a_ttl(backend: LockEnv) -> None:
    locks = backend.manager()
    for ttl_ms in (None, 0, -1, 99, 1.5, True):
        with pytest.raises(ConfigurationError):
            connect(backend.url, ttl_ms=ttl_ms)
        if ttl_ms is not None:  # None on acquire means "the manager's default", which is bounded
            with pytest.raises(ConfigurationError):
                locks.acquire(backend.key("k"), ttl_ms=ttl_ms)  # type: ignore[arg-type]
    with locks.acquire(backend.key("k")) as lease:
        assert 0 < lease.ttl_ms == locks.ttl_ms


def test_empty_or_bad_keys_are_rejected(backend: LockEnv) -> None:
    locks = backend.manager()
    for keys in ([], [""], "", [backend.key("x"), None]):
        with pytest.raises(ConfigurationError):
            locks.acquire(keys)  # type: ignore[arg-type]


# --- fairness and wake-ups ----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_contending_threads_get_balanced_turns(backend: LockEnv) -> None:
    key = backend.key("fair")
    workers, total = 8, 240
    counts = Counter()
    stop = threading.Event()
    managers = [backend.manager() for _ in range(2)]

    def work(index: int) -> None:
        manager = managers[index % 2]
        while not stop.is_set():
            with manager.acquire(key, ttl_ms=5_000, timeout_s=30):
                counts[index] += 1
                if sum(counts.values()) >= total:
                    stop.set()
                time.sleep(0.001)

    run_threads(workers, work)
    per_thread = [counts[i] for i in range(workers)]
    assert min(per_thread) / max(per_thread) >= 0.5, per_thread


@pytest.mark.timeout(60)
def test_waiter_is_woken_by_the_release_not_by_polling(backend: LockEnv, monkeypatch) -> None:
    """With every fallback poll at least QUIET_POLL_S apart, only a wake-up can hand over
    within 10 s."""
    monkeypatch.setattr(manager_module, "MAX_POLL_S", 30.0)
    key = backend.key("wake")
    holder, waiter = backend.quiet_manager(), backend.quiet_manager()
    assert QUIET_POLL_S > 10
    for _ in range(3):
        lease = holder.acquire(key)
        got: list[Lease] = []
        thread = threading.Thread(target=lambda got=got: got.append(waiter.acquire(key, timeout_s=25)))
        thread.start()
        time.sleep(0.3)  # let the waiter queue up and block
        released_at = time.monotonic()
        lease.release()
        thread.join(timeout=25)
        assert got, "the waiter was not woken"
        assert time.monotonic() - released_at < 10, "woken by the poll, not by the release"
        assert got[0].token > lease.token
        got[0].release()


def test_fifo_order_of_waiters(backend: LockEnv) -> None:
    """Waiters that queued one after the other are served in that order."""
    key = backend.key("fifo")
    holder = backend.manager()
    lease = holder.acquire(key, ttl_ms=10_000)
    order: list[int] = []
    threads = []
    for index in range(4):
        manager = backend.manager()

        def wait_turn(index: int = index, manager: LockManager = manager) -> None:
            with manager.acquire(key, ttl_ms=5_000, timeout_s=20):
                order.append(index)

        thread = threading.Thread(target=wait_turn, daemon=True)
        thread.start()
        time.sleep(0.2)  # the next waiter arrives only after this one queued
        threads.append(thread)
    lease.release()
    for thread in threads:
        thread.join(timeout=20)
    assert order == [0, 1, 2, 3]


def test_raise_floor_makes_the_next_token_exceed_it(backend: LockEnv) -> None:
    key = backend.key("floor")
    locks = backend.manager()
    with locks.acquire(key) as lease:
        before = lease.token
    floor = before + 10**12
    locks.raise_floor(key, floor)
    locks.raise_floor(key, before)  # a lower floor never lowers the counter
    with locks.acquire(key) as lease:
        assert lease.token > floor


WAIT_OPTIONS = ["timeout_s", "round_wait_s", "backoff_base_s", "backoff_cap_s"]
BAD_SECONDS = [-1, -0.001, float("nan"), float("inf"), "5", True, None, [1]]


@pytest.mark.parametrize("option", WAIT_OPTIONS)
def test_bad_wait_options_are_configuration_errors_naming_the_value(backend: LockEnv,
                                                                    option: str) -> None:
    for bad in BAD_SECONDS:
        with pytest.raises(ConfigurationError) as caught:
            connect(backend.url, **{option: bad})
        assert option in str(caught.value) and repr(bad) in str(caught.value)
    if option != "timeout_s":
        return
    locks = backend.manager()
    for bad in BAD_SECONDS:
        if bad is None:  # None per call means "the manager's default"
            continue
        with pytest.raises(ConfigurationError) as caught:
            locks.acquire(backend.key("k"), timeout_s=bad)  # type: ignore[arg-type]
        assert "timeout_s" in str(caught.value) and repr(bad) in str(caught.value)
    with locks.acquire(backend.key("k"), timeout_s=0) as lease:  # zero: one try, no wait
        assert lease.token


def test_round_wait_must_be_positive_and_the_backoff_cap_above_its_base(backend: LockEnv) -> None:
    with pytest.raises(ConfigurationError, match="round_wait_s"):
        connect(backend.url, round_wait_s=0)
    with pytest.raises(ConfigurationError, match="backoff_cap_s"):
        connect(backend.url, backoff_base_s=0.5, backoff_cap_s=0.1)


@pytest.mark.parametrize("keys", [42, [42], b"lead:1", None, [["a"]], 4.2, object()])
def test_keys_of_the_wrong_type_are_configuration_errors(backend: LockEnv, keys: object) -> None:
    locks = backend.manager()
    with pytest.raises(ConfigurationError) as caught:
        locks.acquire(keys)  # type: ignore[arg-type]
    assert "lock keys" in str(caught.value)


def test_unknown_or_bad_connect_options_are_configuration_errors(backend: LockEnv) -> None:
    with pytest.raises(ConfigurationError) as caught:
        connect(backend.url, wait_timeout=5)
    assert "wait_timeout" in str(caught.value)
    with pytest.raises(ConfigurationError) as caught:
        connect(backend.url, presence_ms=-5)
    assert "presence_ms" in str(caught.value) and "-5" in str(caught.value)


def test_async_acquire_checks_its_arguments_when_called(backend: LockEnv) -> None:
    import asyncio

    async def main() -> None:
        locks = backend.async_manager()
        try:
            with pytest.raises(ConfigurationError):
                locks.acquire(42)  # type: ignore[arg-type]
            with pytest.raises(ConfigurationError, match="timeout_s"):
                locks.acquire(backend.key("k"), timeout_s=-1)
            with pytest.raises(ConfigurationError, match="ttl_ms"):
                locks.acquire(backend.key("k"), ttl_ms=5)
        finally:
            await locks.aclose()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_handed_off_lease_outlives_its_hand_off_ttl_through_renewals(backend: LockEnv) -> None:
    """A hand-off runs for the waiter's presence window (2 s) until renewed; the heartbeat
    renews it in time, so a holder with a 10 s TTL keeps it for longer."""
    key = backend.key("handed")
    holder, waiter, rival = backend.manager(), backend.manager(), backend.manager()
    first = holder.acquire(key, ttl_ms=10_000)
    got: list[Lease] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(key, ttl_ms=10_000,
                                                                         timeout_s=20)))
    thread.start()
    time.sleep(0.3)
    first.release()
    thread.join(20)
    assert got, "the waiter did not get the lock"
    lease = got[0]
    try:
        until = time.monotonic() + 3.0  # well past the 2 s hand-off TTL
        while time.monotonic() < until:
            assert_held(rival, key)
            assert not lease.lost
        lease.check()
        assert lease.remaining_s() > 2.0  # renewed to the full TTL
    finally:
        lease.release()
