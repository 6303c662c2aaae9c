"""``create_agent`` workers whose models decide from what they read, with ``hold: true``.

Two depositors on one account: the second one's read waits for the first one's
write, so neither decision rests on a value about to change and no write is
refused ``stale_read``. An agent whose turn ends without writing frees the key
when its run ends (the middleware's ``after_agent``).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage

from guard.harness import Harness
from guard.reads_world import Bank
from guard.test_holds import HELD
from guard.test_reads_agents import Reactive, account_tools
from toolguard.adapters import ToolGuardMiddleware
from toolguard.steps.holds import Holds


class AtTheLock:
    """Which agents' hold reads have reached the lock (the guard's ``Holds`` acquisition)."""

    def __init__(self, h: Harness) -> None:
        self.reached: dict[str, threading.Event] = {}
        holds: Holds = h.guard.holds
        sync, asynchronous = holds._acquire, holds._aacquire

        def agent_of(caller: str) -> str:
            return caller.split('"')[1]

        def acquire(locks: Any, board: Any, caller: str, *rest: Any) -> Any:
            self.event(agent_of(caller)).set()
            return sync(locks, board, caller, *rest)

        async def aacquire(locks: Any, board: Any, caller: str, *rest: Any) -> Any:
            self.event(agent_of(caller)).set()
            return await asynchronous(locks, board, caller, *rest)

        holds._acquire = acquire  # type: ignore[method-assign]
        holds._aacquire = aacquire  # type: ignore[method-assign]

    def event(self, agent: str) -> threading.Event:
        return self.reached.setdefault(agent, threading.Event())


def holder(name: str, other: str, account: str, amount: int, lock: AtTheLock,
           write: bool = True) -> Callable[[list[BaseMessage]], AIMessage]:
    """Read; once the other agent's read is at the lock too, write read + amount."""
    ids = itertools.count(1)

    def call(tool: str, **args: Any) -> AIMessage:
        return AIMessage(content="", tool_calls=[{"name": tool, "args": args,
                                                  "id": f"{name}-{next(ids)}",
                                                  "type": "tool_call"}])

    def decide(messages: list[BaseMessage]) -> AIMessage:
        answers = [m for m in messages if isinstance(m, ToolMessage)]
        if not answers:
            return call("get_balance", account_id=account)
        last = answers[-1]
        if last.name == "get_balance" and last.status != "error" and write:
            assert lock.event(other).wait(30)  # the other decides after this write, not before
            return call("set_balance", account_id=account, balance=int(last.content) + amount)
        return AIMessage(content=f"done: {last.content}")

    return decide


def _workers(h: Harness, models: dict[str, Any]) -> list[Any]:
    return [create_agent(model, account_tools(h),
                         middleware=[ToolGuardMiddleware(h.guard, agent=name)])
            for name, model in models.items()]


def _run(h: Harness, mode: str, workers: list[Any]) -> list[Any]:
    inputs = {"messages": [HumanMessage("deposit")]}
    configs = [{"configurable": {"thread_id": f"thread-{i}"}} for i in range(len(workers))]
    if mode == "sync":
        results: list[Any] = [None] * len(workers)

        def work(i: int) -> None:
            results[i] = workers[i].invoke(inputs, configs[i])

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(workers))]
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


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_agents_holding_the_account_end_exact_without_a_stale_read(harness: Any,
                                                                        mode: str) -> None:
    h: Harness = harness(HELD)
    Bank(h).open({"acct": 100})
    lock = AtTheLock(h)
    finals = _run(h, mode, _workers(h, {
        "alice": Reactive(decide=holder("alice", "bob", "acct", 25, lock)),
        "bob": Reactive(decide=holder("bob", "alice", "acct", 30, lock))}))
    assert Bank(h).balances("acct") == {"acct": 155}
    assert all(f["messages"][-1].content.startswith("done") for f in finals)
    assert h.audit(reason="stale_read") == []
    reads = sorted(int(m.content) for f in finals for m in f["messages"]
                   if isinstance(m, ToolMessage) and m.name == "get_balance")
    assert reads in ([100, 125], [100, 130])  # the second read saw the first write
    assert h.sql("SELECT key FROM toolguard_hold") == []


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_turn_that_ends_without_writing_frees_the_key(harness: Any, mode: str) -> None:
    h: Harness = harness(HELD)
    Bank(h).open({"acct": 100})
    lock = AtTheLock(h)
    _run(h, mode, _workers(h, {"idle": Reactive(decide=holder("idle", "-", "acct", 0, lock,
                                                              write=False))}))
    assert h.guard.holds.holding(h.guard.caller("idle", "thread-0")) == []
    ended = h.audit(reason="hold_ended")
    assert [r.agent for r in ended] == ["idle"] and "turn ended" in (ended[0].detail or "")
    with h.locks.acquire("account:acct", timeout_s=0.5) as lease:  # free: nobody holds it
        assert lease.tokens
    assert h.sql("SELECT key FROM toolguard_hold") == []
