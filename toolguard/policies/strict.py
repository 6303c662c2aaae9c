"""Strict argument models: no unknown fields, no silent coercion.

A LangChain ``@tool`` schema ignores unknown arguments and turns ``"5"`` into
``5``; for an untrusted intent both hide mistakes (or attacks). ``strict_model``
derives a model that forbids extra fields at every level of nesting and
validates types strictly, from a pydantic model, a JSON schema, a function
signature or a LangChain tool. ``validate_args`` runs it the one right way.
"""

from __future__ import annotations

import copy
import inspect
import json
import keyword
import re
import threading
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from toolguard.errors import InvalidArguments

__all__ = ["json_schema_of", "strict_model", "validate_args"]

SchemaSource = type[BaseModel] | Mapping[str, Any] | Callable[..., Any] | Any

_STRICT = ConfigDict(extra="forbid", strict=True)
#: Generic aliases subscripted with types only known at run time (built from a JSON schema).
_LIST: Any = list
_DICT: Any = dict
_TUPLE: Any = tuple
_MAX_MESSAGES = 5
_cache: dict[type[BaseModel], type[BaseModel]] = {}
_cache_lock = threading.RLock()  # one strict class per model, even when threads race


def strict_model(source: SchemaSource, *, name: str | None = None) -> type[BaseModel]:
    """A model that refuses unknown fields and type coercion, derived from ``source``.

    ``source`` is a pydantic model class (its validators are kept: the result
    subclasses it), a JSON schema dict, a function (its signature), or an
    object with ``tool_call_schema``/``args_schema`` (a LangChain tool).
    Nested pydantic models are made strict too; a self-referencing model keeps
    its own setting for extra fields below the first level (strict types still
    apply there through ``validate_args``). Field names that pydantic cannot
    use (``_x``, ``model_x``, ``json``...) become aliases: dump with
    ``by_alias=True`` to get the original names back.
    """
    if isinstance(source, type) and issubclass(source, BaseModel):
        with _cache_lock:
            return _strict_from_model(source, set())
    if isinstance(source, Mapping):
        return _SchemaModels(source).build(name)
    schema = _tool_schema(source)
    if schema is not None:
        return strict_model(schema, name=name or getattr(source, "name", None))
    if callable(source):
        return _strict_from_function(source, name)
    msg = f"cannot derive an argument model from {type(source).__name__}"
    raise TypeError(msg)


def json_schema_of(source: SchemaSource) -> dict[str, Any]:
    """The JSON schema of a tool's arguments, from any source ``strict_model`` accepts."""
    if isinstance(source, type) and issubclass(source, BaseModel):
        return source.model_json_schema(by_alias=True)
    if isinstance(source, Mapping):
        return dict(source)
    schema = _tool_schema(source)
    if schema is not None:
        return json_schema_of(schema)
    if callable(source):
        return strict_model(source).model_json_schema(by_alias=True)
    msg = f"cannot find an argument schema in {type(source).__name__}"
    raise TypeError(msg)


#: ``json.dumps(value, allow_nan=False)``, built once.
_STRICT_JSON = json.JSONEncoder(allow_nan=False)


def validate_args(model: type[BaseModel], args: Any, *, root: str = "args") -> BaseModel:
    """Validate raw (untrusted) arguments; raise ``InvalidArguments`` naming each bad field.

    Validation runs in pydantic's strict *JSON* mode: exactly what a model can
    send. ``"5"`` is not an int, but an ISO string is a datetime and ``"a"`` is
    the enum member whose value is ``"a"``. Messages never echo the input.
    """
    if not isinstance(args, Mapping):
        msg = f"{root}: expected an object of named arguments, got {_json_kind(args)}"
        raise InvalidArguments(msg)
    try:
        text = _STRICT_JSON.encode(args)
    except (TypeError, ValueError) as error:
        msg = f"{root}: not JSON ({error})"
        raise InvalidArguments(msg) from None
    try:
        return model.model_validate_json(text, strict=True)
    except ValidationError as error:
        # ``from None``: the pydantic error holds the input values, which may be
        # sensitive (redacted fields) and must not reach logs through the cause.
        raise InvalidArguments(_describe(error, root)) from None


def _describe(error: ValidationError, root: str) -> str:
    parts = []
    for item in error.errors(include_url=False, include_input=False):
        where = root + "".join(f"[{p}]" if isinstance(p, int) else
                               (f".{p}" if str(p).isidentifier() else f"[{json.dumps(str(p))}]")
                               for p in item["loc"])
        kind = item["type"]
        text = {"extra_forbidden": "unexpected argument",
                "missing": "required argument missing"}.get(kind, item["msg"])
        parts.append(f"{where}: {text}")
    shown = "; ".join(parts[:_MAX_MESSAGES])
    more = len(parts) - _MAX_MESSAGES
    return shown + (f" (and {more} more)" if more > 0 else "")


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, str):
        return "a string"
    return type(value).__name__


