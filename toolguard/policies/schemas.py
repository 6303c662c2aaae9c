"""Checks that need the real tools' argument schemas (``Policy.check_against``).

A template field that is not an argument would fail on every call; a list used
as a key without ``[*]``, a numeric bound on a string, or an id that is an
integer in one tool and a string in another (the keys would never match, so
the two tools would not exclude each other) are caught here, at start-up.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from toolguard.policies.model import Policy, Problem, ToolPolicy
from toolguard.policies.paths import STAR, FieldPath
from toolguard.policies.strict import json_schema_of
from toolguard.policies.templates import KeyTemplate

__all__ = ["schema_problems"]

_SCALARS = {"string", "integer", "number", "boolean"}
_KIND_TYPES = {"number": {"integer", "number"}, "string": {"string"}, "collection": {"array", "object"}}


def schema_problems(policy: Policy, tool_schemas: Mapping[str, Any], *,
                    missing_ok: bool = True) -> list[Problem]:
    """Every mismatch between ``policy`` and the tools' schemas, located in the policy file."""
    problems: list[Problem] = []
    key_types: dict[str, tuple[str, int, list[frozenset[str] | None]]] = {}
    for name, tool in policy.tools.items():
        base = ("tools", name)
        if name not in tool_schemas:
            if not missing_ok:
                problems.append(policy.problem(base, "no tool of this name among the tools given"))
            continue
        try:
            schema = _Schema(json_schema_of(tool_schemas[name]))
        except Exception as error:  # a model pydantic cannot describe: report it, keep checking
            problems.append(policy.problem(
                base, f"cannot read the tool's argument schema: {type(error).__name__}: {error}"))
            continue
        problems.extend(_tool_problems(policy, name, tool, schema, key_types))
    return problems


def _tool_problems(policy: Policy, name: str, tool: ToolPolicy, schema: _Schema,
                   key_types: dict[str, tuple[str, int, list[frozenset[str] | None]]]) -> list[Problem]:
    problems: list[Problem] = []
    base = ("tools", name)
    templates: list[tuple[tuple[str | int, ...], KeyTemplate]] = [
        (("locks", i), t) for i, t in enumerate(tool.locks)]
    templates += [((field, i), t) for field in ("reads", "decides_on")
                  for i, t in enumerate(getattr(tool, field))]
    if tool.idempotency_key is not None:
        templates.append((("idempotency_key",), tool.idempotency_key))
    for where, template in templates:
        field_types: list[frozenset[str] | None] = []
        for path in template.fields:
            leaves, error = schema.walk(path)
            if error:
                problems.append(policy.problem((*base, *where), f"{{{path}}}: {error}"))
                field_types.append(None)
                continue
            found = schema.types(leaves) if leaves is not None else None
            found = found - {"null"} if found else None
            if found and not found & _SCALARS:
                what = "a list" if "array" in found else "an object"
                hint = f"; use {{{path}[*]}} for one key per element" if "array" in found else ""
                problems.append(policy.problem((*base, *where),
                                               f"{{{path}}} is {what}: a key needs a scalar{hint}"))
            field_types.append(frozenset(found) if found else None)
        if where[0] == "locks":
            index = where[1]
            assert isinstance(index, int)
            problems.extend(_type_mismatch(policy, name, index, template.text, template.skeleton,
                                           field_types, key_types))
    for path, constraint in tool.args.items():
        leaves, error = schema.walk(path)
        if error:
            problems.append(policy.problem((*base, "args", str(path)), error))
            continue
        found = schema.types(leaves) if leaves is not None else None
        if not found:
            continue
        for kind in sorted(constraint.kinds):
            if not found & _KIND_TYPES[kind]:
                problems.append(policy.problem(
                    (*base, "args", str(path)),
                    f"{kind} constraint on an argument of type {'/'.join(sorted(found))}"))
    for index, path in enumerate(tool.redact):
        _, error = schema.walk(path)
        if error:
            problems.append(policy.problem((*base, "redact", index), error))
    return problems


