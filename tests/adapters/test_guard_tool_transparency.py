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
def test_arguments_the_tool_refuses_too_get_toolguards_answer(guarded, mode: str) -> None:
    """Plain, the tool raises its ValidationError; guarded, the refused call never reaches it."""
    g = guarded(read_only("add"))
    runs: list[int] = []

    @tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        runs.append(a)
        return a + b

    with pytest.raises(ValidationError):
        invoke(add, mode, tool_call("add", {"a": "x", "b": 1}))
    guarded_add = guard_tool(g.guard, add, agent="t")
    message = invoke(guarded_add, mode, tool_call("add", {"a": "x", "b": 1}))
    assert isinstance(message, ToolMessage) and message.status == "error"
    assert message.content.startswith("rejected by toolguard (invalid_arguments): args.a")
    with pytest.raises(ToolException, match="invalid_arguments"):
        invoke(guarded_add, mode, {"a": "x", "b": 1})

    assert g.decisions() == [("rejected", "invalid_arguments")] * 2
    assert runs == []


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


#: What a host reads off a tool besides name, description and schema: create_agent ends the
#: run after a ``return_direct`` tool, chat models' ``bind_tools`` send ``extras`` (provider
#: options such as prompt caching), tracing reads ``tags`` and ``metadata``.
TOOL_ATTRIBUTES = ("name", "description", "return_direct", "response_format", "extras", "tags",
                   "metadata", "verbose")


def test_the_guarded_tool_shows_the_hosts_every_attribute_of_the_tool(guarded) -> None:
    g = guarded(read_only("look_up"))

    @tool(return_direct=True, response_format="content_and_artifact",
          extras={"cache_control": {"type": "ephemeral"}})
    def look_up(query: str) -> tuple[str, dict[str, str]]:
        """Look a record up."""
        return f"found {query}", {"raw": query}

    look_up.tags, look_up.metadata = ["crm"], {"team": "sales"}
    wrapped = guard_tool(g.guard, look_up, agent="t")

    assert {a: getattr(wrapped, a) for a in TOOL_ATTRIBUTES} == {
        a: getattr(look_up, a) for a in TOOL_ATTRIBUTES}
    assert wrapped.tool_call_schema.model_json_schema() == look_up.tool_call_schema.model_json_schema()
    answer = wrapped.invoke(tool_call("look_up", {"query": "acme"}))
    assert (answer.content, answer.artifact) == ("found acme", {"raw": "acme"})
    assert "toolguard" in answer.response_metadata  # the decision, as before


def test_metadata_false_leaves_answers_without_the_decision_and_keeps_the_tools_metadata(
        guarded) -> None:
    g = guarded(read_only("look_up"))

    @tool
    def look_up(query: str) -> str:
        """Look a record up."""
        return f"found {query}"

    look_up.metadata = {"team": "sales"}
    wrapped = guard_tool(g.guard, look_up, agent="t", metadata=False)

    answer = wrapped.invoke(tool_call("look_up", {"query": "acme"}))
    assert answer.content == "found acme" and "toolguard" not in answer.response_metadata
    assert wrapped.metadata == {"team": "sales"}


@pytest.mark.parametrize("mode", MODES)
def test_create_agent_ends_the_run_after_a_guarded_return_direct_tool(guarded, mode: str) -> None:
    from langchain.agents import create_agent
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, HumanMessage

    class Scripted(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
            return self

    @tool(return_direct=True)
    def look_up(query: str) -> str:
        """Look a record up; its answer goes straight to the user."""
        return f"found {query}"

    g = guarded(read_only("look_up"))
    outcomes = []
    for each in (look_up, guard_tool(g.guard, look_up, agent="t")):
        model = Scripted(messages=iter([
            AIMessage(content="", tool_calls=[tool_call("look_up", {"query": "acme"})]),
            AIMessage(content="the model speaks again")]))
        out = run(create_agent(model, [each]), mode, {"messages": [HumanMessage("find acme")]})
        outcomes.append([(type(m).__name__, m.content) for m in out["messages"]])

    assert outcomes[1] == outcomes[0] == [("HumanMessage", "find acme"), ("AIMessage", ""),
                                          ("ToolMessage", "found acme")]