def _tool_schema(source: Any) -> Any:
    """The argument schema of a LangChain-like tool, or None."""
    for attribute in ("tool_call_schema", "args_schema"):
        schema = getattr(source, attribute, None)
        if isinstance(schema, Mapping) or (isinstance(schema, type) and issubclass(schema, BaseModel)):
            return schema
    return None


# --- from pydantic models ---------------------------------------------------------


def _strict_from_model(model: type[BaseModel], building: set[type[BaseModel]]) -> type[BaseModel]:
    if model in _cache:
        return _cache[model]
    if model in building:
        return model  # self-reference: see strict_model's docstring
    building.add(model)
    try:
        annotations: dict[str, Any] = {}
        namespace: dict[str, Any] = {}
        for field_name, field in model.model_fields.items():
            new = _strictify(field.annotation, building)
            if new is not field.annotation:
                annotations[field_name] = new
                namespace[field_name] = copy.copy(field)
    finally:
        building.discard(model)
    config = ConfigDict(**{**model.model_config, **_STRICT})
    metaclass: Any = type(model)  # pydantic's model metaclass builds the subclass
    strict: type[BaseModel] = metaclass(f"Strict{model.__name__}", (model,), {
        "__module__": model.__module__, "__doc__": model.__doc__, "model_config": config,
        "__annotations__": annotations, **namespace})
    _cache[model] = strict
    return strict


