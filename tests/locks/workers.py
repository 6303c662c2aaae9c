"""Entry points for the multi-process contract tests (run under the 'spawn' start method).

Each worker builds its own manager from a URL, as a separate agent process would.
"""

from __future__ import annotations

import asyncio
import time
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

from toolguard.errors import LockLost
from toolguard.locks import connect, connect_async


def increment_file(url: str, key: str, path: str, rounds: int) -> list[int]:
    """Read-modify-write a counter file under the lock; returns the tokens it was granted."""
    counter = Path(path)
    tokens = []
    with connect(url, ttl_ms=5_000, timeout_s=60) as locks:
        for _ in range(rounds):
            with locks.acquire(key) as lease:
                value = int(counter.read_text() or "0")
                time.sleep(0.001)  # widen the window a lost update would need
                counter.write_text(str(value + 1))
                with counter.with_suffix(".log").open("a") as log:
                    log.write(f"{lease.token}\n")  # append order = grant order
                tokens.append(lease.token)
    return tokens


def hold(url: str, key: str, ttl_ms: int, report: Any, proceed: EventType) -> None:
    """Take ``key``, report the token, wait to be told to go on, then report whether it is lost.

    The parent SIGKILLs or SIGSTOPs this process in between.
    """
    locks = connect(url)
    lease = locks.acquire(key, ttl_ms=ttl_ms, timeout_s=10)
    report.put(("token", lease.token))
    proceed.wait(60)
    try:
        lease.check()
        report.put(("held", lease.lost))
    except LockLost as error:
        report.put(("lost", type(error).__name__))
    lease.release()
    locks.close()


def stalled_waiter(url: str, key: str, ttl_ms: int, mode: str, report: Any,
                   proceed: EventType) -> None:
    """Wait in line for ``key`` and report the lease ``acquire`` returned, then hold it until
    told to go on. The parent SIGSTOPs this process while it waits."""
    if mode == "async":
        asyncio.run(_stalled_waiter_async(url, key, ttl_ms, report, proceed))
        return
    locks = connect(url)
    report.put(("waiting",))
    lease = locks.acquire(key, ttl_ms=ttl_ms, timeout_s=60)
    report.put(("granted", lease.token, lease.lost))
    proceed.wait(60)
    lease.release()
    locks.close()


async def _stalled_waiter_async(url: str, key: str, ttl_ms: int, report: Any,
                                proceed: EventType) -> None:
    locks = connect_async(url)
    try:
        report.put(("waiting",))
        lease = await locks.acquire(key, ttl_ms=ttl_ms, timeout_s=60)
        report.put(("granted", lease.token, lease.lost))
        await asyncio.to_thread(proceed.wait, 60)
        await lease.arelease()
    finally:
        await locks.aclose()


def hold_then_queue(url: str, held_key: str, key: str, ttl_ms: int, report: Any,
                    mode: str = "sync") -> None:
    """Hold ``held_key``, then wait in line for ``key``; the parent SIGKILLs it there."""
    if mode == "async":
        asyncio.run(_hold_then_queue_async(url, held_key, key, ttl_ms, report))
        return
    locks = connect(url)
    locks.acquire(held_key, ttl_ms=ttl_ms, timeout_s=10)
    report.put(("holding",))
    locks.acquire(key, ttl_ms=ttl_ms, timeout_s=120)
    report.put(("granted",))


async def _hold_then_queue_async(url: str, held_key: str, key: str, ttl_ms: int,
                                 report: Any) -> None:
    locks = connect_async(url)
    await locks.acquire(held_key, ttl_ms=ttl_ms, timeout_s=10)
    report.put(("holding",))
    await locks.acquire(key, ttl_ms=ttl_ms, timeout_s=120)
    report.put(("granted",))
