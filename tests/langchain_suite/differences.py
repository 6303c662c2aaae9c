"""Where LangChain's agent suite ends otherwise with a middleware in every ``create_agent``.

Two lists, each test under its reason and the runs it applies to:

- ``ANY_MIDDLEWARE``: tests that end otherwise than plain with the no-op
  middleware of the ``passthrough`` run. LangChain's own behaviour once any
  middleware wraps tool calls; toolguard meets the same in both positions.
- ``DIFFERENCES``: tests that end otherwise with toolguard than with the no-op
  middleware, by composition (``innermost``: appended, ``outermost``: prepended).

``test_langchain_suite`` fails on any other difference, on a listed one that no
longer differs, and on a reason that does not hold (each reason has a check there).
"""

from __future__ import annotations

from dataclasses import dataclass

INNERMOST = frozenset({"innermost"})
OUTERMOST = frozenset({"outermost"})


@dataclass(frozen=True)
class Reason:
    """Why a test ends differently, and how the CI test proves that this is why."""

    code: str
    why: str


TOOLS_NODE_WITHOUT_TOOLS = Reason("tools_node_without_tools", (
    "LangChain, not toolguard: create_agent builds a tools node when a middleware wraps tool "
    "calls, even for an agent without tools, so the graph these tests draw or run has a node "
    "(and edges) more than without the middleware. No tool call reaches the middleware."))

NO_UNKNOWN_TOOL_CHECK = Reason("no_unknown_tool_check", (
    "LangChain, not toolguard: create_agent checks that the tools a model request names were "
    "given to it only when no middleware wraps tool calls (one that does may run tools of its "
    "own); with the middleware the expected ValueError is not raised."))

STRICT_ARGUMENTS = Reason("strict_arguments", (
    "toolguard validates arguments strictly (README: unknown fields are refused). Innermost it "
    "sees the call as a person edited it in human-in-the-loop, with an argument the tool does "
    "not declare, and refuses it (rejected/invalid_arguments); LangChain's lenient tool schema "
    "drops the extra argument and runs the tool. Outermost toolguard sees the model's call, "
    "before the edit, and these tests pass."))

NO_CALL_ID = Reason("no_call_id", (
    "toolguard refuses a model's tool call without an id (rejected/invalid_intent): without one "
    "a call sent twice cannot be applied once. Outermost the refusal comes before "
    "human-in-the-loop sees the call, so its own handling of a missing or empty id (a "
    "ValueError, an interrupt for the empty id) never happens. Innermost "
    "human-in-the-loop answers first and these tests pass."))

TOOLGUARD_ANSWERS = Reason("toolguard_answers", (
    "A call toolguard refuses gets toolguard's answer and never reaches ToolNode or the tool "
    "(README: a refused call is answered by toolguard, whatever the tool's own schema would "
    "say). These tests send arguments the tool's schema refuses and look for LangChain's own "
    "validation message; toolguard answers rejected/invalid_arguments, naming each field, in "
    "both positions. Handing such calls back to ToolNode let hostile arguments crash the graph "
    "run (issue 21), so toolguard no longer does."))

ANY_MIDDLEWARE_REASONS = (TOOLS_NODE_WITHOUT_TOOLS, NO_UNKNOWN_TOOL_CHECK)
REASONS = (STRICT_ARGUMENTS, NO_CALL_ID, TOOLGUARD_ANSWERS)

_CORE = "tests/unit_tests/agents/middleware/core/"
_HITL = "tests/unit_tests/agents/middleware/implementations/test_human_in_the_loop.py::"
_VALIDATION = "tests/unit_tests/agents/test_create_agent_tool_validation.py::"
_BOTH = INNERMOST | OUTERMOST

#: test id -> reason, for the tests the no-op middleware ends otherwise than plain.
ANY_MIDDLEWARE: dict[str, Reason] = {
    _CORE + "test_decorators.py::test_async_middleware_with_can_jump_to_graph_snapshot":
        TOOLS_NODE_WITHOUT_TOOLS,
    _CORE + "test_diagram.py::test_create_agent_diagram": TOOLS_NODE_WITHOUT_TOOLS,
    _CORE + "test_framework.py::test_jump_to_is_ephemeral": TOOLS_NODE_WITHOUT_TOOLS,
    **{_CORE + f"test_dynamic_tools.py::test_dynamic_tool_without_handler_raises_error[{case}]":
       NO_UNKNOWN_TOOL_CHECK
       for case in ("with_static_tools-False", "with_static_tools-True",
                    "without_static_tools-False", "without_static_tools-True")},
    _CORE + "test_tools.py::test_unknown_tool_raises_error": NO_UNKNOWN_TOOL_CHECK,
}

#: test id -> (compositions where it differs from the no-op middleware, reason)
DIFFERENCES: dict[str, tuple[frozenset[str], Reason]] = {
    _HITL + "test_resume_with_each_decision[batched-edit-with-an-undeclared-arg]":
        (INNERMOST, STRICT_ARGUMENTS),
    _HITL + "test_resume_with_each_decision[per_call-edit-with-an-undeclared-arg]":
        (INNERMOST, STRICT_ARGUMENTS),
    _HITL + "test_per_call_needs_a_tool_call_id": (OUTERMOST, NO_CALL_ID),
    _HITL + "test_per_call_same_tool_twice_routes_each_answer_to_its_own_call":
        (OUTERMOST, NO_CALL_ID),
    **{_VALIDATION + name: (_BOTH, TOOLGUARD_ANSWERS)
       for name in ("test_create_agent_error", "test_create_agent_error_async",
                    "test_tool_invocation_error_excludes_injected_state")},
}


def any_middleware(reason: Reason | None = None) -> set[str]:
    """The tests documented to differ from plain with any tool-call middleware."""
    return {test for test, why in ANY_MIDDLEWARE.items() if reason is None or why is reason}


def expected(composition: str, reason: Reason | None = None) -> set[str]:
    """The tests documented to differ from the no-op middleware in ``composition``."""
    return {test for test, (where, why) in DIFFERENCES.items()
            if composition in where and (reason is None or why is reason)}
