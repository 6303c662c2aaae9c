"""The ``guarded`` decorator keeps what hosts read off a function, so LangChain wraps it as the function.

LangChain's ``@tool`` and ``StructuredTool.from_function`` read a function's
name, docstring and signature, and tell a coroutine function from a sync one
with ``inspect.iscoroutinefunction``; Python binds a function defined in a
class body to the instance. A guarded function must look the same to all of them.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
from langchain_core.tools import StructuredTool, tool
from langgraph.prebuilt import ToolNode

from adapters.conftest import ai, answers, one_node, read_only, run, tool_call
from toolguard.adapters import guarded as guarded_function
from toolguard.errors import GuardMisconfigured


def scale(value: int, factor: int = 2) -> int:
    """Scale a value."""
    return value * factor


async def ascale(value: int, factor: int = 2) -> int:
    """Scale a value, asynchronously."""
    return value * factor


@pytest.mark.parametrize("function", [scale, ascale], ids=["sync", "async"])
def test_a_guarded_function_keeps_the_functions_metadata_and_kind(guarded, function: Any) -> None:
    g = guarded(read_only(function.__name__))
    wrapped = guarded_function(g.guard, agent="tester")(function)

    for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
        assert getattr(wrapped, attribute) == getattr(function, attribute)
    assert wrapped.__wrapped__ is function
    assert inspect.signature(wrapped) == inspect.signature(function)
    assert inspect.iscoroutinefunction(wrapped) == inspect.iscoroutinefunction(function)
    assert asyncio.iscoroutinefunction(wrapped) == asyncio.iscoroutinefunction(function)


def as_tools(wrapped: Any, is_async: bool) -> list[Any]:
    if is_async:
        return [tool(wrapped), StructuredTool.from_function(coroutine=wrapped)]
    return [tool(wrapped), StructuredTool.from_function(func=wrapped)]


# An async-only tool has no sync path, guarded or not: the async function runs async only.
@pytest.mark.parametrize(("mode", "function"), [("sync", scale), ("async", scale), ("async", ascale)],
                         ids=["sync-function-sync", "sync-function-async", "async-function-async"])
def test_langchain_wraps_a_guarded_function_as_it_wraps_the_function(guarded, mode: str,
                                                                      function: Any) -> None:
    is_async = inspect.iscoroutinefunction(function)
    g = guarded(read_only(function.__name__))
    wrapped = guarded_function(g.guard, agent="tester")(function)

    for index, (plain, mine) in enumerate(zip(as_tools(function, is_async),
                                              as_tools(wrapped, is_async), strict=True)):
        assert (mine.name, mine.description, mine.args) == (plain.name, plain.description,
                                                           plain.args)
        assert (mine.func is None, mine.coroutine is None) == (plain.func is None,
                                                               plain.coroutine is None)
        call_id = f"c{index}"
        inputs = ai(tool_call(function.__name__, {"value": 21}, call_id))
        expected = answers(run(one_node(ToolNode([plain])), mode, inputs))[call_id]
        answer = answers(run(one_node(ToolNode([mine])), mode, inputs))[call_id]
        assert (answer.content, answer.status) == (expected.content, expected.status) == ("42",
                                                                                         "success")
        assert g.decisions()[-1] == ("accepted", "applied")


def make_ledger(guard: Any) -> Any:
    class Ledger:
        def __init__(self, base: int) -> None:
            self.base = base

        @guarded_function(guard, agent="tester")
        def credit(self, amount: int) -> int:
            """Credit an amount."""
            return self.base + amount

        @guarded_function(guard, agent="tester")
        async def acredit(self, amount: int) -> int:
            """Credit an amount, asynchronously."""
            return self.base + amount

    return Ledger


def test_a_guarded_method_is_bound_to_its_instance_and_self_is_no_argument(guarded) -> None:
    g = guarded(read_only("credit", "acredit"))
    ledger = make_ledger(g.guard)(100)

    assert ledger.credit(5) == 105
    assert ledger.credit(amount=6) == 106
    assert type(ledger).credit(ledger, 7) == 107
    assert ledger.credit.run({"amount": 8}).raise_for_rejection() == 108
    assert asyncio.run(ledger.acredit(9)) == 109
    assert list(inspect.signature(ledger.credit).parameters) == ["amount"]
    assert inspect.iscoroutinefunction(ledger.acredit)
    assert tool(ledger.credit).args == {"amount": {"title": "Amount", "type": "integer"}}
    assert [row.args for row in g.audit()] == [{"amount": n} for n in (5, 6, 7, 8, 9)]
    assert g.decisions() == [("accepted", "applied")] * 5
    with pytest.raises(GuardMisconfigured, match="on an instance"):
        type(ledger).credit.run({"amount": 1})
