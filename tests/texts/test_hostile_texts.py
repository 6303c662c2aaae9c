"""Texts built from untrusted values are bounded and never raise (issue 21, point 2).

A call id or tool name that is a 5,000-digit integer (``str()`` raises past
Python's 4,300-digit limit) or a list nested 1,000 deep (``RecursionError``)
used to be decided ``rejected/invalid_intent`` and audited, after which
building the refusal message raised. Every text toolguard builds from such a
value goes through ``toolguard.runtime.safe_text``: the refusal ``ToolMessage``, the
decision's message, the audit row's detail and argument shape, an approval
resume value's error, the host's thread id.
"""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from langchain_core.messages import ToolMessage
from langchain_core.tools import StructuredTool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.runtime import ExecutionInfo
from langgraph.types import Send

from texts.conftest import GuardFactory
from toolguard.adapters import GuardedToolCalls, guarded
from toolguard.call.envelope import untrusted_intent
from toolguard.controls.approvals import InvalidResume, parse_resume
from toolguard.runtime.safe_text import safe_repr, safe_str, text_of

POLICY: dict[str, Any] = {"version": 1, "tools": {
    "note": {"locks": ["note:{x}"], "agents": ["a"]}}}


def nested(depth: int, make: Any = lambda inner: [inner]) -> Any:
    value: Any = []
    for _ in range(depth):
        value = make(value)
    return value


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no str")

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class SelfNamed(str):
    """A ``str`` subclass whose own methods raise: read as the text it holds."""

    def __str__(self) -> str:
        raise RuntimeError("no str")

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


HUGE = 10 ** 5000
HOSTILE: list[tuple[str, Any]] = [
    ("5000-digit int", HUGE), ("negative 5000-digit int", -HUGE),
    ("list 1000 deep", nested(1_000)), ("dict 1000 deep", nested(1_000, lambda v: {"k": v})),
    ("unprintable object", Unprintable()), ("list holding a huge int", [HUGE, "x"]),
    ("str subclass", SelfNamed("c1")), ("1 MB of text", "c" * 1_000_000),
]


def note_tool() -> StructuredTool:
    def note(x: str) -> str:
        """Note x."""
        return x

    return StructuredTool.from_function(func=note)


def request(call: dict[str, Any], tool: Any) -> ToolCallRequest:
    info = ExecutionInfo(thread_id="t-1", checkpoint_ns="tools:task-1", checkpoint_id="cp",
                         task_id="task-1", run_id=None, node_attempt=1)
    runtime = SimpleNamespace(execution_info=info, config={"metadata": {}}, tools=[tool])
    return ToolCallRequest(tool_call=call, tool=tool, state={}, runtime=runtime)  # type: ignore[arg-type]


def must_not_run(_request: ToolCallRequest) -> ToolMessage:
    raise AssertionError("a refused call reached the tool")


async def amust_not_run(_request: ToolCallRequest) -> ToolMessage:
    raise AssertionError("a refused call reached the tool")


@pytest.mark.parametrize("field", ["id", "name"])
@pytest.mark.parametrize(("what", "value"), HOSTILE, ids=[w for w, _ in HOSTILE])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_hostile_id_or_name_gets_a_bounded_refusal_and_one_audit_row(
        make_guard: GuardFactory, field: str, what: str, value: Any, mode: str) -> None:
    guard = make_guard(POLICY)
    tool = note_tool()
    call = {"id": "c1", "name": "note", "args": {"x": "1"}, "type": "tool_call", field: value}
    calls = GuardedToolCalls(guard, agent="a")
    req = request(call, tool if field == "id" else None)
    if mode == "sync":
        answer = calls.wrap_tool_call(req, must_not_run)
    else:
        answer = asyncio.run(calls.awrap_tool_call(req, amust_not_run))
    assert isinstance(answer, ToolMessage) and answer.status == "error"
    assert answer.response_metadata["toolguard"]["reason"] == "invalid_intent", answer.content
    assert len(str(answer.content)) <= 2_100
    # kept as sent up to 8,192 characters (the answer pairs with its call), cut beyond
    assert len(answer.tool_call_id) <= 8_192 and len(answer.name or "") <= 8_192
    assert guard.store is not None
    rows = guard.store.query_audit(limit=None)
    assert [(r.decision, r.reason) for r in rows] == [("rejected", "invalid_intent")]


