"""What LangChain's own agent suite (tests/langchain_suite) found in the adapters.

A parameter named ``runtime`` is injected by ToolNode whatever its annotation
(LangChain's ``test_tool_runtime_name_based_injection``: ``def tool(x: int,
runtime: Any)``), yet it stays in the tool's model-facing schema. toolguard read
it as a required argument the model never sent: the call was refused
(``rejected/invalid_arguments``) and then, as the tool's own schema refused the
arguments too, handed to ToolNode, which injected the runtime and ran the tool
unguarded under an audit row saying it was refused. It is the host's value, as
every injected parameter: dropped from the intent, never asked of the model.
"""

from __future__ import annotations

from typing import Any

import pytest
from guard.tools import scripted
from langchain.agents import create_agent
from langchain.tools import ToolRuntime
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import BaseTool, tool
from langgraph.prebuilt import ToolNode

from adapters.conftest import MODES, ai, answers, one_node, read_only, run, tool_call
from toolguard.adapters import GuardedToolCalls, ToolGuardMiddleware, guard_tool


def name_injected(seen: list[Any]) -> BaseTool:
    @tool
    def lookup(x: int, runtime: Any) -> str:
        """Look x up; ``runtime`` is injected by its name alone."""
        seen.append(runtime)
        return f"Processed {x}"

    return lookup


def _ran_guarded(seen: list[Any], out: dict[str, Any], g: Any) -> None:
    assert answers(out)["c1"].content == "Processed 42"
    assert len(seen) == 1 and isinstance(seen[0], ToolRuntime)
    assert g.decisions("c1") == [("accepted", "applied")]


@pytest.mark.parametrize("mode", MODES)
def test_a_runtime_parameter_injected_by_name_is_the_hosts_in_create_agent(guarded,
                                                                            mode: str) -> None:
    g = guarded(read_only("lookup"))
    seen: list[Any] = []
    model = scripted(AIMessage(content="", tool_calls=[tool_call("lookup", {"x": 42})]),
                     AIMessage(content="done"))
    agent = create_agent(model, [name_injected(seen)],
                         middleware=[ToolGuardMiddleware(g.guard, agent="t")])

    _ran_guarded(seen, run(agent, mode, {"messages": [HumanMessage("go")]}), g)


@pytest.mark.parametrize("mode", MODES)
def test_a_runtime_parameter_injected_by_name_is_the_hosts_in_a_tool_node(guarded,
                                                                           mode: str) -> None:
    g = guarded(read_only("lookup"))
    seen: list[Any] = []
    calls = GuardedToolCalls(g.guard, agent="t")
    node = ToolNode([name_injected(seen)], wrap_tool_call=calls.wrap_tool_call,
                    awrap_tool_call=calls.awrap_tool_call)

    _ran_guarded(seen, run(one_node(node), mode, ai(tool_call("lookup", {"x": 42}))), g)


@pytest.mark.parametrize("mode", MODES)
def test_a_runtime_parameter_injected_by_name_is_the_hosts_with_guard_tool(guarded,
                                                                           mode: str) -> None:
    g = guarded(read_only("lookup"))
    seen: list[Any] = []
    node = ToolNode([guard_tool(g.guard, name_injected(seen), agent="t")])

    _ran_guarded(seen, run(one_node(node), mode, ai(tool_call("lookup", {"x": 42}))), g)


@pytest.mark.parametrize("mode", MODES)
def test_a_model_value_for_a_name_injected_runtime_is_dropped(guarded, mode: str) -> None:
    g = guarded(read_only("lookup"))
    seen: list[Any] = []
    calls = GuardedToolCalls(g.guard, agent="t")
    node = ToolNode([name_injected(seen)], wrap_tool_call=calls.wrap_tool_call,
                    awrap_tool_call=calls.awrap_tool_call)

    out = run(one_node(node), mode, ai(tool_call("lookup", {"x": 42, "runtime": "forged"})))

    _ran_guarded(seen, out, g)
    [row] = g.audit(intent_id="c1")
    assert "runtime" not in (row.args or {})
