"""``guard_tool`` answers as the LangChain tool it wraps, with the same audit as the ToolNode path."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import ToolException, tool
from langgraph.graph import MessagesState
from langgraph.prebuilt import InjectedState, ToolNode
from pydantic import ValidationError

from adapters.conftest import MODES, ai, answers, one_node, read_only, run, tool_call
from toolguard.adapters import guard_tool


class Boom(Exception):
    """A tool's own failure."""


def invoke(tool_: Any, mode: str, tool_input: Any) -> Any:
    if mode == "sync":
        return tool_.invoke(tool_input)
    return asyncio.run(tool_.ainvoke(tool_input))


@pytest.mark.parametrize("mode", MODES)
def test_what_the_tool_raises_comes_out_unchanged(guarded, mode: str) -> None:
    g = guarded(read_only("explode"))
    raised: list[Exception] = []

    @tool
    def explode(x: int) -> str:
        """Fail."""
        raised.append(Boom(f"boom {x}"))
        raise raised[-1]

    with pytest.raises(Boom) as caught:
        invoke(guard_tool(g.guard, explode, agent="t"), mode, tool_call("explode", {"x": 1}))

    assert caught.value is raised[-1]
    assert g.decisions("c1") == [("failed", "error")]


@pytest.mark.parametrize("mode", MODES)
def test_the_tools_own_error_answer_comes_out_unchanged(guarded, mode: str) -> None:
    g = guarded(read_only("picky"))

    @tool
    def picky(x: int) -> str:
        """Refuse odd numbers."""
        if x % 2:
            msg = f"{x} is odd"
            raise ToolException(msg)
        return "even"

    picky.handle_tool_error = True
    plain = invoke(picky, mode, tool_call("picky", {"x": 3}))

    message = invoke(guard_tool(g.guard, picky, agent="t"), mode, tool_call("picky", {"x": 3}))

    assert isinstance(message, ToolMessage)
    assert (message.content, message.status) == (plain.content, plain.status) == ("3 is odd", "error")
    assert message.response_metadata["toolguard"]["decision"] == "failed"
    assert g.decisions("c1") == [("failed", "tool_error")]


@pytest.mark.parametrize("mode", MODES)
def test_arguments_the_tool_refuses_too_fail_as_the_tool_fails(guarded, mode: str) -> None:
    g = guarded(read_only("add"))

    @tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    with pytest.raises(ValidationError):
        invoke(add, mode, tool_call("add", {"a": "x", "b": 1}))
    with pytest.raises(ValidationError):
        invoke(guard_tool(g.guard, add, agent="t"), mode, tool_call("add", {"a": "x", "b": 1}))

    assert g.decisions("c1") == [("rejected", "invalid_arguments")]


@pytest.mark.parametrize("mode", MODES)
def test_a_refusal_is_a_message_for_a_tool_call_and_a_tool_exception_otherwise(guarded,
                                                                               mode: str) -> None:
    g = guarded({"version": 1, "tools": {"add": {"read_only": True, "agents": ["billing"]}}})

    @tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    guarded_add = guard_tool(g.guard, add, agent="support")
    message = invoke(guarded_add, mode, tool_call("add", {"a": 1, "b": 2}))
    assert message.status == "error" and "not_authorized" in message.content
    with pytest.raises(ToolException, match="not_authorized"):
        invoke(guarded_add, mode, {"a": 1, "b": 2})

    assert [reason for _, reason in g.decisions()] == ["not_authorized", "not_authorized"]


class Session(MessagesState):
    user: str


@pytest.mark.parametrize("mode", MODES)
def test_in_a_toolnode_injected_values_reach_the_tool_and_stay_out_of_the_intent(guarded,
                                                                                 mode: str) -> None:
    g = guarded(read_only("greet"))

    @tool
    def greet(greeting: str, user: Annotated[str, InjectedState("user")]) -> str:
        """Greet the signed-in user."""
        return f"{greeting}, {user}"

    app = one_node(ToolNode([guard_tool(g.guard, greet, agent="t")]), state=Session)
    out = run(app, mode, {**ai(tool_call("greet", {"greeting": "hi", "user": "mallory"})),
                          "user": "ana"})

    assert answers(out)["c1"].content == "hi, ana"
    assert g.decisions("c1") == [("accepted", "applied")]
    assert g.audit(intent_id="c1")[0].args == {"greeting": "hi"}
