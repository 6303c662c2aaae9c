"""An LLM tool call as an untrusted intent, its idempotency key and its input limits.

Nothing in an ``Intent`` is trusted: the tool name, the arguments, even the call
id come from a model's output. The guard only acts on what it derived itself:
arguments that passed ``check_limits`` and then the tool's strict schema
(``toolguard.policies.validate_args``), and keys rendered from those.

This module is pure: no I/O, no clock, nothing that differs between the sync
and the async path.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Literal, NoReturn
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt
from pydantic_core import to_jsonable_python

from toolguard.errors import InvalidArguments

__all__ = [
    "DEFAULT_LIMITS",
    "MAX_KEY_BYTES",
    "IdempotencyKeyFn",
    "IdempotencyScope",
    "Intent",
    "Limits",
    "Origin",
    "WorkflowIdentity",
    "args_hash",
    "bounded_key",
    "canonical_json",
    "check_limits",
    "default_idempotency_key",
    "json_args",
    "node_path",
]

#: ``(intent) -> key``; ``None`` means "no stable identity", see ``default_idempotency_key``.
IdempotencyKeyFn = Callable[["Intent"], "str | None"]

#: Who built the intent: a model's tool call (ToolNode, ``create_agent``, a LangChain tool
#: invoked with a tool call) or a direct Python call. Only a Python call may lack an id.
Origin = Literal["model", "python"]

#: How far a tool-call id is unique (``default_idempotency_key``).
IdempotencyScope = Literal["thread", "task"]

#: Longer idempotency keys are hashed (``bounded_key``): they must fit a database index.
MAX_KEY_BYTES = 512


class WorkflowIdentity(BaseModel):
    """Where the call happened; the stable parts make the default idempotency key.

    Maps to LangGraph's ``runtime.execution_info``: ``thread_id`` survives
    interrupt/resume, ``checkpoint_ns`` names the node path and the task
    (``scorer:<task id>|tools:<task id>``; the task ids change every superstep),
    ``run_id`` identifies one invocation (the fallback without a checkpointer).
    ``checkpoint_id`` is kept for the audit log only: it changes on every step.
    ``conversation`` names whose reads a write is checked against, with the agent
    (``toolguard.store.reads.caller_of``); None: the thread, else the run; ``""``:
    the agent alone (the MCP gateway without a client-named thread).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    thread_id: str | None = None
    checkpoint_ns: str = ""
    checkpoint_id: str | None = None
    run_id: str | None = None
    conversation: str | None = None


