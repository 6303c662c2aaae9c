"""Load policies from YAML files with file:line for every problem.

PyYAML's node tree (``compose``) keeps the line of every mapping key; the
loader builds plain data and a map from field path to line side by side, and
translates pydantic's error locations through that map.
"""

from __future__ import annotations

import copy
import difflib
import os
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from toolguard.call.intent import IdempotencyKeyFn
from toolguard.errors import PolicyProblems
from toolguard.policies.model import (
    ArgConstraint,
    Location,
    Policy,
    Problem,
    ToolPolicy,
    dotted,
    locate,
)

__all__ = ["build_policy", "load_policy", "policy_files", "read_policy_data"]

PathLike = str | os.PathLike[str]
Locations = dict[tuple[str | int, ...], Location]
_SUFFIXES = (".yml", ".yaml")
_MAX_ERRORS_PER_FIELD = 3
_TOOL_FIELDS = [name for name in ToolPolicy.model_fields if not name.startswith("_")]
_PLAIN_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")
#: Spellings from JSON Schema, pydantic v1 and habit, mapped to the constraint they mean.
_CONSTRAINT_ALIASES = {
    "gte": "ge", "lte": "le", "min": "ge", "max": "le", "minimum": "ge", "maximum": "le",
    "exclusiveMinimum": "gt", "exclusiveMaximum": "lt", "minLength": "min_length",
    "maxLength": "max_length", "minItems": "min_items", "maxItems": "max_items", "regex": "pattern",
    "min_len": "min_length", "max_len": "max_length", "one_of": "enum", "in": "enum",
}


def load_policy(paths: PathLike | Iterable[PathLike], *,
                key_fn: IdempotencyKeyFn | None = None) -> Policy:
    """Load one YAML file, a folder of ``*.yml``/``*.yaml`` files, or several of either.

    Files are merged into one policy: ``tools`` and ``agents`` are combined; a
    tool (or ``defaults``) defined in two places is an error naming both.
    Raise ``PolicyProblems`` (a ``PolicyError``) with file:line for each problem.
    """
    data, locations, problems, complete = _read(paths)
    if problems and not complete:  # a file could not be read at all: checking the rest would
        raise PolicyProblems(problems)  # report tools it defines as unknown
    try:
        policy = build_policy(data, locations, key_fn=key_fn)
    except PolicyProblems as error:
        raise PolicyProblems(_in_file_order([*problems, *_new(error.problems, problems)])) from None
    if problems:
        raise PolicyProblems(_in_file_order(problems))
    return policy


