"""toolguard: fenced locks, exactly-once intents and an audit log for LLM tool calls."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from toolguard.errors import (
    BackendUnavailable,
    ConfigurationError,
    IntentRejected,
    LockLost,
    LockTimeout,
    NotOwned,
    PolicyError,
    StaleFencingToken,
    ToolGuardError,
)

try:
    __version__ = version("toolguard")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0"

__all__ = [
    "BackendUnavailable",
    "ConfigurationError",
    "IntentRejected",
    "LockLost",
    "LockTimeout",
    "NotOwned",
    "PolicyError",
    "StaleFencingToken",
    "ToolGuardError",
    "__version__",
]
