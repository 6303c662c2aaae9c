"""How the LangGraph adapters wait for a person: LangGraph's ``interrupt``, inside a graph only.

Inside a running graph the guard pauses a call that needs approval with
``interrupt(request)`` and reads the decision from the resume value; anywhere
else (a tool invoked from plain code) there is nothing to resume, so the call
is refused ``approval_required`` with the request's id, as for any caller.
"""

from __future__ import annotations

from typing import Any

from langchain_core.runnables.config import var_child_runnable_config
from langgraph.types import interrupt

from toolguard.steps.approval import Interrupt

__all__ = ["TaskInterrupt", "graph_interrupt"]

try:  # where LangGraph keeps the task's interrupt bookkeeping (present only inside a graph)
    from langgraph._internal._constants import CONFIG_KEY_SCRATCHPAD
except ImportError:  # pragma: no cover - a LangGraph that moved it
    CONFIG_KEY_SCRATCHPAD = "__pregel_scratchpad"


class TaskInterrupt:
    """LangGraph's ``interrupt`` for one task, which also says whether the task was resumed.

    The approval step asks with it, and on a re-run of a resumed task reads
    again the answers it read when it asked (LangGraph hands a task's resume
    values out by the order of its ``interrupt()`` calls).
    """

    __slots__ = ("_scratchpad",)

    def __init__(self, scratchpad: Any) -> None:
        self._scratchpad = scratchpad

    def __call__(self, value: Any) -> Any:
        return interrupt(value)

    def resumed(self) -> bool:
        """True when the task runs again with resume values (given, or waiting to be read)."""
        if getattr(self._scratchpad, "resume", None):
            return True
        waiting = getattr(self._scratchpad, "get_null_resume", None)
        return callable(waiting) and waiting(False) is not None


def graph_interrupt(config: Any = None) -> Interrupt | None:
    """``interrupt`` when this code runs as a task of a LangGraph graph, else None."""
    for current in (config, var_child_runnable_config.get()):
        configurable = current.get("configurable") if isinstance(current, dict) else None
        if isinstance(configurable, dict) and CONFIG_KEY_SCRATCHPAD in configurable:
            return TaskInterrupt(configurable[CONFIG_KEY_SCRATCHPAD])
    return None