def policy_files(paths: PathLike | Iterable[PathLike]) -> list[Path]:
    """The files ``paths`` names: files as given, folders as their sorted YAML files (not recursive)."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in _SUFFIXES and p.is_file())
            if not found:
                raise PolicyProblems([Problem("no *.yml or *.yaml policy files in this folder",
                                              str(path))])
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise PolicyProblems([Problem("no such policy file or folder", str(path))])
    if not files:
        raise PolicyProblems([Problem("no policy files given")])
    return files


def read_policy_data(paths: PathLike | Iterable[PathLike]) -> tuple[dict[str, Any], Locations]:
    """Parse and merge the files into plain data plus the location of every field."""
    merged, locations, problems, _complete = _read(paths)
    if problems:
        raise PolicyProblems(problems)
    return merged, locations


def _read(paths: PathLike | Iterable[PathLike]) -> tuple[dict[str, Any], Locations, list[Problem], bool]:
    """(merged data, locations, problems, whether every file was parsed).

    A duplicate key or tool is a problem, but the first definition is kept so
    the rest of the policy is still checked; invalid YAML leaves a file out.
    """
    merged: dict[str, Any] = {}
    locations: Locations = {}
    problems: list[Problem] = []
    complete = True
    for file in policy_files(paths):
        try:
            data, where, found = _parse(file.read_text(encoding="utf-8"), str(file))
        except PolicyProblems as error:
            problems.extend(error.problems)  # type: ignore[arg-type]
            complete = False
            continue
        except (OSError, UnicodeDecodeError) as error:
            problems.append(Problem(f"cannot read the file: {error}", str(file)))
            complete = False
            continue
        problems.extend(found)
        problems.extend(_merge(merged, locations, data, where, str(file)))
    return merged, locations, problems, complete


def build_policy(data: Mapping[str, Any], locations: Locations | None = None, *,
                 key_fn: IdempotencyKeyFn | None = None) -> Policy:
    """Validate plain data into a ``Policy``; every problem becomes a located ``Problem``."""
    try:
        policy = Policy.model_validate(data, context={"locations": locations or {}})
    except ValidationError as error:
        problems = validation_problems(error, locations)
        found = [*problems, *_despite(data, locations, error, problems)]
        raise PolicyProblems(_in_file_order(found)) from None
    return policy.with_key_fn(key_fn) if key_fn is not None else policy


def _despite(data: Mapping[str, Any], locations: Locations | None, error: ValidationError,
             reported: list[Problem]) -> list[Problem]:
    """The whole-policy problems (``after:``, agents, missing locks) the field errors hid.

    pydantic stops before the cross-tool checks when a field is invalid, so a
    file would be fixed one problem at a time. Here the invalid fields are left
    out and the rest is checked again; problems that leaving a field out could
    have caused (a tool whose ``locks:`` was dropped has none) are not reported.
    """
    repaired = copy.deepcopy(dict(data))
    dropped: dict[str, set[str]] = {}
    found: list[Problem] = []
    for _ in range(3):
        if not _drop_invalid(repaired, error, dropped):
            return found
        try:
            Policy.model_validate(repaired, context={"locations": locations or {}})
        except ValidationError as again:
            found.extend(_new(validation_problems(again, locations), [*reported, *found]))
            error = again
            continue
        except PolicyProblems as whole:
            kept = [p for p in whole.problems if isinstance(p, Problem) and not _caused(p, dropped)]
            return [*found, *_new(kept, [*reported, *found])]
        return found
    return found


def _drop_invalid(data: dict[str, Any], error: ValidationError, dropped: dict[str, set[str]]) -> bool:
    """Remove each field pydantic refused; False if one cannot be removed (checking stops)."""
    for item in error.errors(include_url=False, include_input=False):
        loc = tuple(part for part in item["loc"] if part != "[key]")
        if item["type"] == "missing" or not loc:
            return False
        if loc[0] == "tools" and len(loc) >= 2 and isinstance(data.get("tools"), dict):
            tools = data["tools"]
            name = str(loc[1])
            if len(loc) == 2 or not isinstance(tools.get(name), dict):
                tools[name] = {"read_only": True}  # stands in for the broken tool: it exists
                dropped.setdefault(name, set()).add("*")
            else:
                field = str(loc[2])
                tools[name].pop(field, None)
                # A misspelt field stands for the one it resembles: 'lock' dropped is 'locks' missing.
                meant = [] if field in _TOOL_FIELDS else difflib.get_close_matches(field, _TOOL_FIELDS, n=1)
                dropped.setdefault(name, set()).update({field, *meant})
        elif loc[0] == "tools":
            return False  # the tools mapping itself (e.g. a bad tool name): nothing to check
        elif len(loc) >= 2 and isinstance(data.get(str(loc[0])), dict):
            data[str(loc[0])].pop(str(loc[1]), None)
            dropped.setdefault("", set()).add(f"{loc[0]}.{loc[1]}")
        else:
            data.pop(str(loc[0]), None)
            dropped.setdefault("", set()).add(str(loc[0]))
    return True


def _caused(problem: Problem, dropped: Mapping[str, set[str]]) -> bool:
    """Whether leaving out the dropped fields could have produced ``problem``."""
    text = problem.message
    if dropped.get(""):
        return True  # broken defaults change every tool: report only what is certain
    for name, fields in dropped.items():
        lockish = bool(fields & {"*", "locks", "read_only"})
        if lockish and text.startswith(f"tools.{name}: no locks"):
            return True
        if lockish and "lock no resource of the same kind" in text and (
                text.startswith(f"tools.{name}.") or f"and {name!r} lock" in text):
            return True
    return False


def _in_file_order(problems: list[Problem]) -> list[Problem]:
    """Every problem once, by file and line (problems without a line first in their file)."""
    return sorted(_new(problems, []), key=lambda p: (p.file or "", p.line or 0))


def _new(problems: Iterable[Any], seen: list[Problem]) -> list[Problem]:
    known = {str(p) for p in seen}
    out: list[Problem] = []
    for problem in problems:
        item = problem if isinstance(problem, Problem) else Problem(str(problem))
        if str(item) not in known:
            known.add(str(item))
            out.append(item)
    return out


def validation_problems(error: ValidationError, locations: Mapping[tuple[str | int, ...], Location] | None
                        ) -> list[Problem]:
    """pydantic's errors as located, readable problems (never echoing input values)."""
    problems: list[Problem] = []
    per_field: dict[tuple[str | int, ...], int] = {}
    for item in error.errors(include_url=False, include_input=False):
        loc = tuple(part for part in item["loc"] if part != "[key]")
        per_field[loc[:3]] = per_field.get(loc[:3], 0) + 1
        if per_field[loc[:3]] > _MAX_ERRORS_PER_FIELD:
            continue
        where = locate(locations, loc)
        message = _message(item["type"], loc, item["msg"])
        # An unknown field is a problem of the mapping it sits in: "tools.x: unknown field 'lock'".
        path = loc[:-1] if item["type"] == "extra_forbidden" else loc
        problems.append(Problem(f"{dotted(path)}: {message}" if path else message, where.file, where.line))
    return problems


