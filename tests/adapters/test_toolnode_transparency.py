"""GuardedToolCalls changes a ToolNode only by refusing calls and by serializing accepted ones.

Each test runs the same graph plain and guarded where it can, and checks that
what comes out is the same apart from ``response_metadata["toolguard"]``, and
that the call left exactly one audit row with the right decision.
"""

from __future__ import annotations

from typing import Annotated, Any

import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import InjectedToolCallId, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import MessagesState
from langgraph.prebuilt import InjectedState, ToolNode
from langgraph.prebuilt.tool_node import ToolInvocationError
from langgraph.types import Command, interrupt
from pydantic import BaseModel, ValidationError

from adapters.conftest import MODES, ai, answers, one_node, read_only, run, tool_call
from toolguard.adapters import GuardedToolCalls


def guarded_node(guard: Any, tools: list[Any], **options: Any) -> ToolNode:
    calls = GuardedToolCalls(guard, agent="tester")
    return ToolNode(tools, wrap_tool_call=calls.wrap_tool_call,
                    awrap_tool_call=calls.awrap_tool_call, **options)


def bare(message: ToolMessage) -> dict[str, Any]:
    """The message without toolguard's metadata, and without the id the graph gives it."""
    fields = message.model_dump(exclude={"id"})
    fields["response_metadata"] = {k: v for k, v in fields["response_metadata"].items()
                                   if k != "toolguard"}
    return fields


def decision_of(message: ToolMessage) -> tuple[str, str]:
    meta = message.response_metadata["toolguard"]
    return meta["decision"], meta["reason"]


# --- interrupts and invalid resumes ---------------------------------------------------------------


class Approval(BaseModel):
    approved: bool


@tool
def ask_human() -> str:
    """Ask a person for approval."""
    answer = interrupt("Approve?", response_schema=Approval)
    return f"approved={answer.approved}"


