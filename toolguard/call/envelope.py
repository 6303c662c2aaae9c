"""The envelope of a tool call: its id and name, the agent, and where it runs.

The model writes the id and the name; the host gives the agent and the
workflow identity. All of it is checked as strictly as the arguments and never
coerced (``7`` is not ``"7"``, ``True`` is not ``"True"``):

* **id**: ``None`` or ``""`` (no id), else a ``str`` of at most 256 characters
  of valid Unicode (no lone surrogates). A model-facing call without an id is
  refused unless the tool's policy has an ``idempotency_key`` template; a
  direct Python call without one runs once, without replay protection.
* **name**: a ``str`` of 1 to 256 characters of valid Unicode.
* **agent**: ``None`` (no identity, which ``authorize`` refuses) or a ``str``
  of 1 to 256 characters of valid Unicode.
* **thread id, run id**: ``None``, a ``str`` of valid Unicode, an ``int`` or a
  ``UUID`` (LangGraph accepts those and uses their text; so does toolguard).
  **checkpoint namespace and id**: ``None`` or a ``str`` of valid Unicode.
* **node attempt**: an ``int`` >= 0.

``untrusted_intent`` turns any envelope into an ``Intent`` without raising: a
value of a type an ``Intent`` cannot hold is replaced by a placeholder and
described in ``problem`` (what is wrong, never the offending value).
``envelope_problem`` then checks the rest (empty, too long, not valid Unicode)
on every intent, however it was built; the guard runs it first and refuses a
broken envelope as ``invalid_intent``, audited, before it looks at anything
else. Pure and cheap: no I/O, a few ``len`` and ``isinstance`` calls per field.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Literal

from toolguard.call.intent import Intent, Origin, WorkflowIdentity

__all__ = ["MAX_ENVELOPE_TEXT", "envelope_problem", "untrusted_intent"]

#: The longest id, name or agent accepted, in characters.
MAX_ENVELOPE_TEXT = 256

_Presence = Literal["optional", "non_empty", "required"]
_BOUNDED = frozenset({"name", "id", "agent"})


def untrusted_intent(*, tool: Any, args: Any = None, call_id: Any = None, agent: Any = None,
                     thread_id: Any = None, checkpoint_ns: Any = None, checkpoint_id: Any = None,
                     run_id: Any = None, node_attempt: Any = 1, origin: Origin = "model",
                     expected_tool: str | None = None, conversation: Any = None) -> Intent:
    """An ``Intent`` from an envelope of any shape; never raises.

    ``expected_tool`` is the tool an adapter bound to one tool stands for (a
    guarded LangChain tool): a call naming another tool is refused, since the
    policy of the named tool would be applied to this tool's body.
    """
    thread_id, run_id = _host_id(thread_id), _host_id(run_id)
    texts = (call_id, agent, thread_id, run_id, checkpoint_ns, checkpoint_id, conversation)
    if (type(tool) is str and (expected_tool is None or tool == expected_tool)
            and all(v is None or type(v) is str for v in texts)
            and type(node_attempt) is int and node_attempt >= 0):
        # The common case, on every call: every type is one an Intent holds.
        flow = WorkflowIdentity(thread_id=thread_id, checkpoint_ns=checkpoint_ns or "",
                                checkpoint_id=checkpoint_id, run_id=run_id,
                                conversation=conversation)
        return Intent(tool=tool, args={} if args is None else args, call_id=call_id,
                      agent=agent, workflow=flow, node_attempt=node_attempt, origin=origin)
    problems: list[str] = []

    def take(value: Any, what: str, default: Any) -> Any:
        """The value when its type can be held by an ``Intent``; the string rules come later."""
        if value is None or type(value) is str:
            return value
        problems.append(f"{what}: expected a string, got {_kind(value)}")
        return default

    name = take(tool, "name", None)
    if tool is None:
        problems.append("name: missing")
    if expected_tool is not None:
        if name is not None and name != expected_tool:
            problems.append(f"name: this tool is {expected_tool!r}; the call names another tool")
        name = expected_tool
    workflow = WorkflowIdentity(
        thread_id=take(thread_id, "thread id", None),
        checkpoint_ns=take(checkpoint_ns, "checkpoint namespace", "") or "",
        checkpoint_id=take(checkpoint_id, "checkpoint id", None),
        run_id=take(run_id, "run id", None),
        conversation=take(conversation, "conversation", None),
    )
    attempt = node_attempt
    if type(attempt) is not int or attempt < 0:
        problems.append(f"node attempt: expected an integer >= 0, got {_kind(attempt)}")
        attempt = 1
    return Intent(tool=name or "", args={} if args is None else args,
                  call_id=take(call_id, "id", None), agent=take(agent, "agent", None),
                  workflow=workflow, node_attempt=attempt, origin=origin,
                  problem="; ".join(problems) if problems else None)


def envelope_problem(intent: Intent) -> str | None:
    """What is wrong with ``intent``'s envelope, or ``None``; cheap enough for every call."""
    if intent.problem is not None:
        return intent.problem
    flow = intent.workflow
    fields: tuple[tuple[str | None, str, _Presence], ...] = (
        (intent.tool, "name", "required"), (intent.call_id, "id", "optional"),
        (flow.thread_id, "thread id", "optional"), (flow.run_id, "run id", "optional"),
        (flow.checkpoint_ns, "checkpoint namespace", "optional"),
        (flow.checkpoint_id, "checkpoint id", "optional"))
    for value, what, presence in fields:
        problem = _text_problem(value, what, presence=presence)
        if problem is not None:
            return problem
    return _text_problem(intent.agent, "agent", presence="non_empty")


#: The longest integer thread or run id taken as its digits (one too long is refused, unread).
_MAX_ID_BITS = 1_000


def _host_id(value: Any) -> Any:
    """Integer thread ids and ``UUID`` run ids as the text LangGraph itself uses for them."""
    if isinstance(value, int) and not isinstance(value, bool):
        # past Python's digit limit str() raises; such an id is refused as "not a string"
        return int.__repr__(value) if int.bit_length(value) <= _MAX_ID_BITS else value
    if isinstance(value, uuid.UUID):
        return uuid.UUID.__str__(value)
    return value


def _text_problem(value: Any, what: str, *, presence: _Presence) -> str | None:
    """Why ``value`` is not a usable envelope text, or ``None``.

    ``"required"`` (the name) refuses ``None`` and ``""``; ``"non_empty"`` (the
    agent: ``None`` is no identity, refused later by ``authorize``) refuses
    ``""``; ``"optional"`` accepts both as absent (an id of ``""`` means no
    id). Id, name and agent are bounded; the host's workflow identity is not
    (the idempotency key that holds it is hashed when long).
    """
    if value is None:
        return None if presence != "required" else f"{what}: missing"
    if not isinstance(value, str):
        return f"{what}: expected a string, got {_kind(value)}"
    if not value:
        return None if presence == "optional" else f"{what}: empty"
    limit = MAX_ENVELOPE_TEXT if what in _BOUNDED else 0
    if limit and len(value) > limit:
        return f"{what}: {len(value)} characters, at most {limit}"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            return f"{what}: not valid Unicode (a lone surrogate at position {error.start})"
    return None


def _kind(value: Any) -> str:
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return type(value).__name__
