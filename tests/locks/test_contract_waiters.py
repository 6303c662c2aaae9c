"""The lock contract for waiters that stop or die while in line, with real processes.

* A waiter stopped (SIGSTOP) while the lock is handed to it must never come back
  with that hand-off once it has expired and someone else holds the key: whatever
  ``acquire`` returns is the server's current grant.
* A waiter killed (SIGKILL) while in line must not hold up the line for longer
  than its presence window (``presence_ms``, 2 s by default on every backend),
  even with a TTL ten times as long.

Bounds are chosen so that only the behaviour under test can meet them: the dead
waiter's TTL is 20 s, the line must move within its 2 s presence window plus slack.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
import time

import pytest

from locks import workers
from locks.backends import LockEnv
from toolguard.locks import Lease

spawn = multiprocessing.get_context("spawn")

#: The default presence window of every backend (``presence_ms=2_000``).
PRESENCE_S = 2.0
SLACK_S = 2.5


def _stop(process: multiprocessing.process.BaseProcess) -> None:
    if process.is_alive():
        process.kill()
    process.join(10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_waiter_stopped_through_its_hand_off_never_returns_the_expired_grant(
        backend: LockEnv, mode: str) -> None:
    key = backend.key("stalled")
    holder, rival = backend.manager(), backend.manager()
    first = holder.acquire(key, ttl_ms=30_000)
    report, proceed = spawn.Queue(), spawn.Event()
    process = spawn.Process(target=workers.stalled_waiter,
                            args=(backend.url, key, 500, mode, report, proceed), daemon=True)
    process.start()
    try:
        assert report.get(timeout=30) == ("waiting",)
        time.sleep(1.0)  # in line, between polls or blocked in a wait
        assert process.pid is not None
        os.kill(process.pid, signal.SIGSTOP)
        try:
            first.release()  # hands the key to the stopped waiter (etcd: puts it first in line)
            # The stopped waiter's 500 ms grant runs out; a rival takes the key and keeps it.
            later = rival.acquire(key, ttl_ms=30_000, timeout_s=10)
        finally:
            os.kill(process.pid, signal.SIGCONT)
        try:
            early = report.get(timeout=1.5)  # time enough to come back with the stale hand-off
        except queue.Empty:
            early = None
        assert early is None, (f"the stopped waiter came back with {early} while the key was "
                               f"held by token {later.token}")
        assert not later.lost
        later.release()
        kind, token, lost = report.get(timeout=30)
        assert kind == "granted"
        assert token > later.token, "the waiter returned a grant older than the last holder's"
        assert not lost, "acquire returned a lease that was already lost"
    finally:
        proceed.set()
        process.join(15)
        _stop(process)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_waiter_killed_in_line_holds_it_up_no_longer_than_its_presence(
        backend: LockEnv, mode: str) -> None:
    key, other = backend.key("line"), backend.key("elsewhere")
    holder, successor = backend.manager(), backend.manager()
    first = holder.acquire(key, ttl_ms=30_000)
    report = spawn.Queue()
    # The doomed waiter holds one lock and queues for another, both with a 20 s TTL.
    process = spawn.Process(target=workers.hold_then_queue,
                            args=(backend.url, other, key, 20_000, report, mode), daemon=True)
    process.start()
    try:
        assert report.get(timeout=30) == ("holding",)
        time.sleep(1.0)  # it is in line for the key now
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
    finally:
        _stop(process)
    got: list[Lease | BaseException] = []

    def take() -> None:
        try:
            got.append(successor.acquire(key, ttl_ms=5_000, timeout_s=PRESENCE_S + SLACK_S))
        except BaseException as error:  # reported below
            got.append(error)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    time.sleep(0.3)  # the successor queues behind the dead waiter
    first.release()  # at once: the dead waiter's presence has not lapsed yet
    thread.join(30)
    assert got, "the successor's acquire hung"
    assert isinstance(got[0], Lease), (
        f"the line stayed blocked by a dead waiter beyond its {PRESENCE_S:g} s presence "
        f"window: {got[0]!r}")
    assert got[0].token > first.token
    got[0].release()
