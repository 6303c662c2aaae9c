"""Turning guard decisions into what a LangChain/LangGraph caller reads."""

from __future__ import annotations

import json
from typing import Any

from langchain_core.messages import ToolMessage
from langgraph.types import Command

from toolguard.guard import Decision, ToolFailed
from toolguard.intent import Intent, WorkflowIdentity

__all__ = ["error_message", "intent_from_call", "recordable", "replayed_message"]


def intent_from_call(call: Any, *, agent: str | None, runtime: Any = None,
                     config: Any = None) -> Intent:
    """An ``Intent`` from a tool call plus whatever identity LangGraph exposes.

    Without a checkpointer LangGraph gives neither a thread nor a run id (unless
    the caller put ``run_id`` in the config). The superstep's checkpoint id then
    stands in for the run: it is the same on every ``RetryPolicy`` re-run of the
    node and new for every invocation, so a retried call still finds its
    idempotency record.
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


def recordable(output: Any) -> Any:
    """What the idempotency record keeps of a tool's output (JSON), or raise if it failed."""
    message = output
    if isinstance(output, Command):
        messages = (output.update or {}).get("messages", []) if isinstance(output.update, dict) \
            else []
        message = next((m for m in messages if isinstance(m, ToolMessage)), None)
        if message is None:
            return {"command": True}
    if isinstance(message, ToolMessage):
        if message.status == "error":
            raise ToolFailed(f"the tool reported an error: {_content_text(message.content)}")
        return {"content": message.content}
    try:
        json.dumps(output)
    except (TypeError, ValueError):
        return {"content": str(output)}
    return {"content": output}


def _content_text(content: Any) -> str:
    return content if isinstance(content, str) else json.dumps(content, default=str)


def replayed_message(decision: Decision, call: Any) -> ToolMessage:
    """The recorded result of an intent that already ran, as the model saw it the first time."""
    recorded = decision.result if isinstance(decision.result, dict) else {"content": decision.result}
    content = recorded.get("content", "")
    if not isinstance(content, str | list):
        content = json.dumps(content, default=str)
    return ToolMessage(content=content, tool_call_id=str(call.get("id") or ""),
                       name=str(call.get("name") or ""), status="success")


def error_message(decision: Decision, call: Any) -> ToolMessage:
    """An error ``ToolMessage`` naming the reason: the graph goes on, the model reads why."""
    return ToolMessage(content=decision.model_text(), tool_call_id=str(call.get("id") or ""),
                       name=str(call.get("name") or ""), status="error",
                       additional_kwargs={"toolguard": {"decision": decision.kind,
                                                        "reason": decision.reason}})

