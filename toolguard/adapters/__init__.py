"""Adapters: plain functions, LangChain tools, LangGraph ToolNode and create_agent middleware,
PydanticAI toolsets and OpenAI Agents SDK function tools.

Each turns a call into an ``Intent``, runs it through ``ToolGuard``, and turns
the ``Decision`` back into what its caller expects: a return value or a typed
error for Python, an error ``ToolMessage`` naming the reason for a model. The
LangChain and LangGraph adapters are transparent otherwise: the tool's own
answer, or its exception, comes back unchanged, with the decision under
``response_metadata["toolguard"]``.

The plain-function adapter needs nothing but toolguard; the others are
loaded on first use and need their extra: ``langgraph`` (LangChain and
LangGraph), ``pydantic-ai``, ``openai-agents``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolguard.adapters.functions import GuardedFunction, guarded

if TYPE_CHECKING:
    from toolguard.adapters.langchain import GuardedTool, guard_tool
    from toolguard.adapters.langgraph import GuardedToolCalls, ToolGuardMiddleware
    from toolguard.adapters.openai_agents import guard_function_tool, guard_tools
    from toolguard.adapters.pydantic_ai import GuardedToolset, guard_toolset

#: name -> (module, extra)
_LAZY = {
    "GuardedTool": ("toolguard.adapters.langchain", "langgraph"),
    "guard_tool": ("toolguard.adapters.langchain", "langgraph"),
    "GuardedToolCalls": ("toolguard.adapters.langgraph", "langgraph"),
    "ToolGuardMiddleware": ("toolguard.adapters.langgraph", "langgraph"),
    "GuardedToolset": ("toolguard.adapters.pydantic_ai", "pydantic-ai"),
    "guard_toolset": ("toolguard.adapters.pydantic_ai", "pydantic-ai"),
    "guard_function_tool": ("toolguard.adapters.openai_agents", "openai-agents"),
    "guard_tools": ("toolguard.adapters.openai_agents", "openai-agents"),
}


def _load(name: str) -> Any:
    """The framework adapters, imported only when asked for."""
    found = _LAZY.get(name)
    if found is None:
        msg = f"module 'toolguard.adapters' has no attribute {name!r}"
        raise AttributeError(msg)
    import importlib

    from toolguard.runtime.extras import require

    module_name, extra = found
    require(extra, f"toolguard.adapters.{name}")
    return getattr(importlib.import_module(module_name), name)


if not TYPE_CHECKING:  # type checkers read the imports above: a name not there is an error
    __getattr__ = _load


__all__ = [
    "GuardedFunction",
    "GuardedTool",
    "GuardedToolCalls",
    "GuardedToolset",
    "ToolGuardMiddleware",
    "guard_function_tool",
    "guard_tool",
    "guard_tools",
    "guard_toolset",
    "guarded",
]
