"""The OpenAI Agents SDK: function tools behind the guard.

``Agent(name="billing", tools=guard_tools(guard, [charge, refund], agent="billing"))``,
or ``guard_function_tool(guard, tool, agent=...)`` for one ``FunctionTool``
(what ``@function_tool`` makes). The guarded copy keeps everything the SDK
reads off the tool (name, description, schema, guardrails, ``needs_approval``,
timeouts); only its invocation goes through the guard first, and a refused
call never reaches the tool.

What toolguard reads, and from where:

- **the arguments**: the JSON text the model wrote, parsed by toolguard and
  validated strictly against the tool's JSON schema (the SDK's own parsing
  and validation then run on the accepted call, inside the guarded call);
- **the agent** from the host: ``agent=`` (a name, or a function of the
  ``ToolContext``), else a ``toolguard_agent`` attribute or key of the run's
  context object (``Runner.run(agent, input, context=...)``). Never from the
  model, never the SDK agent's name; none is refused (``missing_identity``);
- **the call id**: ``ToolContext.tool_call_id``, the id of the model's
  function call; the thread is the run's ``RunConfig.group_id`` (the SDK's
  id for one conversation), else the run's trace id. Without either, a call
  has no stable identity: it runs without replay protection (an unfenced
  tool is refused ``missing_idempotency_key``).

A refusal is the tool's answer to the model (``decision.model_text()``: the
reason and what it may do next), as the SDK answers a tool's error; a replay
answers with the recorded result (as JSON). A tool that raises is recorded as
failed (its transaction rolled back), then answered as the SDK answers it (its
``failure_error_function``). Inside the tool, ``toolguard.current()`` holds the
lease and the transaction: ``current().atx`` in an async function,
``current().tx`` in a sync one (its guarded call runs in a worker thread).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import quote

from agents import FunctionTool, RunContextWrapper, Tool
from agents.tool import (
    maybe_invoke_function_tool_failure_error_function,
    set_function_tool_failure_error_function,
)
from agents.tool_context import ToolContext

from toolguard.adapters._results import PlainOutcome, replayed_value
from toolguard.adapters._worker import has_sync_edges, in_worker, on_loop
from toolguard.adapters.identity import AGENT_METADATA_KEY
from toolguard.call.context import CallContext
from toolguard.call.envelope import untrusted_intent
from toolguard.call.intent import Intent
from toolguard.errors import GuardMisconfigured
from toolguard.guard import Decision, ToolGuard

__all__ = ["AgentResolver", "agent_of_context", "guard_function_tool", "guard_tools"]

AgentResolver = Callable[[ToolContext[Any]], Any]

#: How the SDK marks the invoker of a tool made from a sync function (it runs in a thread).
_SYNC_MARKER = "__agents_sync_function_tool__"
_SYNC_TOOL_ASYNC_GUARD = (
    "{tool} is a sync function tool, and this guard has only asyncio locks and store "
    "(async_locks=, async_store=): it would run without a sync fenced transaction. Give the "
    "guard locks= and store= as well (the sync guarded call then runs in a worker thread), or "
    "make {tool} an async def using current().atx")


def agent_of_context(ctx: RunContextWrapper[Any]) -> Any:
    """The run context's ``toolguard_agent`` (attribute or key), as given; None if absent."""
    context = ctx.context
    if isinstance(context, Mapping):
        return context.get(AGENT_METADATA_KEY)
    return getattr(context, AGENT_METADATA_KEY, None)


