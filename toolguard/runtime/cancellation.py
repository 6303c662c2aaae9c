"""Cleanup that survives cancellation, however the server cancels.

Two ways of cancelling meet in a fenced service. asyncio cancels a task once:
``asyncio.shield`` then keeps the shielded work running and the caller may wait
for it. anyio, under Starlette and the MCP SDK (``notifications/cancelled``
cancels the request's scope), cancels again at every await until the scope is
left: an ``await asyncio.shield(conn.execute("ROLLBACK"))`` in a ``finally`` is
interrupted at once, the code after it runs while the ROLLBACK is still on the
wire, and the connection goes back to its pool busy. The pool closes it, and
the leftover statement touches a file descriptor another socket uses by then.

Here, work that must end before its caller goes on runs in a task of its own:

* ``isolated(work, stoppable)`` delivers the caller's cancellation to ``work``
  once, the asyncio way (unless ``stoppable()`` says ``work`` is past the point
  where it may be stopped), and waits for ``work`` to finish its own cleanup
  before the caller's cancellation goes on. The fenced transaction, the in-flight marker
  and the handler run inside one, so the store's cleanup (rollback, the audit
  row, the connection back to the pool idle) sees a single cancellation.
* ``finish(work)`` does not cancel ``work`` at all (an audit row, a ROLLBACK):
  it runs to its end, then the caller's cancellation goes on.

While waiting, repeated cancellations are absorbed (under anyio inside a
shielded scope, so they are not even delivered). ``work`` must be bounded: the
stores bound theirs (the pool's timeout, SQLite's busy timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["finish", "isolated"]

T = TypeVar("T")
log = logging.getLogger("toolguard.fences")


def _shielded() -> contextlib.AbstractContextManager[Any]:
    """anyio's shielded scope when anyio is there (it then stops re-cancelling this task)."""
    try:
        import anyio
    except ImportError:  # plain asyncio: every cancellation arrives once, and is absorbed below
        return contextlib.nullcontext()
    return anyio.CancelScope(shield=True)


async def isolated(work: Awaitable[T],
                   stoppable: Callable[[], bool] = lambda: True) -> T:
    """Run ``work`` in its own task; a cancellation of the caller reaches it once (if
    ``stoppable()`` says it still may be stopped then), and the caller waits for it to end
    before the cancellation propagates (see the module docstring)."""
    return await _run(work, forward=stoppable)


async def finish(work: Awaitable[T]) -> T:
    """Run ``work`` to its end even if the caller is cancelled meanwhile; then re-raise that."""
    return await _run(work, forward=lambda: False)


async def _run(work: Awaitable[T], *, forward: Callable[[], bool]) -> T:
    task = asyncio.ensure_future(work)  # a copy of this context: contextvars travel along
    try:
        await asyncio.wait({task})
    except asyncio.CancelledError:
        if forward():
            task.cancel()
        with _shielded():
            while not task.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:  # retrieved, never left behind
            log.debug("cancelled while its cleanup failed: %r", task.exception())
        raise
    return task.result()
