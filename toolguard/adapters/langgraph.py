"""LangGraph ``ToolNode`` wrappers and a ``create_agent`` middleware.

``ToolNode(tools, wrap_tool_call=calls.wrap_tool_call, awrap_tool_call=calls.awrap_tool_call)``
or ``create_agent(model, tools, middleware=[ToolGuardMiddleware(guard)])``. Every
expected rejection comes back to the model as an error ``ToolMessage`` naming the
reason; ``GraphBubbleUp`` (interrupts) passes through after the locks are
released, so resuming re-runs the call and the idempotency record answers it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import ToolMessage
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command

from toolguard.adapters._messages import error_message, recordable, replayed_message
from toolguard.adapters.identity import agent_from_metadata, intent_from_call
from toolguard.context import CallContext
from toolguard.guard import Decision, ToolGuard

__all__ = ["AgentResolver", "GuardedToolCalls", "ToolGuardMiddleware", "agent_from_metadata"]

Output = ToolMessage | Command
AgentResolver = Callable[[ToolCallRequest], str | None]


class GuardedToolCalls:
    """The ``wrap_tool_call`` / ``awrap_tool_call`` pair for a ``ToolNode``.

    ``agent`` is the identity the policy authorizes: a fixed name (one ToolNode
    per agent) or a function of the request (default: run metadata
    ``toolguard_agent``, else the node name).
    """

    def __init__(self, guard: ToolGuard, *, agent: str | AgentResolver | None = None) -> None:
        self.guard = guard
        self._agent = agent if callable(agent) else (lambda _r, name=agent: name) \
            if agent is not None else agent_from_metadata

    def _intent(self, request: ToolCallRequest) -> Any:
        if request.tool is not None and not self.guard.has_schema(request.tool.name):
            self.guard.register(request.tool.name, request.tool)
        runtime = request.runtime
        return intent_from_call(request.tool_call, agent=self._agent(request), runtime=runtime,
                                config=getattr(runtime, "config", None))

    def wrap_tool_call(self, request: ToolCallRequest,
                       execute: Callable[[ToolCallRequest], Output]) -> Output:
        produced: list[Output] = []

        def run_tool(_: CallContext) -> Any:
            output = execute(request)
            produced.append(output)
            return recordable(output)

        decision = self.guard.run(self._intent(request), run_tool)
        return self._answer(decision, request, produced)

    async def awrap_tool_call(self, request: ToolCallRequest,
                              execute: Callable[[ToolCallRequest], Awaitable[Output]]) -> Output:
        produced: list[Output] = []

        async def run_tool(_: CallContext) -> Any:
            output = await execute(request)
            produced.append(output)
            return recordable(output)

        decision = await self.guard.arun(self._intent(request), run_tool)
        return self._answer(decision, request, produced)

    @staticmethod
    def _answer(decision: Decision, request: ToolCallRequest, produced: list[Output]) -> Output:
        if not decision.ok:
            return error_message(decision, request.tool_call)
        if decision.kind == "accepted" and produced:
            return produced[-1]
        return replayed_message(decision, request.tool_call)


class ToolGuardMiddleware(AgentMiddleware):
    """``create_agent`` middleware guarding every tool call (sync and async).

    List it after human-approval middleware and before tool-retry middleware:
    the first middleware listed is the outermost.
    """

    def __init__(self, guard: ToolGuard, *, agent: str | AgentResolver | None = None) -> None:
        super().__init__()
        self.calls = GuardedToolCalls(guard, agent=agent)

    def wrap_tool_call(self, request: ToolCallRequest,
                       handler: Callable[[ToolCallRequest], Output]) -> Output:
        return self.calls.wrap_tool_call(request, handler)

    async def awrap_tool_call(self, request: ToolCallRequest,
                              handler: Callable[[ToolCallRequest], Awaitable[Output]]) -> Output:
        return await self.calls.awrap_tool_call(request, handler)
