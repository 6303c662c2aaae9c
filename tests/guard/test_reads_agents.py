"""Two ``create_agent`` workers whose models decide from what their tools returned.

Each worker's model reads the balance, waits until the other has read too (so
both decisions rest on the same value), then writes the balance it computed.
With the per-call guard alone one deposit is lost; with ``reads:`` and
``requires_read`` the later writer is told its read is stale, its model reads
again and decides again, and both deposits land.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from guard.harness import Harness
from guard.reads_world import CHECKED, READ, UNCHECKED, UPSERT, Bank
from toolguard.adapters import GuardedToolCalls, ToolGuardMiddleware
from toolguard.call.context import current


class Reactive(BaseChatModel):
    """A chat model whose next message is ``decide(messages)``: it acts on what tools returned."""

    decide: Any

    @property
    def _llm_type(self) -> str:
        return "reactive"

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        return ChatResult(generations=[ChatGeneration(message=self.decide(messages))])

    def bind_tools(self, tools: Any, **kwargs: Any) -> Reactive:
        return self


def depositor(name: str, account: str, amount: int,
              both_read: threading.Barrier) -> Callable[[list[BaseMessage]], AIMessage]:
    """Read, wait for the other's read (once), write read + amount; re-read when told."""
    ids = itertools.count(1)
    waited = False

    def call(tool: str, **args: Any) -> AIMessage:
        return AIMessage(content="", tool_calls=[{"name": tool, "args": args,
                                                  "id": f"{name}-{next(ids)}",
                                                  "type": "tool_call"}])

    def decide(messages: list[BaseMessage]) -> AIMessage:
        nonlocal waited
        answers = [m for m in messages if isinstance(m, ToolMessage)]
        if not answers:
            return call("get_balance", account_id=account)
        last = answers[-1]
        if last.name == "get_balance":
            if not waited:
                waited = True
                both_read.wait(30)
            return call("set_balance", account_id=account, balance=int(last.content) + amount)
        reason = (last.response_metadata.get("toolguard") or {}).get("reason")
        if last.status == "error" and reason in ("stale_read", "unread"):
            return call("get_balance", account_id=account)
        return AIMessage(content=f"done: {last.content}")

    return decide


def account_tools(h: Harness) -> list[BaseTool]:
    """The tools; without ``reads:`` (the control) ``get_balance`` reads outside toolguard."""
    tracked = h.policy.tracks_reads

    def get_balance(account_id: str) -> int:
        """The account's balance."""
        if not tracked:
            return Bank(h).balances(account_id)[account_id]
        row = current().tx.execute(READ, (account_id,)).fetchone()
        return int(row[0]) if row else 0

    async def aget_balance(account_id: str) -> int:
        if not tracked:
            return (await asyncio.to_thread(Bank(h).balances, account_id))[account_id]
        row = await (await current().atx.execute(READ, (account_id,))).fetchone()
        return int(row[0]) if row else 0

    def set_balance(account_id: str, balance: int) -> str:
        """Set the account's balance."""
        current().tx.execute(UPSERT, (account_id, balance))
        return f"{account_id}={balance}"

    async def aset_balance(account_id: str, balance: int) -> str:
        await current().atx.execute(UPSERT, (account_id, balance))
        return f"{account_id}={balance}"

    return [StructuredTool.from_function(func=get_balance, coroutine=aget_balance),
            StructuredTool.from_function(func=set_balance, coroutine=aset_balance)]


def _run_two(h: Harness, mode: str, build: Callable[[str, Any], Any]) -> list[Any]:
    """Run two workers (alice +25, bob +30 on one account) at once; their final states."""
    both_read = threading.Barrier(2)
    workers = [build(name, Reactive(decide=depositor(name, "acct", amount, both_read)))
               for name, amount in (("alice", 25), ("bob", 30))]
    inputs = {"messages": [HumanMessage("deposit")]}
    configs = [{"configurable": {"thread_id": f"thread-{i}"}} for i in range(2)]
    if mode == "sync":
        results: list[Any] = [None, None]

        def work(i: int) -> None:
            results[i] = workers[i].invoke(inputs, configs[i])

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        return results

    async def main() -> list[Any]:
        async with h.async_edges():
            return list(await asyncio.gather(*(w.ainvoke(inputs, c)
                                               for w, c in zip(workers, configs, strict=True))))

    return asyncio.run(main())


def _agent(h: Harness) -> Callable[[str, Any], Any]:
    def build(name: str, model: Any) -> Any:
        return create_agent(model, account_tools(h),
                            middleware=[ToolGuardMiddleware(h.guard, agent=name)])

    return build


def _tool_node_graph(h: Harness) -> Callable[[str, Any], Any]:
    def build(name: str, model: Any) -> Any:
        calls = GuardedToolCalls(h.guard, agent=name)
        node = ToolNode(account_tools(h), wrap_tool_call=calls.wrap_tool_call,
                        awrap_tool_call=calls.awrap_tool_call)
        graph = StateGraph(MessagesState)
        graph.add_node("model", lambda state: {"messages": [model.invoke(state["messages"])]})
        graph.add_node("tools", node)
        graph.add_edge(START, "model")
        graph.add_conditional_edges("model", tools_condition, ["tools", END])
        graph.add_edge("tools", "model")
        return graph.compile()

    return build


_SURFACES = {"create_agent": _agent, "tool_node": _tool_node_graph}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("surface", ["create_agent", "tool_node"])
def test_control_the_per_call_guard_loses_a_deposit(harness: Any, mode: str,
                                                     surface: str) -> None:
    h: Harness = harness(UNCHECKED)
    Bank(h).open({"acct": 100})
    _run_two(h, mode, _SURFACES[surface](h))
    assert Bank(h).balances("acct")["acct"] in (125, 130)  # one deposit lost


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("surface", ["create_agent", "tool_node"])
def test_two_agents_deciding_from_their_reads(harness: Any, mode: str, surface: str) -> None:
    h: Harness = harness(CHECKED)
    Bank(h).open({"acct": 100})
    finals = _run_two(h, mode, _SURFACES[surface](h))
    assert Bank(h).balances("acct") == {"acct": 155}  # both deposits, each on a current read
    assert all(f["messages"][-1].content.startswith("done") for f in finals)
    stale = h.audit(reason="stale_read")
    assert len(stale) == 1 and stale[0].tool == "set_balance"
    calls = [m.tool_call_id for f in finals for m in f["messages"] if isinstance(m, ToolMessage)]
    assert calls and all(len(h.decisions(c)) == 1 for c in calls)
