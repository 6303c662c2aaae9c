"""Adapters: plain functions, LangChain tools, LangGraph ToolNode and create_agent middleware.

Each turns a call into an ``Intent``, runs it through ``ToolGuard``, and turns
the ``Decision`` back into what its caller expects: a return value or a typed
error for Python, an error ``ToolMessage`` naming the reason for a model. The
LangChain and LangGraph adapters are transparent otherwise: the tool's own
answer, or its exception, comes back unchanged, with the decision under
``response_metadata["toolguard"]``.
"""

from toolguard.adapters.functions import GuardedFunction, guarded
from toolguard.adapters.langchain import GuardedTool, guard_tool
from toolguard.adapters.langgraph import GuardedToolCalls, ToolGuardMiddleware

__all__ = [
    "GuardedFunction",
    "GuardedTool",
    "GuardedToolCalls",
    "ToolGuardMiddleware",
    "guard_tool",
    "guarded",
]
