"""Who is calling, and from where: the envelope of a tool call turned into an ``Intent``.

Every adapter builds its intent here, so the rules for the call id, the agent
identity and the workflow identity are the same whether a call comes through a
ToolNode, a ``create_agent`` middleware or a LangChain tool.
"""

from __future__ import annotations

from typing import Any

from toolguard.intent import Intent, WorkflowIdentity

__all__ = ["agent_from_metadata", "intent_from_call"]


def intent_from_call(call: Any, *, agent: str | None, runtime: Any = None,
                     config: Any = None, origin: str = "model",
                     expected_tool: str | None = None) -> Intent:
    """An ``Intent`` from a tool call plus whatever identity LangGraph exposes.

    Without a checkpointer LangGraph gives neither a thread nor a run id (unless
    the caller put ``run_id`` in the config). The superstep's checkpoint id then
    stands in for the run: it is the same on every ``RetryPolicy`` re-run of the
    node and new for every invocation, so a retried call still finds its
    idempotency record. ``origin="python"`` marks a direct call (not a model's
    tool call); ``expected_tool`` names the one tool an adapter stands for.
    Both are accepted here so adapters can pass them; the envelope rules that
    use them come in the next commits.
    """
    configurable = dict((config or {}).get("configurable") or {})
    info = getattr(runtime, "execution_info", None)
    if info is None:  # a tool invoked by ToolNode gets only the config; the runtime rides in it
        info = getattr(configurable.get("__pregel_runtime"), "execution_info", None)
    thread_id = _text(getattr(info, "thread_id", None) or configurable.get("thread_id"))
    run_id = _text(getattr(info, "run_id", None) or (config or {}).get("run_id"))
    checkpoint_id = _text(getattr(info, "checkpoint_id", None))
    if thread_id is None and run_id is None and checkpoint_id:
        run_id = f"step:{checkpoint_id}"
    workflow = WorkflowIdentity(
        thread_id=thread_id,
        checkpoint_ns=_text(getattr(info, "checkpoint_ns", None)
                            or configurable.get("checkpoint_ns")) or "",
        checkpoint_id=checkpoint_id,
        run_id=run_id,
    )
    attempt = getattr(info, "node_attempt", 1) or 1
    return Intent(tool=str(call.get("name") or ""), args=call.get("args", {}),
                  call_id=_text(call.get("id")), agent=agent, workflow=workflow,
                  node_attempt=_attempt(attempt))


def _attempt(value: Any) -> int:
    try:
        return max(int(value), 0)
    except (TypeError, ValueError):
        return 1


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def agent_from_metadata(request: Any) -> str | None:
    """``toolguard_agent`` from the run's metadata, else the graph node's name."""
    config = getattr(request.runtime, "config", None) or {}
    metadata = config.get("metadata") or {}
    agent = metadata.get("toolguard_agent") or metadata.get("langgraph_node")
    return None if agent is None else str(agent)
