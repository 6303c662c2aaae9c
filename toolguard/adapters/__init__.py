"""Adapters: plain functions, LangChain tools, LangGraph ToolNode and create_agent middleware.

Each turns a call into an ``Intent``, runs it through ``ToolGuard``, and turns
the ``Decision`` back into what its caller expects: a return value or a typed
error for Python, an error ``ToolMessage`` naming the reason for a model. The
LangChain and LangGraph adapters are transparent otherwise: the tool's own
answer, or its exception, comes back unchanged, with the decision under
``response_metadata["toolguard"]``.

The plain-function adapter needs nothing but toolguard; the LangChain and
LangGraph ones are loaded on first use and need the ``langgraph`` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolguard.adapters.functions import GuardedFunction, guarded

if TYPE_CHECKING:
    from toolguard.adapters.langchain import GuardedTool, guard_tool
    from toolguard.adapters.langgraph import GuardedToolCalls, ToolGuardMiddleware

_LAZY = {
    "GuardedTool": "toolguard.adapters.langchain",
    "guard_tool": "toolguard.adapters.langchain",
    "GuardedToolCalls": "toolguard.adapters.langgraph",
    "ToolGuardMiddleware": "toolguard.adapters.langgraph",
}


def _load(name: str) -> Any:
    """The LangChain/LangGraph adapters, imported only when asked for."""
    module_name = _LAZY.get(name)
    if module_name is None:
        msg = f"module 'toolguard.adapters' has no attribute {name!r}"
        raise AttributeError(msg)
    import importlib

    from toolguard.runtime.extras import require

    require("langgraph", f"toolguard.adapters.{name}")
    return getattr(importlib.import_module(module_name), name)


if not TYPE_CHECKING:  # type checkers read the imports above: a name not there is an error
    __getattr__ = _load


__all__ = [
    "GuardedFunction",
    "GuardedTool",
    "GuardedToolCalls",
    "ToolGuardMiddleware",
    "guard_tool",
    "guarded",
]
