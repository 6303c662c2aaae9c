"""A tool's whole answer kept as JSON in its idempotency record, and rebuilt for a replay.

LangGraph re-runs a node's tool calls when it resumes an interrupt or retries
the node; a call that already applied is then answered from its record. The
graph must go on as if the tool had run again, so the record keeps the whole
answer, not only its text:

- a ``ToolMessage``: its content, its artifact, and what a tool answering
  with a message of its own put on it (id, name, ``additional_kwargs``,
  ``response_metadata``); the id is given back only to the call the record
  answered, so a new call replaying it under a business key never takes the
  place of the earlier call's answer in the state;
- a ``Command``: its state update (messages as LangChain's own message
  dicts, other values as JSON), its ``goto`` (nodes and ``Send``) and its
  ``graph``, and the id of the call it answered, so that the replay answers
  the call in hand (a business idempotency key lets a new call id replay an
  earlier call's record).

The record is plain JSON, so the policy's redaction masks it like any result
before it is stored. An answer that JSON cannot hold (an artifact or a state
value of another type) is kept as its text alone, as a plain result is, and
its replay answers with that text; the log says so once per tool.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import BaseMessage, ToolMessage, message_to_dict, messages_from_dict
from langgraph.types import Command, Send

from toolguard.policies.decisions import REDACTED

__all__ = ["record_of", "replayed_answer"]

logger = logging.getLogger("toolguard.adapters")

_warned: set[str] = set()


class _NotJson(Exception):
    """A part of the answer JSON cannot hold."""


class _Masked(Exception):
    """A part of the record's structure was masked by redaction."""


def record_of(output: Any, message: ToolMessage | None, call_id: str | None) -> dict[str, Any]:
    """The record of a successful answer: ``{"content": ...}`` plus what a replay rebuilds."""
    content = message.content if message is not None else None
    try:
        if isinstance(output, Command):
            return {"content": content, "call_id": call_id, "command": _command(output)}
        if isinstance(output, ToolMessage):
            record: dict[str, Any] = {"content": content}
            if output.artifact is not None:
                record["artifact"] = _json(output.artifact)
            own = _own_fields(output)
            if own:
                record.update(message=own, call_id=call_id)
            return record
    except _NotJson as error:
        name = message.name if message is not None and message.name else "?"
        if name not in _warned:
            _warned.add(name)
            logger.warning("the answer of tool %r holds %s, which JSON cannot keep: a replay of "
                           "its calls answers with the message text only", name, error)
        return {"content": content} if message is not None else {"command": True}
    return {"content": content}


def replayed_answer(recorded: Mapping[str, Any], call: Mapping[str, Any]) -> ToolMessage | Command[Any]:
    """The answer a replay gives the call ``call``: the recorded one, under ``call``'s id.

    Redaction masks every text of the record equal to a redacted value, field
    names too; a record whose structure was masked so cannot be rebuilt, and
    its replay answers with the recorded text (the log says why).
    """
    call_id, name = _text(call.get("id")), _text(call.get("name"))
    command = recorded.get("command")
    if isinstance(command, Mapping):
        try:
            return _rebuilt_command(command, recorded.get("call_id"), call_id)
        except (_Masked, ValueError, KeyError, TypeError) as error:
            logger.warning("the recorded answer of tool %r cannot be rebuilt (%s): its replay "
                           "answers with the recorded text only", name, error)
    content = recorded.get("content", REDACTED)
    if not isinstance(content, str | list):
        content = json.dumps(content, default=str)
    own = _rebuilt_fields(recorded.get("message"), recorded.get("call_id"), call_id, name)
    return ToolMessage(content=content, tool_call_id=call_id, status="success",
                       artifact=recorded.get("artifact"), **{"name": name, **own})


# --- recording ------------------------------------------------------------------------------


def _json(value: Any) -> Any:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise _NotJson(f"a {type(value).__name__} value") from error
    return value


#: The fields of a tool's own ToolMessage a replay gives back (beyond content and artifact).
_OWN_FIELDS = ("id", "name", "additional_kwargs", "response_metadata")
#: toolguard's own key under ``response_metadata``: each decision writes its own.
_DECISION_KEY = "toolguard"


