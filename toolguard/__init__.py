"""toolguard: fenced locks, exactly-once intents and an audit log for LLM tool calls.

>>> from toolguard import ToolGuard, load_policy, connect, open_store, guarded, current
>>> guard = ToolGuard(load_policy("policy.yml"), locks=connect(), store=open_store(install=True))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toolguard.errors import (
    BackendUnavailable,
    ConfigurationError,
    DuplicateIntent,
    GuardMisconfigured,
    IdempotencyConflict,
    IntentRejected,
    InvalidArguments,
    InvalidIntent,
    LockLost,
    LockTimeout,
    MissingIdentity,
    NotAuthorized,
    NotOwned,
    OutOfOrder,
    PolicyError,
    StaleFencingToken,
    ToolGuardError,
    UnknownTool,
    UnknownToolWarning,
)

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports on first use
    from toolguard.adapters.functions import guarded
    from toolguard.call.context import CallContext, current, current_or_none
    from toolguard.call.decision import Decision, ToolFailed
    from toolguard.call.intent import Intent, WorkflowIdentity
    from toolguard.guard import ToolGuard
    from toolguard.locks import connect, connect_async
    from toolguard.open import open_guard
    from toolguard.policies import Policy, ToolPolicy, load_policy
    from toolguard.runtime import telemetry as telemetry
    from toolguard.store import open_async_store, open_store

#: The one place the version is written (pyproject.toml reads it from here); no
#: ``importlib.metadata`` lookup at import time.
__version__ = "0.1.0"

#: name -> module: ``import toolguard`` loads only the errors; the guard, pydantic models,
#: YAML and the lock machinery load when a name is first used (``from toolguard import X``).
_LAZY = {
    "guarded": "toolguard.adapters.functions",
    "CallContext": "toolguard.call.context",
    "current": "toolguard.call.context",
    "current_or_none": "toolguard.call.context",
    "Decision": "toolguard.call.decision",
    "ToolFailed": "toolguard.call.decision",
    "ToolGuard": "toolguard.guard",
    "Intent": "toolguard.call.intent",
    "WorkflowIdentity": "toolguard.call.intent",
    "connect": "toolguard.locks",
    "connect_async": "toolguard.locks",
    "Policy": "toolguard.policies",
    "ToolPolicy": "toolguard.policies",
    "load_policy": "toolguard.policies",
    "open_guard": "toolguard.open",
    "open_async_store": "toolguard.store",
    "open_store": "toolguard.store",
}


#: Modules reachable as attributes (``toolguard.locks.connect``) without importing them first;
#: ``telemetry`` (``from toolguard import telemetry``) is ``toolguard.runtime.telemetry``.
_SUBMODULES = {name: f"toolguard.{name}" for name in (
    "adapters", "call", "config", "controls", "errors", "guard", "locks", "policies", "runtime",
    "store")} | {"telemetry": "toolguard.runtime.telemetry"}


def _load(name: str) -> Any:
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    module_name = _LAZY.get(name)
    if module_name is None:
        msg = f"module 'toolguard' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


if not TYPE_CHECKING:  # type checkers read the imports above: a name not there is an error
    __getattr__ = _load


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "BackendUnavailable",
    "CallContext",
    "ConfigurationError",
    "Decision",
    "DuplicateIntent",
    "GuardMisconfigured",
    "IdempotencyConflict",
    "Intent",
    "IntentRejected",
    "InvalidArguments",
    "InvalidIntent",
    "LockLost",
    "LockTimeout",
    "MissingIdentity",
    "NotAuthorized",
    "NotOwned",
    "OutOfOrder",
    "Policy",
    "PolicyError",
    "StaleFencingToken",
    "ToolFailed",
    "ToolGuard",
    "ToolGuardError",
    "ToolPolicy",
    "UnknownTool",
    "UnknownToolWarning",
    "WorkflowIdentity",
    "__version__",
    "connect",
    "connect_async",
    "current",
    "current_or_none",
    "guarded",
    "load_policy",
    "open_async_store",
    "open_guard",
    "open_store",
]
