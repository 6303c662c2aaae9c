"""The injected parameters of a LangChain tool, which are the host's and never the model's.

Injected parameters (``InjectedState``, ``InjectedStore``, ``ToolRuntime``,
``InjectedToolCallId``...) are filled by the host, never by the model: ToolNode
strips a model-supplied value for one and injects the trusted value, so the
guard drops it too instead of refusing the call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["InjectedKeys", "model_arguments"]


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


def _injected_keys(tool: Any) -> frozenset[str]:
    """Parameters in the tool's input schema that its model-facing schema leaves out."""
    try:
        full = _field_names(tool.get_input_schema())
        facing = _field_names(tool.tool_call_schema)
    except Exception:  # not a LangChain tool, or a schema we cannot read: nothing to drop
        return frozenset()
    return frozenset(full - facing)


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
