"""PydanticAI: any toolset behind the guard, as a ``WrapperToolset``.

``agent = Agent(model, toolsets=[GuardedToolset(toolset, guard=guard, agent="billing")])``,
or ``guard_toolset(guard, toolset, agent=...)``. Function toolsets and MCP
toolsets alike: every call the model makes to a tool of ``toolset`` goes
through the guard first, and a refused call never reaches the toolset.

What toolguard reads, and from where:

- **the arguments** exactly as the model sent them. PydanticAI validates a
  call's arguments before any toolset sees them (laxly: ``"7"`` becomes ``7``,
  unknown keys are dropped); the wrapper lists its tools with a validator
  that keeps the model's arguments as they are, so toolguard validates them
  strictly against the tool's JSON schema and audits every call, whatever it
  holds. The tool's own validator then runs on the accepted arguments,
  inside the guarded call, before the tool.
- **the agent** from the host: ``agent=`` (a name, or a function of the
  ``RunContext``), else the run's metadata ``toolguard_agent``
  (``agent.run(..., metadata={"toolguard_agent": "billing"})``), else a
  ``toolguard_agent`` attribute or key of the run's dependencies. Never from
  the model; none is refused (``missing_identity``).
- **the call id** from PydanticAI's tool call (``ctx.tool_call_id``); the
  conversation id is the thread, the run id the run, so the default
  idempotency key is conversation + agent + call id. Under PydanticAI's
  durable execution (DBOS, Temporal, Prefect) the run and conversation ids
  are derived from the workflow, so a replayed run finds its records.

A refusal is answered the way PydanticAI answers a tool's error: arguments
the model can fix (``invalid_arguments``) raise ``ModelRetry`` (a retry
prompt), while the tool's retries last; anything else raises ``ToolFailed``
(a failed tool result the model reads, no retry asked). A replay answers with
the recorded result (as JSON). Inside the tool, ``toolguard.current()`` holds
the lease and the fenced transaction: ``current().tx`` in a sync function
(its guarded call runs in a worker thread, and PydanticAI's thread for the
function is that thread), ``current().atx`` in an async one.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar
from urllib.parse import quote

from pydantic import ValidationError
from pydantic_ai import Agent, ModelRetry, RunContext
from pydantic_ai.exceptions import ToolFailed
from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset

from toolguard.adapters._results import PlainOutcome, replayed_value
from toolguard.adapters._worker import InboxExecutor, has_sync_edges, in_worker, on_loop
from toolguard.adapters.identity import AGENT_METADATA_KEY
from toolguard.call.context import CallContext
from toolguard.call.envelope import untrusted_intent
from toolguard.call.intent import Intent
from toolguard.errors import GuardMisconfigured
from toolguard.guard import Decision, ToolGuard

__all__ = ["AgentResolver", "GuardedToolset", "agent_of_run", "guard_toolset"]

T = TypeVar("T")

AgentResolver = Callable[[RunContext[Any]], Any]

#: Reasons the model can fix by sending other arguments: answered with a retry prompt.
RETRY_REASONS = frozenset({"invalid_arguments"})
_SYNC_TOOL_ASYNC_GUARD = (
    "{tool} is a sync function, and this guard has only asyncio locks and store "
    "(async_locks=, async_store=): it would run without a sync fenced transaction. Give the "
    "guard locks= and store= as well (the sync guarded call then runs in a worker thread), or "
    "make {tool} an async def using current().atx")


def agent_of_run(ctx: RunContext[Any]) -> Any:
    """The run's metadata ``toolguard_agent``, else the dependencies' (as given; None if absent)."""
    metadata = ctx.metadata
    if isinstance(metadata, Mapping) and AGENT_METADATA_KEY in metadata:
        return metadata[AGENT_METADATA_KEY]
    deps = ctx.deps
    if isinstance(deps, Mapping):
        return deps.get(AGENT_METADATA_KEY)
    return getattr(deps, AGENT_METADATA_KEY, None)


class _Unparsed(dict[str, Any]):
    """Arguments that are not a JSON object (or not JSON at all), carried to the guard as sent."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw


class _AsSent:
    """A tool's argument validator that keeps the model's arguments as sent.

    PydanticAI calls it where it would validate; toolguard validates in the
    guarded call (strictly, audited), then runs ``original`` on what it accepted.
    """

    __slots__ = ("func", "original")

    def __init__(self, original: Any, func: Any) -> None:
        self.original = original
        self.func = func

    def validate_json(self, input: str | bytes | bytearray, **_: Any) -> Any:
        try:
            value = json.loads(input)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's limit
            value = input if isinstance(input, str) else bytes(input).decode("utf-8", "replace")
        return value if type(value) is dict else _Unparsed(value)

    def validate_python(self, input: Any, **_: Any) -> Any:
        return input if isinstance(input, dict) else _Unparsed(input)