class _GuardedInvoke:
    """``on_invoke_tool`` of the guarded copy: the guard, then the tool's own invocation."""

    def __init__(self, guard: ToolGuard, tool: FunctionTool,
                 agent: str | AgentResolver | None) -> None:
        self.guard = guard
        self.tool = tool
        #: The tool with its errors raised rather than answered: the guard records them first.
        self.quiet = set_function_tool_failure_error_function(dataclasses.replace(tool), None)
        self.agent = agent
        self.sync = bool(getattr(tool.on_invoke_tool, _SYNC_MARKER, False))

    def _agent_of(self, ctx: ToolContext[Any]) -> Any:
        if self.agent is None:
            return agent_of_context(ctx)
        return self.agent(ctx) if callable(self.agent) else self.agent

    def intent(self, ctx: ToolContext[Any], input: Any) -> Intent:
        """The untrusted intent of one call; never raises (the guard refuses a bad one)."""
        agent = self._agent_of(ctx)
        path = quote(agent, safe="") if type(agent) is str else ""
        config = getattr(ctx, "run_config", None)
        thread = getattr(config, "group_id", None)
        run = _trace_id()
        return untrusted_intent(
            tool=self.tool.name, args=_parsed(input), call_id=getattr(ctx, "tool_call_id", None),
            agent=agent, thread_id=thread if thread else None, run_id=run,
            checkpoint_ns=f"{path}:{run}" if run else path, origin="model")

    async def __call__(self, ctx: ToolContext[Any], input: str) -> Any:
        outcome = PlainOutcome()
        try:
            if self.sync:
                decision = await self._sync_call(ctx, input, outcome)
            else:
                async def run_tool(cctx: CallContext) -> Any:
                    return await outcome.arun(lambda: self.quiet.on_invoke_tool(
                        ctx, _as_approved(input, cctx)))

                decision = await self.guard.arun(self.intent(ctx, input), run_tool)
            return _answer(decision, outcome)
        except Exception as error:
            if outcome.raised is not error:
                raise  # toolguard's own (a configuration error): the developer's to see
            # the tool's error, recorded as failed: answered as the SDK answers it
            answer = await maybe_invoke_function_tool_failure_error_function(
                function_tool=self.tool, context=ctx, error=error)
            if answer is None:
                raise
            return answer

    async def _sync_call(self, ctx: ToolContext[Any], input: str, outcome: PlainOutcome) -> Decision:
        if not has_sync_edges(self.guard):
            raise GuardMisconfigured(_SYNC_TOOL_ASYNC_GUARD.format(tool=self.tool.name))
        loop = asyncio.get_running_loop()

        def body(cctx: CallContext) -> Any:
            # the SDK runs the function in a thread of its own, with this call's context
            return outcome.run(lambda: on_loop(
                lambda _here: self.quiet.on_invoke_tool(ctx, _as_approved(input, cctx)), loop))

        return await in_worker(lambda: self.guard.run(self.intent(ctx, input), body))


def _trace_id() -> str | None:
    """The current trace's id (one per run unless the host groups runs in one trace)."""
    try:
        from agents.tracing import get_current_trace

        trace = get_current_trace()
    except Exception:  # tracing unavailable: no run identity
        return None
    trace_id = getattr(trace, "trace_id", None)
    return trace_id if isinstance(trace_id, str) and trace_id.startswith("trace_") else None


def _parsed(input: Any) -> Any:
    """The model's arguments: a JSON object as a dict, anything else as sent (refused)."""
    if not isinstance(input, str):
        return input
    try:
        return json.loads(input) if input.strip() else {}
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's limit
        return input


def _as_approved(input: str, cctx: CallContext) -> str:
    """The arguments to run: as the model sent them, or with those a person edited."""
    if not cctx.edited:
        return input
    return json.dumps({**dict(cctx.args), **cctx.edited})


def _answer(decision: Decision, outcome: PlainOutcome) -> Any:
    """The tool's own answer, the recorded one, or the refusal as the tool's answer."""
    if outcome.passes_on(decision):
        return outcome.output
    if decision.ok:
        return replayed_value(decision)
    return decision.model_text()


def guard_function_tool(guard: ToolGuard, tool: FunctionTool, *,
                        agent: str | AgentResolver | None = None) -> FunctionTool:
    """A guarded copy of ``tool``: the same name, schema and options, invoked through ``guard``."""
    given: object = tool  # checked at run time: the caller may not use a type checker
    if not isinstance(given, FunctionTool):
        msg = (f"guard_function_tool guards a FunctionTool (@function_tool), got "
               f"{type(given).__name__}")
        raise GuardMisconfigured(msg)
    if isinstance(agent, str) and not agent:
        msg = "agent= must be a non-empty string, a function of the tool context, or None"
        raise GuardMisconfigured(msg)
    if not guard.has_schema(tool.name):
        guard.register(tool.name, tool.params_json_schema, stacklevel=3)
    return dataclasses.replace(tool, on_invoke_tool=_GuardedInvoke(guard, tool, agent))


def guard_tools(guard: ToolGuard, tools: Iterable[FunctionTool], *,
                agent: str | AgentResolver | None = None) -> list[Tool]:
    """``guard_function_tool`` for each of ``tools`` (typed as ``Agent(tools=...)`` takes them)."""
    return [guard_function_tool(guard, tool, agent=agent) for tool in tools]
