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


#: Submodules reachable as attributes (``toolguard.locks.connect``) without importing them first.
_SUBMODULES = frozenset({"adapters", "call", "config", "context", "controls", "decision",
                         "envelope", "errors", "extras", "guard", "intent", "locks", "policies",
                         "runtime", "store", "telemetry"})


def _load(name: str) -> Any:
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"toolguard.{name}")
    module_name = _LAZY.get(name)
    if module_name is None:
        msg = f"module 'toolguard' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


if not TYPE_CHECKING:  # type checkers read the imports above: a name not there is an error
    __getattr__ = _load


#: modules that moved into the rooms of ARCHITECTURE.md -> where they live now; code written
#: against the old paths (``from toolguard.intent import Intent``) keeps working
_MOVED = {
    "toolguard.intent": "toolguard.call.intent",
    "toolguard.envelope": "toolguard.call.envelope",
    "toolguard.facts": "toolguard.call.facts",
    "toolguard.decision": "toolguard.call.decision",
    "toolguard.recording": "toolguard.call.recording",
    "toolguard.context": "toolguard.call.context",
    "toolguard.approvals": "toolguard.controls.approvals",
    "toolguard.pause": "toolguard.controls.pause",
    "toolguard.shadow": "toolguard.controls.shadow",
    "toolguard.quotas": "toolguard.controls.quotas",
    "toolguard.safe_text": "toolguard.runtime.safe_text",
    "toolguard.cancellation": "toolguard.runtime.cancellation",
    "toolguard.connection_errors": "toolguard.runtime.connection_errors",
    "toolguard.telemetry": "toolguard.runtime.telemetry",
    "toolguard.extras": "toolguard.runtime.extras",
    "toolguard.doctor": "toolguard.cli.checks",
    "toolguard.store.cli": "toolguard.cli.db",
    "toolguard.policies.cli": "toolguard.cli.policy",
}


def _moved_to(name: str) -> str | None:
    """Where the module ``name`` (an old path, or a module inside an old package) lives now."""
    head = name
    while head:
        new = _MOVED.get(head)
        if new is not None:
            return new + name[len(head):]
        head = head.rpartition(".")[0]
    return None


class _MovedModules:
    """Finds an old module path and hands out the module from its new home: one module
    object under both names, so state and ``monkeypatch`` targets are shared."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> Any:
        if not name.startswith("toolguard.") or _moved_to(name) is None:
            return None
        from importlib.util import spec_from_loader

        return spec_from_loader(name, self)  # type: ignore[arg-type]  # a Loader by protocol

    def create_module(self, spec: Any) -> Any:
        import importlib

        new = _moved_to(spec.name)
        assert new is not None
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import machinery sets the old name's spec
        return module

    def exec_module(self, module: Any) -> None:
        """Already run, under its new name: it gets its own spec back (``reload`` and tools
        read ``__spec__``)."""
        own = module.__spec__.loader_state
        if own is not None:
            module.__spec__ = own


def _install_moved_modules() -> None:
    import sys

    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())


_install_moved_modules()


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
