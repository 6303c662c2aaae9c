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

__all__ = ["graph_interrupt"]

try:  # where LangGraph keeps the task's interrupt bookkeeping (present only inside a graph)
    from langgraph._internal._constants import CONFIG_KEY_SCRATCHPAD
except ImportError:  # pragma: no cover - a LangGraph that moved it
    CONFIG_KEY_SCRATCHPAD = "__pregel_scratchpad"


def graph_interrupt(config: Any = None) -> Interrupt | None:
    """``interrupt`` when this code runs as a task of a LangGraph graph, else None."""
    for current in (config, var_child_runnable_config.get()):
        if isinstance(current, dict) and CONFIG_KEY_SCRATCHPAD in (current.get("configurable")
                                                                    or {}):
            return interrupt
    return None
