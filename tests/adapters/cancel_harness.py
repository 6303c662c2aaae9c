"""Cancel a guarded call at each of its await points in turn, and check what it leaves behind.

``count_await_points(call)`` runs ``call()`` once in a task that counts how
often it, and every task it starts meanwhile, suspends (each suspension is a
point where a cancellation from outside lands: a sibling failing in a
superstep, a client going away). ``cancel_at(call, k)`` runs it again and
cancels it at its k-th suspension. The tasks are pure-Python
``asyncio.Task``s whose steps are counted; nothing in toolguard or the
backends is replaced, and the I/O is real.

After each cancellation the caller checks (``Aftermath``): every pool's
connections idle, no task exception left unretrieved, the call audited once,
nothing applied twice, and the next calls going through.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Cancelled", "UnretrievedExceptions", "cancel_at", "count_await_points", "idle_pools"]

Call = Callable[[], Awaitable[Any]]


class _Count:
    """Suspensions of one call's tasks so far, and the one to cancel it at."""

    def __init__(self, cancel_at: int | None) -> None:
        self.suspensions = 0
        self.cancel_at = cancel_at
        self.root: asyncio.Task[Any] | None = None
        #: Where the call was suspended when it was cancelled (toolguard's frames, innermost last).
        self.where = ""


class _CountedTask(asyncio.tasks._PyTask):  # type: ignore[name-defined,misc]
    """A task that counts its suspensions into the call's ``_Count``; at the chosen one, the
    call's root task is cancelled (which reaches whatever child task it awaits)."""

    def __init__(self, coro: Any, *, count: _Count, **options: Any) -> None:
        super().__init__(coro, **options)
        self._count = count

    def _Task__step(self, exc: BaseException | None = None) -> None:
        super()._Task__step(exc)
        count, root = self._count, self._count.root
        if self.done() or root is None or root.done():
            return
        count.suspensions += 1
        if count.suspensions == count.cancel_at:
            count.where = _where(root)
            root.cancel()


async def _counted(call: Call, count: _Count) -> Any:
    """Run ``call()`` as a counted task; the tasks it creates meanwhile are counted too
    (LangChain runs a tool's coroutine in a task of its own, for instance)."""
    loop = asyncio.get_running_loop()
    previous = loop.get_task_factory()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **options: Any) -> asyncio.Task[Any]:
        return _CountedTask(coro, loop=loop, count=count, **options)

    loop.set_task_factory(factory)
    try:
        count.root = loop.create_task(_run(call))
        return await count.root
    finally:
        loop.set_task_factory(previous)


async def count_await_points(call: Call) -> tuple[int, Any]:
    """``(suspensions, result)`` of one uncancelled run of ``call()``."""
    count = _Count(None)
    result = await _counted(call, count)
    return count.suspensions, result


class Cancelled:
    """What a run cancelled at its k-th await point ended with."""

    def __init__(self, k: int, cancelled: bool, result: Any, where: str) -> None:
        self.k = k
        self.cancelled = cancelled
        self.result = result
        self.where = where


async def cancel_at(call: Call, k: int) -> Cancelled:
    """Run ``call()`` and cancel it at its ``k``-th suspension (it may finish first)."""
    count = _Count(k)
    try:
        result = await _counted(call, count)
    except asyncio.CancelledError:
        if count.root is None or not count.root.cancelled():
            raise  # the test itself was cancelled
        return Cancelled(k, True, None, count.where)
    return Cancelled(k, False, result, count.where)


def _where(task: asyncio.Task[Any]) -> str:
    """The awaits the task is suspended in, through the tasks it awaits (toolguard's frames)."""
    frames = []
    awaited: Any = task.get_coro()
    while awaited is not None:
        if isinstance(awaited, asyncio.Task):
            awaited = awaited.get_coro()
            continue
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
        if frame is not None and "toolguard" in frame.f_code.co_filename:
            name = frame.f_code.co_filename.rsplit("/", 2)
            frames.append(f"{'/'.join(name[-2:])}:{frame.f_lineno} {frame.f_code.co_name}")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
    return " > ".join(frames)


async def _run(call: Call) -> Any:
    return await call()


class UnretrievedExceptions:
    """Collects what the loop reports (``Task exception was never retrieved`` and the like)."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    @contextmanager
    def watching(self, loop: asyncio.AbstractEventLoop) -> Iterator[UnretrievedExceptions]:
        previous = loop.get_exception_handler()
        loop.set_exception_handler(lambda _loop, context: self.reports.append(context))
        try:
            yield self
        finally:
            gc.collect()  # a task dropped with an exception reports it when it is collected
            loop.set_exception_handler(previous)


async def settle(rounds: int = 20) -> None:
    """Let the loop run what a cancellation left scheduled (shielded cleanups, callbacks)."""
    for _ in range(rounds):
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)


def idle_pools(guard: Any) -> list[str]:
    """What is not idle in the guard's async pools (empty when all are idle)."""
    problems: list[str] = []
    pool = getattr(guard.async_store, "_pool", None)
    if pool is not None and hasattr(pool, "get_stats"):
        stats = pool.get_stats()
        busy = stats.get("pool_size", 0) - stats.get("pool_available", 0)
        if busy or stats.get("requests_waiting", 0):
            problems.append(f"store pool: {busy} in use, {stats.get('requests_waiting', 0)} waiting")
    backend = getattr(guard.async_locks, "backend", None)
    client = getattr(backend, "client", None)
    connections = getattr(getattr(client, "connection_pool", None), "_in_use_connections", None)
    if connections:
        problems.append(f"lock server pool: {len(connections)} connections in use")
    return problems