def _own_fields(message: ToolMessage) -> dict[str, Any]:
    fields = {"id": message.id, "name": message.name,
              "additional_kwargs": message.additional_kwargs,
              "response_metadata": {k: v for k, v in message.response_metadata.items()
                                    if k != _DECISION_KEY}}
    return {key: _json(value) for key, value in fields.items() if value}


def _command(command: Command[Any]) -> dict[str, Any]:
    if command.resume is not None or not isinstance(command.update, Mapping | None):
        raise _NotJson("a Command with resume or a non-mapping update")
    update = {str(key): _value(value) for key, value in (command.update or {}).items()}
    return {"update": update, "goto": _goto(command.goto), "graph": command.graph}


def _value(value: Any) -> dict[str, Any]:
    if isinstance(value, BaseMessage):
        return {"message": _json(message_to_dict(value))}
    if isinstance(value, list | tuple) and value and all(isinstance(v, BaseMessage) for v in value):
        return {"messages": [_json(message_to_dict(v)) for v in value]}
    return {"value": _json(value)}


def _goto(goto: Any) -> Any:
    if isinstance(goto, str):
        return goto
    if isinstance(goto, Send):
        return {"send": goto.node, "arg": _json(goto.arg)}
    if isinstance(goto, Sequence):
        return [_goto(each) for each in goto]
    raise _NotJson(f"a goto of type {type(goto).__name__}")


# --- replaying ------------------------------------------------------------------------------


def _rebuilt_fields(kept: Any, answered: Any, call_id: str, name: str) -> dict[str, Any]:
    """The tool's own message fields to give back; none if redaction masked their names."""
    if not isinstance(kept, Mapping):
        return {}
    if REDACTED in kept:
        logger.warning("the recorded message of tool %r lost its field names to redaction: its "
                       "replay answers with the recorded content and artifact only", name)
        return {}
    types = {"id": str, "name": str, "additional_kwargs": dict, "response_metadata": dict}
    own = {key: kept[key] for key in _OWN_FIELDS
           if key in kept and isinstance(kept[key], types[key])}
    if not call_id or answered != call_id:
        own.pop("id", None)  # another call: its answer is a message of its own
    return own


def _rebuilt_command(recorded: Mapping[str, Any], answered: Any, call_id: str) -> Command[Any]:
    update: dict[str, Any] = {}
    for key, kept in _structure(recorded.get("update") or {}).items():
        if "message" in kept:
            message = _message(kept["message"])
            update[_structure(key)] = _answering(message, answered, call_id)
        elif "messages" in kept:
            update[_structure(key)] = [_answering(_message(m), answered, call_id)
                                       for m in kept["messages"]]
        elif "value" in kept:
            update[_structure(key)] = kept["value"]
        else:
            raise _Masked(f"the kind of state value {key!r}")
    return Command(update=update, goto=_rebuilt_goto(recorded.get("goto", ())),
                   graph=_structure(recorded.get("graph")))


def _structure(value: Any) -> Any:
    """``value`` unless redaction masked it (a state key, a node name, a message type)."""
    if value == REDACTED or (isinstance(value, Mapping) and REDACTED in value):
        raise _Masked(f"{value!r}")
    return value


def _message(kept: Any) -> BaseMessage:
    _structure(kept)
    _structure(kept["type"])
    _structure(kept["data"])
    return messages_from_dict([kept])[0]


def _answering(message: BaseMessage, answered: Any, call_id: str) -> BaseMessage:
    if isinstance(message, ToolMessage) and answered is not None and message.tool_call_id == answered:
        return message.model_copy(update={"tool_call_id": call_id})
    return message


def _rebuilt_goto(kept: Any) -> Any:
    _structure(kept)
    if isinstance(kept, Mapping):
        return Send(str(_structure(kept["send"])), kept.get("arg"))
    if isinstance(kept, list):
        return [_rebuilt_goto(each) for each in kept] if kept else ()
    return kept


def _text(value: Any) -> str:
    return "" if value is None else str(value)
