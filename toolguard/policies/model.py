"""The policy model: what each tool may do, checked once when the policy is built.

``Policy`` is a frozen pydantic model. Building it (from YAML, a dict or Python
objects) fills every tool's inherited settings from ``defaults`` and runs the
checks that need the whole policy (``after:`` names and cycles, unknown agents,
tools without locks). Problems raise ``PolicyProblems``, which lists them all
with file and line when the policy came from a file.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from toolguard.call.intent import DEFAULT_LIMITS, IdempotencyKeyFn, IdempotencyScope, Limits, canonical_json
from toolguard.errors import PolicyProblems
from toolguard.policies import controls
from toolguard.policies.controls import ApprovalSetting, Mode, QuotaList
from toolguard.policies.paths import FieldPath
from toolguard.policies.templates import KeyTemplate

__all__ = [
    "ANY_AGENT",
    "ArgConstraint",
    "Defaults",
    "Location",
    "Policy",
    "Problem",
    "StaleReadMode",
    "ToolPolicy",
    "UnknownToolMode",
]

#: In ``agents:``, stands for every agent. A call without an agent identity is never admitted.
ANY_AGENT = "*"

UnknownToolMode = Literal["deny", "allow"]
#: What a write whose decision rests on a stale or missing read gets (``stale_reads:``):
#: refused, or applied with the would-be refusal audited (to measure before enforcing).
StaleReadMode = Literal["refuse", "shadow"]
Number = StrictInt | StrictFloat
Scalar = StrictStr | StrictInt | StrictFloat | StrictBool | None

_NAME = re.compile(r"[^\s\x00-\x1f\x7f]{1,256}")


def _private(model: BaseModel, name: str) -> Any:
    """A private attribute's value, read from pydantic's own dict: ``model._x`` goes through
    ``BaseModel.__getattr__`` (microseconds), and the guard reads these on every call."""
    private = model.__pydantic_private__
    return private[name] if private is not None else getattr(model, name)


@dataclass(frozen=True, slots=True)
class Location:
    """Where a policy value was written; ``line`` is 1-based."""

    file: str | None
    line: int | None = None

    def __str__(self) -> str:
        if self.file and self.line:
            return f"{self.file}:{self.line}"
        return self.file or "<policy>"


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a policy, with the field path and, when known, file:line."""

    message: str
    file: str | None = None
    line: int | None = None

    def __str__(self) -> str:
        where = str(Location(self.file, self.line)) if self.file else ""
        return f"{where}: {self.message}" if where else self.message


Locations = Mapping[tuple[str | int, ...], Location]


def locate(locations: Locations | None, path: tuple[str | int, ...]) -> Location:
    """The location of ``path``, else of its nearest ancestor that has one."""
    if locations:
        for end in range(len(path), -1, -1):
            found = locations.get(path[:end])
            if found is not None:
                return found
    return Location(None)


