"""What the adapters read off a LangChain tool: its injected parameters, and whether it is sync.

Injected parameters (``InjectedState``, ``InjectedStore``, ``ToolRuntime``,
``InjectedToolCallId``..., and any parameter named ``runtime``) are filled by the
host, never by the model: ToolNode strips a model-supplied value for one and
injects the trusted value, so the guard drops it too instead of refusing the
call, and never asks the model for it. A sync tool (no coroutine) needs a guard
with sync edges: ``check_tools`` says so when an adapter is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from langchain_core.tools import BaseTool, StructuredTool, Tool
from pydantic import BaseModel, create_model

from toolguard.adapters._worker import has_sync_edges
from toolguard.errors import GuardMisconfigured

__all__ = ["InjectedKeys", "as_tool", "check_tools", "model_arguments", "model_schema", "runs_sync"]

_ASYNC_ONLY = ("{where}: {tools} {verb} sync (no coroutine), and this guard has only asyncio "
               "locks and store (async_locks=, async_store=), so {pronoun} would run without a "
               "sync fenced transaction. Give the guard locks= and store= as well (a sync tool "
               "then runs its sync guarded call in a worker thread under ainvoke/astream), or "
               "give the tool an async implementation (StructuredTool coroutine=..., using "
               "current().atx).")


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


def as_tool(tool: Any) -> Any:
    """``tool`` as ToolNode and ``create_agent`` hold it: a plain function becomes a LangChain tool."""
    if isinstance(tool, BaseTool) or not callable(tool):
        return tool
    from langchain_core.tools import tool as create_tool

    return create_tool(tool)


def runs_sync(tool: Any) -> bool:
    """True if ``tool`` has no async implementation (LangChain runs its sync body in a thread)."""
    if isinstance(tool, StructuredTool | Tool):
        return tool.coroutine is None
    if not isinstance(tool, BaseTool):
        return False
    kind = type(tool)
    return kind._arun is BaseTool._arun and kind.ainvoke is BaseTool.ainvoke


def check_tools(guard: Any, tools: Iterable[Any], where: str) -> None:
    """Raise ``GuardMisconfigured`` if ``guard`` cannot run the sync ones among ``tools``."""
    if has_sync_edges(guard):
        return
    names = sorted({str(getattr(tool, "name", tool)) for tool in tools if runs_sync(tool)})
    if not names:
        return
    plural = len(names) > 1
    msg = _ASYNC_ONLY.format(where=where, tools=", ".join(repr(n) for n in names),
                             verb="are" if plural else "is", pronoun="they" if plural else "it")
    raise GuardMisconfigured(msg)