@dataclass
class GuardedToolset(WrapperToolset[Any]):
    """``wrapped`` with every tool call guarded by ``guard`` (see the module's docstring).

    ``agent`` is the identity the policy authorizes: a name, or a function of
    the ``RunContext``; without it, ``agent_of_run`` (run metadata, then deps).
    """

    guard: ToolGuard | None = None
    agent: str | AgentResolver | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.guard, ToolGuard):
            msg = f"GuardedToolset needs guard=ToolGuard(...), got {type(self.guard).__name__}"
            raise GuardMisconfigured(msg)
        if isinstance(self.agent, str) and not self.agent:
            msg = "agent= must be a non-empty string, a function of the run context, or None"
            raise GuardMisconfigured(msg)

    @property
    def _guard(self) -> ToolGuard:
        assert self.guard is not None  # checked in __post_init__
        return self.guard

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        tools = await super().get_tools(ctx)
        guarded: dict[str, ToolsetTool[Any]] = {}
        for name, tool in tools.items():
            if not self._guard.has_schema(name):
                self._guard.register(name, tool.tool_def.parameters_json_schema, stacklevel=3)
            validator = tool.args_validator
            if not isinstance(validator, _AsSent):
                validator = _AsSent(validator, tool.args_validator_func)
            guarded[name] = replace(tool, args_validator=validator, args_validator_func=None)
        return guarded

    def _agent_of(self, ctx: RunContext[Any]) -> Any:
        if self.agent is None:
            return agent_of_run(ctx)
        return self.agent(ctx) if callable(self.agent) else self.agent

    def intent(self, name: str, tool_args: Any, ctx: RunContext[Any]) -> Intent:
        """The untrusted intent of one call; never raises (the guard refuses a bad one)."""
        args = tool_args.raw if isinstance(tool_args, _Unparsed) else tool_args
        agent = self._agent_of(ctx)
        path = quote(agent, safe="") if type(agent) is str else ""
        run_id = ctx.run_id
        retry = ctx.retry
        return untrusted_intent(
            tool=name, args=args, call_id=ctx.tool_call_id, agent=agent,
            thread_id=ctx.conversation_id, run_id=run_id,
            # the agent is the path (two agents in one conversation never share a key); the run
            # is its task, kept by ``idempotency_scope: task`` (models that reuse call ids)
            checkpoint_ns=f"{path}:{run_id}" if type(run_id) is str and run_id else path,
            node_attempt=retry + 1 if type(retry) is int and retry >= 0 else 1, origin="model")

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any],
                        tool: ToolsetTool[Any]) -> Any:
        original = _original(tool)
        if getattr(original, "is_async", True) is False:  # a sync function tool
            if not has_sync_edges(self._guard):
                raise GuardMisconfigured(_SYNC_TOOL_ASYNC_GUARD.format(tool=name))
            loop = asyncio.get_running_loop()
            outcome = PlainOutcome()
            decision = await in_worker(lambda: self._guard.run(
                self.intent(name, tool_args, ctx), lambda cctx: outcome.run(
                    lambda: on_loop(lambda here: _with_executor(
                        here, lambda: self._call(name, cctx, ctx, original)), loop))))
            return _answer(decision, outcome, ctx)
        outcome = PlainOutcome()

        async def run_tool(cctx: CallContext) -> Any:
            return await outcome.arun(lambda: self._call(name, cctx, ctx, original))

        decision = await self._guard.arun(self.intent(name, tool_args, ctx), run_tool)
        return _answer(decision, outcome, ctx)

    async def _call(self, name: str, cctx: CallContext, ctx: RunContext[Any],
                    tool: ToolsetTool[Any]) -> Any:
        """The tool's own validation on the accepted arguments, then the tool."""
        try:
            args = tool.args_validator.validate_python(dict(cctx.args),
                                                       context=ctx.validation_context)
        except ValidationError as error:
            raise ModelRetry(str(error)) from error
        if tool.args_validator_func is not None:
            checked = tool.args_validator_func(ctx, **args)
            if inspect.isawaitable(checked):
                await checked
        return await self.wrapped.call_tool(name, args, ctx, tool)


def _original(tool: ToolsetTool[Any]) -> ToolsetTool[Any]:
    """The tool as the wrapped toolset listed it (its own validators back in place)."""
    validator = tool.args_validator
    if not isinstance(validator, _AsSent):
        return tool
    return replace(tool, args_validator=validator.original, args_validator_func=validator.func)


def _answer(decision: Decision, outcome: PlainOutcome, ctx: RunContext[Any]) -> Any:
    """The tool's own answer, the recorded one, or the refusal as PydanticAI's tool error."""
    if outcome.passes_on(decision):
        return outcome.output
    if decision.ok:
        return replayed_value(decision)
    text = decision.model_text()
    if decision.reason in RETRY_REASONS and ctx.retry < ctx.max_retries:
        raise ModelRetry(text)
    raise ToolFailed(text)


async def _with_executor(here: InboxExecutor, call: Callable[[], Awaitable[T]]) -> T:
    """``call()`` with PydanticAI handing its sync functions to ``here`` (the worker thread)."""
    with Agent.using_thread_executor(here):
        return await call()


def guard_toolset(guard: ToolGuard, toolset: AbstractToolset[Any], *,
                  agent: str | AgentResolver | None = None) -> GuardedToolset:
    """``toolset`` with every call guarded: ``GuardedToolset(toolset, guard=guard, agent=agent)``."""
    return GuardedToolset(toolset, guard=guard, agent=agent)
