"""LangGraph ``ToolNode`` wrappers and a ``create_agent`` middleware.

``calls = GuardedToolCalls(guard, agent="router")``, then
``ToolNode(tools, wrap_tool_call=calls.wrap_tool_call, awrap_tool_call=calls.awrap_tool_call)``;
or ``create_agent(model, tools, middleware=[..., ToolGuardMiddleware(guard, agent="router")])``.

The wrapper is transparent: it changes what a ToolNode does only by refusing a
call (an error ToolMessage naming the reason, audited; a refused call never
reaches ToolNode's ``execute``, whatever it holds) and by serializing and
fencing the calls it accepts. Everything else comes out as ToolNode made it:
the exceptions it lets through (after the failure is recorded), the messages
``handle_tool_errors`` builds, ``Command`` and list returns, injection,
streaming, interrupts and invalid resumes (re-raised after the locks are
released, so resuming re-runs the call and the idempotency record answers it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import ToolMessage
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command

from toolguard.adapters._approval import graph_interrupt
from toolguard.adapters._messages import (
    annotate,
    refusal_message,
    replayed_message,
    unknown_tool_message,
)
from toolguard.adapters._outcome import ToolOutcome
from toolguard.adapters._tools import (
    InjectedKeys,
    as_tool,
    check_tools,
    model_arguments,
    model_schema,
    runs_sync,
)
from toolguard.adapters._turns import Turns
from toolguard.adapters._worker import has_sync_edges, in_worker, worker_execute
from toolguard.adapters.identity import (
    AgentFrom,
    agent_from_metadata,
    check_identity_source,
    intent_from_call,
)
from toolguard.call.context import CallContext
from toolguard.call.intent import Intent
from toolguard.guard import Decision, ToolGuard

__all__ = ["AgentResolver", "GuardedToolCalls", "ToolGuardMiddleware", "agent_from_metadata"]

Output = ToolMessage | Command[Any]
AgentResolver = Callable[[ToolCallRequest], str | None]


class GuardedToolCalls:
    """The ``wrap_tool_call`` / ``awrap_tool_call`` pair for a ``ToolNode``.

    ``agent`` is the identity the policy authorizes, given by the host: a
    fixed name (one ToolNode per agent) or a function of the request. Or
    ``agent_from="metadata"``: the run's metadata ``toolguard_agent`` names
    the agent (``config={"metadata": {"toolguard_agent": "router"}}``), and a
    run without it is refused (``missing_identity``), whatever the policy's
    ``agents:`` says. With neither, building it raises ``GuardMisconfigured``:
    every call would be refused. ``metadata=False`` leaves the tool's answers
    without ``response_metadata["toolguard"]``.

    Under ``ainvoke``/``astream`` a sync tool (no coroutine) runs its sync
    guarded call in a worker thread when the guard has ``locks=`` and
    ``store=`` (``toolguard.adapters._worker``); a guard with only asyncio
    edges cannot run one. ``tools=`` (the ToolNode's tools) checks that when
    the wrapper is built and raises ``GuardMisconfigured`` naming the sync
    tools; without it, the first such call raises it. ``tools=`` also checks
    the policy against each tool's arguments now (``PolicyProblems``: an
    ``args:`` or lock template naming an argument the tool lacks), as
    ``ToolGuard.register`` does; without it, that check runs at each tool's
    first call.

    Put it innermost (directly around ToolNode's ``execute``, i.e. last in a
    ``create_agent`` middleware list): then it guards every tool that really
    runs, including one an interceptor above it substitutes, and a retry above
    it gets a fresh decision and transaction per attempt.
    """

    def __init__(self, guard: ToolGuard, *, agent: str | AgentResolver | None = None,
                 agent_from: AgentFrom | None = None, metadata: bool = True,
                 tools: Iterable[Any] | None = None) -> None:
        check_identity_source(agent, agent_from, type(self).__name__)
        self.guard = guard
        self.metadata = metadata
        self._agent = agent if callable(agent) else (lambda _r: agent) \
            if agent is not None else agent_from_metadata
        self._injected = InjectedKeys()
        #: Told of every intent before it runs (``ToolGuardMiddleware`` notes hold readers).
        self.seen: Callable[[Intent], None] | None = None
        if tools is not None:
            tools = [as_tool(tool) for tool in tools]
            check_tools(guard, tools, type(self).__name__)
            for tool in tools:  # the policy against each tool's arguments: PolicyProblems now
                self._register(tool)

    def _register(self, tool: Any) -> None:
        if not self.guard.has_schema(tool.name):
            self.guard.register(tool.name, model_schema(tool, self._injected.of(tool)))

    def _intent(self, request: ToolCallRequest) -> Intent:
        tool, call = request.tool, _envelope(request)
        args = call.get("args")
        if tool is not None:
            self._register(tool)
            args = model_arguments(args, self._injected.of(tool))
        runtime = request.runtime
        intent = intent_from_call({**call, "args": args}, agent=self._agent(request),
                                  runtime=runtime, config=getattr(runtime, "config", None))
        if self.seen is not None:
            self.seen(intent)
        return intent

    def wrap_tool_call(self, request: ToolCallRequest,
                       execute: Callable[[ToolCallRequest], Output]) -> Output:
        intent = self._intent(request)
        outcome = ToolOutcome(_call_id(_envelope(request)))
        decision = self.guard.run(
            intent, lambda ctx: outcome.run(lambda: execute(_as_approved(request, ctx))),
            interrupt=graph_interrupt())
        return self._annotated(self._answer(decision, request, outcome), outcome, decision)

    async def awrap_tool_call(self, request: ToolCallRequest,
                              execute: Callable[[ToolCallRequest], Awaitable[Output]]) -> Output:
        if runs_sync(request.tool):
            if not has_sync_edges(self.guard):
                check_tools(self.guard, _node_tools(request) or [request.tool], "ToolNode")
            loop = asyncio.get_running_loop()  # the sync guarded call, in a worker thread
            return await in_worker(
                lambda: self.wrap_tool_call(request, worker_execute(execute, loop)))
        intent = self._intent(request)
        outcome = ToolOutcome(_call_id(_envelope(request)))

        async def run_tool(ctx: CallContext) -> Any:
            return await outcome.arun(lambda: execute(_as_approved(request, ctx)))

        decision = await self.guard.arun(intent, run_tool, interrupt=graph_interrupt())
        return self._annotated(self._answer(decision, request, outcome), outcome, decision)

    @staticmethod
    def _answer(decision: Decision, request: ToolCallRequest, outcome: ToolOutcome) -> Any:
        """The tool's own answer or toolguard's (pure: no I/O).

        A call toolguard refused never goes on to ToolNode's ``execute``: whatever the
        call holds (arguments the tool's own schema would refuse as well, ``None`` or
        missing arguments, values nested past any limit), toolguard answers it.
        """
        if outcome.passes_on(decision):
            return outcome.output
        call, tool = _envelope(request), request.tool
        if decision.ok:
            return replayed_message(decision, call)
        if decision.reason == "unknown_tool" and tool is None:
            return unknown_tool_message(call, _tool_names(request))
        return refusal_message(decision, call)

    def _annotated(self, output: Output, outcome: ToolOutcome, decision: Decision) -> Output:
        if not self.metadata:
            return output
        annotated: Output = annotate(output, outcome.call_id, decision)
        return annotated


def _as_approved(request: ToolCallRequest, ctx: CallContext) -> ToolCallRequest:
    """The request to run: as the model sent it, or with the arguments a person edited."""
    if not ctx.edited:
        return request
    call = request.tool_call
    return request.override(tool_call={**call, "args": {**call.get("args", {}), **ctx.edited}})


def _envelope(request: ToolCallRequest) -> Mapping[str, Any]:
    """The tool call as a mapping (a request built by other code may hold anything there)."""
    call = request.tool_call
    return call if isinstance(call, Mapping) else {}


def _call_id(call: Mapping[str, Any]) -> str | None:
    call_id = call.get("id")
    return call_id if isinstance(call_id, str) else None


def _node_tools(request: ToolCallRequest) -> list[Any]:
    return list(getattr(request.runtime, "tools", None) or [])


def _tool_names(request: ToolCallRequest) -> list[str]:
    return [str(getattr(tool, "name", tool)) for tool in _node_tools(request)]


class ToolGuardMiddleware(AgentMiddleware):
    """``create_agent`` middleware guarding every tool call (sync and async).

    ``agent``, ``agent_from``, ``metadata`` and ``tools`` (the agent's tools,
    checked against the guard's edges and the policy now) as for
    ``GuardedToolCalls``: without ``agent=`` or ``agent_from="metadata"`` it
    raises ``GuardMisconfigured``. The first middleware
    listed is the outermost: list toolguard last among the tool-call
    middlewares (after human approval and tool retry), so it sits directly
    around the tool's execution. When the agent's run ends, the holds its
    ``hold: true`` reads took and kept end too (``after_agent``).
    """

    def __init__(self, guard: ToolGuard, *, agent: str | AgentResolver | None = None,
                 agent_from: AgentFrom | None = None, metadata: bool = True,
                 tools: Iterable[Any] | None = None) -> None:
        super().__init__()
        check_identity_source(agent, agent_from, type(self).__name__)
        known = None if tools is None else [as_tool(tool) for tool in tools]
        if known is not None:
            check_tools(guard, known, type(self).__name__)
        self.calls = GuardedToolCalls(guard, agent=agent, agent_from=agent_from,
                                      metadata=metadata, tools=known)
        self._turns = Turns()
        self.calls.seen = lambda intent: self._turns.note(intent, guard.policy)

    def wrap_tool_call(self, request: ToolCallRequest,
                       handler: Callable[[ToolCallRequest], Output]) -> Output:
        return self.calls.wrap_tool_call(request, handler)

    async def awrap_tool_call(self, request: ToolCallRequest,
                              handler: Callable[[ToolCallRequest], Awaitable[Output]]) -> Output:
        return await self.calls.awrap_tool_call(request, handler)

    def after_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """The run ended: the holds its callers kept end now (others stop waiting)."""
        for caller in self._turns.ended(runtime):
            self.calls.guard.holds.release(caller, "the agent's turn ended")
        return None

    async def aafter_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        for caller in self._turns.ended(runtime):
            await self.calls.guard.holds.arelease(caller, "the agent's turn ended")
        return None