def _strictify(annotation: Any, building: set[type[BaseModel]]) -> Any:
    """The same type with every nested pydantic model replaced by its strict version."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _strict_from_model(annotation, building)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is None or not args or origin is Literal:
        return annotation
    if origin is Annotated:
        inner = _strictify(args[0], building)
        return annotation if inner is args[0] else Annotated[(inner, *annotation.__metadata__)]
    new_args = tuple(_strictify(arg, building) if arg is not Ellipsis else arg for arg in args)
    if all(a is b for a, b in zip(new_args, args, strict=True)):
        return annotation
    if origin in (Union, types.UnionType):
        return Union[new_args]  # noqa: UP007 - built from a runtime tuple
    try:
        return origin[new_args]
    except TypeError:
        return annotation


# --- from functions -------------------------------------------------------------------


def _strict_from_function(function: Callable[..., Any], name: str | None) -> type[BaseModel]:
    signature = inspect.signature(function)
    try:
        hints = typing.get_type_hints(function, include_extras=True)
    except Exception:  # unresolvable string annotations: fall back to what is there
        hints = {}
    fields: dict[str, Any] = {}
    for index, parameter in enumerate(signature.parameters.values()):
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        annotation = hints.get(parameter.name, parameter.annotation)
        if annotation is inspect.Parameter.empty:
            annotation = Any
        with _cache_lock:
            annotation = _strictify(annotation, set())
        default = ... if parameter.default is inspect.Parameter.empty else parameter.default
        field_name = _field_name(parameter.name, index)
        alias = None if field_name == parameter.name else parameter.name
        fields[field_name] = (annotation, Field(default, alias=alias))
    title = name or f"{getattr(function, '__name__', 'tool')}_args"
    return create_model(_class_name(title), __config__=_STRICT, **fields)


def _field_name(original: str, index: int) -> str:
    usable = (original.isidentifier() and not keyword.iskeyword(original)
              and not original.startswith(("_", "model_")) and not hasattr(BaseModel, original))
    return original if usable else f"field_{index}"


def _class_name(title: str) -> str:
    words = re.findall(r"[A-Za-z0-9]+", title) or ["Args"]
    name = "".join(word[:1].upper() + word[1:] for word in words)
    return name if name[0].isalpha() else f"M{name}"


# --- from JSON schemas ---------------------------------------------------------------


class _SchemaModels:
    """Builds strict pydantic models from one JSON schema (with ``$defs`` and ``$ref``)."""

    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root
        self.by_ref: dict[str, Any] = {}
        self.building: dict[str, str] = {}  # ref -> class name, while it is being built
        self.namespace: dict[str, type[BaseModel]] = {}
        self.models: list[type[BaseModel]] = []

    def build(self, name: str | None) -> type[BaseModel]:
        title = name or str(self.root.get("title") or "Args")
        model = self.object_model(self.root, title)
        for each in self.models:  # resolve forward references of recursive schemas
            each.model_rebuild(_types_namespace=self.namespace)
        return model

    def object_model(self, schema: Mapping[str, Any], title: str) -> type[BaseModel]:
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        fields: dict[str, Any] = {}
        for index, (prop, prop_schema) in enumerate(properties.items()):
            annotation = self.annotation(prop_schema, f"{title}_{prop}")
            default = ... if prop in required else (
                prop_schema.get("default") if isinstance(prop_schema, Mapping) else None)
            field_name = _field_name(prop, index)
            alias = None if field_name == prop else prop
            fields[field_name] = (annotation, Field(default, alias=alias))
        extra = schema.get("additionalProperties")
        config = ConfigDict(extra="allow" if extra not in (None, False) else "forbid", strict=True)
        reserved = title in self.building.values() and title not in self.namespace
        class_name = title if reserved else self._unique(_class_name(title))  # a $ref's own name
        model: type[BaseModel] = create_model(class_name, __config__=config, **fields)
        self.namespace[class_name] = model
        self.models.append(model)
        return model

    def _unique(self, name: str) -> str:
        candidate, counter = name, 1
        while candidate in self.namespace or candidate in self.building.values():
            counter += 1
            candidate = f"{name}{counter}"
        return candidate

    def resolve_ref(self, ref: str) -> Any:
        if not ref.startswith("#/"):
            msg = f"only local $ref are supported, got {ref!r}"
            raise TypeError(msg)
        target: Any = self.root
        for part in ref[2:].split("/"):
            target = target[part.replace("~1", "/").replace("~0", "~")]
        return target

    def annotation(self, schema: Any, title: str) -> Any:
        if schema is True or schema == {} or not isinstance(schema, Mapping):
            return Any
        if "$ref" in schema:
            ref = schema["$ref"]
            if ref in self.by_ref:
                return self.by_ref[ref]
            if ref in self.building:
                return self.building[ref]  # forward reference by class name
            target = self.resolve_ref(ref)
            self.building[ref] = self._unique(_class_name(str(target.get("title") or ref.rsplit("/", 1)[-1])))
            try:
                built = self.annotation(target, self.building[ref])
            finally:
                del self.building[ref]
            self.by_ref[ref] = built
            return built
        if "const" in schema:
            return _literal([schema["const"]])
        if "enum" in schema:
            return _literal(schema["enum"])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = tuple(self.annotation(option, title) for option in schema[key])
                return Union[options] if len(options) > 1 else options[0]  # noqa: UP007
        if "allOf" in schema and len(schema["allOf"]) == 1:
            return self.annotation(schema["allOf"][0], title)
        kind = schema.get("type")
        if isinstance(kind, list):
            options = tuple(self.annotation({**schema, "type": one}, title) for one in kind)
            return Union[options] if len(options) > 1 else options[0]  # noqa: UP007
        if kind is None and "properties" in schema:
            kind = "object"
        return self.typed(kind, schema, title)

    def typed(self, kind: Any, schema: Mapping[str, Any], title: str) -> Any:
        if kind == "string":
            return _constrained(str, min_length=schema.get("minLength"), max_length=schema.get("maxLength"),
                                pattern=schema.get("pattern"))
        if kind in ("integer", "number"):
            return _constrained(int if kind == "integer" else float, ge=schema.get("minimum"),
                                le=schema.get("maximum"), gt=schema.get("exclusiveMinimum"),
                                lt=schema.get("exclusiveMaximum"), multiple_of=schema.get("multipleOf"))
        if kind == "boolean":
            return bool
        if kind == "null":
            return type(None)
        if kind == "array":
            if "prefixItems" in schema:
                return _TUPLE[tuple(self.annotation(item, title) for item in schema["prefixItems"])]
            item = self.annotation(schema.get("items", True), f"{title}_item")
            return _constrained(_LIST[item], min_length=schema.get("minItems"),
                                max_length=schema.get("maxItems"))
        if kind == "object":
            if schema.get("properties"):
                return self.object_model(schema, title)
            extra = schema.get("additionalProperties", True)
            value = Any if extra in (True, None) else self.annotation(extra, f"{title}_value")
            return _DICT[str, value]
        return Any


def _constrained(base: Any, **constraints: Any) -> Any:
    given = {key: value for key, value in constraints.items() if value is not None}
    return Annotated[base, Field(**given)] if given else base


def _literal(values: list[Any]) -> Any:
    if values and all(isinstance(v, (str, int, bool)) or v is None for v in values):
        return Literal[tuple(values)]
    return Any
