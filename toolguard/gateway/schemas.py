"""Upstream tools' ``inputSchema`` as strict models, or a clear refusal at start-up.

The gateway validates every ``tools/call`` against the strict model
``strict_model`` derives from the upstream tool's JSON Schema. That derivation
knows a subset of JSON Schema (types, properties, required, enums, bounds,
lengths, patterns, local ``$ref``, ``anyOf``/``oneOf``); a keyword outside it
would be ignored, so a call the schema forbids could pass. Such a schema is
refused when the gateway starts, naming the tool and the construct, never at
the first call: the operator fixes it (or leaves the tool out of the policy
and hides it with ``--hide-unlisted``), no model can.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel

from toolguard.errors import GuardMisconfigured
from toolguard.policies.strict import strict_model

__all__ = ["UnjudgeableSchema", "tool_model", "unjudgeable"]

#: Keywords the strict model enforces.
_ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "minLength", "maxLength", "pattern",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems",
    "maxItems",
})
#: Keywords that only describe (JSON Schema annotations): nothing to enforce.
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "format", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "$defs",
    "definitions", "discriminator", "nullable",
})
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


class UnjudgeableSchema(GuardMisconfigured):
    """An upstream tool's ``inputSchema`` uses a construct toolguard cannot enforce."""


def unjudgeable(schema: Any, where: str = "inputSchema") -> Iterator[str]:
    """Each construct in ``schema`` the strict model would not enforce, with its JSON path."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        yield f"{where}: a schema must be an object or a boolean, got {type(schema).__name__}"
        return
    for keyword in schema:
        if not isinstance(keyword, str):
            yield f"{where}: a non-text keyword {keyword!r}"
            continue
        if keyword in _ANNOTATIONS or keyword.startswith("x-"):
            continue
        if keyword not in _ENFORCED:
            yield f"{where}.{keyword}"
    yield from _nested(schema, where)


def _nested(schema: Mapping[str, Any], where: str) -> Iterator[str]:
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#/")):
        yield f"{where}.$ref: only local references (#/...) are supported, got {ref!r}"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        yield f"{where}.allOf: more than one schema to satisfy at once"
    for keyword in ("enum", "const"):
        if keyword in schema:
            values = schema[keyword] if keyword == "enum" else [schema[keyword]]
            if not isinstance(values, list) or not all(
                    isinstance(v, str | int | bool) or v is None for v in values):
                yield f"{where}.{keyword}: only text, integer, boolean or null values are enforced"
    for bound in ("exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(schema.get(bound), bool):
            yield f"{where}.{bound}: the boolean form (draft 4)"
    extra = schema.get("additionalProperties")
    if isinstance(extra, Mapping) and extra and schema.get("properties"):
        yield f"{where}.additionalProperties: a schema for extra properties beside named ones"
    properties = schema.get("properties")
    if isinstance(properties, Mapping):
        for name, sub in properties.items():
            yield from unjudgeable(sub, f"{where}.properties.{name}")
    elif properties is not None:
        yield f"{where}.properties: not an object"
    for keyword in ("items", "additionalProperties"):
        sub = schema.get(keyword)
        if isinstance(sub, Mapping):
            yield from unjudgeable(sub, f"{where}.{keyword}")
    for keyword in _SUBSCHEMA_LISTS:
        subs = schema.get(keyword)
        if isinstance(subs, list):
            for index, sub in enumerate(subs):
                yield from unjudgeable(sub, f"{where}.{keyword}[{index}]")
    for keyword in ("$defs", "definitions"):
        defs = schema.get(keyword)
        if isinstance(defs, Mapping):
            for name, sub in defs.items():
                yield from unjudgeable(sub, f"{where}.{keyword}.{name}")


def tool_model(name: str, schema: Any) -> type[BaseModel]:
    """The strict model of tool ``name``'s arguments; ``UnjudgeableSchema`` names what is wrong."""
    problems = list(unjudgeable(schema))
    if isinstance(schema, Mapping) and schema.get("type", "object") != "object":
        problems.insert(0, f"inputSchema.type: {schema.get('type')!r}, not an object of arguments")
    if problems:
        shown = "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)"
                                             if len(problems) > 5 else "")
        msg = (f"the upstream tool {name!r} has an input schema toolguard cannot enforce: "
               f"{shown}. Leave the tool out of the policy and start the gateway with "
               f"--hide-unlisted, or simplify its schema")
        raise UnjudgeableSchema(msg)
    try:
        return strict_model(dict(schema) if isinstance(schema, Mapping) else {}, name=name)
    except Exception as error:  # e.g. a pattern the regex engine cannot compile
        msg = (f"the upstream tool {name!r} has an input schema toolguard cannot build a "
               f"strict model from: {type(error).__name__}: {error}")
        raise UnjudgeableSchema(msg) from None
