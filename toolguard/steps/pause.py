"""The kill switch step, first of all: a paused tool or agent costs nothing more.

``check_pause(board, intent)`` raises ``Paused`` when an operator paused the
call's tool, its agent or everything (``toolguard pause``), and
``BackendUnavailable`` when the pause set cannot be read: the switch fails
closed. It runs before validation, on the envelope as sent; a name that is
not text cannot match a pause (validation refuses it next), but a pause of
everything still stops it. Never shadowed.
"""

from __future__ import annotations

from toolguard.call.intent import Intent
from toolguard.controls.pause import AsyncPauseBoard, PauseBoard, PauseSet
from toolguard.errors import BackendUnavailable, ToolGuardError
from toolguard.runtime.safe_text import text_of

__all__ = ["acheck_pause", "check_pause"]


def _names(intent: Intent) -> tuple[str, str | None]:
    tool = intent.tool if isinstance(intent.tool, str) else ""
    agent = intent.agent if isinstance(intent.agent, str) else None
    return tool, agent


def _unreadable(error: Exception) -> BackendUnavailable:
    msg = (f"the pause set cannot be read ({type(error).__name__}: {text_of(error)}); calls are "
           f"refused until it can (a kill switch fails closed)")
    failure = BackendUnavailable(msg)
    failure.__cause__ = error
    return failure


def _refuse(pauses: PauseSet, intent: Intent) -> None:
    error = pauses.refusal(*_names(intent))
    if error is not None:
        raise error


def check_pause(board: PauseBoard | None, intent: Intent) -> None:
    """Raise ``Paused`` (or ``BackendUnavailable``) unless the call may go on."""
    if board is None:
        return
    try:
        pauses = board.current()
    except ToolGuardError as error:
        if isinstance(error, BackendUnavailable):
            raise
        raise _unreadable(error) from error
    except Exception as error:  # a driver error: the store is away
        raise _unreadable(error) from error
    _refuse(pauses, intent)


async def acheck_pause(board: AsyncPauseBoard | None, intent: Intent) -> None:
    """The asyncio twin of ``check_pause``."""
    if board is None:
        return
    try:
        pauses = await board.current()
    except ToolGuardError as error:
        if isinstance(error, BackendUnavailable):
            raise
        raise _unreadable(error) from error
    except Exception as error:
        raise _unreadable(error) from error
    _refuse(pauses, intent)
