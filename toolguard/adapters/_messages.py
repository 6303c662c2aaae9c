"""Turning guard decisions into what a LangChain/LangGraph caller reads."""

from __future__ import annotations

import json
from typing import Any

from langchain_core.messages import ToolMessage
from langgraph.types import Command

from toolguard.guard import Decision, ToolFailed

__all__ = ["error_message", "recordable", "replayed_message"]


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

