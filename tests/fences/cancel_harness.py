"""Cancel a call at each of its await points in turn: count them on a first run, then stop at
the 1st, the 2nd, ... the n-th.

How the points are counted. An await point is a place where a task of the call gives
the event loop control (a coroutine somewhere down its chain yields a future, or a bare
``yield`` from ``asyncio.sleep(0)``). ``Harness.run(coro)`` drives ``coro`` through
``Counted``, a proxy that sits between the task and the coroutine and sees every such
yield; a task factory installed on the loop puts the same proxy around every task
created inside the call (its context carries the harness), so the points of the tasks
the call spawns (toolguard's isolated request task, anyio task groups) are counted too,
in one sequence. The count is a property of the code path, not of timing: a path that
runs the same way gives the same points.

What happens at point n (``Harness.arm(n, mode)``):

* ``"cancel"``: the call's task is cancelled right there, the asyncio way: at a point of
  its own task with the awaited operation still in flight (a statement on the wire, a
  worker thread running; the proxy calls ``task.cancel()`` before handing the future to
  the task, which cancels it); at a point of a task the call spawned, while that task
  is there.
* ``"pause"``: the task stops there (the awaited operation goes on) until something from
  outside cancels it: the MCP client's ``notifications/cancelled`` (the SDK cancels the
  request's anyio scope, again at every later await), or the client hanging up while
  an ASGI layer cancels the request on ``http.disconnect``. ``paused`` is set once it
  stops; ``release()`` lets a point no cancellation can reach go on.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

T = TypeVar("T")
Mode = Literal["cancel", "pause"]

_harness: contextvars.ContextVar[Harness | None] = contextvars.ContextVar("cancel_harness",
                                                                          default=None)


@dataclass
class Harness:
    """One call's await points: counted, and the armed one acted on."""

    count: int = 0
    target: int | None = None
    mode: Mode = "cancel"
    reached: bool = False  # the armed point was reached (and acted on)
    paused: asyncio.Event = field(default_factory=asyncio.Event)
    root: asyncio.Task[Any] | None = None  # the task that called ``run``: the one cancelled
    _release: asyncio.Future[None] | None = None

    def arm(self, target: int | None, mode: Mode = "cancel") -> None:
        self.count, self.target, self.mode, self.reached = 0, target, mode, False
        self.paused = asyncio.Event()
        self._release = None

    def release(self) -> None:
        if self._release is not None and not self._release.done():
            self._release.set_result(None)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` with its points (and those of the tasks it creates) counted."""
        install_task_factory()
        self.root = asyncio.current_task()
        token = _harness.set(self)
        try:
            return await Counted(coro, self)
        finally:
            _harness.reset(token)

    def _point(self) -> Literal["go", "cancel", "pause"]:
        self.count += 1
        if self.target is not None and self.count == self.target:
            self.reached = True
            return self.mode
        return "go"

    def _pause(self) -> asyncio.Future[None]:
        self._release = asyncio.get_running_loop().create_future()
        self.paused.set()
        return self._release


class Counted:
    """The awaitable proxy between a task and ``coro`` (see the module docstring)."""

    def __init__(self, coro: Coroutine[Any, Any, Any], harness: Harness) -> None:
        self.coro = coro
        self.harness = harness

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, harness = self.coro, self.harness
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            action = harness._point()
            try:
                if action == "cancel":
                    # The caller is cancelled: if this is its own task, it cancels ``yielded``
                    # as soon as it gets it (the operation in flight); a task the call
                    # spawned hears of it as the call's code passes it on.
                    assert harness.root is not None
                    harness.root.cancel()
                    value = yield yielded
                elif action == "pause":
                    pause = harness._pause()
                    pause._asyncio_future_blocking = True
                    yield pause  # returns only when released; a cancellation raises here
                    value = yield yielded
                else:
                    value = yield yielded
            except BaseException as raised:
                if action == "pause" and isinstance(yielded, asyncio.Future) and not yielded.done():
                    yielded.cancel()
                error = raised


async def _drive(coro: Coroutine[Any, Any, T], harness: Harness) -> T:
    result: T = await Counted(coro, harness)
    return result


def install_task_factory() -> None:
    """Count the points of every task created inside a harnessed call (once per loop)."""
    loop = asyncio.get_running_loop()
    if getattr(loop.get_task_factory(), "_cancel_harness", False):
        return

    def factory(loop: asyncio.AbstractEventLoop, coro: Any,
                context: contextvars.Context | None = None) -> asyncio.Task[Any]:
        harness = (context or contextvars.copy_context()).run(_harness.get)
        if harness is not None and asyncio.iscoroutine(coro):
            coro = _drive(coro, harness)
        return asyncio.Task(coro, loop=loop, context=context)

    factory._cancel_harness = True  # type: ignore[attr-defined]
    loop.set_task_factory(factory)  # type: ignore[arg-type]
