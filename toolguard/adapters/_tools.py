"""What a LangChain tool itself accepts: its injected parameters and its own argument check.

The adapters need both to stay transparent. Injected parameters (``InjectedState``,
``InjectedStore``, ``ToolRuntime``, ``InjectedToolCallId``..., and any parameter
named ``runtime``) are filled by the host, never by the model: ToolNode strips a
model-supplied value for one and injects the trusted value, so the guard drops it
too instead of refusing the call, and never asks the model for it.
And when the tool's own (lenient) schema refuses the arguments as well, the
answer belongs to ToolNode and the tool, not to toolguard.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError, create_model

__all__ = ["InjectedKeys", "model_arguments", "model_schema", "tool_refuses"]


class InjectedKeys:
    """The injected parameter names of each tool, computed once per tool object."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[Any, frozenset[str]]] = {}

    def of(self, tool: Any) -> frozenset[str]:
        name = str(getattr(tool, "name", ""))
        cached = self._seen.get(name)
        if cached is not None and cached[0] is tool:
            return cached[1]
        keys = _injected_keys(tool)
        self._seen[name] = (tool, keys)
        return keys


#: Parameters ToolNode injects by their name alone, whatever their annotation (a ``runtime``
#: parameter gets the ``ToolRuntime``), though the model-facing schema still lists them.
_INJECTED_BY_NAME = frozenset({"runtime"})


def _injected_keys(tool: Any) -> frozenset[str]:
    """Parameters in the tool's input schema that its model-facing schema leaves out, and
    those ToolNode injects by name."""
    try:
        full = _field_names(tool.get_input_schema())
        facing = _field_names(tool.tool_call_schema)
    except Exception:  # not a LangChain tool, or a schema we cannot read: nothing to drop
        return frozenset()
    return frozenset((full - facing) | (full & _INJECTED_BY_NAME))


def model_schema(tool: Any, injected: frozenset[str]) -> Any:
    """What toolguard validates a call to ``tool`` against: the arguments the model sends.

    ``tool`` itself (its model-facing schema), unless that schema lists a parameter the
    host injects (``_INJECTED_BY_NAME``): then that schema without it, as the model's
    arguments never hold the host's value.
    """
    schema = getattr(tool, "tool_call_schema", None)
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        return tool
    kept = {name: (info.annotation, info) for name, info in schema.model_fields.items()
            if name not in injected and info.alias not in injected}
    if len(kept) == len(schema.model_fields):
        return tool
    model: type[BaseModel] = create_model(schema.__name__, __config__=schema.model_config,
                                          __doc__=schema.__doc__, **kept)  # type: ignore[call-overload]
    return model


def _field_names(schema: Any) -> set[str]:
    if isinstance(schema, Mapping):
        return set((schema.get("properties") or {}).keys())
    fields = getattr(schema, "model_fields", None)
    if fields is None:
        fields = getattr(schema, "__fields__", None) or {}  # a pydantic v1 model
    names = set()
    for name, info in fields.items():
        alias = getattr(info, "alias", None)
        names.add(alias if isinstance(alias, str) and alias else name)
    return names


def model_arguments(args: Any, injected: frozenset[str]) -> Any:
    """``args`` without values for injected parameters (anything but a mapping stays as is)."""
    if not injected or not isinstance(args, Mapping):
        return args
    return {key: value for key, value in args.items() if key not in injected}


def tool_refuses(tool: Any, args: Any) -> bool:
    """True if the tool's own schema (lenient, as the tool will validate) rejects ``args``.

    Then the tool cannot run with them: ToolNode (or the tool's own
    ``handle_validation_error``) answers as it always does. A schema that is
    not a pydantic model counts as accepting: toolguard's refusal stands.
    """
    if not isinstance(args, Mapping):
        return False
    schema = getattr(tool, "tool_call_schema", None)
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        try:
            schema.model_validate(dict(args))
        except ValidationError:
            return True
        return False
    parse = getattr(schema, "parse_obj", None)  # a pydantic v1 model
    if parse is None:
        return False
    try:
        from pydantic.v1 import ValidationError as ValidationErrorV1
    except ImportError:  # pragma: no cover - pydantic 2 always ships pydantic.v1
        return False
    try:
        parse(dict(args))
    except ValidationErrorV1:
        return True
    return False
