"""Sync tools on the async path: the sync guarded call in a worker thread, as LangGraph runs them.

LangGraph runs a sync tool under ``ainvoke``/``astream`` in a worker thread. A
guarded sync tool needs more than that: its body reads ``current().tx``, the
sync fenced transaction, so the whole guarded call has to be the sync one.
When the guard has sync edges (``locks=`` and ``store=``), the async adapters
run the sync guarded call (decision, locks, fenced transaction, audit) in a
worker thread of toolguard's own, with the caller's contextvars: the call has
the identity, the transaction and the cancellation behaviour of the sync path
(a cancelled caller stops waiting; the call runs to its end and is audited, as
a sync sibling in a LangGraph superstep does).

For a ToolNode the tool still runs through ToolNode's own async ``execute``
(injection, ``handle_tool_errors``, the ``Command`` and message shapes), on the
event loop; only the tool's sync body is handed back to the worker, which runs
it in the thread that holds the transaction. The worker never waits on the
loop's default executor (LangChain's sync callbacks use it), so no number of
parallel calls can starve it.

A guard with only async edges cannot run a sync tool body at all (it has no
sync transaction): ``toolguard.adapters._tools.check_tools`` raises
``GuardMisconfigured`` naming them, when the adapter is built. Nothing here
needs LangChain: plain guarded functions use ``in_worker`` too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import copy
import functools
import queue
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["InboxExecutor", "has_sync_edges", "in_worker", "on_loop", "worker_execute"]

T = TypeVar("T")

#: toolguard's own workers: never the loop's default executor, which a tool's run may need.
_WORKERS = concurrent.futures.ThreadPoolExecutor(max_workers=32,
                                                 thread_name_prefix="toolguard-sync-call")
#: How often a worker waiting on the loop checks that the loop still runs (liveness only).
_LOOP_CHECK_S = 0.5


def has_sync_edges(guard: Any) -> bool:
    """True if ``guard`` can run a sync guarded call (it has ``locks=`` and ``store=``)."""
    return getattr(guard, "locks", None) is not None and getattr(guard, "store", None) is not None


async def in_worker(function: Callable[[], T]) -> T:
    """``function()`` in one of toolguard's worker threads, with this task's contextvars."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    return await loop.run_in_executor(_WORKERS, context.run, function)


def worker_execute(execute: Callable[[Any], Awaitable[T]],
                   loop: asyncio.AbstractEventLoop) -> Callable[[Any], T]:
    """A sync ``execute(request)`` for the worker: ToolNode's async one, the tool's body here.

    Called in the worker thread (inside the sync guarded call), it runs
    ``execute`` on ``loop`` under the worker's contextvars, with the request's
    tool answering ``ainvoke`` by sending its sync ``invoke`` back to this
    thread, and returns what ``execute`` returned (or raises what it raised).
    """

    def run(request: Any) -> T:
        inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        tool = request.tool
        if tool is not None:
            request = request.override(tool=_answered_here(tool, inbox, loop))
        running = asyncio.run_coroutine_threadsafe(_awaited(execute(request)), loop)
        return _serve(running, inbox, loop)

    return run


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _serve(running: concurrent.futures.Future[T],
           inbox: queue.SimpleQueue[Callable[[], None] | None],
           loop: asyncio.AbstractEventLoop) -> T:
    """Run in this thread what ``inbox`` gets until ``running`` is done; then its result."""
    running.add_done_callback(lambda _done: inbox.put(None))
    while True:
        try:
            work = inbox.get(timeout=_LOOP_CHECK_S)
        except queue.Empty:
            if loop.is_closed() and not running.done():  # the loop is gone: nothing answers
                running.cancel()
                raise asyncio.CancelledError from None
            continue
        if work is None:
            break
        work()
    try:
        return running.result()
    except concurrent.futures.CancelledError:  # the loop cancelled it (e.g. shutting down)
        raise asyncio.CancelledError from None


class InboxExecutor(concurrent.futures.Executor):
    """An executor whose work runs in the worker thread that waits in ``on_loop`` for it."""

    def __init__(self, inbox: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        self._inbox = inbox

    def submit(self, fn: Callable[..., T], /, *args: Any,
               **kwargs: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def work() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:  # handed to the awaiting coroutine
                future.set_exception(error)

        self._inbox.put(work)
        return future


def on_loop(call: Callable[[InboxExecutor], Awaitable[T]], loop: asyncio.AbstractEventLoop) -> T:
    """Await ``call(here)`` on ``loop`` from this worker thread, and run what ``here`` gets here.

    For frameworks whose tool runner is async and hands a sync function to an
    executor: ``call`` makes that executor ``here`` (e.g. PydanticAI's
    ``Agent.using_thread_executor``), so the function runs in this thread, the
    one that holds the sync guarded call's transaction. The coroutine starts
    with this thread's contextvars (``current()``).
    """
    inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
    running = asyncio.run_coroutine_threadsafe(_awaited(call(InboxExecutor(inbox))), loop)
    return _serve(running, inbox, loop)


def _answered_here(tool: Any, inbox: queue.SimpleQueue[Callable[[], None] | None],
                   loop: asyncio.AbstractEventLoop) -> Any:
    """A copy of ``tool`` whose ``ainvoke`` runs its sync ``invoke`` in the waiting worker.

    Everything ToolNode reads off the tool (name, schemas, injected parameters,
    ``func``) is the tool's own; only where its sync body runs changes.
    """

    async def ainvoke(tool_input: Any, config: Any = None, **kwargs: Any) -> Any:
        answer: asyncio.Future[Any] = loop.create_future()
        inbox.put(functools.partial(_answer, answer, loop,
                                    functools.partial(tool.invoke, tool_input, config, **kwargs)))
        return await answer

    here = copy.copy(tool)
    object.__setattr__(here, "ainvoke", ainvoke)  # an instance attribute: the class is untouched
    return here


def _answer(answer: asyncio.Future[Any], loop: asyncio.AbstractEventLoop,
            invoke: Callable[[], Any]) -> None:
    """Run the tool's sync body (in the worker) and hand its result to the waiting coroutine."""
    if answer.cancelled():  # its caller stopped waiting before it began: it never runs
        return
    try:
        value = invoke()
    except BaseException as error:  # handed to the coroutine, which raises it in ToolNode
        _settle(loop, answer, error=error)
        if not isinstance(error, Exception):
            raise
        return
    _settle(loop, answer, value=value)


def _settle(loop: asyncio.AbstractEventLoop, answer: asyncio.Future[Any], *, value: Any = None,
            error: BaseException | None = None) -> None:
    def settle() -> None:
        if answer.done():
            return
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(value)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for the answer
        loop.call_soon_threadsafe(settle)
