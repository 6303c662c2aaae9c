"""Any LangChain ``BaseTool`` as a guarded tool, keeping its name, description and schema."""

from __future__ import annotations

from typing import Any

from langchain_core.messages import ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, ToolException
from pydantic import ConfigDict, PrivateAttr

from toolguard.adapters._approval import graph_interrupt
from toolguard.adapters._messages import (
    annotate,
    refusal_message,
    replayed_message,
    replayed_value,
)
from toolguard.adapters._outcome import ToolOutcome
from toolguard.adapters._tools import (
    InjectedKeys,
    check_tools,
    model_arguments,
    model_schema,
    runs_sync,
)
from toolguard.adapters._worker import has_sync_edges, in_worker
from toolguard.adapters.identity import (
    AGENT_METADATA_KEY,
    AgentFrom,
    check_identity_source,
    intent_from_call,
)
from toolguard.call.context import CallContext
from toolguard.call.intent import Intent
from toolguard.guard import Decision, ToolGuard

__all__ = ["GuardedTool", "guard_tool"]


class GuardedTool(BaseTool):
    """Wraps ``inner``: every invocation goes through the guard first.

    Invoked with a tool call (``{"name", "args", "id", "type": "tool_call"}``)
    it answers as ``inner`` does, with the decision under
    ``response_metadata["toolguard"]``; a refusal is an error ``ToolMessage``
    naming the reason. Invoked with plain arguments it returns the tool's
    output, or raises ``ToolException`` naming the reason of a refusal. A
    refused call never reaches ``inner``, whatever it holds. Whatever ``inner``
    raises on a call toolguard accepted (a tool error its ``handle_tool_error``
    does not handle) is recorded as failed and raised unchanged. The agent
    identity is ``agent``, or with ``agent_from="metadata"`` the run's
    metadata ``toolguard_agent``; with neither, building it raises
    ``GuardMisconfigured``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    inner: BaseTool
    guard: Any
    agent: str | None = None
    #: ``"metadata"``: the identity is each run's metadata ``toolguard_agent`` (no ``agent``).
    agent_from: AgentFrom | None = None
    #: Put the decision under ``response_metadata["toolguard"]`` of the answers (``guard_tool``'s
    #: ``metadata=``); ``metadata`` itself is the wrapped tool's, as hosts and tracing read it.
    decision_metadata: bool = True
    _injected: InjectedKeys = PrivateAttr(default_factory=InjectedKeys)

    def model_post_init(self, context: Any, /) -> None:
        super().model_post_init(context)
        check_identity_source(self.agent, self.agent_from, f"guard_tool({self.name!r})",
                              resolver=False)

    def _run(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - invoke is overridden
        msg = "GuardedTool runs through invoke()"
        raise NotImplementedError(msg)

    def _intent(self, tool_input: Any, config: RunnableConfig | None) -> tuple[Intent, dict[str, Any]]:
        config = config or {}
        is_call = isinstance(tool_input, dict) and tool_input.get("type") == "tool_call"
        call = tool_input if is_call else {"name": self.name, "args": tool_input, "id": None}
        # ToolNode passes the values it injected (state, store, runtime) in the call's
        # args: they are the host's, not the model's, and never part of the intent.
        args = model_arguments(call.get("args"), self._injected.of(self.inner))
        agent = self.agent
        if agent is None and self.agent_from == "metadata":
            agent = (config.get("metadata") or {}).get(AGENT_METADATA_KEY)
        intent = intent_from_call({**call, "args": args}, agent=agent, config=config,
                                  origin="model" if is_call else "python", expected_tool=self.name)
        return intent, call

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        intent, call = self._intent(input, config)
        outcome = ToolOutcome(_call_id(call))
        decision = self.guard.run(intent, lambda ctx: outcome.run(
            lambda: self.inner.invoke(_as_approved(input, ctx), config, **kwargs)),
            interrupt=graph_interrupt(config))
        return self._annotated(self._answer(decision, input, call, outcome), call, decision)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None,
                      **kwargs: Any) -> Any:
        if runs_sync(self.inner) and has_sync_edges(self.guard):
            # A sync tool: its sync guarded call, in a worker thread (current().tx as on invoke).
            return await in_worker(lambda: self.invoke(input, config, **kwargs))
        intent, call = self._intent(input, config)
        outcome = ToolOutcome(_call_id(call))

        async def run_tool(ctx: CallContext) -> Any:
            return await outcome.arun(lambda: self.inner.ainvoke(_as_approved(input, ctx), config,
                                                                 **kwargs))

        decision = await self.guard.arun(intent, run_tool, interrupt=graph_interrupt(config))
        return self._annotated(self._answer(decision, input, call, outcome), call, decision)

    def _answer(self, decision: Decision, tool_input: Any, call: dict[str, Any],
                outcome: ToolOutcome) -> Any:
        """The tool's own answer or toolguard's (pure: no I/O); a refused call never reaches it."""
        if outcome.passes_on(decision):
            return outcome.output
        is_call = isinstance(tool_input, dict) and tool_input.get("type") == "tool_call"
        if decision.ok:
            return replayed_message(decision, call) if is_call else replayed_value(decision, call)
        if is_call:
            return refusal_message(decision, call)
        raise ToolException(decision.model_text()) from decision.error

    def _annotated(self, output: Any, call: dict[str, Any], decision: Decision) -> Any:
        if not self.decision_metadata or not isinstance(output, ToolMessage):
            return output
        return annotate(output, _call_id(call), decision)


def _as_approved(tool_input: Any, ctx: CallContext) -> Any:
    """The input to run: as given, or with the arguments a person edited when approving."""
    if not ctx.edited or not isinstance(tool_input, dict):
        return tool_input
    if tool_input.get("type") == "tool_call":
        return {**tool_input, "args": {**tool_input.get("args", {}), **ctx.edited}}
    return {**tool_input, **ctx.edited}


def _call_id(call: dict[str, Any]) -> str | None:
    call_id = call.get("id")
    return call_id if isinstance(call_id, str) else None


def guard_tool(guard: ToolGuard, tool: BaseTool, *, agent: str | None = None,
               agent_from: AgentFrom | None = None, metadata: bool = True) -> GuardedTool:
    """A guarded copy of ``tool``: what hosts read off a tool is the tool's own.

    Every field ``BaseTool`` declares is copied: name, description, argument
    schema, ``return_direct`` (``create_agent`` ends the run after it),
    ``extras`` (provider options ``bind_tools`` sends), ``tags``, ``metadata``
    and the rest, whatever this langchain-core version has. The copy's own
    fields only say how to guard; ``metadata=False`` leaves the answers
    without the decision. A sync ``tool`` (no coroutine) needs a guard with
    ``locks=`` and ``store=`` (its ``ainvoke`` runs the sync guarded call in a
    worker thread): with only asyncio edges this raises ``GuardMisconfigured``.
    The identity is ``agent``, or ``agent_from="metadata"`` (each run's
    metadata ``toolguard_agent``); with neither this raises
    ``GuardMisconfigured``. The policy is checked against the tool's
    arguments here (``PolicyProblems``).
    """
    check_identity_source(agent, agent_from, f"guard_tool({tool.name!r})", resolver=False)
    check_tools(guard, [tool], "guard_tool")
    guard.register(tool.name, model_schema(tool, InjectedKeys().of(tool)))
    own = {name: getattr(tool, name) for name in BaseTool.model_fields}
    return GuardedTool(**own, inner=tool, guard=guard, agent=agent, agent_from=agent_from,
                       decision_metadata=metadata)
