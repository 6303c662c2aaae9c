"""Hostile tool calls through every LangGraph/LangChain surface: nothing escapes, all audited.

The contract (docs/async.md, README "What comes back"): whatever a call holds,
in any field of its envelope or its arguments, a call toolguard refuses gets
toolguard's answer and never reaches ToolNode's execution or the tool; the
run returns, every sibling call of the superstep gets its ToolMessage, each
call leaves exactly one audit row, and the tool runs only for accepted calls.

The regressions of issue 21 point 1 are pinned first (the exact inputs that
crashed ``graph.invoke``); then hypothesis drives the strategies of
``adapters.hostile`` through real compiled graphs (a ToolNode fed by ``Send``
with several calls per task and several tasks per superstep, and
``create_agent``), sync and async, toolguard innermost and outermost, and
through ``guard_tool(...).invoke/ainvoke`` and ``@guarded`` functions. The CI
run draws a few thousand calls in all; ``-m nightly`` draws ten times more,
with fresh random examples.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated, Any

import pytest
from guard.tools import ScriptedModel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, InjectedToolCallId, StructuredTool, ToolException
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Send

from adapters.conftest import Guarded
from adapters.hostile import MISSING, call, hostile_value, nested, plain_input, valid_call
from toolguard.adapters import GuardedToolCalls, ToolGuardMiddleware, guard_tool, guarded
from toolguard.errors import ToolGuardError
from toolguard.guard import Decision

POLICY = {"version": 1, "defaults": {"agents": ["*"]},
          "tools": {"add": {"locks": ["n:{a}"]}, "echo": {"read_only": True}}}
MODES = ("sync", "async")
COMPOSITIONS = ("innermost", "outermost")

#: (examples per graph test, per direct-call test, derandomized): CI, and ``-m nightly``.
SCALES = {"ci": (50, 300, True), "nightly": (500, 3_000, False)}
SCALE_PARAMS = [pytest.param("ci"), pytest.param("nightly", marks=pytest.mark.nightly)]


def hypothesis_settings(scale: str, graph: bool) -> settings:
    per_graph, per_call, derandomize = SCALES[scale]
    return settings(max_examples=per_graph if graph else per_call, deadline=None, database=None,
                    derandomize=derandomize, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# --- the tools, and what they and the audit log saw ------------------------------------------------


class Ledger:
    """Every run of a tool body (by call id), and the audit log's counts."""

    def __init__(self, g: Guarded) -> None:
        self.g = g
        self.runs: list[str] = []
        self._lock = threading.Lock()

    def ran(self, call_id: str) -> None:
        with self._lock:
            self.runs.append(call_id)

    def counts(self) -> tuple[int, int, int]:
        """``(audit rows, accepted rows, tool runs)`` so far."""
        assert self.g.guard.store is not None
        with self.g.guard.store.connection() as conn:
            rows = conn.execute("SELECT count(*), coalesce(sum(CASE WHEN decision = 'accepted' "
                                "THEN 1 ELSE 0 END), 0) FROM toolguard_audit").fetchone()
        return int(rows[0]), int(rows[1]), len(self.runs)

    def graph_tools(self) -> list[BaseTool]:
        """``add`` (fenced; a sync and an async body) and ``echo`` (read-only; sync only, so
        under ainvoke it runs its sync guarded call in a worker thread)."""

        def add(a: int, b: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
            """Add two numbers."""
            self.ran(tool_call_id)
            return str(a + b)

        async def aadd(a: int, b: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
            self.ran(tool_call_id)
            return str(a + b)

        def echo(text: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
            """Echo a text."""
            self.ran(tool_call_id)
            return text

        return [StructuredTool.from_function(func=add, coroutine=aadd),
                StructuredTool.from_function(func=echo)]

    def plain_add(self) -> BaseTool:
        def add(a: int, b: int) -> str:
            """Add two numbers."""
            self.ran("plain")
            return str(a + b)

        async def aadd(a: int, b: int) -> str:
            self.ran("plain")
            return str(a + b)

        return StructuredTool.from_function(func=add, coroutine=aadd)


@pytest.fixture
def ledger(guarded: Callable[[Any], Guarded]) -> Ledger:
    return Ledger(guarded(POLICY))


class Runner:
    """Runs coroutines on one event loop for the whole test (as a server does), or not at all."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._runner = asyncio.Runner() if mode == "async" else None

    def __call__(self, sync: Callable[[], Any], asynchronous: Callable[[], Awaitable[Any]]) -> Any:
        if self._runner is None:
            return sync()
        return self._runner.run(_awaited(asynchronous()))

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


@pytest.fixture(params=MODES)
def runner(request: pytest.FixtureRequest) -> Iterator[Runner]:
    made = Runner(request.param)
    yield made
    made.close()


# --- graphs ----------------------------------------------------------------------------------


class Calls(MessagesState):
    groups: list[Any]


def _host_wrapper(request: Any, execute: Callable[[Any], Any]) -> Any:
    """The host's own ``wrap_tool_call`` (a logging or retry wrapper) next to toolguard's."""
    return execute(request)


async def _ahost_wrapper(request: Any, execute: Callable[[Any], Awaitable[Any]]) -> Any:
    return await execute(request)


def tool_node_app(ledger: Ledger, composition: str) -> Any:
    """START -Send-> ToolNode (toolguard inside or outside a host wrapper), one task per group."""
    calls = GuardedToolCalls(ledger.g.guard, agent="tester")
    ours, aours = calls.wrap_tool_call, calls.awrap_tool_call
    if composition == "outermost":
        def wrap(req: Any, execute: Any) -> Any:
            return ours(req, lambda r: _host_wrapper(r, execute))

        async def awrap(req: Any, execute: Any) -> Any:
            async def inner(r: Any) -> Any:
                return await _ahost_wrapper(r, execute)

            return await aours(req, inner)
    else:
        def wrap(req: Any, execute: Any) -> Any:
            return _host_wrapper(req, lambda r: ours(r, execute))

        async def awrap(req: Any, execute: Any) -> Any:
            async def inner(r: Any) -> Any:
                return await aours(r, execute)

            return await _ahost_wrapper(req, inner)

    node = ToolNode(ledger.graph_tools(), wrap_tool_call=wrap, awrap_tool_call=awrap)
    graph = StateGraph(Calls)
    graph.add_node("tools", node)
    graph.add_conditional_edges(START, lambda state: [Send("tools", group)
                                                      for group in state["groups"]])
    return graph.compile()


class PassThrough(AgentMiddleware):
    """A host middleware next to toolguard's."""

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        return handler(request)

    async def awrap_tool_call(self, request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        return await handler(request)


def agent_app(ledger: Ledger, composition: str) -> tuple[Any, ScriptedModel]:
    model = ScriptedModel(messages=iter([]))
    ours = ToolGuardMiddleware(ledger.g.guard, agent="tester")
    middleware = [ours, PassThrough()] if composition == "outermost" else [PassThrough(), ours]
    return create_agent(model, ledger.graph_tools(), middleware=middleware), model


def unvalidated(calls: list[dict[str, Any]]) -> AIMessage:
    """An AIMessage holding ``calls`` as they are (what a broken parser or a raw dict gives)."""
    return AIMessage.model_construct(content="", tool_calls=calls, invalid_tool_calls=[])


# --- what every run must show ----------------------------------------------------------------------


def sibling(n: int) -> tuple[dict[str, Any], str]:
    """A valid call on a lock key of its own, and the answer it must get."""
    call_id = f"ok-{uuid.uuid4().hex[:10]}"
    return valid_call("add", {"a": 10_000_000 + n, "b": 1}, call_id), str(10_000_001 + n)


def check_run(ledger: Ledger, before: tuple[int, int, int], out: Any, sent: int,
              siblings: dict[str, str]) -> None:
    messages = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert len(messages) == sent, "every call of the superstep has its ToolMessage"
    answers = {m.tool_call_id: m for m in messages}
    for call_id, content in siblings.items():
        assert (answers[call_id].status, answers[call_id].content) == ("success", content)
    rows, accepted, runs = ledger.counts()
    assert rows - before[0] == sent, "exactly one audit row per call"
    assert runs - before[2] == accepted - before[1], "the tool runs for accepted calls only"
    ran = Counter(ledger.runs)
    assert all(ran[call_id] == 1 for call_id in siblings)


def lone_calls(groups: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """ToolNode reads a ``Send`` as tool calls only if its last item says ``type: tool_call``."""
    return [[*group[:-1], {**group[-1], "type": "tool_call"}] for group in groups]


# --- issue 21 point 1: the inputs that crashed graph.invoke ---------------------------------------


def _regressions() -> dict[str, dict[str, Any]]:
    return {
        "deep": {"name": "add", "id": "h", "type": "tool_call",
                 "args": {"a": nested(1_000), "b": 1}},
        "huge_int": {"name": "add", "id": "h", "type": "tool_call",
                     "args": {"a": 10 ** 5_000, "b": "x"}},
        "args_null": {"name": "add", "id": "h", "type": "tool_call", "args": None},
        "no_args": {"name": "add", "id": "h", "type": "tool_call"},
        "huge_int_id": {"name": "add", "id": 10 ** 5_000, "type": "tool_call",
                        "args": {"a": 1, "b": 2}},
        "deep_name": {"name": nested(1_000, "tuple"), "id": "h", "type": "tool_call",
                      "args": {}},
    }


REGRESSIONS = _regressions()


@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize("case", sorted(REGRESSIONS))
def test_a_refused_call_never_reaches_toolnode_and_its_sibling_keeps_its_answer(
        ledger: Ledger, runner: Runner, case: str, composition: str) -> None:
    app = tool_node_app(ledger, composition)
    ok, content = sibling(0)
    inputs = {"messages": [], "groups": [[REGRESSIONS[case], ok], [REGRESSIONS[case]], [ok]]}
    ok_again = {**ok, "id": ok["id"] + "-b"}
    inputs["groups"][2] = [ok_again]
    before = ledger.counts()

    out = runner(lambda: app.invoke(inputs), lambda: app.ainvoke(inputs))

    check_run(ledger, before, out, 4, {ok["id"]: content, ok_again["id"]: content})
    refused = [m for m in out["messages"] if isinstance(m, ToolMessage) and m.status == "error"]
    assert len(refused) == 2
    assert all(m.content.startswith("rejected by toolguard (invalid_") for m in refused)


@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize("case", ["deep", "huge_int", "args_null", "no_args", "huge_int_id"])
def test_create_agent_answers_refused_calls_itself(ledger: Ledger, runner: Runner, case: str,
                                                   composition: str) -> None:
    app, model = agent_app(ledger, composition)
    ok, content = sibling(0)
    model.messages = iter([unvalidated([REGRESSIONS[case], ok]), AIMessage(content="done")])
    before = ledger.counts()
    inputs = {"messages": [HumanMessage("go")]}

    out = runner(lambda: app.invoke(inputs), lambda: app.ainvoke(inputs))

    assert out["messages"][-1].content == "done"
    check_run(ledger, before, out, 2, {ok["id"]: content})


# --- properties --------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", SCALE_PARAMS)
@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_any_calls_through_a_guarded_tool_node(ledger: Ledger, runner: Runner, composition: str,
                                               scale: str) -> None:
    app = tool_node_app(ledger, composition)
    numbers = itertools.count()

    @hypothesis_settings(scale, graph=True)
    @given(groups=st.lists(st.lists(call(), min_size=1, max_size=3), min_size=1, max_size=3))
    def check(groups: list[list[dict[str, Any]]]) -> None:
        first, first_answer = sibling(next(numbers))
        second, second_answer = sibling(next(numbers))
        sends = lone_calls([[*groups[0], first], *groups[1:], [second]])
        sent = sum(len(group) for group in sends)
        inputs = {"messages": [], "groups": sends}
        before = ledger.counts()
        out = runner(lambda: app.invoke(inputs), lambda: app.ainvoke(inputs))
        check_run(ledger, before, out, sent, {first["id"]: first_answer,
                                              second["id"]: second_answer})

    check()


@pytest.mark.parametrize("scale", SCALE_PARAMS)
@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_any_calls_through_create_agent(ledger: Ledger, runner: Runner, composition: str,
                                        scale: str) -> None:
    app, model = agent_app(ledger, composition)
    numbers = itertools.count()

    @hypothesis_settings(scale, graph=True)
    @given(calls=st.lists(call(hashable_id=True, lone=True), min_size=1, max_size=4))
    def check(calls: list[dict[str, Any]]) -> None:
        ok, content = sibling(next(numbers))
        model.messages = iter([unvalidated([*calls, ok]), AIMessage(content="done")])
        before = ledger.counts()
        inputs = {"messages": [HumanMessage("go")]}
        out = runner(lambda: app.invoke(inputs), lambda: app.ainvoke(inputs))
        assert out["messages"][-1].content == "done"
        check_run(ledger, before, out, len(calls) + 1, {ok["id"]: content})

    check()


@pytest.mark.parametrize("scale", SCALE_PARAMS)
def test_any_input_to_a_guarded_langchain_tool(ledger: Ledger, runner: Runner,
                                               scale: str) -> None:
    tool = guard_tool(ledger.g.guard, ledger.plain_add(), agent="tester")
    threads = itertools.count()

    @hypothesis_settings(scale, graph=False)
    @given(tool_input=call() | plain_input)
    def check(tool_input: Any) -> None:
        config = {"configurable": {"thread_id": f"t-{next(threads)}"}}
        is_call = isinstance(tool_input, dict) and tool_input.get("type") == "tool_call"
        before = ledger.counts()
        try:
            answer = runner(lambda: tool.invoke(tool_input, config),
                            lambda: tool.ainvoke(tool_input, config))
        except ToolException:  # toolguard's refusal of plain arguments, typed
            assert not is_call
            answer = None
        rows, accepted, runs = ledger.counts()
        assert rows - before[0] == 1
        assert runs - before[2] == accepted - before[1]
        if is_call:
            assert isinstance(answer, ToolMessage)

    check()


@pytest.mark.parametrize("scale", SCALE_PARAMS)
def test_any_input_to_a_guarded_function(ledger: Ledger, runner: Runner, scale: str) -> None:
    g = ledger.g

    @guarded(g.guard, name="add", agent="tester")
    def add(a: int, b: int) -> int:
        ledger.ran("plain")
        return a + b

    @guarded(g.guard, name="add", agent="tester")
    async def aadd(a: int, b: int) -> int:
        ledger.ran("plain")
        return a + b

    threads = itertools.count()
    envelope = hostile_value | st.text(max_size=8)

    @hypothesis_settings(scale, graph=False)
    @given(args=plain_input, agent=st.just("tester") | envelope, call_id=envelope,
           direct=st.booleans())
    def check(args: Any, agent: Any, call_id: Any, direct: bool) -> None:
        before = ledger.counts()
        thread = f"t-{next(threads)}"
        if direct and isinstance(args, dict) and set(args) <= {"a", "b"} and len(args) == 2:
            with contextlib.suppress(ToolGuardError):  # the result, or toolguard's typed error
                runner(lambda: add(**args), lambda: aadd(**args))
        else:
            decision = runner(
                lambda: add.run(args, agent=agent, call_id=call_id, thread_id=thread),
                lambda: aadd.arun(args, agent=agent, call_id=call_id, thread_id=thread))
            assert isinstance(decision, Decision)
        rows, accepted, runs = ledger.counts()
        assert rows - before[0] == 1
        assert runs - before[2] == accepted - before[1]

    check()


def test_the_strategies_reach_every_kind_of_hostile_field() -> None:
    """A guard for the strategies themselves: each envelope field gets each hostile kind."""
    seen: Counter[str] = Counter()

    @settings(max_examples=150, database=None, derandomize=True, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(drawn=call())
    def check(drawn: dict[str, Any]) -> None:
        for field in ("id", "name", "args", "type"):
            value = drawn.get(field, MISSING)
            seen[f"{field}:{_kind(value)}"] += 1

    check()
    for field in ("id", "name", "args"):
        for kind in ("text", "huge_int", "deep", "none"):
            assert seen[f"{field}:{kind}"], (field, kind, seen)
    assert seen["args:missing"] and seen["type:missing"] and seen["type:other"]


def _kind(value: Any) -> str:
    if value is MISSING:
        return "missing"
    if value is None:
        return "none"
    if isinstance(value, int) and not isinstance(value, bool) and value > 10 ** 4_000:
        return "huge_int"
    if isinstance(value, list | tuple | dict) and _depth(value) > 50:
        return "deep"
    if isinstance(value, str):
        return "text"
    return "other"


def _depth(value: Any) -> int:
    depth = 0
    while isinstance(value, list | tuple | dict) and value:
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
        depth += 1
    return depth
