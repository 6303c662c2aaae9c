"""The production controls of a tool's policy: ``approval:``, ``quotas:`` and ``mode:``.

Only their shape and the checks that need the whole policy live here; what they
decide for one call is in ``toolguard.controls.approvals``, ``toolguard.limits`` and
``toolguard.controls.shadow``, so the model stays free of behaviour.

.. code-block:: yaml

    defaults:
      mode: enforce                   # enforce | shadow (decide and audit, do not refuse)
      quotas:                         # added to every tool's own quotas
        - {name: agent-calls, calls: 600, window: 1m, per: agent}
    tools:
      transfer:
        locks: ["account:{from_id}", "account:{to_id}"]
        mode: shadow                  # this tool only
        approval:                     # or `approval: true` (always)
          when: {amount: {gt: 1000}}  # a list of mappings: any of them; a mapping: all of it
          expires: 1h                 # the request and its approval end here
          reason: large transfer      # shown to the person deciding
        quotas:
          - {calls: 10, window: 1m, per: agent}        # at most 10 calls in any minute
          - {in_flight: 2, per: key, lease: 2m}         # at most 2 running per account
          - {budget: 10000, arg: amount, window: 1d, per: [agent]}   # sum of amount per day

``window`` and ``lease`` take seconds or ``500ms``, ``30s``, ``5m``, ``2h``,
``1d``, ``1w``. ``per`` is one scope or a list: ``agent``, ``tool``, ``key``
(each lock key of the call is counted on its own), ``workflow`` (the thread,
else the run); the default is ``tool``. Quotas with the same ``name`` share one
counter across tools (their definitions must be equal); without a name each
tool counts on its own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PositiveInt,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

from toolguard.policies.paths import FieldPath

if TYPE_CHECKING:  # the model imports this module: ArgConstraint is resolved by resolve_forward_refs
    from toolguard.policies.model import ArgConstraint, Policy, Problem

__all__ = [
    "MODES",
    "QUOTA_SCOPES",
    "ApprovalRule",
    "ApprovalSetting",
    "Duration",
    "Mode",
    "QuotaKind",
    "QuotaList",
    "QuotaRule",
    "QuotaScope",
    "control_problems",
    "control_schema_problems",
    "parse_duration",
]

Mode = Literal["enforce", "shadow"]
MODES: tuple[Mode, ...] = ("enforce", "shadow")
QuotaScope = Literal["agent", "tool", "key", "workflow"]
QUOTA_SCOPES: tuple[QuotaScope, ...] = ("agent", "tool", "key", "workflow")
QuotaKind = Literal["rate", "in_flight", "budget"]

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)\s*$")
#: Longer windows would keep a budget's entries (one per call) for longer than anyone means.
MAX_DURATION_S = 366 * 86400.0
DEFAULT_LEASE_S = 60.0
DEFAULT_APPROVAL_EXPIRY_S = 3600.0


def parse_duration(value: Any) -> float:
    """Seconds from ``30``, ``2.5``, ``"500ms"``, ``"30s"``, ``"5m"``, ``"2h"``, ``"1d"``, ``"1w"``."""
    if isinstance(value, bool):
        msg = "a duration is a number of seconds or text like 30s, 5m, 1h, 1d"
        raise ValueError(msg)
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION.match(value)
        if not match:
            msg = f"{value!r} is not a duration: use seconds or e.g. 500ms, 30s, 5m, 1h, 1d, 1w"
            raise ValueError(msg)
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        msg = "a duration is a number of seconds or text like 30s, 5m, 1h, 1d"
        raise ValueError(msg)
    if not math.isfinite(seconds) or seconds <= 0:
        msg = "a duration must be greater than 0"
        raise ValueError(msg)
    if seconds > MAX_DURATION_S:
        msg = f"a duration of at most 366 days, got {seconds:g}s"
        raise ValueError(msg)
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]


def _text_seconds(seconds: float) -> str:
    """``60.0`` -> ``60s``: the window as it appears in a quota's counter name."""
    return f"{seconds:g}s"


