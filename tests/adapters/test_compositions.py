"""toolguard outermost and innermost among other ``wrap_tool_call`` wrappers and agent middlewares.

Innermost (directly around ToolNode's ``execute``, last in a ``create_agent``
middleware list) toolguard guards whatever really runs: a tool an interceptor
above it substitutes, each attempt of a retry above it. Outermost it judges the
model's call before the wrappers inside it see it, and cannot see what they
run: a call naming a tool outside the policy never reaches them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from guard.tools import scripted
from langchain.agents import create_agent
from langchain.agents.middleware import ToolRetryMiddleware
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.prebuilt import ToolNode

from adapters.conftest import MODES, ai, answers, one_node, read_only, run, tool_call
from toolguard.adapters import GuardedToolCalls, ToolGuardMiddleware
from toolguard.errors import UnknownToolWarning

Wrapper = Callable[[Any, Callable[[Any], Any]], Any]


def nest(outer: Wrapper, inner: Wrapper) -> Wrapper:
    """``outer`` around ``inner``, as ``create_agent`` chains its middlewares."""
    return lambda request, execute: outer(request, lambda req: inner(req, execute))


def anest(outer: Any, inner: Any) -> Any:
    async def composed(request: Any, execute: Callable[[Any], Awaitable[Any]]) -> Any:
        async def call_inner(req: Any) -> Any:
            return await inner(req, execute)

        return await outer(request, call_inner)

    return composed


def node(tools: list[Any], calls: GuardedToolCalls, interceptor: Any, ainterceptor: Any, *,
         toolguard: str) -> ToolNode:
    if toolguard == "innermost":
        wrap = nest(interceptor, calls.wrap_tool_call)
        awrap = anest(ainterceptor, calls.awrap_tool_call)
    else:
        wrap = nest(calls.wrap_tool_call, interceptor)
        awrap = anest(calls.awrap_tool_call, ainterceptor)
    return ToolNode(tools, wrap_tool_call=wrap, awrap_tool_call=awrap)


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def substituting(substitute: Any, seen: list[str]) -> tuple[Wrapper, Any]:
    """An interceptor serving ``name`` (a tool the ToolNode lacks) with ``substitute``."""

    def interceptor(request: Any, execute: Callable[[Any], Any]) -> Any:
        seen.append(request.tool_call["name"])
        if request.tool is None:
            return execute(request.override(tool=substitute))
        return execute(request)

    async def ainterceptor(request: Any, execute: Callable[[Any], Awaitable[Any]]) -> Any:
        seen.append(request.tool_call["name"])
        if request.tool is None:
            return await execute(request.override(tool=substitute))
        return await execute(request)

    return interceptor, ainterceptor


def answering(seen: list[str]) -> tuple[Wrapper, Any]:
    """An interceptor answering calls for tools the ToolNode lacks itself."""

    def reply(request: Any) -> ToolMessage:
        return ToolMessage("answered by the interceptor", tool_call_id=request.tool_call["id"],
                           name=request.tool_call["name"])

    def interceptor(request: Any, execute: Callable[[Any], Any]) -> Any:
        seen.append(request.tool_call["name"])
        return reply(request) if request.tool is None else execute(request)

    async def ainterceptor(request: Any, execute: Callable[[Any], Awaitable[Any]]) -> Any:
        seen.append(request.tool_call["name"])
        return reply(request) if request.tool is None else await execute(request)

    return interceptor, ainterceptor


def lookup(ran: list[str]) -> Any:
    @tool
    def lookup(key: str) -> str:
        """Look a key up."""
        ran.append(key)
        return f"value of {key}"

    return lookup


@pytest.mark.parametrize("mode", MODES)
def test_innermost_an_interceptor_above_answers_a_tool_the_node_lacks(guarded, mode: str) -> None:
    g = guarded(read_only("add"))
    seen: list[str] = []
    app = one_node(node([add], GuardedToolCalls(g.guard, agent="t"), *answering(seen),
                        toolguard="innermost"))

    out = run(app, mode, ai(tool_call("lookup", {"key": "k"})))

    assert answers(out)["c1"].content == "answered by the interceptor"
    assert seen == ["lookup"]
    assert g.decisions() == []  # the call never reached toolguard, and nothing ran


@pytest.mark.parametrize("mode", MODES)
def test_innermost_a_substituted_tool_outside_the_policy_is_refused(guarded, mode: str) -> None:
    g = guarded(read_only("add"))
    ran: list[str] = []
    app = one_node(node([add], GuardedToolCalls(g.guard, agent="t"),
                        *substituting(lookup(ran), []), toolguard="innermost"))

    with pytest.warns(UnknownToolWarning, match="'lookup' is not in the policy"):
        out = run(app, mode, ai(tool_call("lookup", {"key": "k"})))

    message = answers(out)["c1"]
    assert message.content.startswith("rejected by toolguard (unknown_tool)")
    assert ran == []
    assert g.decisions("c1") == [("rejected", "unknown_tool")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("toolguard", ["innermost", "outermost"])
def test_a_tool_the_policy_names_runs_guarded_when_an_interceptor_serves_it(
        guarded, mode: str, toolguard: str) -> None:
    g = guarded(read_only("add", "lookup"))
    ran: list[str] = []
    app = one_node(node([add], GuardedToolCalls(g.guard, agent="t"),
                        *substituting(lookup(ran), []), toolguard=toolguard))

    out = run(app, mode, ai(tool_call("lookup", {"key": "k"})))

    assert answers(out)["c1"].content == "value of k"
    assert ran == ["k"]
    assert g.decisions("c1") == [("accepted", "applied")]


@pytest.mark.parametrize("mode", MODES)
def test_outermost_a_tool_outside_the_policy_is_answered_before_the_interceptor(guarded,
                                                                                mode: str) -> None:
    g = guarded(read_only("add"))
    seen: list[str] = []
    ran: list[str] = []
    app = one_node(node([add], GuardedToolCalls(g.guard, agent="t"),
                        *substituting(lookup(ran), seen), toolguard="outermost"))

    out = run(app, mode, ai(tool_call("lookup", {"key": "k"}), tool_call("add", {"a": 1, "b": 2},
                                                                          "c2")))

    assert answers(out)["c1"].content == "Error: lookup is not a valid tool, try one of [add]."
    assert answers(out)["c2"].content == "3"
    assert (seen, ran) == (["add"], [])
    assert g.decisions("c1") == [("rejected", "unknown_tool")]


# --- create_agent: toolguard and a retry middleware ----------------------------------------------


def flaky(attempts: list[int]) -> Any:
    @tool
    def fetch_rate(currency: str) -> str:
        """Fetch an exchange rate; fails on the first attempt."""
        attempts.append(len(attempts) + 1)
        if len(attempts) == 1:
            msg = "rate service timed out"
            raise TimeoutError(msg)
        return f"{currency}: 1.08"

    return fetch_rate


def agent_run(middleware: list[Any], tools: list[Any], mode: str) -> dict[str, Any]:
    model = scripted(AIMessage(content="", tool_calls=[tool_call("fetch_rate", {"currency": "EUR"})]),
                     AIMessage(content="done"))
    agent = create_agent(model, tools, middleware=middleware)
    return run(agent, mode, {"messages": [HumanMessage("rate?")]})


def retry() -> ToolRetryMiddleware:
    return ToolRetryMiddleware(max_retries=1, initial_delay=0, jitter=False)


@pytest.mark.parametrize("mode", MODES)
def test_a_retry_above_toolguard_gets_a_fresh_decision_per_attempt(guarded, mode: str) -> None:
    g = guarded(read_only("fetch_rate"))
    attempts: list[int] = []
    out = agent_run([retry(), ToolGuardMiddleware(g.guard, agent="t")], [flaky(attempts)], mode)

    assert answers(out)["c1"].content == "EUR: 1.08"
    assert attempts == [1, 2]
    assert g.decisions("c1") == [("failed", "error"), ("accepted", "applied")]


@pytest.mark.parametrize("mode", MODES)
def test_a_retry_inside_toolguard_runs_within_one_decision(guarded, mode: str) -> None:
    g = guarded(read_only("fetch_rate"))
    attempts: list[int] = []
    out = agent_run([ToolGuardMiddleware(g.guard, agent="t"), retry()], [flaky(attempts)], mode)

    assert answers(out)["c1"].content == "EUR: 1.08"
    assert attempts == [1, 2]
    assert g.decisions("c1") == [("accepted", "applied")]


@pytest.mark.parametrize("mode", MODES)
def test_a_tool_error_reaches_an_outer_middleware_as_without_toolguard(guarded, mode: str) -> None:
    """A retry that gives up answers with its own message, as it does when toolguard is absent."""
    g = guarded(read_only("fetch_rate"))

    @tool
    def fetch_rate(currency: str) -> str:
        """Always fails."""
        msg = "rate service down"
        raise TimeoutError(msg)

    plain = agent_run([ToolRetryMiddleware(max_retries=0)], [fetch_rate], mode)
    out = agent_run([ToolRetryMiddleware(max_retries=0), ToolGuardMiddleware(g.guard, agent="t")],
                    [fetch_rate], mode)

    assert answers(out)["c1"].content == answers(plain)["c1"].content
    assert "rate service down" in answers(out)["c1"].content
    assert g.decisions("c1") == [("failed", "error")]
