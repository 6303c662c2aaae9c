"""Any LangChain ``BaseTool`` as a guarded tool, keeping its name, description and schema."""

from __future__ import annotations

from typing import Any

from langchain_core.messages import ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, ToolException
from pydantic import ConfigDict

from toolguard.adapters._messages import error_message, recordable, replayed_message
from toolguard.adapters.identity import intent_from_call
from toolguard.context import CallContext
from toolguard.guard import Decision, ToolGuard

__all__ = ["GuardedTool", "guard_tool"]


class GuardedTool(BaseTool):
    """Wraps ``inner``: every invocation goes through the guard first.

    Invoked with a tool call (``{"name", "args", "id", "type": "tool_call"}``)
    it answers with a ``ToolMessage`` (an error one when refused); invoked with
    plain arguments it returns the tool's output or raises ``ToolException``
    naming the reason. The agent identity is ``agent``, else the run's
    metadata ``toolguard_agent``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    inner: BaseTool
    guard: Any
    agent: str | None = None

    def _run(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - invoke is overridden
        msg = "GuardedTool runs through invoke()"
        raise NotImplementedError(msg)

    def _call(self, tool_input: Any, config: RunnableConfig | None) -> tuple[Any, dict[str, Any]]:
        config = config or {}
        is_call = isinstance(tool_input, dict) and tool_input.get("type") == "tool_call"
        call = tool_input if is_call else {"name": self.name, "args": tool_input, "id": None}
        agent = self.agent or (config.get("metadata") or {}).get("toolguard_agent")
        intent = intent_from_call(call, agent=agent, config=config,
                                  origin="model" if is_call else "python", expected_tool=self.name)
        return intent, call

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        intent, call = self._call(input, config)
        produced: list[Any] = []

        def run_tool(_: CallContext) -> Any:
            output = self.inner.invoke(input, config, **kwargs)
            produced.append(output)
            return recordable(output)

        return self._answer(self.guard.run(intent, run_tool), input, call, produced)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None,
                      **kwargs: Any) -> Any:
        intent, call = self._call(input, config)
        produced: list[Any] = []

        async def run_tool(_: CallContext) -> Any:
            output = await self.inner.ainvoke(input, config, **kwargs)
            produced.append(output)
            return recordable(output)

        return self._answer(await self.guard.arun(intent, run_tool), input, call, produced)

    @staticmethod
    def _answer(decision: Decision, tool_input: Any, call: Any, produced: list[Any]) -> Any:
        is_call = isinstance(tool_input, dict) and tool_input.get("type") == "tool_call"
        if not decision.ok:
            if is_call:
                return error_message(decision, call)
            raise ToolException(decision.model_text())
        if decision.kind == "accepted" and produced:
            return produced[-1]
        message = replayed_message(decision, call)
        return message if is_call else _plain(message)


def _plain(message: ToolMessage) -> Any:
    return message.content


def guard_tool(guard: ToolGuard, tool: BaseTool, *, agent: str | None = None) -> GuardedTool:
    """A guarded copy of ``tool`` (same name, description and argument schema)."""
    guard.register(tool.name, tool)
    return GuardedTool(name=tool.name, description=tool.description, args_schema=tool.args_schema,
                       inner=tool, guard=guard, agent=agent)