@pytest.mark.parametrize("mode", MODES)
def test_an_invalid_resume_fails_the_run_and_the_interrupt_stays_pending(guarded, mode: str) -> None:
    g = guarded(read_only("ask_human"))
    app = one_node(guarded_node(g.guard, [ask_human]), checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t1"}}

    [pending] = run(app, mode, ai(tool_call("ask_human", {})), config)["__interrupt__"]
    with pytest.raises(ValidationError, match="approved"):
        run(app, mode, Command(resume={pending.id: {"approved": "maybe"}}), config)

    assert [i.id for i in app.get_state(config).interrupts] == [pending.id]
    assert g.decisions() == [("unknown", "interrupted"), ("unknown", "interrupted")]
    out = run(app, mode, Command(resume={pending.id: {"approved": True}}), config)
    assert answers(out)["c1"].content == "approved=True"
    assert g.decisions()[-1] == ("accepted", "applied")


# --- what ToolNode lets through, and what it answers itself ------------------------------------


class Boom(Exception):
    """A tool's own failure."""


def exploding(raised: list[Exception]) -> Any:
    @tool
    def explode(x: int) -> str:
        """Fail."""
        error = Boom(f"boom {x}")
        raised.append(error)
        raise error

    return explode


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("handle", ["default", False], ids=["default-handler", "handle-false"])
def test_an_exception_toolnode_lets_through_comes_out_unchanged(guarded, mode: str,
                                                                handle: Any) -> None:
    g = guarded(read_only("explode"))
    raised: list[Exception] = []
    options = {} if handle == "default" else {"handle_tool_errors": handle}
    app = one_node(guarded_node(g.guard, [exploding(raised)], **options))

    with pytest.raises(Boom) as caught:
        run(app, mode, ai(tool_call("explode", {"x": 1})))

    assert caught.value is raised[-1]
    assert g.decisions("c1") == [("failed", "error")]


def _any_error(error: Exception) -> str:
    return f"handled {type(error).__name__}: {error}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("handle", [True, "it failed", _any_error], ids=["true", "text", "callable"])
def test_the_message_handle_tool_errors_builds_is_toolnodes(guarded, mode: str, handle: Any) -> None:
    g = guarded(read_only("explode"))
    plain = run(one_node(ToolNode([exploding([])], handle_tool_errors=handle)), mode,
                ai(tool_call("explode", {"x": 2})))
    out = run(one_node(guarded_node(g.guard, [exploding([])], handle_tool_errors=handle)), mode,
              ai(tool_call("explode", {"x": 2})))

    message = answers(out)["c1"]
    assert bare(message) == bare(answers(plain)["c1"])
    assert message.status == "error" and "toolguard" not in str(message.content)
    assert decision_of(message) == ("failed", "tool_error")
    assert g.decisions("c1") == [("failed", "tool_error")]


class Flagged(MessagesState):
    flag: str


@tool
def refuse_and_reroute(x: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
    """Answer with an error and send the graph elsewhere."""
    answer = ToolMessage("cannot do that", tool_call_id=tool_call_id, status="error",
                         artifact={"why": "policy"})
    return Command(update={"messages": [answer], "flag": f"set by {x}"}, goto="fallback")


@pytest.mark.parametrize("mode", MODES)
def test_a_command_with_an_error_message_keeps_its_update_and_goto(guarded, mode: str) -> None:
    g = guarded(read_only("refuse_and_reroute"))
    inputs = ai(tool_call("refuse_and_reroute", {"x": 3}))
    plain = run(one_node(ToolNode([refuse_and_reroute]), state=Flagged, then=["fallback"]), mode,
                inputs)
    out = run(one_node(guarded_node(g.guard, [refuse_and_reroute]), state=Flagged,
                       then=["fallback"]), mode, inputs)

    assert out["flag"] == plain["flag"] == "set by 3"
    assert out["messages"][-1].content == "fallback"  # the goto was followed
    message = answers(out)["c1"]
    assert bare(message) == bare(answers(plain)["c1"])
    assert message.artifact == {"why": "policy"}
    assert g.decisions("c1") == [("failed", "tool_error")]


@tool
def reports_failure(tool_call_id: Annotated[str, InjectedToolCallId]) -> ToolMessage:
    """Answer with an error of its own, carrying an id and an artifact."""
    return ToolMessage("no rows", tool_call_id=tool_call_id, status="error", id="msg-7",
                       artifact={"rows": []})


@pytest.mark.parametrize("mode", MODES)
def test_a_tools_own_error_message_keeps_its_id_and_artifact(guarded, mode: str) -> None:
    g = guarded(read_only("reports_failure"))
    out = run(one_node(guarded_node(g.guard, [reports_failure])), mode,
              ai(tool_call("reports_failure", {})))

    message = answers(out)["c1"]
    assert (message.id, message.artifact, message.content) == ("msg-7", {"rows": []}, "no rows")
    assert g.decisions("c1") == [("failed", "tool_error")]


# --- unknown tools, injected parameters, arguments ----------------------------------------------


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@tool
def mul(a: int, b: int) -> int:
    """Multiply two numbers."""
    return a * b


@pytest.mark.parametrize("mode", MODES)
def test_an_unknown_tool_gets_toolnodes_own_answer_and_one_audit_row(guarded, mode: str) -> None:
    g = guarded(read_only("add", "mul"))
    inputs = ai(tool_call("drop_tables", {"confirm": True}))
    plain = run(one_node(ToolNode([add, mul])), mode, inputs)
    out = run(one_node(guarded_node(g.guard, [add, mul])), mode, inputs)

    message = answers(out)["c1"]
    assert bare(message) == bare(answers(plain)["c1"])
    assert message.content == "Error: drop_tables is not a valid tool, try one of [add, mul]."
    assert decision_of(message) == ("rejected", "unknown_tool")
    assert g.decisions("c1") == [("rejected", "unknown_tool")]


class Session(MessagesState):
    user: str


@tool
def greet(greeting: str, user: Annotated[str, InjectedState("user")]) -> str:
    """Greet the signed-in user."""
    return f"{greeting}, {user}"


@pytest.mark.parametrize("mode", MODES)
def test_a_model_value_for_an_injected_parameter_is_dropped_as_toolnode_does(guarded,
                                                                             mode: str) -> None:
    g = guarded(read_only("greet"))
    inputs = {**ai(tool_call("greet", {"greeting": "hi", "user": "mallory"})), "user": "ana"}
    plain = run(one_node(ToolNode([greet]), state=Session), mode, inputs)
    out = run(one_node(guarded_node(g.guard, [greet]), state=Session), mode, inputs)

    message = answers(out)["c1"]
    assert message.content == answers(plain)["c1"].content == "hi, ana"
    assert g.decisions("c1") == [("accepted", "applied")]
    assert g.audit(intent_id="c1")[0].args == {"greeting": "hi"}


def counted_add(runs: list[tuple[Any, Any]]) -> Any:
    @tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        runs.append((a, b))
        return a + b

    return add


@pytest.mark.parametrize("handle_tool_errors", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_arguments_the_tool_refuses_too_get_toolguards_answer(guarded, mode: str,
                                                             handle_tool_errors: bool) -> None:
    """A refused call never reaches ToolNode's execute, even when the tool would refuse it too.

    Plain, ToolNode answers ``Error invoking tool ...`` (or raises ``ToolInvocationError``
    with ``handle_tool_errors=False``); guarded, toolguard answers, whatever the setting.
    """
    g = guarded(read_only("add"))
    runs: list[tuple[Any, Any]] = []
    inputs = ai(tool_call("add", {"a": "x", "b": 1}))
    if handle_tool_errors:
        plain = run(one_node(ToolNode([counted_add(runs)])), mode, inputs)
        assert answers(plain)["c1"].content.startswith("Error invoking tool 'add'")
    else:
        with pytest.raises(ToolInvocationError):
            run(one_node(ToolNode([counted_add(runs)], handle_tool_errors=False)), mode, inputs)

    out = run(one_node(guarded_node(g.guard, [counted_add(runs)],
                                    handle_tool_errors=handle_tool_errors)), mode, inputs)

    message = answers(out)["c1"]
    assert message.status == "error"
    assert message.content.startswith("rejected by toolguard (invalid_arguments): args.a")
    assert decision_of(message) == ("rejected", "invalid_arguments")
    assert g.decisions("c1") == [("rejected", "invalid_arguments")]
    assert runs == []


@pytest.mark.parametrize("mode", MODES)
def test_a_refusal_only_toolguard_makes_is_a_message_even_with_handle_tool_errors_false(
        guarded, mode: str) -> None:
    """``"1"`` is not an int to toolguard; the tool's own schema would coerce it and run."""
    g = guarded(read_only("add"))
    runs: list[tuple[Any, Any]] = []
    inputs = ai(tool_call("add", {"a": "1", "b": 2}))
    plain = run(one_node(ToolNode([counted_add(runs)], handle_tool_errors=False)), mode, inputs)
    assert answers(plain)["c1"].content == "3" and runs == [(1, 2)]

    out = run(one_node(guarded_node(g.guard, [counted_add(runs)], handle_tool_errors=False)), mode,
              inputs)

    message = answers(out)["c1"]
    assert message.status == "error"
    assert message.content.startswith("rejected by toolguard (invalid_arguments): args.a")
    assert g.decisions("c1") == [("rejected", "invalid_arguments")]
    assert runs == [(1, 2)]  # only the plain run's


@pytest.mark.parametrize("mode", MODES)
def test_a_policy_refusal_is_a_message_and_the_tool_never_runs(guarded, mode: str) -> None:
    g = guarded({"version": 1, "tools": {"add": {"read_only": True, "agents": ["billing"]}}})
    runs: list[tuple[Any, Any]] = []
    out = run(one_node(guarded_node(g.guard, [counted_add(runs)], handle_tool_errors=False)), mode,
              ai(tool_call("add", {"a": 1, "b": 2})))

    message = answers(out)["c1"]
    assert message.content.startswith("rejected by toolguard (not_authorized)")
    assert g.decisions("c1") == [("rejected", "not_authorized")]
    assert runs == []
