"""``toolguard mcp check``: a policy against an upstream's live tool list (pure, no I/O).

Reports what would go wrong in front of that server before any call does:
tools the upstream lists that the policy misses (refused ``unknown_tool``, or
let through unguarded when the policy allows unknown tools), tools the policy
names that the upstream lacks, templates, constraints and redactions that name
arguments the upstream's schema lacks (file:line), and input schemas the
gateway would refuse at start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from toolguard.gateway.schemas import UnjudgeableSchema, tool_model
from toolguard.gateway.server import UpstreamTool
from toolguard.policies import Policy
from toolguard.policies.schemas import schema_problems

__all__ = ["UpstreamReport", "check_upstream"]


@dataclass(frozen=True)
class UpstreamReport:
    """What ``check_upstream`` found; ``ok`` when nothing would fail."""

    missed: tuple[str, ...] = ()          # listed upstream, not in the policy
    absent: tuple[str, ...] = ()          # in the policy, not listed upstream
    problems: tuple[str, ...] = ()        # file:line problems of the policy against the schemas
    unjudgeable: tuple[str, ...] = ()     # schemas the gateway refuses at start-up
    allow_unknown: bool = field(default=False)

    @property
    def ok(self) -> bool:
        return not (self.missed or self.absent or self.problems or self.unjudgeable)


def check_upstream(policy: Policy, tools: Sequence[UpstreamTool]) -> UpstreamReport:
    """Check ``policy`` against the upstream's ``tools`` (see the module docstring)."""
    listed = {tool.name: tool for tool in tools}
    allow_unknown = policy.defaults.on_unknown_tool == "allow"
    missed = tuple(sorted(name for name in listed if name not in policy.tools))
    absent = tuple(sorted(name for name in policy.tools if name not in listed))
    unjudgeable: list[str] = []
    for tool in tools:
        if tool.name not in policy.tools and not allow_unknown:
            continue  # refused whatever its schema: the gateway never builds its model
        try:
            tool_model(tool.name, tool.input_schema)
        except UnjudgeableSchema as error:
            unjudgeable.append(str(error))
    schemas = {name: tool.input_schema for name, tool in listed.items()}
    problems = tuple(str(problem) for problem in schema_problems(policy, schemas, missing_ok=True))
    return UpstreamReport(missed=missed, absent=absent, problems=problems,
                          unjudgeable=tuple(unjudgeable), allow_unknown=allow_unknown)