@pytest.mark.parametrize("field", ["id", "name"])
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
def test_a_raw_send_with_a_5000_digit_id_or_name_does_not_crash_the_graph(
        make_guard: GuardFactory, field: str, mode: str) -> None:
    """Through a real compiled graph: ``Send`` hands ToolNode the raw dict, unvalidated."""
    guard = make_guard(POLICY)
    calls = GuardedToolCalls(guard, agent="a")
    node = ToolNode([note_tool()], wrap_tool_call=calls.wrap_tool_call,
                    awrap_tool_call=calls.awrap_tool_call)
    hostile = {"id": "c1", "name": "note", "args": {"x": "1"}, "type": "tool_call", field: HUGE}
    good = {"id": "c2", "name": "note", "args": {"x": "2"}, "type": "tool_call"}

    def route(state: MessagesState) -> list[Send]:
        return [Send("tools", {"__type": "tool_call_with_context", "tool_call": call,
                               "state": state}) for call in (hostile, good)]

    graph = StateGraph(MessagesState).add_node("tools", node) \
        .add_conditional_edges(START, route, ["tools"]).compile()
    out = graph.invoke({"messages": []}) if mode == "invoke" \
        else asyncio.run(graph.ainvoke({"messages": []}))
    answers = {m.tool_call_id: m for m in out["messages"] if isinstance(m, ToolMessage)}
    assert answers["c2"].content == "2" and answers["c2"].status == "success"
    (refused,) = [m for key, m in answers.items() if key != "c2"]
    assert refused.status == "error" and "(invalid_intent)" in str(refused.content)
    assert guard.store is not None
    assert sorted((r.decision, r.reason) for r in guard.store.query_audit(limit=None)) == [
        ("accepted", "applied"), ("rejected", "invalid_intent")]


@pytest.mark.parametrize(("what", "key"), [("5000-digit int key", HUGE),
                                           ("unprintable key", Unprintable())],
                         ids=["int", "unprintable"])
def test_arguments_with_hostile_keys_are_refused_and_their_shape_audited(
        make_guard: GuardFactory, what: str, key: Any) -> None:
    guard = make_guard(POLICY)

    @guarded(guard, agent="a", name="note")
    def note(x: str) -> str:
        return x

    decision = note.run({key: 1}, call_id="c1", thread_id="t1")  # type: ignore[dict-item]
    assert (decision.kind, decision.reason) == ("rejected", "invalid_arguments")
    assert guard.store is not None
    (row,) = guard.store.query_audit(limit=None)
    assert (row.decision, row.reason) == ("rejected", "invalid_arguments")
    assert len(str(row.args)) < 500


@pytest.mark.parametrize("answer", [{"type": HUGE}, {"type": "approve", "approval_id": HUGE},
                                    {"type": nested(1_000)}, {HUGE: 1}])
def test_a_hostile_resume_value_is_refused_with_a_bounded_reason(answer: Any) -> None:
    with pytest.raises(InvalidResume) as refused:
        parse_resume(answer)
    assert len(refused.value.message) < 400


def test_a_host_thread_id_past_the_digit_limit_is_refused_not_raised() -> None:
    intent = untrusted_intent(tool="note", thread_id=HUGE, run_id=-HUGE)
    assert intent.problem is not None and "thread id" in intent.problem
    assert untrusted_intent(tool="note", thread_id=42).workflow.thread_id == "42"


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
    | st.text(max_size=50) | st.integers(4_400, 6_000).map(lambda n: 10 ** n)
    | st.builds(Unprintable),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=5) | st.integers(), children, max_size=4)
    | st.tuples(children, children),
    max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(value=JSONISH, limit=st.integers(min_value=1, max_value=300))
def test_safe_text_never_raises_and_stays_bounded(value: Any, limit: int) -> None:
    assert len(safe_repr(value, limit)) <= max(limit, 1)
    assert len(safe_str(value, limit)) <= max(limit, 1)
    assert len(text_of(value, limit)) <= max(limit, 1)


def test_safe_text_survives_depth_past_the_recursion_limit() -> None:
    deep = nested(sys.getrecursionlimit() * 3)
    assert safe_repr(deep) == "[[[[...]]]]"
    assert text_of(deep) == "[[[[...]]]]"
    assert safe_str(HUGE) == "<an integer of about 5001 digits>"


@pytest.mark.parametrize("reason", ["stale_fencing_token", "key_not_fenced", "fences_required",
                                    "backend_unavailable"])
def test_a_hostile_problem_answer_from_a_fenced_service_is_typed_not_raised(reason: str) -> None:
    """A service's problem+json is read as data: its detail and keys may be anything."""
    from toolguard.fences.problems import error_from_problem

    deep = nested(2_000)
    error = error_from_problem({"reason": reason, "detail": HUGE, "key": deep,
                                "keys": [HUGE, deep], "missing": [deep]})
    assert error is not None and error.reason == reason
    assert len(error.message) < 2_100
