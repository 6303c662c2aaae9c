"""A guarded LangChain tool called with plain arguments replays the value the tool returned.

Called with plain arguments (not a tool call) a LangChain tool returns its
value itself: a dict, a list, a number, ``None``. With an idempotency key the
same call again is answered from its record; that answer must be the same
value, not the text a ToolMessage would carry.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain_core.tools import tool

from adapters.conftest import MODES
from toolguard.adapters import guard_tool


@tool
def profile(key: str) -> dict[str, Any]:
    """A profile."""
    return {"key": key, "score": 80, "tags": ["a", "b"]}


@tool
def tags(key: str) -> list[Any]:
    """Tags and a count."""
    return [key, 2]


@tool
def count(key: str) -> int:
    """A count."""
    return 3


@tool
def nothing(key: str) -> None:
    """Nothing at all."""


TOOLS = {"profile": profile, "tags": tags, "count": count, "nothing": nothing}
POLICY = {"version": 1, "defaults": {"agents": ["*"]},
          "tools": {name: {"locks": ["key:{key}"], "idempotency_key": f"{name}:{{key}}"}
                    for name in TOOLS}}


def call(tool: Any, mode: str, args: dict[str, Any]) -> Any:
    return tool.invoke(args) if mode == "sync" else asyncio.run(tool.ainvoke(args))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(TOOLS))
def test_a_replay_of_a_plain_call_returns_the_value_the_tool_returned(guarded, mode: str,
                                                                       name: str) -> None:
    g = guarded(POLICY)
    plain = TOOLS[name].invoke({"key": "k"})
    wrapped = guard_tool(g.guard, TOOLS[name], agent="tester")

    first = call(wrapped, mode, {"key": "k"})
    again = call(wrapped, mode, {"key": "k"})

    assert first == plain
    assert again == plain and type(again) is type(plain)
    assert [d for d, _ in g.decisions()] == ["accepted", "replayed"]
