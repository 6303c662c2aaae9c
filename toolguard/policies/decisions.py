"""The guard's decisions as pure functions: no I/O, shared by the sync and async paths.

Each takes a ``ToolPolicy`` and *validated* arguments (a pydantic model or its
JSON form) and either returns what the guard needs or raises the typed
rejection whose ``reason`` the audit log records.
"""

from __future__ import annotations

import copy
import json
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic import BaseModel

from toolguard.call.intent import (
    IdempotencyKeyFn,
    Intent,
    bounded_key,
    default_idempotency_key,
    json_args,
)
from toolguard.errors import (
    GuardMisconfigured,
    InvalidArguments,
    MissingIdentity,
    NotAuthorized,
    UnknownTool,
)
from toolguard.policies.model import ANY_AGENT, ArgConstraint, Policy, ToolPolicy
from toolguard.policies.paths import MISSING, STAR, FieldPath
from toolguard.policies.templates import KeyTemplate, escape_text

__all__ = [
    "REDACTED",
    "authorize",
    "check_constraints",
    "decided_keys",
    "idempotency_key",
    "lock_keys",
    "lookup_tool",
    "ordering_keys",
    "read_keys",
    "redact",
    "redacted_args",
]

#: What a redacted value is replaced with in the audit log.
REDACTED = "[redacted]"
_SHOWN = 60

Args = BaseModel | Mapping[str, Any]


def lookup_tool(policy: Policy, name: str) -> ToolPolicy:
    """The tool's rules; an unknown name raises ``UnknownTool`` unless ``on_unknown_tool: allow``.

    An allowed unknown tool gets the defaults, no locks and ``fenced=False``:
    it runs unserialized, known only through its idempotency key and the audit.
    """
    tool = policy.tools.get(name)
    if tool is not None:
        return tool
    if policy.defaults.on_unknown_tool != "allow":
        msg = f"unknown tool {_shown(name)}: not in the policy, and unknown tools are denied"
        raise UnknownTool(msg)
    defaults = policy.defaults
    tool = ToolPolicy(agents=defaults.agents, fenced=False, ttl_ms=defaults.ttl_ms,
                      wait_timeout_s=defaults.wait_timeout_s, after_wait_s=defaults.after_wait_s,
                      idempotency_scope=defaults.idempotency_scope, limits=defaults.limits)
    tool._name = name
    return tool


def authorize(tool: ToolPolicy, agent: str | None) -> None:
    """Raise ``NotAuthorized`` unless ``agent`` may call ``tool``.

    ``"*"`` admits every identified agent; a named list admits only those
    names. A call without an agent identity is refused (``MissingIdentity``)
    whatever the list says: identity comes from the host, and is never guessed.
    """
    if agent is None:
        msg = (f"a call without an agent identity may not call {tool.name or 'this tool'}: "
               f"the host must say which agent is calling")
        raise MissingIdentity(msg)
    if ANY_AGENT in tool.agents or agent in tool.agents:
        return
    allowed = ", ".join(tool.agents) or "no agent"
    msg = f"agent {_shown(agent)} may not call {tool.name or 'this tool'} (allowed: {allowed})"
    raise NotAuthorized(msg)


def check_constraints(tool: ToolPolicy, args: Args) -> None:
    """Raise ``InvalidArguments`` naming the first argument that breaks a policy constraint."""
    data = json_args(args)
    for path, constraint in tool.args.items():
        for where, value in path.resolve(data):
            if value is MISSING or value is None:
                continue
            problem = _violation(constraint, value)
            if problem:
                raise InvalidArguments(f"{where}: {problem}")


_BOUNDS: tuple[tuple[str, Callable[[Any, Any], bool], str], ...] = (
    ("ge", operator.ge, ">="), ("gt", operator.gt, ">"), ("le", operator.le, "<="),
    ("lt", operator.lt, "<"))


def _violation(rule: ArgConstraint, value: Any) -> str | None:
    kinds = rule.kinds
    if "number" in kinds:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number"
        for name, holds, symbol in _BOUNDS:
            bound = getattr(rule, name)
            if bound is not None and not holds(value, bound):
                return f"must be {symbol} {bound}"
    if "string" in kinds:
        if not isinstance(value, str):
            return "must be a string"
        if rule.min_length is not None and len(value) < rule.min_length:
            return f"shorter than {rule.min_length} characters"
        if rule.max_length is not None and len(value) > rule.max_length:
            return f"longer than {rule.max_length} characters"
        if rule.regex is not None and not rule.regex.fullmatch(value):
            return f"does not match the pattern {rule.pattern!r}"
    if "collection" in kinds:
        if not isinstance(value, (list, tuple, Mapping)):
            return "must be a list"
        if rule.min_items is not None and len(value) < rule.min_items:
            return f"fewer than {rule.min_items} items"
        if rule.max_items is not None and len(value) > rule.max_items:
            return f"more than {rule.max_items} items"
    if rule.enum is not None and not any(_same(value, choice) for choice in rule.enum):
        shown = json.dumps(list(rule.enum))
        return f"must be one of {shown if len(shown) <= 200 else shown[:197] + '...'}"
    return None