class Intent(BaseModel):
    """One tool call as the model emitted it, plus who asked and where; all untrusted.

    ``args`` is kept exactly as received (any JSON-ish value, possibly hostile);
    treat it as read-only. ``id`` names this attempt in the audit log;
    ``node_attempt`` is audited but never part of the idempotency key, since it
    grows on retries of the same intent. Fields are typed strictly (``7`` is
    not a call id); build intents from untrusted envelopes with
    ``from_tool_call`` or ``toolguard.call.envelope.untrusted_intent``, which never
    raise: a broken envelope is kept as ``problem`` and refused by the guard as
    ``invalid_intent``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    tool: str
    args: Any = Field(default_factory=dict)
    call_id: str | None = None
    agent: str | None = None
    workflow: WorkflowIdentity = Field(default_factory=WorkflowIdentity)
    node_attempt: NonNegativeInt = 1
    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    origin: Origin = "model"
    problem: str | None = None

    @classmethod
    def from_tool_call(cls, call: Any, *, agent: Any = None,
                       workflow: WorkflowIdentity | None = None, node_attempt: Any = 1,
                       origin: Origin = "model") -> Intent:
        """Build from a LangChain-style ``{"name", "args", "id"}`` tool call; never raises."""
        from toolguard.call.envelope import untrusted_intent

        flow = workflow or WorkflowIdentity()
        fields = call if isinstance(call, Mapping) else {}
        return untrusted_intent(
            tool=fields.get("name"), args=fields.get("args", {}), call_id=fields.get("id"),
            agent=agent, thread_id=flow.thread_id, checkpoint_ns=flow.checkpoint_ns,
            checkpoint_id=flow.checkpoint_id, run_id=flow.run_id, node_attempt=node_attempt,
            origin=origin)


def node_path(checkpoint_ns: str) -> str:
    """The agent/node path of a LangGraph checkpoint namespace: its task ids left out.

    ``scorer:1f0c...|tools:9a1b...`` -> ``scorer|tools``. LangGraph forbids ``|``
    and ``:`` in node names, so the path is exact; it stays the same across
    supersteps, retries and resumes, and differs between two agents or subgraphs.
    """
    if ":" not in checkpoint_ns:
        return checkpoint_ns
    return "|".join(part.split(":", 1)[0] for part in checkpoint_ns.split("|"))


def default_idempotency_key(intent: Intent, scope: IdempotencyScope = "thread") -> str | None:
    """``thread:<thread>/<node path>/<call id>``, else ``run:<run>/...``; ``None`` without one.

    Providers' tool-call ids are unique within a conversation, so with the
    default ``scope="thread"`` a call id seen again in the same thread and on the
    same agent/node path (``node_path``: the checkpoint namespace without its
    task ids) is the same intent: a replay when the arguments match, a conflict
    when they do not, in any later superstep. Two agents or subgraphs that reuse
    ids stay apart, since their paths differ. ``scope="task"`` keeps the task
    ids (the whole namespace): for frameworks that reuse call ids across the
    turns of one thread; it still recognises retries and resumes of one task.

    Each part is percent-encoded, so ``/`` inside an id cannot make two
    different identities share a key. ``None`` (no call id, or neither a thread
    nor a run) tells the guard that a retry of this call cannot be recognised:
    it must decide whether to run without replay protection or refuse.
    """
    if not intent.call_id:
        return None
    flow = intent.workflow
    where = flow.checkpoint_ns if scope == "task" else node_path(flow.checkpoint_ns)
    if flow.thread_id:
        return f"thread:{_part(flow.thread_id)}/{_part(where)}/{_part(intent.call_id)}"
    if flow.run_id:
        return f"run:{_part(flow.run_id)}/{_part(where)}/{_part(intent.call_id)}"
    return None


_UNQUOTED = re.compile(r"[A-Za-z0-9_.~-]*")


def _part(text: str) -> str:
    if _UNQUOTED.fullmatch(text):  # nothing ``quote`` would change
        return text
    return quote(text, safe="", errors="surrogatepass")


_HASHED = "%h"  # never in a percent-encoded key: there ``%`` is followed by two hex digits


def bounded_key(key: str) -> str:
    """``key`` as an index can hold it: unchanged when short and plain, else hashed.

    A key longer than ``MAX_KEY_BYTES`` in UTF-8 (a 256-character id of emoji
    is 3,072 bytes percent-encoded), or holding NUL or a lone surrogate (only a
    custom key function can produce those), becomes ``<first 64 characters,
    ASCII>%h<SHA-256 of the whole key>``. Keys built by toolguard never contain
    ``%h``, and a key that does is hashed too, so the mapping stays injective.
    """
    try:
        raw, plain = key.encode("utf-8"), "\x00" not in key
    except UnicodeEncodeError:
        raw, plain = key.encode("utf-8", "surrogatepass"), False
    if plain and len(raw) <= MAX_KEY_BYTES and _HASHED not in key:
        return key
    shown = key[:64].encode("ascii", "backslashreplace").decode("ascii")[:64].replace("\x00", "")
    return f"{shown}{_HASHED}{hashlib.sha256(raw).hexdigest()}"


# --- validated arguments: canonical form and hash ---------------------------------


def json_args(args: BaseModel | Mapping[str, Any]) -> dict[str, Any]:
    """Validated arguments as plain JSON values (aliases as field names).

    Keys, hashes, constraints and redaction all work on this one form, so a
    ``UUID`` field and the string the model sent render the same way.
    """
    if isinstance(args, BaseModel):
        return args.model_dump(mode="json", by_alias=True)
    return dict(to_jsonable_python(dict(args)))


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                              allow_nan=False)


def canonical_json(value: Any) -> str:
    """Sorted keys, no spaces, UTF-8 text, no NaN: equal values give equal text."""
    try:  # already plain JSON values (the usual case): no conversion pass first
        return _CANONICAL.encode(value)
    except TypeError:
        return _CANONICAL.encode(to_jsonable_python(value))


def args_hash(args: BaseModel | Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of *validated* arguments.

    Stored with the idempotency record: the same key with another hash is a
    conflict, not a replay.
    """
    form = args if type(args) is dict else json_args(args)  # a dict: json_args' output already
    return hashlib.sha256(canonical_json(form).encode("utf-8")).hexdigest()


# --- limits on untrusted input ---------------------------------------------------------