class QuotaRule(BaseModel):
    """One quota: exactly one of ``calls`` (per ``window``), ``in_flight``, ``budget`` (of ``arg``).

    Windows slide: ``calls: 10, window: 1m`` admits at most 10 calls in *any*
    60 seconds, so there is no burst of 20 at a minute's boundary. An
    ``in_flight`` slot is a lease: released when the call ends, freed after
    ``lease`` if the process died.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,100}$")] | None = None
    calls: PositiveInt | None = None
    in_flight: PositiveInt | None = None
    budget: Annotated[StrictInt | StrictFloat, Field(gt=0)] | None = None
    arg: FieldPath | None = None
    window: Duration | None = None
    lease: Duration | None = None
    per: tuple[QuotaScope, ...] = ("tool",)

    @field_validator("per", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("per")
    @classmethod
    def _canonical(cls, value: tuple[QuotaScope, ...]) -> tuple[QuotaScope, ...]:
        if not value:
            msg = "per needs at least one scope (agent, tool, key, workflow)"
            raise ValueError(msg)
        if len(set(value)) != len(value):
            msg = "per names a scope twice"
            raise ValueError(msg)
        return tuple(scope for scope in QUOTA_SCOPES if scope in value)

    @model_validator(mode="after")
    def _one_kind(self) -> Self:
        given = [name for name in ("calls", "in_flight", "budget") if getattr(self, name) is not None]
        if len(given) != 1:
            msg = ("a quota is exactly one of calls: N (per window), in_flight: K or budget: X "
                   f"(of arg, per window); got {', '.join(given) or 'none'}")
            raise ValueError(msg)
        if self.in_flight is None and self.window is None:
            msg = f"{given[0]}: needs a window (e.g. window: 1m)"
            raise ValueError(msg)
        if self.in_flight is not None and self.window is not None:
            msg = "in_flight counts running calls: it takes a lease, not a window"
            raise ValueError(msg)
        if self.lease is not None and self.in_flight is None:
            msg = "lease applies to in_flight quotas only"
            raise ValueError(msg)
        if self.budget is not None and self.arg is None:
            msg = "budget: needs arg: the argument whose values are summed (e.g. arg: amount)"
            raise ValueError(msg)
        if self.arg is not None and self.budget is None:
            msg = "arg applies to budget quotas only"
            raise ValueError(msg)
        return self

    @property
    def kind(self) -> QuotaKind:
        if self.calls is not None:
            return "rate"
        return "in_flight" if self.in_flight is not None else "budget"

    @property
    def limit(self) -> float:
        """The most that may be counted at once: calls, running calls or the budget."""
        value = self.calls if self.calls is not None else (
            self.in_flight if self.in_flight is not None else self.budget)
        assert value is not None
        return float(value)

    @property
    def ttl_s(self) -> float:
        """How long one entry counts: the window, or an in-flight slot's lease."""
        if self.in_flight is not None:
            return self.lease if self.lease is not None else DEFAULT_LEASE_S
        assert self.window is not None
        return self.window

    def counter(self, tool: str) -> str:
        """The counter's name: ``name`` (shared across tools), else tool/kind/window/scope."""
        if self.name is not None:
            return self.name
        return f"{tool}/{self.kind}/{_text_seconds(self.ttl_s)}/{'+'.join(self.per)}"

    def definition(self) -> dict[str, Any]:
        """Everything but the name: two quotas sharing a name must agree on it."""
        return self.model_dump(mode="json", exclude={"name"}, exclude_defaults=True)


def _quota_list(value: Any) -> Any:
    if value is None:
        return ()
    return (value,) if isinstance(value, Mapping) else value


QuotaList = Annotated[tuple[QuotaRule, ...], BeforeValidator(_quota_list)]


