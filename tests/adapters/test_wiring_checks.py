"""Wiring mistakes an adapter can see when it is built are raised there, not at the first call.

An adapter with no identity source would have every call refused
``missing_identity``: the model reads that, the developer finds it in the audit
log. So it raises ``GuardMisconfigured`` when built, unless it is told where the
identity comes from (``agent_from="metadata"``: each run's metadata; for plain
functions ``agent_from="call"``: each ``run(agent=...)``). A policy whose
``args:`` names an argument a wrapped tool lacks raises ``PolicyProblems`` when
the adapter is built with that tool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from langchain_core.tools import StructuredTool
from langgraph.prebuilt import ToolNode

from tests.adapters.conftest import Guarded, ai, answers, one_node, read_only, run, tool_call
from toolguard.adapters import GuardedToolCalls, ToolGuardMiddleware, guard_tool
from toolguard.adapters import guarded as guarded_fn  # the fixture `guarded` makes the guard
from toolguard.errors import GuardMisconfigured, PolicyProblems

Make = Callable[[Mapping[str, Any]], Guarded]

TYPO = {"version": 1, "defaults": {"agents": ["*"]},
        "tools": {"pay": {"locks": ["account:{account}"], "args": {"ammount": {"le": 100}}}}}


def pay(account: str, amount: int) -> str:
    """Pay ``amount`` from ``account``."""
    return f"paid {amount} from {account}"


def pay_tool() -> StructuredTool:
    return StructuredTool.from_function(pay, name="pay")


ADAPTERS: dict[str, Callable[..., Any]] = {
    "GuardedToolCalls": lambda g, **kw: GuardedToolCalls(g, **kw),
    "ToolGuardMiddleware": lambda g, **kw: ToolGuardMiddleware(g, **kw),
    "guard_tool": lambda g, **kw: guard_tool(g, pay_tool(), **kw),
}


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_no_identity_source_is_refused_when_built(guarded: Make, adapter: str) -> None:
    g = guarded(read_only("pay"))
    with pytest.raises(GuardMisconfigured, match=r"agent_from=\"metadata\"") as caught:
        ADAPTERS[adapter](g.guard)
    assert "missing_identity" in str(caught.value)
    ADAPTERS[adapter](g.guard, agent="billing")
    ADAPTERS[adapter](g.guard, agent_from="metadata")
    with pytest.raises(GuardMisconfigured, match="one identity source"):
        ADAPTERS[adapter](g.guard, agent="billing", agent_from="metadata")
    with pytest.raises(GuardMisconfigured, match="agent_from="):
        ADAPTERS[adapter](g.guard, agent_from="model")


def test_a_function_without_an_identity_source_is_refused_when_decorated(guarded: Make) -> None:
    g = guarded(read_only("pay"))
    with pytest.raises(GuardMisconfigured, match=r"agent_from=\"call\""):
        _decorate(g, {})
    per_call = _decorate(g, {"agent_from": "call"})
    assert per_call.run({"account": "a", "amount": 1}, agent="billing", call_id="c1").ok
    assert _decorate(g, {"agent": "billing"})(account="a", amount=2) == "paid 2 from a"


def _decorate(g: Guarded, options: dict[str, Any]) -> Any:
    return guarded_fn(g.guard, name="pay", **options)(pay)


def test_metadata_identity_still_reaches_the_policy(guarded: Make) -> None:
    """``agent_from="metadata"`` reads the run's ``toolguard_agent``, as before."""
    g = guarded({"version": 1, "tools": {"pay": {"read_only": True, "agents": ["billing"]}}})
    calls = GuardedToolCalls(g.guard, agent_from="metadata")
    node = ToolNode([pay_tool()], wrap_tool_call=calls.wrap_tool_call,
                    awrap_tool_call=calls.awrap_tool_call)
    app = one_node(node)
    out = run(app, "sync", ai(tool_call("pay", {"account": "a", "amount": 3})),
              {"metadata": {"toolguard_agent": "billing"}})
    assert answers(out)["c1"].content == "paid 3 from a"
    out = run(app, "sync", ai(tool_call("pay", {"account": "a", "amount": 3}, "c2")))
    assert "missing_identity" in str(answers(out)["c2"].content)


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_a_policy_argument_the_tool_lacks_is_reported_when_built(guarded: Make, adapter: str) -> None:
    g = guarded(TYPO)
    options: dict[str, Any] = {"agent": "billing"}
    if adapter != "guard_tool":
        options["tools"] = [pay_tool()]
    with pytest.raises(PolicyProblems, match=r"tools\.pay\.args.*'ammount' is not an argument of "
                                             r"the tool \(did you mean 'amount'\?\)"):
        ADAPTERS[adapter](g.guard, **options)


def test_a_policy_argument_the_function_lacks_is_reported_when_decorated(guarded: Make) -> None:
    g = guarded(TYPO)
    with pytest.raises(PolicyProblems, match="'ammount' is not an argument of the tool"):
        guarded_fn(g.guard, agent="billing")(pay)


def test_guarded_mcp_tools_needs_an_identity_source_before_it_lists(guarded: Make) -> None:
    from toolguard.fences.mcp_client import guarded_mcp_tools

    g = guarded(read_only("pay"))

    class Unreachable:
        async def list_tools(self) -> Any:
            raise AssertionError("listed before the identity was checked")

    with pytest.raises(GuardMisconfigured, match="guarded_mcp_tools has no agent identity"):
        asyncio.run(guarded_mcp_tools(g.guard, Unreachable()))