def dotted(path: Iterable[str | int]) -> str:
    """``("tools", "x", "locks", 0)`` -> ``tools.x.locks[0]``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class ArgConstraint(BaseModel):
    """Checks on one validated argument, on top of the tool's own schema.

    A value that is absent or ``null`` is not checked (the schema decides what
    is required). ``pattern`` must match the whole string. ``choices`` is
    accepted as another name for ``enum``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    ge: Number | None = None
    gt: Number | None = None
    le: Number | None = None
    lt: Number | None = None
    min_length: NonNegativeInt | None = None
    max_length: NonNegativeInt | None = None
    pattern: str | None = None
    enum: tuple[Scalar, ...] | None = None
    min_items: NonNegativeInt | None = None
    max_items: NonNegativeInt | None = None

    _regex: re.Pattern[str] | None = PrivateAttr(default=None)
    _kinds: frozenset[str] | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _choices_is_enum(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "choices" in data:
            if "enum" in data:
                msg = "give either enum or choices, not both"
                raise ValueError(msg)
            data = {("enum" if key == "choices" else key): value for key, value in data.items()}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        low = [(name, value) for name, value in (("ge", self.ge), ("gt", self.gt)) if value is not None]
        high = [(name, value) for name, value in (("le", self.le), ("lt", self.lt)) if value is not None]
        if len(low) > 1 or len(high) > 1:
            msg = "give at most one lower bound (ge or gt) and one upper bound (le or lt)"
            raise ValueError(msg)
        if low and high:
            (lname, lvalue), (hname, hvalue) = low[0], high[0]
            empty = lvalue > hvalue or (lvalue == hvalue and (lname, hname) != ("ge", "le"))
            if empty:
                msg = f"{lname}={lvalue} and {hname}={hvalue} leave no allowed value"
                raise ValueError(msg)
        for kind in ("length", "items"):
            lower, upper = getattr(self, f"min_{kind}"), getattr(self, f"max_{kind}")
            if lower is not None and upper is not None and lower > upper:
                msg = f"min_{kind}={lower} is greater than max_{kind}={upper}"
                raise ValueError(msg)
        if self.enum is not None and not self.enum:
            msg = "enum needs at least one value"
            raise ValueError(msg)
        if self.pattern is not None:
            try:
                self._regex = re.compile(self.pattern)
            except re.error as error:
                msg = f"invalid regular expression {self.pattern!r}: {error}"
                raise ValueError(msg) from None
        if not self.model_fields_set:
            msg = "an empty constraint: give ge/gt/le/lt, min_length/max_length, pattern, enum or max_items"
            raise ValueError(msg)
        return self

    @property
    def regex(self) -> re.Pattern[str] | None:
        """``pattern`` compiled once."""
        regex: re.Pattern[str] | None = _private(self, "_regex")
        return regex

    @property
    def kinds(self) -> frozenset[str]:
        """Which kinds of value the constraint applies to: number, string, collection."""
        known: frozenset[str] | None = _private(self, "_kinds")
        if known is not None:
            return known
        kinds = set()
        if any(v is not None for v in (self.ge, self.gt, self.le, self.lt)):
            kinds.add("number")
        if any(v is not None for v in (self.min_length, self.max_length, self.pattern)):
            kinds.add("string")
        if self.min_items is not None or self.max_items is not None:
            kinds.add("collection")
        known = self._kinds = frozenset(kinds)  # once: the model is frozen
        return known


controls.resolve_forward_refs()  # ApprovalRule.when holds ArgConstraints


class ToolPolicy(BaseModel):
    """The rules for one tool. Inside a ``Policy`` every inherited field is filled in.

    ``fenced: false`` marks a side effect that cannot check fencing tokens (an
    external API): it relies on its idempotency key, and its lock only avoids
    wasted concurrent calls. ``read_only: true`` marks a tool that changes
    nothing: it needs no lock. ``idempotency_scope`` says how far a tool-call
    id is unique for the default idempotency key: ``thread`` (the thread and
    agent/node path) or ``task`` (one LangGraph task), see
    ``toolguard.call.intent.default_idempotency_key``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    locks: tuple[KeyTemplate, ...] = ()
    agents: tuple[str, ...] = (ANY_AGENT,)
    args: dict[FieldPath, ArgConstraint] = Field(default_factory=dict)
    after: tuple[str, ...] = ()
    after_wait_s: NonNegativeFloat = 5.0
    fenced: bool = True
    read_only: bool = False
    idempotency_key: KeyTemplate | None = None
    redact: tuple[FieldPath, ...] = ()
    ttl_ms: PositiveInt = 10_000
    wait_timeout_s: NonNegativeFloat = 5.0
    idempotency_scope: IdempotencyScope = "thread"
    limits: Limits = DEFAULT_LIMITS
    approval: ApprovalSetting = None
    quotas: QuotaList = ()
    mode: Mode = "enforce"
    reads: tuple[KeyTemplate, ...] = ()
    requires_read: StrictBool = False
    decides_on: tuple[KeyTemplate, ...] = ()
    stale_reads: StaleReadMode = "refuse"
    read_ttl_s: PositiveFloat = 600.0
    #: A read that takes its keys' lock and keeps it for its caller until it writes them.
    hold: StrictBool = False
    max_hold_s: PositiveFloat = 60.0

    _name: str = PrivateAttr(default="")

    @property
    def name(self) -> str:
        """The tool's name in its policy ("" for a rule built on its own)."""
        name: str = _private(self, "_name")
        return name

    @field_validator("idempotency_key")
    @classmethod
    def _key_names_fields(cls, value: KeyTemplate | None) -> KeyTemplate | None:
        if value is not None:
            if not value.fields:
                msg = (f"idempotency_key {value.text!r} names no argument: every call would "
                       f"share one key and only the first would ever run")
                raise ValueError(msg)
            if value.expands:
                msg = f"idempotency_key {value.text!r} cannot use [*]: it must render one key"
                raise ValueError(msg)
        return value

    @field_validator("agents", "after")
    @classmethod
    def _names(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for value in values:
            if not _NAME.fullmatch(value):
                msg = f"{value!r} is not a usable name (1 to 256 characters, no spaces)"
                raise ValueError(msg)
        return values

    @model_validator(mode="after")
    def _redacted_not_in_keys(self) -> Self:
        templates = [*self.locks, *self.reads, *self.decides_on,
                     *([self.idempotency_key] if self.idempotency_key else [])]
        for secret in self.redact:
            for template in templates:
                for path in template.fields:
                    if _overlaps(secret, path):
                        msg = (f"redacted field {str(secret)!r} is used in key template "
                               f"{template.text!r}: keys are written to the audit log in clear; "
                               f"key on a non-sensitive id instead")
                        raise ValueError(msg)
        return self


def _overlaps(a: FieldPath, b: FieldPath) -> bool:
    """True when one path is a prefix of the other (``contact`` covers ``contact.email``)."""
    n = min(len(a.parts), len(b.parts))
    return a.parts[:n] == b.parts[:n]


class Defaults(BaseModel):
    """Settings a tool inherits unless it sets its own."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ttl_ms: PositiveInt = 10_000
    wait_timeout_s: NonNegativeFloat = 5.0
    after_wait_s: NonNegativeFloat = 5.0
    on_unknown_tool: UnknownToolMode = "deny"
    agents: tuple[str, ...] = (ANY_AGENT,)
    fenced: bool = True
    idempotency_scope: IdempotencyScope = "thread"
    limits: Limits = DEFAULT_LIMITS
    mode: Mode = "enforce"
    quotas: QuotaList = ()
    stale_reads: StaleReadMode = "refuse"
    read_ttl_s: PositiveFloat = 600.0
    max_hold_s: PositiveFloat = 60.0


_INHERITED = ("ttl_ms", "wait_timeout_s", "after_wait_s", "agents", "fenced", "idempotency_scope",
              "mode", "stale_reads", "read_ttl_s", "max_hold_s")


class Policy(BaseModel):
    """A whole policy: defaults, the known agents, and one ``ToolPolicy`` per tool.

    Build it with ``load_policy`` (YAML), ``Policy.from_dict`` or
    ``Policy(tools={...})``; either way the cross-tool checks run and raise
    ``PolicyProblems``. ``check_against`` adds the checks that need the real
    tools' argument schemas.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    defaults: Defaults = Field(default_factory=Defaults)
    agents: tuple[str, ...] | None = None
    tools: dict[str, ToolPolicy] = Field(default_factory=dict)

    _locations: dict[tuple[str | int, ...], Location] = PrivateAttr(default_factory=dict)
    _key_fn: IdempotencyKeyFn | None = PrivateAttr(default=None)
    _digest: str | None = PrivateAttr(default=None)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str | None = None,
                  key_fn: IdempotencyKeyFn | None = None) -> Policy:
        """Build from plain data (e.g. parsed YAML/JSON); problems raise ``PolicyProblems``."""
        from toolguard.policies.loader import build_policy

        locations: dict[tuple[str | int, ...], Location] | None = (
            {(): Location(source)} if source else None)
        return build_policy(data, locations, key_fn=key_fn)

    @field_validator("tools", mode="before")
    @classmethod
    def _no_null_tools(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("tools")
    @classmethod
    def _inherit(cls, tools: dict[str, ToolPolicy], info: ValidationInfo) -> dict[str, ToolPolicy]:
        defaults = info.data.get("defaults")
        if not isinstance(defaults, Defaults):
            return tools  # defaults are broken: that error is reported, nothing to inherit
        resolved = {}
        for name, tool in tools.items():
            if not _NAME.fullmatch(name):
                msg = f"{name!r} is not a usable tool name (1 to 256 characters, no spaces)"
                raise ValueError(msg)
            update: dict[str, Any] = {field: getattr(defaults, field) for field in _INHERITED
                                      if field not in tool.model_fields_set}
            own = tool.limits.model_dump(exclude_unset=True) if "limits" in tool.model_fields_set else {}
            update["limits"] = defaults.limits.model_copy(update=own) if own else defaults.limits
            update["quotas"] = (*defaults.quotas, *tool.quotas)  # added to, never replaced
            copy = tool.model_copy(update=update)
            copy._name = name
            resolved[name] = copy
        return resolved

    @model_validator(mode="after")
    def _whole_policy(self, info: ValidationInfo) -> Self:
        context = info.context if isinstance(info.context, Mapping) else {}
        self._locations = dict(context.get("locations") or {})
        problems = policy_problems(self)
        if problems:
            # Not a ValueError on purpose: pydantic would flatten the list into one
            # error without lines; this exception passes through it unchanged.
            raise PolicyProblems(problems)
        return self

    # --- using the policy ---------------------------------------------------------

    @property
    def digest(self) -> str:
        """SHA-256 (hex) of the policy's canonical content: which policy decided.

        Two policies that mean the same (defaults written out or not, keys in
        another order, several files or one) have the same digest; comments and
        file names do not count, nor does a ``key_fn`` given in code. ``version``
        is the file format's version (1), not this.
        """
        digest: str | None = _private(self, "_digest")
        if digest is None:
            content = canonical_json(self.model_dump(mode="json", exclude_defaults=True))
            digest = self._digest = hashlib.sha256(content.encode("utf-8")).hexdigest()
        return digest

    @property
    def key_fn(self) -> IdempotencyKeyFn | None:
        """The custom default idempotency key function, if one was given."""
        key_fn: IdempotencyKeyFn | None = _private(self, "_key_fn")
        return key_fn

    def with_key_fn(self, key_fn: IdempotencyKeyFn | None) -> Policy:
        """A copy whose default idempotency key comes from ``key_fn``."""
        copy = self.model_copy()
        copy._key_fn = key_fn
        return copy

    def location(self, *path: str | int) -> Location:
        """Where ``path`` (e.g. ``"tools", "x", "locks", 0``) was written, as near as known."""
        return locate(self._locations, path)

    def problem(self, path: tuple[str | int, ...], message: str) -> Problem:
        """A ``Problem`` at ``path``, its message prefixed with the dotted field path."""
        where = self.location(*path)
        text = f"{dotted(path)}: {message}" if path else message
        return Problem(text, where.file, where.line)

    @property
    def tracks_reads(self) -> bool:
        """Whether any tool reads (``reads:``): then every write is checked against its caller's
        reads and counts as its read of what it wrote."""
        return any(tool.reads for tool in self.tools.values())

    def check_against(self, tool_schemas: Mapping[str, Any], *, missing_ok: bool = True) -> None:
        """Raise ``PolicyProblems`` if the policy does not fit the tools' argument schemas.

        ``tool_schemas`` maps tool names to pydantic models, JSON schemas,
        functions or LangChain tools. The guard calls this once at start-up.
        """
        from toolguard.policies.schemas import schema_problems

        problems = schema_problems(self, tool_schemas, missing_ok=missing_ok)
        problems += controls.control_schema_problems(self, tool_schemas)
        if problems:
            raise PolicyProblems(problems)


def policy_problems(policy: Policy) -> list[Problem]:
    """Checks that need the whole policy; each problem points at the offending value."""
    problems: list[Problem] = []
    known_agents = set(policy.agents) if policy.agents is not None else None
    if known_agents is not None:
        for index, agent in enumerate(policy.defaults.agents):
            if agent != ANY_AGENT and agent not in known_agents:
                problems.append(policy.problem(("defaults", "agents", index),
                                               f"unknown agent {agent!r} (not in agents:)"))
    for name, tool in policy.tools.items():
        base = ("tools", name)
        problems.extend(_read_problems(policy, name, tool))
        if not tool.locks and not tool.read_only and not tool.reads:
            why = ("a fenced tool needs a lock key for its fencing token" if tool.fenced else
                   "an unfenced tool relies on its lock to keep concurrent duplicates out")
            problems.append(policy.problem(
                base, f"no locks: {why}; add locks: [...] or mark it read_only: true"))
        if known_agents is not None and tool.agents != policy.defaults.agents:  # else reported once
            for index, agent in enumerate(tool.agents):
                if agent != ANY_AGENT and agent not in known_agents:
                    problems.append(policy.problem((*base, "agents", index),
                                                   f"unknown agent {agent!r} (not in agents:)"))
        for index, earlier in enumerate(tool.after):
            path = (*base, "after", index)
            if earlier == name:
                problems.append(policy.problem(path, f"{name!r} cannot run after itself"))
            elif earlier not in policy.tools:
                problems.append(policy.problem(path, f"unknown tool {earlier!r}"))
            elif policy.tools[earlier].reads or policy.tools[earlier].read_only:
                problems.append(policy.problem(path, (
                    f"{earlier!r} only reads, so 'after' can never be checked (it records no "
                    f"applied write); to require a current read before {name!r} writes, give "
                    f"{earlier!r} reads: [...] and {name!r} requires_read: true "
                    f"(docs/decisions.md)")))
            elif not shared_resources(tool, policy.tools[earlier]):
                problems.append(policy.problem(path, (
                    f"{name!r} and {earlier!r} lock no resource of the same kind, so 'after' "
                    f"can never be checked on the same resource (compare their locks:)")))
    problems.extend(_cycles(policy))
    problems.extend(controls.control_problems(policy))
    return problems


def _read_problems(policy: Policy, name: str, tool: ToolPolicy) -> list[Problem]:
    """``reads:`` / ``requires_read:`` / ``decides_on:`` that could never be checked."""
    base = ("tools", name)
    problems = []
    if tool.reads and tool.locks:
        problems.append(policy.problem((*base, "reads"), (
            "a tool either reads (reads:) or writes (locks:): a write whose decision rests on "
            "other keys names them in decides_on:")))
    if tool.hold and not tool.reads:
        problems.append(policy.problem((*base, "hold"), (
            "hold: true keeps the lock of the keys a tool reads; this tool reads nothing (add "
            "reads: [...], or remove hold)")))
    if not tool.locks:
        for field, given in (("requires_read", tool.requires_read),
                             ("decides_on", bool(tool.decides_on))):
            if given:
                problems.append(policy.problem((*base, field), (
                    f"{field} checks a write's reads when it takes its locks; this tool locks "
                    f"nothing (add locks: [...], or remove {field})")))
    return problems


def shared_resources(a: ToolPolicy, b: ToolPolicy) -> frozenset[str]:
    """Template skeletons (``lead:{}``) that both tools lock: where ordering can apply."""
    return frozenset(t.skeleton for t in a.locks) & frozenset(t.skeleton for t in b.locks)


def _cycles(policy: Policy) -> list[Problem]:
    """One problem per ``after:`` cycle, at the edge that closes it."""
    problems = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    reported: set[frozenset[str]] = set()

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        trail.append(name)
        tool = policy.tools[name]
        for index, earlier in enumerate(tool.after):
            if earlier not in policy.tools or earlier == name:
                continue  # reported elsewhere
            if state.get(earlier) == 1:
                loop = [*trail[trail.index(earlier):], earlier]
                if frozenset(loop) not in reported:
                    reported.add(frozenset(loop))
                    chain = " -> ".join(loop)
                    problems.append(policy.problem(
                        ("tools", name, "after", index),
                        f"ordering cycle: {chain} (each runs after the next; none could start)"))
            elif earlier not in state:
                visit(earlier, trail)
        trail.pop()
        state[name] = 2

    for name in policy.tools:
        if name not in state:
            visit(name, [])
    return problems