def _same(value: Any, choice: Any) -> bool:
    """JSON equality: ``true`` is not ``1``, ``1`` equals ``1.0``."""
    if isinstance(value, bool) or isinstance(choice, bool):
        return type(value) is type(choice) and value == choice
    if isinstance(value, (int, float)) and isinstance(choice, (int, float)):
        return value == choice
    return type(value) is type(choice) and value == choice


def lock_keys(tool: ToolPolicy, args: Args) -> tuple[str, ...]:
    """Every lock key for this call, rendered from validated args: unique and sorted.

    Raise ``InvalidArguments`` when a tool that has lock templates ends up
    with no key at all (e.g. ``{ids[*]}`` over an empty list): running it
    unlocked would be a silent hole.
    """
    return _rendered(tool.locks, args, "lock")


def read_keys(tool: ToolPolicy, args: Args) -> tuple[str, ...]:
    """The keys a read (``reads:``) observes, rendered as ``lock_keys`` renders locks."""
    return _rendered(tool.reads, args, "read")


def decided_keys(tool: ToolPolicy, args: Args) -> tuple[str, ...]:
    """The keys a write's decision rests on (``decides_on:``), rendered as ``lock_keys``."""
    return _rendered(tool.decides_on, args, "decides_on")


def _rendered(templates: tuple[KeyTemplate, ...], args: Args, what: str) -> tuple[str, ...]:
    data = json_args(args)
    keys = {key for template in templates for key in template.render(data)}
    if templates and not keys:
        fields = ", ".join(str(path) for template in templates for path in template.fields)
        msg = f"args: no {what} key could be rendered (empty list in {fields})"
        raise InvalidArguments(msg)
    return tuple(sorted(keys))


def ordering_keys(tool: ToolPolicy, earlier: ToolPolicy, args: Args) -> tuple[str, ...]:
    """The keys of this call on which ``earlier``'s applied record must exist (``after:``).

    Those rendered from this tool's templates that lock the same kind of
    resource (same skeleton, e.g. ``lead:{}``) as one of ``earlier``'s.
    """
    kinds = {template.skeleton for template in earlier.locks}
    data = json_args(args)
    keys = {key for template in tool.locks if template.skeleton in kinds for key in template.render(data)}
    return tuple(sorted(keys))


def idempotency_key(intent: Intent, tool: ToolPolicy, args: Args, *,
                    key_fn: IdempotencyKeyFn | None = None) -> str | None:
    """The key that makes retries of this intent return the recorded result.

    The tool's ``idempotency_key`` template wins (prefixed with the tool name,
    so two tools never share a key by accident); else ``key_fn`` (the guard's
    or the policy's); else ``default_idempotency_key`` in the tool's
    ``idempotency_scope``. ``None`` means no stable identity: the guard decides
    whether to refuse (e.g. for unfenced tools) or run without replay
    protection. The key is bounded (``bounded_key``) so every store can index it.
    """
    if tool.idempotency_key is not None:
        (rendered,) = tool.idempotency_key.render(json_args(args), what="idempotency key")
        return bounded_key(f"{escape_text(tool.name or intent.tool)}:{rendered}")
    key = key_fn(intent) if key_fn is not None else \
        default_idempotency_key(intent, tool.idempotency_scope)
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        msg = f"the idempotency key function returned {type(key).__name__} {key!r:.40}, not a key"
        raise GuardMisconfigured(msg)
    return bounded_key(key)


def redact(args: Any, paths: Iterable[FieldPath | str], *, mask: Any = REDACTED) -> Any:
    """A copy of ``args`` with the value at each path replaced by ``mask``.

    Works on raw or validated args (a model is dumped to JSON first); paths
    that do not exist are ignored; ``[*]`` covers every element.
    """
    data = json_args(args) if isinstance(args, BaseModel) else copy.deepcopy(args)
    for path in paths:
        parsed = path if isinstance(path, FieldPath) else FieldPath.parse(path)
        _mask(data, parsed.parts, mask)
    return data


def redacted_args(tool: ToolPolicy, args: Any) -> Any:
    """``args`` as the audit log may store them: the tool's ``redact`` paths masked."""
    return redact(args, tool.redact)


def _mask(data: Any, parts: tuple[str, ...], mask: Any) -> None:
    head, rest = parts[0], parts[1:]
    if head == STAR:
        if isinstance(data, list):
            children: Iterable[Any] = range(len(data))
        elif isinstance(data, dict):
            children = list(data)
        else:
            return
    elif isinstance(data, dict) and head in data:
        children = [head]
    else:
        return
    for child in children:
        if rest:
            _mask(data[child], rest, mask)
        else:
            data[child] = mask


def _shown(text: str) -> str:
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "...")