# --- YAML with lines -------------------------------------------------------------------


def _parse(text: str, file: str) -> tuple[Any, Locations, list[Problem]]:
    """YAML text -> (data, {path: Location}, problems).

    Bad YAML raises; a duplicate key or a non-string key is a problem returned
    beside the data (which keeps the first definition), so the rest is checked.
    """
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        what = " ".join(part for part in (error.context, error.problem) if part)
        raise PolicyProblems([Problem(f"invalid YAML: {what}", file,
                                      mark.line + 1 if mark else None)]) from None
    except yaml.YAMLError as error:
        raise PolicyProblems([Problem(f"invalid YAML: {error}", file)]) from None
    finally:
        loader.dispose()
    if root is None:
        raise PolicyProblems([Problem("the file is empty; a policy starts with 'version: 1'", file, 1)])
    builder = _Builder(loader, file)
    try:
        data = builder.build(root, ())
    except yaml.MarkedYAMLError as error:  # e.g. an unknown !tag
        mark = error.problem_mark
        raise PolicyProblems([Problem(f"invalid YAML: {error.problem}", file,
                                      mark.line + 1 if mark else None)]) from None
    if not isinstance(data, dict):
        raise PolicyProblems([*builder.problems,
                              Problem("a policy file is a mapping with version:, tools: ...", file,
                                      root.start_mark.line + 1)])
    return data, builder.locations, builder.problems


class _Builder:
    """Turns composed YAML nodes into data, recording the line of every key and item."""

    def __init__(self, loader: yaml.SafeLoader, file: str) -> None:
        self.loader = loader
        self.file = file
        self.locations: Locations = {(): Location(file, 1)}
        self.problems: list[Problem] = []
        self.done: dict[int, Any] = {}  # node id -> value: aliases are built once, not expanded

    def build(self, node: yaml.Node, path: tuple[str | int, ...]) -> Any:
        if id(node) in self.done:
            return self.done[id(node)]
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and node.tag not in _PLAIN_TAGS:
            where = dotted(path) or "top level"
            self.problems.append(Problem(f"{where}: invalid YAML: unsupported tag {node.tag!r}",
                                         self.file, node.start_mark.line + 1))
            return None
        if isinstance(node, yaml.MappingNode):
            self.loader.flatten_mapping(node)  # resolves "<<" merge keys
            value: Any = {}
            self.done[id(node)] = value
            for key_node, value_node in node.value:
                line = key_node.start_mark.line + 1
                key = self.loader.construct_object(key_node, deep=True)
                if not isinstance(key, str):
                    self.problems.append(Problem(
                        f"{dotted(path) or 'top level'}: key {key!r} is not a string; quote it "
                        f"(YAML reads yes/no/on/off as booleans)", self.file, line))
                    continue
                if key in value:
                    first = self.locations[(*path, key)].line
                    self.problems.append(Problem(
                        f"{dotted((*path, key))}: defined twice (first at line {first})", self.file, line))
                    continue
                self.locations[(*path, key)] = Location(self.file, line)
                value[key] = self.build(value_node, (*path, key))
            return value
        if isinstance(node, yaml.SequenceNode):
            items: list[Any] = []
            self.done[id(node)] = items
            for index, item in enumerate(node.value):
                self.locations[(*path, index)] = Location(self.file, item.start_mark.line + 1)
                items.append(self.build(item, (*path, index)))
            return items
        return self.loader.construct_object(node, deep=True)


