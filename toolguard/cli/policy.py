"""``toolguard policy check``: validate policy files and print every problem as file:line.

Exit codes: 0 clean, 1 problems found, 2 bad usage (missing file, bad
``--tools``). Output is for people (rich), never a traceback.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

from toolguard.errors import PolicyProblems
from toolguard.policies.advice import computed_write_warnings
from toolguard.policies.loader import load_policy, policy_files
from toolguard.policies.model import Policy, Problem
from toolguard.policies.schemas import schema_problems

__all__ = ["load_tool_schemas", "policy_app"]

policy_app = typer.Typer(name="policy", help="Check toolguard policy files.",
                         no_args_is_help=True, pretty_exceptions_enable=False)


@policy_app.callback()
def _group() -> None:
    """Check toolguard policy files."""


@policy_app.command("check")
def check(
    files: Annotated[list[Path], typer.Argument(
        help="Policy files or folders of *.yml/*.yaml files (merged into one policy).",
        exists=True, readable=True, show_default=False, metavar="FILE...")],
    tools: Annotated[list[str] | None, typer.Option(
        "--tools", metavar="MODULE:ATTR",
        help="Where the real tools are (a dict name -> model/schema/function, or a list of "
             "tools/functions); checks that templates and constraints name real arguments. "
             "Repeatable. Without it only the policy itself is checked, and the output says so.")
    ] = None,
    each: Annotated[bool, typer.Option(
        "--each", help="Check every file (a folder: each of its files) as a policy of its own "
                       "instead of merging them.")] = False,
) -> None:
    """Validate policy files; report every problem with file:line."""
    console = Console(highlight=False, soft_wrap=True)
    schemas: dict[str, Any] | None = None
    if tools:
        try:
            schemas = {}
            for spec in tools:
                schemas.update(load_tool_schemas(spec))
        except Exception as error:  # importing user code can raise anything: a usage error, no traceback
            raise typer.BadParameter(f"{type(error).__name__}: {error}", param_hint="--tools") from None
    problems: list[Problem] = []
    groups: list[list[Path]] = []
    if each:
        for path in files:  # a folder given with --each is its files, each a policy of its own
            try:
                groups.extend([file] for file in policy_files(path))
            except PolicyProblems as error:
                problems.extend(p if isinstance(p, Problem) else Problem(str(p)) for p in error.problems)
    else:
        groups = [list(files)]
    checked: list[tuple[str, Policy]] = []
    for group in groups:
        label = ", ".join(str(path) for path in group)
        try:
            policy = load_policy(group)
        except PolicyProblems as error:
            problems.extend(p if isinstance(p, Problem) else Problem(str(p)) for p in error.problems)
            continue
        mismatches = schema_problems(policy, schemas, missing_ok=False) if schemas is not None else []
        problems.extend(mismatches)
        if not mismatches:
            checked.append((label, policy))
    for problem in problems:
        line = Text()
        if problem.file:
            line.append(f"{problem.file}:{problem.line}" if problem.line else problem.file, style="bold")
            line.append(": ")
        line.append("error: ", style="bold red")
        line.append(problem.message)
        console.print(line)
    for label, policy in checked:
        if problems and not each:
            break  # one merged policy: its problems are the answer
        tools_count = len(policy.tools)
        console.print(Text.assemble(("ok ", "bold green"), label,
                                    f": {tools_count} tool{'s' if tools_count != 1 else ''}"))
        for warning in computed_write_warnings(policy, _argument_names(schemas)):
            where = f"{warning.file}:{warning.line}: " if warning.file and warning.line else ""
            console.print(Text.assemble(where, ("warning: ", "bold yellow"), warning.message))
    if problems:
        count = len(problems)
        console.print(Text(f"{count} problem{'s' if count != 1 else ''} found", style="red"))
        raise typer.Exit(1)
    if schemas is None and any(_has_templates(policy) for _, policy in checked):
        console.print(Text(
            "note: the tools were not given, so lock and idempotency templates, args: and redact: "
            "were not checked against the tools' arguments (a template naming no argument fails "
            "every call). Check them with --tools MODULE:ATTR; ToolGuard checks them when it "
            "registers each tool.", style="yellow"))


def _argument_names(schemas: Mapping[str, Any] | None) -> dict[str, list[str]] | None:
    """Each given tool's argument names (``--tools``), for the warnings; None without them."""
    if schemas is None:
        return None
    from toolguard.policies.strict import strict_model

    names: dict[str, list[str]] = {}
    for tool, source in schemas.items():
        try:
            names[tool] = list(strict_model(source, name=tool).model_fields)
        except Exception:  # a schema problem is reported as one already
            continue
    return names


def _has_templates(policy: Policy) -> bool:
    return any(tool.locks or tool.idempotency_key or tool.args or tool.redact
               for tool in policy.tools.values())


def load_tool_schemas(spec: str) -> dict[str, Any]:
    """Import ``module:attr`` and return ``{tool name: schema source}``.

    ``attr`` may be a mapping (name -> pydantic model, JSON schema or
    function), or a list of LangChain-like tools (``.name``) and functions.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        msg = f"expected MODULE:ATTR, got {spec!r}"
        raise ValueError(msg)
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # like `python -m`: modules in the current folder
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    if isinstance(target, Mapping):
        return {str(name): value for name, value in target.items()}
    if isinstance(target, Iterable) and not isinstance(target, (str, bytes)):
        out: dict[str, Any] = {}
        for item in target:
            name = getattr(item, "name", None) or getattr(item, "__name__", None)
            if not isinstance(name, str):
                msg = f"{spec}: cannot tell the name of {item!r}"
                raise TypeError(msg)
            out[name] = item
        return out
    msg = f"{spec} is neither a mapping of tool names nor a list of tools"
    raise TypeError(msg)
