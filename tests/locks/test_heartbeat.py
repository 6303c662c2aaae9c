"""The shared heartbeat and the acquisition plan, against an in-memory backend (no server).

These pin down DESIGN.md point 4 independently of any backend: one renewal loop
per process, batched per backend; transient errors retried until the local
deadline; "not yours" is loss at once; a hung server cannot hide a loss.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from toolguard.errors import BackendUnavailable, ConfigurationError, LockLost, LockTimeout, NotOwned
from toolguard.locks import Attempt, BackendInfo, LockBackend, LockManager
from toolguard.locks.base import canonical_keys, full_jitter, owner_handoff_ms, owner_ttl_ms
from toolguard.locks.manager import _Grant, _Plan

SLACK_S = 1.0


class FakeBackend:
    """Single-process locks in a dict, with a switch for how renewals behave."""

    info = BackendInfo(name="fake", durable_tokens=False, server_wakeup=False, fair=False)
    presence_ms = 2_000

    def __init__(self) -> None:
        self.held: dict[str, tuple[str, float]] = {}
        self.fence = 0
        self.mode = "ok"  # ok | fail | deny | hang
        self.renewals: list[list[str]] = []
        self.unhang = threading.Event()
        self._mutex = threading.Lock()

    def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        with self._mutex:
            current = self.held.get(key)
            if current and current[0] != owner and current[1] > time.monotonic():
                return Attempt(token=None, retry_ms=10)
            self.fence += 1
            self.held[key] = (owner, time.monotonic() + ttl_ms / 1000)
            return Attempt(token=self.fence)

    def wait(self, key: str, owner: str, timeout_s: float) -> int | None:
        time.sleep(min(timeout_s, 0.01))
        return None

    def release(self, key: str, owner: str) -> bool:
        with self._mutex:
            if self.held.get(key, ("",))[0] == owner:
                del self.held[key]
                return True
            return False

    def renew(self, held: Sequence[tuple[str, str, int]]) -> list[bool]:
        self.renewals.append([key for key, _, _ in held])
        if self.mode == "fail":
            msg = "connection refused"
            raise BackendUnavailable(msg)
        if self.mode == "hang":
            self.unhang.wait(30)
        if self.mode == "deny":
            return [False] * len(held)
        with self._mutex:
            now = time.monotonic()
            results = []
            for key, owner, ttl_ms in held:
                ok = self.held.get(key, ("", 0.0))[0] == owner
                if ok:
                    self.held[key] = (owner, now + ttl_ms / 1000)
                results.append(ok)
            return results

    def raise_floor(self, key: str, token: int) -> None:
        self.fence = max(self.fence, token)

    def close(self) -> None:
        self.unhang.set()


@pytest.fixture
def fake() -> Iterator[FakeBackend]:
    backend = FakeBackend()
    assert isinstance(backend, LockBackend)
    yield backend
    backend.close()


def test_one_heartbeat_thread_renews_many_leases_in_batches(fake: FakeBackend) -> None:
    locks = LockManager(fake, ttl_ms=300)
    leases = [locks.acquire(f"k{i}") for i in range(10)]
    time.sleep(1.0)  # about ten renewal intervals
    assert [t.name for t in threading.enumerate()].count("toolguard-heartbeat") == 1
    assert all(not lease.lost for lease in leases)
    sizes = sorted(len(batch) for batch in fake.renewals)
    assert sizes[len(sizes) // 2] == 10, f"leases renewed one by one: {sizes}"
    for lease in leases:
        lease.release()


def test_transient_renewal_errors_are_retried(fake: FakeBackend) -> None:
    locks = LockManager(fake)
    lease = locks.acquire("k", ttl_ms=600)
    fake.mode = "fail"
    time.sleep(0.3)  # past the first renewal, well before the deadline
    fake.mode = "ok"
    time.sleep(0.6)
    assert not lease.lost
    lease.release()


def test_renewal_errors_until_the_deadline_lose_the_lease(fake: FakeBackend) -> None:
    locks = LockManager(fake)
    lease = locks.acquire("k", ttl_ms=300)
    fake.mode = "fail"
    assert lease.lost_event.wait(0.3 + SLACK_S)
    assert isinstance(lease.lost_reason, LockLost)
    assert not isinstance(lease.lost_reason, NotOwned)
    count = len(fake.renewals)
    time.sleep(0.3)
    assert len(fake.renewals) == count, "a lost lease is still being renewed"
    lease.release()


def test_not_owned_is_loss_at_once(fake: FakeBackend) -> None:
    locks = LockManager(fake)
    lease = locks.acquire("k", ttl_ms=3_000)
    fake.mode = "deny"
    assert lease.lost_event.wait(1.0 + SLACK_S)  # the first renewal, long before the 3 s TTL
    with pytest.raises(NotOwned):
        lease.check()
    lease.release()


def test_a_hung_backend_neither_hides_loss_nor_stalls_others(fake: FakeBackend) -> None:
    healthy = FakeBackend()
    stuck_lease = LockManager(fake).acquire("a", ttl_ms=300)
    good_lease = LockManager(healthy).acquire("b", ttl_ms=300)
    fake.mode = "hang"
    assert stuck_lease.lost_event.wait(0.3 + SLACK_S), "loss hidden by a hung renewal"
    time.sleep(0.6)
    assert not good_lease.lost, "one hung backend stopped renewals of another"
    fake.unhang.set()
    stuck_lease.release()
    good_lease.release()


def test_released_lease_is_not_renewed(fake: FakeBackend) -> None:
    lease = LockManager(fake).acquire("k", ttl_ms=300)
    lease.release()
    time.sleep(0.3)
    assert all("k" not in batch for batch in fake.renewals)


# --- pure logic -----------------------------------------------------------------------------------


def test_canonical_keys_sort_dedupe_and_validate() -> None:
    assert canonical_keys(["b", "a", "b"]) == ("a", "b")
    assert canonical_keys("x") == ("x",)
    for bad in ([], [""], ["a", None], [1]):
        with pytest.raises(ConfigurationError):
            canonical_keys(bad)  # type: ignore[arg-type]


def test_full_jitter_is_bounded_and_truncated() -> None:
    for attempt in range(60):
        pause = full_jitter(attempt, 0.005, 0.25)
        assert 0.0 <= pause <= min(0.25, 0.005 * 2**attempt)


def test_owner_carries_its_ttl_and_its_hand_off_ttl() -> None:
    from toolguard.locks.base import new_owner

    assert owner_ttl_ms(new_owner(1234)) == 1234
    assert owner_handoff_ms(new_owner(1234)) == 1234
    assert (owner_ttl_ms(new_owner(10_000, 2_000)), owner_handoff_ms(new_owner(10_000, 2_000))) \
        == (10_000, 2_000)
    assert new_owner(500, 2_000).count(":") == 1  # no shorter hand-off: the old format


def test_later_keys_are_awaited_no_longer_than_the_first_may_go_unrenewed() -> None:
    now = time.monotonic()
    plan = _Plan(keys=("a", "b"), ttl_ms=300, deadline=now + 60, round_wait_s=1.0,
                 backoff_base_s=0.005, backoff_cap_s=0.25)
    assert plan.key_deadline(0) == plan.deadline
    plan.grants["a"] = _Grant(1, now, 300)
    assert plan.key_deadline(1) <= now + 0.3 / 3 + 1e-6
    long_plan = _Plan(keys=("a", "b"), ttl_ms=60_000, deadline=now + 60, round_wait_s=1.0,
                      backoff_base_s=0.005, backoff_cap_s=0.25)
    long_plan.grants["a"] = _Grant(1, now, 60_000)
    assert long_plan.key_deadline(1) <= time.monotonic() + 1.0
    # A hand-off runs for its shorter hand-off TTL: later keys wait a third of that at most.
    handed = _Plan(keys=("a", "b"), ttl_ms=60_000, deadline=now + 60, round_wait_s=30.0,
                   backoff_base_s=0.005, backoff_cap_s=0.25, handoff_ms=2_000)
    handed.grants["a"] = _Grant(1, now, handed.handoff_ms)
    assert handed.key_deadline(1) <= now + 2.0 / 3 + 1e-6


def test_waits_between_tries_leave_a_hand_off_two_thirds_of_its_ttl() -> None:
    now = time.monotonic()
    plan = _Plan(keys=("a",), ttl_ms=60_000, deadline=now + 60, round_wait_s=1.0,
                 backoff_base_s=0.005, backoff_cap_s=0.25, handoff_ms=300)
    for retry_ms in (0, 10, 5_000):
        poll = plan.poll_s(plan.deadline, retry_ms)
        assert poll is not None and poll <= 0.3 / 3 + 1e-6
    assert owner_handoff_ms(plan.owner) == 300 and owner_ttl_ms(plan.owner) == 60_000


def test_a_grant_is_usable_only_with_a_third_of_its_ttl_left() -> None:
    grant = _Grant(7, 100.0, 3_000)
    assert grant.usable(100.0) and grant.usable(101.99)
    assert not grant.usable(102.0) and not grant.usable(500.0)


def test_transient_errors_are_retried_until_the_deadline_then_reported() -> None:
    now = time.monotonic()
    plan = _Plan(keys=("a",), ttl_ms=1_000, deadline=now + 5, round_wait_s=1.0,
                 backoff_base_s=0.005, backoff_cap_s=0.25)
    error = BackendUnavailable("connection refused")
    pauses = [plan.retry_s(error, plan.deadline) for _ in range(12)]
    assert all(p is not None and 0 < p <= 0.5 for p in pauses)
    assert plan.retry_s(error, now - 1) is None
    assert isinstance(plan.failure("a"), BackendUnavailable)  # the server was away at the end
    plan.answered()
    assert isinstance(plan.failure("a"), LockTimeout)  # it answered: contention


def test_an_acquire_retries_a_failing_backend_within_its_deadline(fake: FakeBackend) -> None:
    calls = {"n": 0}
    original = fake.try_acquire

    def flaky(key: str, owner: str, ttl_ms: int) -> Attempt:
        calls["n"] += 1
        if calls["n"] <= 3:
            msg = "connection reset"
            raise BackendUnavailable(msg)
        return original(key, owner, ttl_ms)

    fake.try_acquire = flaky  # type: ignore[method-assign]
    with LockManager(fake).acquire("k", ttl_ms=1_000, timeout_s=10) as lease:
        assert lease.token and calls["n"] == 4
    fake.try_acquire = lambda *a: (_ for _ in ()).throw(BackendUnavailable("down"))  # type: ignore
    with pytest.raises(BackendUnavailable):
        LockManager(fake).acquire("k2", timeout_s=0.2)
