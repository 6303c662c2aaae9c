"""Warnings about a policy that loads but probably does not say what its author meant (pure).

Not problems: the policy works as written. ``toolguard policy check`` prints
them, and exits 0 for them alone.

A write whose arguments look computed (``set_balance(balance)``, not
``deposit(amount)``) carries a value the model decided from an earlier read;
if no tool of the policy reads those keys (``reads:``), nothing checks that the
read was still current when the write lands: two agents that read the same
balance overwrite each other. See docs/decisions.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from toolguard.policies.model import Policy, Problem, ToolPolicy

__all__ = ["computed_write_warnings"]

#: Argument names that say "a change", not "a new value": such a write decides in its body.
_DELTA = re.compile(r"(^|_)(amount|delta|by|increment|decrement|change|diff|step|add|"
                    r"count|quantity|qty|n)($|_)")


def computed_write_warnings(policy: Policy,
                            arguments: Mapping[str, Iterable[str]] | None = None) -> list[Problem]:
    """One warning per write whose value arguments look computed while nothing reads its keys.

    ``arguments`` maps tool names to their argument names (from the real tools,
    ``--tools``); without them, the names a tool's ``args:`` constrains are used.
    """
    read_kinds = {template.skeleton for tool in policy.tools.values() for template in tool.reads}
    warnings: list[Problem] = []
    for name, tool in policy.tools.items():
        if not tool.locks or tool.read_only or tool.requires_read or tool.decides_on:
            continue
        kinds = {template.skeleton for template in tool.locks}
        if kinds & read_kinds:
            continue
        computed = _value_arguments(tool, (arguments or {}).get(name))
        if not computed:
            continue
        keys = ", ".join(sorted(template.text for template in tool.locks))
        warnings.append(policy.problem(("tools", name), (
            f"its arguments read as values a model computed ({', '.join(computed)}) and no tool "
            f"reads {keys}: a decision resting on an earlier read cannot be checked when it writes; declare "
            f"reads: on the tool that reads it (and requires_read: true here), or make the "
            f"write a change decided in its body (see docs/decisions.md)")))
    return warnings


def _value_arguments(tool: ToolPolicy, names: Iterable[str] | None) -> list[str]:
    """The tool's arguments that are neither key fields nor changes."""
    keyed = {str(path).split(".")[0].split("[")[0] for template in tool.locks
             for path in template.fields}
    given: Any = names if names is not None else [str(path).split(".")[0] for path in tool.args]
    return sorted({n for n in given if n not in keyed and not _DELTA.search(n.lower())})