class ApprovalRule(BaseModel):
    """Pause a call for a person before it takes its locks (``approval:`` on a tool).

    ``when`` is empty for "always"; else a list of conditions, any of which
    asks for approval; each is a mapping of argument path to constraint (as in
    ``args:``) that must all match. A value that is absent or null matches
    nothing. ``expires`` bounds both the wait for a decision and its use.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    when: tuple[dict[FieldPath, ArgConstraint], ...] = ()
    expires: Duration = DEFAULT_APPROVAL_EXPIRY_S
    reason: Annotated[str, Field(min_length=1, max_length=500)] | None = None

    @field_validator("when", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        if value is None:
            return ()
        return (value,) if isinstance(value, Mapping) else value

    @field_validator("when")
    @classmethod
    def _not_empty(cls, value: tuple[dict[FieldPath, Any], ...]) -> tuple[dict[FieldPath, Any], ...]:
        for condition in value:
            if not condition:
                msg = "an empty condition would match every call: leave when: out for 'always'"
                raise ValueError(msg)
        return value

    @property
    def always(self) -> bool:
        return not self.when


def _approval_input(value: Any) -> Any:
    """``approval: true`` is "always"; ``false`` or null is no approval."""
    if value is True:
        return {}
    if value is False:
        return None
    return value


ApprovalSetting = Annotated[ApprovalRule | None, BeforeValidator(_approval_input)]


def resolve_forward_refs() -> None:
    """Called by the model once ``ArgConstraint`` exists (the two modules import each other)."""
    from toolguard.policies.model import ArgConstraint as Constraint

    ApprovalRule.model_rebuild(_types_namespace={"ArgConstraint": Constraint})


# --- checks that need the whole policy ---------------------------------------------------


def control_problems(policy: Policy) -> list[Problem]:
    """Named quotas that disagree, and ``per: key`` quotas on a tool that has no keys."""
    problems: list[Problem] = []
    named: dict[str, tuple[dict[str, Any], tuple[str | int, ...]]] = {}
    defaults = policy.defaults.quotas
    seen_paths: set[tuple[str | int, ...]] = set()
    for name, tool in policy.tools.items():
        for index, quota in enumerate(tool.quotas):
            path: tuple[str | int, ...] = (("defaults", "quotas", index) if index < len(defaults)
                                           else ("tools", name, "quotas", index - len(defaults)))
            if "key" in quota.per and not tool.locks and path not in seen_paths:
                seen_paths.add(path)
                where = path if path[0] == "tools" else ("tools", name)
                problems.append(policy.problem(where, (
                    f"a per: key quota on {name!r}, which locks nothing: it would count no call; "
                    f"use per: tool or give the tool locks")))
            if quota.name is None:
                continue
            first = named.get(quota.name)
            if first is None:
                named[quota.name] = (quota.definition(), path)
            elif first[0] != quota.definition() and path not in seen_paths:
                seen_paths.add(path)
                earlier = policy.location(*first[1])
                problems.append(policy.problem(path, (
                    f"quota {quota.name!r} is defined differently at {earlier}: quotas that share a "
                    f"name share one counter, so they must be equal (or give this one another name)")))
    return problems


_NUMBERS = {"integer", "number"}
_KIND_TYPES = {"number": {"integer", "number"}, "string": {"string"}, "collection": {"array", "object"}}


def control_schema_problems(policy: Policy, tool_schemas: Mapping[str, Any]) -> list[Problem]:
    """Budget ``arg:`` and approval ``when:`` paths that are not (numeric) arguments of the tool."""
    from toolguard.policies.schemas import _Schema
    from toolguard.policies.strict import json_schema_of

    problems: list[Problem] = []
    defaults = policy.defaults.quotas
    for name, tool in policy.tools.items():
        if name not in tool_schemas or not (tool.quotas or tool.approval):
            continue
        try:
            schema = _Schema(json_schema_of(tool_schemas[name]))
        except Exception:  # reported by schema_problems
            continue
        base = ("tools", name)
        for index, quota in enumerate(tool.quotas):
            if quota.arg is None:
                continue
            path: tuple[str | int, ...] = (("defaults", "quotas", index, "arg") if index < len(defaults)
                                           else (*base, "quotas", index - len(defaults), "arg"))
            leaves, error = schema.walk(quota.arg)
            if error:
                problems.append(policy.problem(path, f"{error} (tool {name!r})"))
                continue
            found = schema.types(leaves) if leaves is not None else None
            if found and not (found - {"null"}) <= _NUMBERS:
                problems.append(policy.problem(path, (
                    f"budget argument {str(quota.arg)!r} is {'/'.join(sorted(found))}: "
                    f"a budget sums numbers")))
        if tool.approval is None:
            continue
        for number, condition in enumerate(tool.approval.when):
            for field, constraint in condition.items():
                path = (*base, "approval", "when", number, str(field))
                leaves, error = schema.walk(field)
                if error:
                    problems.append(policy.problem(path, error))
                    continue
                found = schema.types(leaves) if leaves is not None else None
                if not found:
                    continue
                for kind in sorted(constraint.kinds):
                    if not found & _KIND_TYPES[kind]:
                        problems.append(policy.problem(path, (
                            f"{kind} condition on an argument of type {'/'.join(sorted(found))}: "
                            f"it would never match")))
    return problems
