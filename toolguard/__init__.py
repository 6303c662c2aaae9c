"""toolguard: fenced locks, exactly-once intents and an audit log for LLM tool calls.

>>> from toolguard import ToolGuard, load_policy, connect, open_store, guarded, current
>>> guard = ToolGuard(load_policy("policy.yml"), locks=connect(), store=open_store(install=True))
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from toolguard.context import CallContext, current
from toolguard.errors import (
    BackendUnavailable,
    ConfigurationError,
    DuplicateIntent,
    IdempotencyConflict,
    IntentRejected,
    InvalidArguments,
    LockLost,
    LockTimeout,
    NotAuthorized,
    NotOwned,
    OutOfOrder,
    PolicyError,
    StaleFencingToken,
    ToolGuardError,
    UnknownTool,
)
from toolguard.guard import Decision, ToolGuard
from toolguard.intent import Intent, WorkflowIdentity
from toolguard.locks import connect, connect_async
from toolguard.policies import Policy, ToolPolicy, load_policy
from toolguard.store import open_async_store, open_store

try:
    __version__ = version("toolguard")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0"


def __getattr__(name: str) -> object:
    """``guarded`` loads the adapters (and LangChain) only when asked for."""
    if name == "guarded":
        from toolguard.adapters.functions import guarded

        return guarded
    msg = f"module 'toolguard' has no attribute {name!r}"
    raise AttributeError(msg)


__all__ = [
    "BackendUnavailable",
    "CallContext",
    "ConfigurationError",
    "Decision",
    "DuplicateIntent",
    "IdempotencyConflict",
    "Intent",
    "IntentRejected",
    "InvalidArguments",
    "LockLost",
    "LockTimeout",
    "NotAuthorized",
    "NotOwned",
    "OutOfOrder",
    "Policy",
    "PolicyError",
    "StaleFencingToken",
    "ToolGuard",
    "ToolGuardError",
    "ToolPolicy",
    "UnknownTool",
    "WorkflowIdentity",
    "__version__",
    "connect",
    "connect_async",
    "current",
    "guarded",
    "load_policy",
    "open_async_store",
    "open_store",
]
