"""Turning guard decisions into what a LangChain/LangGraph caller reads, and tool answers into records.

A tool's answer passes through unchanged: same content, id, artifact, status,
``Command`` update and ``goto``. toolguard only adds its decision under
``response_metadata["toolguard"]`` of the ToolMessage that answers the call
(``decision``, ``reason``, ``idempotency_key``, ``keys``, ``tokens``). That is
the one place that can never collide with the tool's own data: ``artifact``
belongs to the tool, ``additional_kwargs`` may be sent to a provider, and chat
model integrations never send ``response_metadata`` of a ToolMessage to the
model, so lock keys and fencing tokens stay out of the prompt.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from langchain_core.messages import ToolMessage
from langgraph.prebuilt.tool_node import INVALID_TOOL_NAME_ERROR_TEMPLATE
from langgraph.types import Command

from toolguard.adapters._replay import record_of, replayed_answer
from toolguard.guard import Decision, ToolFailed
from toolguard.runtime.safe_text import safe_str, text_of

__all__ = [
    "METADATA_KEY",
    "annotate",
    "decision_metadata",
    "recordable",
    "refusal_message",
    "replayed_message",
    "replayed_value",
    "terminating_message",
    "unknown_tool_message",
]

#: Characters kept of a tool's answer that JSON cannot hold (recorded as its text).
_CONTENT_LIMIT = 10_000_000
#: The key under ``ToolMessage.response_metadata`` that holds toolguard's decision.
METADATA_KEY = "toolguard"


def decision_metadata(decision: Decision) -> dict[str, Any]:
    """What the caller may know about a decision (never shown to the model)."""
    return {"decision": decision.kind, "reason": decision.reason,
            "idempotency_key": decision.idempotency_key, "keys": list(decision.keys),
            "tokens": dict(decision.tokens)}


def terminating_message(output: Any, call_id: str | None) -> ToolMessage | None:
    """The ToolMessage that answers call ``call_id`` in a tool's output, if there is one.

    ``output`` is what ToolNode's ``execute`` returns: a ToolMessage, a
    ``Command`` whose update holds it, or a list of both.
    """
    if isinstance(output, ToolMessage):
        return output
    for message in _messages_in(output):
        if call_id is None or message.tool_call_id == call_id:
            return message
    return None


def _messages_in(output: Any) -> Iterable[ToolMessage]:
    if isinstance(output, ToolMessage):
        yield output
    elif isinstance(output, Command):
        update = output.update
        values = update.values() if isinstance(update, Mapping) else [update]
        for value in values:
            if isinstance(value, list | tuple):
                yield from (m for m in value if isinstance(m, ToolMessage))
    elif isinstance(output, list | tuple):
        for item in output:
            yield from _messages_in(item)


def recordable(output: Any, call_id: str | None) -> Any:
    """What the idempotency record keeps of a tool's answer (JSON); ``ToolFailed`` if it failed.

    An answer with ``status="error"`` is a failure: the guard rolls the
    transaction back and records it, and the adapter hands the answer on as it was.
    """
    message = terminating_message(output, call_id)
    if message is not None and message.status == "error":
        raise ToolFailed(f"the tool reported an error: {_content_text(message.content)}")
    if message is not None or isinstance(output, Command):
        return record_of(output, message, call_id)
    if isinstance(output, list) and any(isinstance(item, ToolMessage | Command) for item in output):
        return {"command": True}
    try:
        json.dumps(output)
    except (TypeError, ValueError, RecursionError):
        return {"content": text_of(output, _CONTENT_LIMIT)}
    return {"content": output}


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    try:
        return json.dumps(content, default=text_of)
    except (TypeError, ValueError, RecursionError) as error:
        return f"<content JSON cannot hold: {text_of(error, 200)}>"


def annotate(output: Any, call_id: str | None, decision: Decision) -> Any:
    """``output`` with the decision under ``response_metadata["toolguard"]`` of its answering message.

    The message is copied, never changed in place (a tool or a cache may hand
    out the same object twice); everything else stays as the tool returned it.
    """
    target = terminating_message(output, call_id)
    if target is None:
        return output
    metadata = decision_metadata(decision)
    replacement = target.model_copy(update={
        "response_metadata": {**target.response_metadata, METADATA_KEY: metadata}})
    return _replace(output, target, replacement)


def _replace(output: Any, target: ToolMessage, replacement: ToolMessage) -> Any:
    if output is target:
        return replacement
    if isinstance(output, Command):
        update = output.update
        if isinstance(update, Mapping):
            new_update: Any = {key: _replace_in(value, target, replacement)
                               for key, value in update.items()}
        else:
            new_update = _replace_in(update, target, replacement)
        return dataclasses.replace(output, update=new_update)
    if isinstance(output, list):
        return [_replace(item, target, replacement) for item in output]
    return output


def _replace_in(value: Any, target: ToolMessage, replacement: ToolMessage) -> Any:
    if isinstance(value, list):
        return [replacement if item is target else item for item in value]
    if isinstance(value, tuple):
        return tuple(replacement if item is target else item for item in value)
    return value


def replayed_message(decision: Decision, call: Mapping[str, Any]) -> ToolMessage | Command[Any]:
    """The recorded answer of an intent that already ran, as the graph got it the first time."""
    recorded = decision.result if isinstance(decision.result, dict) else {"content": decision.result}
    return replayed_answer(recorded, call)


def replayed_value(decision: Decision, call: Mapping[str, Any]) -> Any:
    """The recorded answer of a call made with plain arguments: the value the tool returned.

    A JSON value comes back as the tool returned it the first time (a dict,
    a list, a number, ``None``), not as the text a ToolMessage would carry; an
    answer JSON could not hold comes back as its recorded text. A ``Command``
    is rebuilt as for a tool call.
    """
    recorded = decision.result
    if not isinstance(recorded, dict):
        return recorded
    if isinstance(recorded.get("command"), Mapping):
        return replayed_answer(recorded, call)
    return recorded.get("content")


def refusal_message(decision: Decision, call: Mapping[str, Any]) -> ToolMessage:
    """An error ``ToolMessage`` naming the reason: the graph goes on, the model reads why."""
    return ToolMessage(content=decision.model_text(), tool_call_id=_text(call.get("id")),
                       name=_text(call.get("name")), status="error")


def unknown_tool_message(call: Mapping[str, Any], tool_names: Iterable[str]) -> ToolMessage:
    """ToolNode's own answer to a tool it does not have (it names the valid ones)."""
    content = INVALID_TOOL_NAME_ERROR_TEMPLATE.format(
        requested_tool=_text(call.get("name")),
        available_tools=", ".join(safe_str(name) for name in tool_names))
    return ToolMessage(content, name=_text(call.get("name")), tool_call_id=_text(call.get("id")),
                       status="error")


#: The longest id or name a ToolMessage repeats as sent (so a refused call's answer still pairs
#: with it); a longer one, refused anyway, is cut to safe_str's bound.
PAIRED_TEXT_LIMIT = 8_192


def _text(value: Any) -> str:
    """A call's id or name as a ToolMessage holds it, without ever raising.

    Text up to ``PAIRED_TEXT_LIMIT`` is kept as sent (a ToolMessage pairs with its
    call by the exact id), longer text is cut, and
    a number becomes its bounded text, as ToolMessage coerces it; anything else
    is a field toolguard already refused, and becomes ``""`` rather than the
    text of a value that may be nested past the recursion limit.
    """
    if isinstance(value, str):
        text = str.__str__(value)
        return text if len(text) <= PAIRED_TEXT_LIMIT else safe_str(text)
    if isinstance(value, int | float):
        return safe_str(value)
    return ""