def _type_mismatch(policy: Policy, name: str, index: int, text: str, skeleton: str,
                   types: list[frozenset[str] | None],
                   seen: dict[str, tuple[str, int, list[frozenset[str] | None]]]) -> list[Problem]:
    """Same resource kind, different value types: the keys would never be equal."""
    if skeleton not in seen:
        seen[skeleton] = (name, index, types)
        return []
    other_name, other_index, other_types = seen[skeleton]
    for position, (mine, theirs) in enumerate(zip(types, other_types, strict=True)):
        if mine and theirs and len(mine) == 1 and len(theirs) == 1 and mine != theirs:
            other = policy.tools[other_name].locks[other_index].text
            message = (f"{text!r} renders field {position + 1} from {_a(next(iter(mine)))} here but "
                       f"from {_a(next(iter(theirs)))} in tool {other_name!r} ({other!r}): keys of "
                       f"different types never match, so these tools would not exclude each other")
            return [policy.problem(("tools", name, "locks", index), message)]
    return []


class _Schema:
    """Walks field paths through one JSON schema ($ref, anyOf/oneOf, arrays)."""

    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root

    def deref(self, schema: Any) -> Any:
        for _ in range(32):
            if not isinstance(schema, Mapping) or "$ref" not in schema:
                return schema
            ref = str(schema["$ref"])
            if not ref.startswith("#/"):
                return {}
            target: Any = self.root
            for part in ref[2:].split("/"):
                target = target[part.replace("~1", "/").replace("~0", "~")]
            schema = target
        return {}

    def branches(self, schema: Any) -> list[Any]:
        schema = self.deref(schema)
        if isinstance(schema, Mapping):
            for key in ("anyOf", "oneOf"):
                if key in schema:
                    return [b for option in schema[key] for b in self.branches(option)]
            if len(schema.get("allOf", ())) == 1:
                return self.branches(schema["allOf"][0])
        return [schema]

    def types(self, leaves: list[Any]) -> set[str] | None:
        """The JSON types a value at these leaves can have; ``None`` when unknown."""
        found: set[str] = set()
        for leaf in (b for each in leaves for b in self.branches(each)):
            if not isinstance(leaf, Mapping):
                return None
            kind = leaf.get("type")
            if isinstance(kind, str):
                found.add(kind)
            elif isinstance(kind, list):
                found.update(str(k) for k in kind)
            elif "enum" in leaf or "const" in leaf:
                values = leaf.get("enum", [leaf.get("const")])
                found.update(_json_type(v) for v in values)
            elif "properties" in leaf:
                found.add("object")
            else:
                return None
        return found

    def walk(self, path: FieldPath) -> tuple[list[Any] | None, str | None]:
        """(leaf schemas, None), (None, None) when unknowable, or (None, what is wrong)."""
        current: list[Any] = [self.root]
        for index, part in enumerate(path.parts):
            following: list[Any] = []
            for branch in (b for schema in current for b in self.branches(schema)):
                if not isinstance(branch, Mapping):
                    return None, None
                kind = branch.get("type")
                properties = branch.get("properties")
                extra = branch.get("additionalProperties")
                if part == STAR:
                    if "items" in branch:
                        following.append(branch["items"])
                    elif "prefixItems" in branch:
                        following.extend(branch["prefixItems"])
                    elif isinstance(extra, Mapping):
                        following.append(extra)
                    elif kind in (None, "array") or (kind == "object" and not properties):
                        return None, None
                elif properties and part in properties:
                    following.append(properties[part])
                elif kind in (None, "object") and not properties:
                    return None, None  # a free-form object: nothing to check
                elif properties and extra not in (None, False):
                    return None, None
            if not following:
                return None, self._missing(path, index, current)
            current = following
        return current, None

    def _missing(self, path: FieldPath, index: int, current: list[Any]) -> str:
        before = str(FieldPath(path.parts[:index])) if index else ""
        if path.parts[index] == STAR:
            return f"{before or 'args'!r} is not a list, so [*] cannot expand it"
        part = path.parts[index]
        shown = f"{before}.{part}" if before else part
        names = sorted({p for s in current for b in self.branches(s) if isinstance(b, Mapping)
                        for p in (b.get("properties") or {})})
        close = difflib.get_close_matches(part, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        where = "an argument of the tool" if not before else f"a field of {before}"
        return f"{shown!r} is not {where}{hint}; known: {', '.join(names) or 'none'}"


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"
