"""toolguard: fenced locks, exactly-once intents and an audit log for LLM tool calls.

>>> from toolguard import ToolGuard, load_policy, connect, open_store, guarded, current
>>> guard = ToolGuard(load_policy("policy.yml"), locks=connect(), store=open_store(install=True))
"""

from __future__ import annotations

from toolguard.adapters.functions import guarded  # plain functions: no LangChain needed
from toolguard.context import CallContext, current, current_or_none
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
from toolguard.guard import Decision, ToolFailed, ToolGuard
from toolguard.intent import Intent, WorkflowIdentity
from toolguard.locks import connect, connect_async
from toolguard.policies import Policy, ToolPolicy, load_policy
from toolguard.store import open_async_store, open_store

#: The one place the version is written (pyproject.toml reads it from here); no
#: ``importlib.metadata`` lookup at import time.
__version__ = "0.1.0"

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
    "ToolFailed",
    "ToolGuard",
    "ToolGuardError",
    "ToolPolicy",
    "UnknownTool",
    "WorkflowIdentity",
    "__version__",
    "connect",
    "connect_async",
    "current",
    "current_or_none",
    "guarded",
    "load_policy",
    "open_async_store",
    "open_store",
]
