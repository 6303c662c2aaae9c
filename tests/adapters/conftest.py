"""A guard on the embedded SQLite default, and one-node graphs around a guarded ToolNode.

The adapters decide what comes back from a call; which backend took the locks
does not change that, so these tests run on the embedded default only (the
guard suite runs the adapters on Redis + PostgreSQL too).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from toolguard.guard import ToolGuard
from toolguard.locks import connect, connect_async
from toolguard.policies import Policy
from toolguard.store import AuditEntry, open_async_store, open_store

MODES = ("sync", "async")


@dataclass
class Guarded:
    """A ``ToolGuard`` and its audit log."""

    guard: ToolGuard

    def audit(self, **filters: Any) -> list[AuditEntry]:
        assert self.guard.store is not None
        return self.guard.store.query_audit(limit=None, newest_first=False, **filters)

    def decisions(self, call_id: str | None = None) -> list[tuple[str, str]]:
        rows = self.audit(intent_id=call_id) if call_id else self.audit()
        return [(row.decision, row.reason) for row in rows]


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[Callable[[Mapping[str, Any]], Guarded]]:
    """``guarded(policy)``: a guard with both pairs (sync and asyncio locks and store) on one database."""
    opened: list[Any] = []

    def make(policy: Mapping[str, Any]) -> Guarded:
        url = f"sqlite:///{tmp_path / 'store.db'}"
        store = open_store(url, install=True)
        lock_url = f"sqlite:///{tmp_path / 'locks.db'}"
        locks = connect(lock_url)
        opened.extend([store, locks])
        guard = ToolGuard(Policy.from_dict(dict(policy)), locks=locks, store=store,
                          async_locks=connect_async(lock_url), async_store=open_async_store(url))
        return Guarded(guard)

    yield make
    for each in reversed(opened):
        each.close()


def read_only(*names: str, **defaults: Any) -> dict[str, Any]:
    """The most permissive legal policy for ``names``: read-only, any agent."""
    return {"version": 1, "defaults": {"agents": ["*"], **defaults},
            "tools": {name: {"read_only": True} for name in names}}


def tool_call(name: str, args: Mapping[str, Any], call_id: str = "c1") -> dict[str, Any]:
    return {"name": name, "args": dict(args), "id": call_id, "type": "tool_call"}


def ai(*calls: dict[str, Any]) -> dict[str, Any]:
    """Graph input: one AIMessage with ``calls``."""
    return {"messages": [AIMessage(content="", tool_calls=list(calls))]}


def one_node(node: ToolNode, *, state: Any = MessagesState, checkpointer: Any = None,
             store: Any = None, then: Sequence[str] = ()) -> Any:
    """START -> tools (-> each of ``then`` when a ``Command`` goes there), compiled."""
    graph = StateGraph(state)
    graph.add_node("tools", node, destinations=tuple(then))
    for name in then:
        graph.add_node(name, lambda _s, name=name: {"messages": [AIMessage(content=name)]})
    graph.add_edge(START, "tools")
    return graph.compile(checkpointer=checkpointer, store=store)


def run(app: Any, mode: str, inputs: Any, config: Mapping[str, Any] | None = None) -> Any:
    if mode == "sync":
        return app.invoke(inputs, config)
    return asyncio.run(app.ainvoke(inputs, config))


def answers(out: Mapping[str, Any]) -> dict[str, ToolMessage]:
    return {m.tool_call_id: m for m in out["messages"] if isinstance(m, ToolMessage)}
