"""The tools, fake model and graphs the guard tests drive.

Every tool writes through ``toolguard.call.context.current().tx`` (the fenced
transaction; ``.atx`` in async bodies) and brackets its body with ``Probe.visit`` so a test can see how
many bodies ran at once. ``add_score`` is a read-modify-write with a pause
between the read and the write: two bodies inside at once on one lead would
lose an update, so an exact final score proves they were serialized.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from guard.harness import Probe
from toolguard.call.context import current

__all__ = [
    "LEAD_POLICY",
    "LeadTools",
    "ScriptedModel",
    "await_event",
    "calls_message",
    "scripted",
    "tool_graph",
    "tool_messages",
]

#: The policy most graph tests use: scorers add to scores, only routers reassign.
LEAD_POLICY: dict[str, Any] = {
    "version": 1,
    "tools": {
        "add_score": {"locks": ["lead:{lead_id}"], "agents": ["scorer"],
                      "args": {"delta": {"ge": -100, "le": 100}}},
        "reassign_lead": {"locks": ["lead:{lead_id}"], "agents": ["router"]},
    },
}

UPSERT = ("INSERT INTO lead (id, score) VALUES (%s, %s) "
          "ON CONFLICT (id) DO UPDATE SET score = excluded.score")
EFFECT = "INSERT INTO effect (tool, lead, delta, call, token) VALUES (%s, %s, %s, %s, %s)"
READ = "SELECT score FROM lead WHERE id = %s"

Hook = Callable[[str], None]
AsyncHook = Callable[[str], Awaitable[None]]


class ScriptedModel(GenericFakeChatModel):
    """``GenericFakeChatModel`` that accepts ``bind_tools`` (``create_agent`` calls it)."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedModel:
        return self


def scripted(*turns: AIMessage) -> ScriptedModel:
    return ScriptedModel(messages=iter(list(turns)))


def calls_message(*calls: tuple[str, Mapping[str, Any], str]) -> AIMessage:
    """One AIMessage with parallel tool calls ``(name, args, id)``."""
    return AIMessage(content="", tool_calls=[{"name": name, "args": dict(args), "id": call_id,
                                              "type": "tool_call"}
                                             for name, args, call_id in calls])


def tool_messages(messages: Iterable[BaseMessage]) -> dict[str, ToolMessage]:
    return {m.tool_call_id: m for m in messages if isinstance(m, ToolMessage)}


async def await_event(event: Any, timeout_s: float = 10.0) -> bool:
    """Wait for a ``threading.Event`` without blocking the loop."""
    deadline = time.monotonic() + timeout_s
    while not event.is_set():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.002)
    return True


class LeadTools:
    """``add_score`` and ``reassign_lead`` with a sync and an async body each.

    ``hooks``/``ahooks`` run inside the body (after ``Probe.visit`` marked it
    entered), keyed by lead: tests use them to hold a body until something
    happened elsewhere.
    """

    def __init__(self, probe: Probe | None = None, *, pause_s: float = 0.003,
                 hooks: Mapping[str, Hook] | None = None,
                 ahooks: Mapping[str, AsyncHook] | None = None) -> None:
        self.probe = probe or Probe()
        self.pause_s = pause_s
        self.hooks = dict(hooks or {})
        self.ahooks = dict(ahooks or {})

    def _write(self, tool: str, lead_id: str, delta: int) -> str:
        ctx = current()
        with self.probe.visit(lead_id):
            if lead_id in self.hooks:
                self.hooks[lead_id](lead_id)
            row = ctx.tx.execute(READ, (lead_id,)).fetchone()
            score = (int(row[0]) if row else 0) + delta
            time.sleep(self.pause_s)
            ctx.tx.execute(UPSERT, (lead_id, score))
            ctx.tx.execute(EFFECT, (tool, lead_id, delta, ctx.intent.call_id,
                                    max(ctx.tokens.values())))
        return f"{lead_id}={score}"

    async def _awrite(self, tool: str, lead_id: str, delta: int) -> str:
        ctx = current()
        with self.probe.visit(lead_id):
            if lead_id in self.ahooks:
                await self.ahooks[lead_id](lead_id)
            row = await (await ctx.atx.execute(READ, (lead_id,))).fetchone()
            score = (int(row[0]) if row else 0) + delta
            await asyncio.sleep(self.pause_s)
            await ctx.atx.execute(UPSERT, (lead_id, score))
            await ctx.atx.execute(EFFECT, (tool, lead_id, delta, ctx.intent.call_id,
                                          max(ctx.tokens.values())))
        return f"{lead_id}={score}"

    def tools(self) -> list[BaseTool]:
        def add_score(lead_id: str, delta: int) -> str:
            """Add ``delta`` to the lead's score."""
            return self._write("add_score", lead_id, delta)

        async def aadd_score(lead_id: str, delta: int) -> str:
            return await self._awrite("add_score", lead_id, delta)

        def reassign_lead(lead_id: str, owner: str) -> str:
            """Give the lead to another owner."""
            return self._write("reassign_lead", lead_id, 0)

        async def areassign_lead(lead_id: str, owner: str) -> str:
            return await self._awrite("reassign_lead", lead_id, 0)

        return [StructuredTool.from_function(func=add_score, coroutine=aadd_score),
                StructuredTool.from_function(func=reassign_lead, coroutine=areassign_lead)]


def tool_graph(model: Any, tools: Sequence[BaseTool], *, wrap: Any = None, awrap: Any = None,
               checkpointer: Any = None, retry_policy: Any = None) -> Any:
    """agent -> tools_condition -> ToolNode(tools, wrappers) -> agent, compiled."""

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(list(tools), wrap_tool_call=wrap, awrap_tool_call=awrap),
                   retry_policy=retry_policy)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition, ["tools", END])
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=checkpointer)