def _merge(merged: dict[str, Any], locations: Locations, data: dict[str, Any], where: Locations,
           file: str) -> list[Problem]:
    """Fold one file into the merged data; return what conflicts."""
    problems: list[Problem] = []

    def at(path: tuple[str | int, ...]) -> Location:
        return locate(where, path)

    if "version" not in data:
        problems.append(Problem("missing 'version: 1' (every policy file states its version)", file, 1))
    elif data["version"] != 1:
        problems.append(Problem(f"version: unsupported policy version {data['version']!r}; "
                                f"this toolguard reads version 1", file, at(("version",)).line))
    else:
        merged["version"] = 1
        locations.setdefault(("version",), at(("version",)))
    for key, value in data.items():
        if key == "version":
            continue
        if key == "tools" and isinstance(value, Mapping) and isinstance(merged.get("tools", {}), dict):
            tools = merged.setdefault("tools", {})
            locations.setdefault(("tools",), at(("tools",)))
            for name, rule in value.items():
                if name in tools:
                    first = locations[("tools", name)]
                    problems.append(Problem(f"tools.{name}: defined twice (first at {first})",
                                            file, at(("tools", name)).line))
                    continue
                tools[name] = rule
                _copy_locations(where, locations, ("tools", name))
        elif key == "agents" and isinstance(value, list) and isinstance(merged.get("agents", []), list):
            known = merged.setdefault("agents", [])
            locations.setdefault(("agents",), at(("agents",)))
            for index, agent in enumerate(value):
                locations[("agents", len(known))] = at(("agents", index))
                known.append(agent)
        elif key in merged:
            first = locations[(key,)]
            problems.append(Problem(f"{key}: defined twice (first at {first})", file, at((key,)).line))
        else:
            merged[key] = value
            _copy_locations(where, locations, (key,))
    return problems


def _copy_locations(source: Locations, target: Locations, prefix: tuple[str | int, ...]) -> None:
    n = len(prefix)
    for path, location in source.items():
        if path[:n] == prefix:
            target[path] = location


# --- readable pydantic errors ------------------------------------------------------


def _message(kind: str, loc: tuple[str | int, ...], text: str) -> str:
    if kind == "extra_forbidden":
        name = str(loc[-1])
        allowed = _fields_at(loc[:-1])
        if allowed is None:
            return f"unknown field {name!r}"
        allowed_text = ", ".join(sorted(allowed))
        is_constraint = _model_at(loc[:-1]) is ArgConstraint
        close = ([_CONSTRAINT_ALIASES[name]] if is_constraint and name in _CONSTRAINT_ALIASES
                 else difflib.get_close_matches(name, allowed, n=1))
        hint = f" — did you mean {close[0]!r}?" if close else ""
        noun = "constraint" if is_constraint else "field"
        return f"unknown {noun} {name!r}{hint} (known: {allowed_text})"
    if kind == "missing":
        return "required field missing"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return "expected a mapping (key: value pairs)"
    for prefix in ("Value error, ", "Assertion failed, "):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def _fields_at(loc: tuple[str | int, ...]) -> list[str] | None:
    model = _model_at(loc)
    if model is None:
        return None
    names = [name for name in model.model_fields if not name.startswith("_")]
    return [*names, "choices"] if model is ArgConstraint else names


def _model_at(loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model whose fields live at ``loc`` (walks annotations: dict values, tuples, Optional)."""
    current: Any = Policy
    parts = list(loc)
    while parts:
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(parts.pop(0)))
            if field is None:
                return None
            current = field.annotation
            continue
        origin, args = typing.get_origin(current), typing.get_args(current)
        if origin is dict and len(args) == 2:
            parts.pop(0)
            current = args[1]
        elif origin is tuple and args:
            parts.pop(0)
            current = args[0]
        elif args:  # Optional / Union: the model branch
            models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
            if not models:
                return None
            current = models[0]
        else:
            return None
    if isinstance(current, type) and issubclass(current, BaseModel):
        return current
    args = typing.get_args(current)
    models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if models else None