class Limits(BaseModel):
    """Bounds on raw arguments, checked before any schema sees them.

    They keep a hostile or confused model from spending the guard's memory and
    CPU (pydantic and ``json`` recurse; regexes scan whole strings).
    ``max_string`` also bounds object keys and the digits of an integer.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_bytes: PositiveInt = 65_536
    max_depth: PositiveInt = 8
    max_string: PositiveInt = 4_096
    max_items: PositiveInt = 256
    max_keys: PositiveInt = 256


DEFAULT_LIMITS = Limits()

_LOG10_2 = math.log10(2)


def check_limits(args: Any, limits: Limits = DEFAULT_LIMITS, *, root: str = "args") -> None:
    """Raise ``InvalidArguments`` naming the path of the first value over a limit.

    Walks iteratively (a 10,000-deep list cannot overflow the stack) and stops
    as soon as the compact JSON size passes ``max_bytes``. Values that are not
    JSON (bytes, NaN, lone surrogates, non-string keys) are rejected too.
    The path of a value is only spelled out when it is named in an error.
    """
    total = 0
    # (value, where, depth); where is None for the root, else (parent's where, key or index).
    stack: list[tuple[Any, Any, int]] = [(args, None, 0)]
    max_string, max_bytes = limits.max_string, limits.max_bytes
    while stack:
        value, where, depth = stack.pop()
        kind = type(value)
        if kind is str:  # the common kinds first, by exact type
            if len(value) > max_string:
                _reject(f"{_path(root, where)}: string longer than {max_string}")
            total += _json_size(value, root, where, "string")
        elif kind is int:
            if value.bit_length() * _LOG10_2 >= max_string:  # i.e. more than max_string digits
                _reject(f"{_path(root, where)}: integer longer than {max_string} digits")
            total += len(str(value))
        elif value is None or isinstance(value, bool):
            total += 4 if value in (None, True) else 5
        elif isinstance(value, int):
            digits = int(value.bit_length() * _LOG10_2) + 1
            if digits > max_string:
                _reject(f"{_path(root, where)}: integer longer than {max_string} digits")
            total += len(str(value))
        elif isinstance(value, float):
            if not math.isfinite(value):
                _reject(f"{_path(root, where)}: not a finite number")
            total += len(repr(value))
        elif isinstance(value, str):
            if len(value) > max_string:
                _reject(f"{_path(root, where)}: string longer than {max_string}")
            total += _json_size(value, root, where, "string")
        elif kind is dict or isinstance(value, Mapping):
            if depth + 1 > limits.max_depth:
                _reject(f"{_path(root, where)}: nested deeper than {limits.max_depth} levels")
            if len(value) > limits.max_keys:
                _reject(f"{_path(root, where)}: more than {limits.max_keys} keys")
            total += 2 + max(len(value) - 1, 0)
            children = []
            for key, child in value.items():
                if type(key) is not str and not isinstance(key, str):
                    _reject(f"{_path(root, where)}: object key of type {type(key).__name__}, "
                            "expected a string")
                at = (where, key)
                if len(key) > max_string:
                    _reject(f"{_path(root, at)}: key longer than {max_string}")
                total += _json_size(key, root, at, "key") + 1
                children.append((child, at, depth + 1))
                if total > max_bytes:
                    break
            stack.extend(reversed(children))
        elif isinstance(value, (list, tuple)):
            if depth + 1 > limits.max_depth:
                _reject(f"{_path(root, where)}: nested deeper than {limits.max_depth} levels")
            if len(value) > limits.max_items:
                _reject(f"{_path(root, where)}: more than {limits.max_items} items")
            total += 2 + max(len(value) - 1, 0)
            stack.extend((value[i], (where, i), depth + 1) for i in reversed(range(len(value))))
        else:
            _reject(f"{_path(root, where)}: {type(value).__name__} is not a JSON value")
        if total > max_bytes:
            _reject(f"{root}: larger than {max_bytes} bytes as JSON")


def _path(root: str, where: Any) -> str:
    """The path text of ``where`` (a chain of ``(parent, key or index)``) under ``root``."""
    steps: list[str] = []
    while where is not None:
        where, step = where
        steps.append(f"[{step}]" if type(step) is int else _key_suffix(step))
    return root + "".join(reversed(steps))


def _json_size(text: str, root: str, where: Any, what: str) -> int:
    """Bytes of ``text`` as a JSON string (UTF-8); ``InvalidArguments`` for a lone surrogate."""
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return len(text) + 2  # nothing to escape: the quotes are all JSON adds
    try:
        encoded = json.encoder.encode_basestring(text).encode("utf-8")
    except UnicodeEncodeError:
        _reject(f"{_path(root, where)}: {what} is not valid Unicode (lone surrogate)")
    return len(encoded)


def _key_suffix(key: str) -> str:
    if key.isidentifier():
        return f".{key}"
    shown = key if len(key) <= 40 else key[:37] + "..."
    return f"[{json.dumps(shown)}]"


def _reject(message: str) -> NoReturn:
    raise InvalidArguments(message)
