"""The deliberate differences between LangGraph's prebuilt suite plain and with toolguard injected.

Every test of the suite must end the same way with toolguard's wrapper in each
``ToolNode`` as without it, except the ones listed here, each under its reason
and for the compositions it applies to (``DIFFERENCES``; ``BARE_DIFFERENCES``
for the runs without toolguard's deliberate differences). ``test_langgraph_suite``
fails on any other difference, on a listed one that no longer differs, and on a
reason that does not hold (each reason has a test there that checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

BOTH = frozenset({"outermost", "innermost"})
OUTERMOST = frozenset({"outermost"})


@dataclass(frozen=True)
class Reason:
    """Why a test ends differently, and how the CI test proves that this is why."""

    code: str
    why: str


ANY_WRAPPER = Reason("any_wrapper", (
    "LangGraph, not toolguard: once a ToolNode has any wrap_tool_call, an exception that "
    "leaves the wrapper goes through handle_tool_errors without its type filter, and so do "
    "injection failures, which ToolNode raises before its own error handling. toolguard "
    "re-raises the tool's exception unchanged; the no-op wrapper of the 'passthrough' run "
    "fails exactly these tests."))

METADATA = Reason("metadata", (
    "toolguard adds its decision under response_metadata['toolguard'] of the answering "
    "ToolMessage (issue 10); these tests compare whole messages with ==. They pass with "
    "GuardedToolCalls(metadata=False) (the 'bare' runs)."))

OUTSIDE_POLICY = Reason("outside_policy", (
    "An interceptor substitutes a tool that the ToolNode was not built with, so the "
    "policy (the node's own tools) does not name it: toolguard refuses it (unknown_tool) "
    "and it never runs. With on_unknown_tool: allow (the 'bare' runs) they pass."))

OUTSIDE_POLICY_BELOW = Reason("outside_policy_below", (
    "toolguard outermost cannot see what an interceptor inside it would run, so a call "
    "naming a tool that neither the ToolNode nor the policy has gets ToolNode's own "
    "'not a valid tool' answer (audited as unknown_tool) before the interceptor sees it. "
    "Innermost, or with the tool named in the policy (or on_unknown_tool: allow, the "
    "'bare' runs), the interceptor answers."))

NO_WORKFLOW_IDENTITY = Reason("no_workflow_identity", (
    "Issue 9: the workflow identity (thread, run, checkpoint) comes only from LangGraph's "
    "ExecutionInfo and is never coerced. These tests run a ToolNode outside a graph with a "
    "Mock runtime, so their calls have neither a thread nor a run id. With on_unknown_tool: "
    "allow (the 'bare' runs) a tool outside the policy runs unfenced, and an unfenced call "
    "without a stable idempotency key is refused (missing_idempotency_key): nothing would "
    "recognise a retry of it. With the default policy they end as listed in DIFFERENCES "
    "(or as plain); in a graph, LangGraph's ExecutionInfo gives every call an identity."))

TOOLGUARD_ANSWERS = Reason("toolguard_answers", (
    "Issue 21 (DESIGN 16): a call toolguard refuses gets toolguard's answer and never reaches "
    "ToolNode's execution, also when the tool's own schema would refuse its arguments too. "
    "These tests send arguments the tool's schema refuses and expect ToolNode's own answer "
    "to them (the 'Error invoking tool ...' text, or ToolInvocationError raised with "
    "handle_tool_errors=False); toolguard answers 'rejected by toolguard "
    "(invalid_arguments): ...' instead, and the run goes on. Handing such calls to ToolNode "
    "let hostile arguments (nested 1,000 deep, 5,000-digit integers, args null or missing) "
    "crash graph.invoke and lose the ToolMessages of the other calls of the superstep. "
    "They differ in the bare runs too."))

REASONS = (ANY_WRAPPER, METADATA, OUTSIDE_POLICY, OUTSIDE_POLICY_BELOW, NO_WORKFLOW_IDENTITY,
           TOOLGUARD_ANSWERS)

_REACT = "tests/test_react_agent.py::"
_NODE = "tests/test_tool_node.py::"
_UNREG = "tests/test_tool_node_interceptor_unregistered.py::"
_FILTERING = "tests/test_tool_node_validation_error_filtering.py::"

#: Arguments the tool's schema refuses: toolguard refuses them first and answers itself.
_TOOLGUARD_ANSWERS = (
    _NODE + "test_tool_node_error_handling_default_invocation",
    _NODE + "test_tool_node_handle_tool_errors_false",
    _FILTERING + "test_tool_invocation_error_without_handle_errors",
)

#: test id -> (compositions where it differs, reason)
DIFFERENCES: dict[str, tuple[frozenset[str], Reason]] = {
    _REACT + "test_tool_node_inject_store": (BOTH, ANY_WRAPPER),
    _NODE + "test_tool_node_inject_store": (BOTH, ANY_WRAPPER),
    _NODE + "test_tool_node_inject_state[_InjectStateSchema]": (BOTH, ANY_WRAPPER),
    _NODE + "test_tool_node_error_handling_callable": (BOTH, ANY_WRAPPER),

    _REACT + "test_create_react_agent_inject_vars[AgentStateExtraKey-v1]": (BOTH, METADATA),
    _REACT + "test_create_react_agent_inject_vars[AgentStateExtraKey-v2]": (BOTH, METADATA),
    _REACT + "test_create_react_agent_inject_vars[AgentStateExtraKeyPydantic-v1]": (BOTH, METADATA),
    _REACT + "test_create_react_agent_inject_vars[AgentStateExtraKeyPydantic-v2]": (BOTH, METADATA),
    _REACT + "test_create_react_agent_inject_vars_with_post_model_hook[AgentStateExtraKey]":
        (BOTH, METADATA),
    _REACT + "test_create_react_agent_inject_vars_with_post_model_hook[AgentStateExtraKeyPydantic]":
        (BOTH, METADATA),
    _REACT + "test_post_model_hook_with_structured_output": (BOTH, METADATA),
    _REACT + "test_react_with_subgraph_tools[memory-v1]": (BOTH, METADATA),
    _REACT + "test_react_with_subgraph_tools[memory-v2]": (BOTH, METADATA),
    _REACT + "test_return_direct[v1]": (BOTH, METADATA),
    _REACT + "test_return_direct[v2]": (BOTH, METADATA),
    _REACT + "test_tool_node_messages_key": (BOTH, METADATA),
    _REACT + "test_tool_node_node_interrupt[memory-v2]": (BOTH, METADATA),
    _REACT + "test_tool_node_stream_writer": (BOTH, METADATA),
    _NODE + "test_tool_node_command[dict]": (BOTH, METADATA),
    _NODE + "test_tool_node_command[tool_calls]": (BOTH, METADATA),
    _NODE + "test_tool_node_command_list_input": (BOTH, METADATA),
    _NODE + "test_tool_node_messages_key": (BOTH, METADATA),
    _NODE + "test_tool_node_stream_writer": (BOTH, METADATA),
    _NODE + "test_tool_node_tool_call_input": (BOTH, METADATA),

    _NODE + "test_tool_node_inject_runtime_dynamic_tool_via_wrap_tool_call": (BOTH, OUTSIDE_POLICY),
    _NODE + "test_tool_node_inject_runtime_dynamic_tool_via_wrap_tool_call_async":
        (BOTH, OUTSIDE_POLICY),
    _UNREG + "test_wrap_tool_call_override_unregistered_tool_with_custom_impl":
        (BOTH, OUTSIDE_POLICY),
    _UNREG + "test_awrap_tool_call_override_unregistered_tool_with_custom_impl":
        (BOTH, OUTSIDE_POLICY),

    _UNREG + "test_interceptor_can_handle_unregistered_tool_sync": (OUTERMOST, OUTSIDE_POLICY_BELOW),
    _UNREG + "test_interceptor_can_handle_unregistered_tool_async": (OUTERMOST, OUTSIDE_POLICY_BELOW),
    _UNREG + "test_interceptor_handles_mix_of_registered_and_unregistered":
        (OUTERMOST, OUTSIDE_POLICY_BELOW),
    _UNREG + "test_interceptor_command_for_unregistered_tool": (OUTERMOST, OUTSIDE_POLICY_BELOW),
    _UNREG + "test_interceptor_exception_with_unregistered_tool": (OUTERMOST, OUTSIDE_POLICY_BELOW),
    _UNREG + "test_async_interceptor_exception_with_unregistered_tool":
        (OUTERMOST, OUTSIDE_POLICY_BELOW),
    _UNREG + "test_interceptor_with_dict_input_format": (OUTERMOST, OUTSIDE_POLICY_BELOW),
    _UNREG + "test_interceptor_verifies_tool_is_none_for_unregistered":
        (OUTERMOST, OUTSIDE_POLICY_BELOW),

    **{test: (BOTH, TOOLGUARD_ANSWERS) for test in _TOOLGUARD_ANSWERS},
}


_BARE_BOTH = (
    "test_wrap_tool_call_override_unregistered_tool_with_custom_impl",
    "test_awrap_tool_call_override_unregistered_tool_with_custom_impl",
    "test_graceful_failure_when_hook_does_not_override_unregistered_tool_sync",
    "test_graceful_failure_when_hook_does_not_override_unregistered_tool_async",
    "test_graceful_failure_even_when_handle_errors_disabled_sync",
    "test_graceful_failure_even_when_handle_errors_disabled_async",
    "test_unregistered_tool_error_when_interceptor_calls_execute",
)
#: Outermost, toolguard decides before the interceptor inside it answers the tool.
_BARE_OUTERMOST = (
    "test_interceptor_can_handle_unregistered_tool_sync",
    "test_interceptor_can_handle_unregistered_tool_async",
    "test_interceptor_handles_mix_of_registered_and_unregistered",
    "test_interceptor_command_for_unregistered_tool",
    "test_interceptor_exception_with_unregistered_tool",
    "test_async_interceptor_exception_with_unregistered_tool",
    "test_interceptor_with_dict_input_format",
    "test_interceptor_verifies_tool_is_none_for_unregistered",
)

#: The 'bare' runs (metadata off, unknown tools allowed): test id -> (compositions, reason),
#: beyond what any wrapper changes (``ANY_WRAPPER``).
BARE_DIFFERENCES: dict[str, tuple[frozenset[str], Reason]] = {
    **{_UNREG + name: (BOTH, NO_WORKFLOW_IDENTITY) for name in _BARE_BOTH},
    **{_UNREG + name: (OUTERMOST, NO_WORKFLOW_IDENTITY) for name in _BARE_OUTERMOST},
    **{test: (BOTH, TOOLGUARD_ANSWERS) for test in _TOOLGUARD_ANSWERS},
}


def expected(composition: str, reason: Reason | None = None) -> set[str]:
    """The tests documented to differ in ``composition`` (for ``reason``, if given)."""
    return {test for test, (where, why) in DIFFERENCES.items()
            if composition in where and (reason is None or why is reason)}


def expected_bare(composition: str, reason: Reason | None = None) -> set[str]:
    """The tests documented to differ in the bare run of ``composition``, beyond any wrapper's
    (for ``reason``, if given)."""
    return {test for test, (where, why) in BARE_DIFFERENCES.items()
            if composition in where and (reason is None or why is reason)}
