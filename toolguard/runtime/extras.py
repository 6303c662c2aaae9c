"""Optional dependencies: which extra brings which backend or adapter.

The core (locks, guard, policies, the embedded SQLite store, the CLI) needs no
server driver and no agent framework. Each backend and adapter checks for its
extra when it is first used and, if it is missing, raises ``MissingExtra``
naming the ``pip install`` line, instead of a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib.util

from toolguard.errors import ConfigurationError

__all__ = ["DISTRIBUTION", "EXTRAS", "MissingExtra", "install_hint", "require"]

#: The name to ``pip install`` (``toolguard`` on the package index is another project).
DISTRIBUTION = "toolguard-fenced"

#: extra -> the top-level modules it provides (the ``[project.optional-dependencies]`` in
#: pyproject.toml; a new extra is added in both places).
EXTRAS: dict[str, tuple[str, ...]] = {
    "redis": ("redis",),
    "postgres": ("psycopg", "psycopg_pool"),
    "etcd": ("etcd3gw",),
    "langgraph": ("langgraph", "langchain_core", "langchain"),
    "http": ("httpx",),
    "asgi": ("starlette",),
    "mcp": ("fastmcp", "mcp"),
    "review": ("starlette", "jinja2", "uvicorn"),
    "otel": ("opentelemetry",),
    "signing": ("cryptography",),
    "pydantic-ai": ("pydantic_ai",),
    "openai-agents": ("agents",),
    "dbos": ("dbos",),
}


class MissingExtra(ConfigurationError):
    """A feature was used whose optional dependencies are not installed."""

    reason = "missing_extra"

    def __init__(self, extra: str, what: str, missing: list[str]) -> None:
        self.extra = extra
        self.missing = tuple(missing)
        super().__init__(f"{what} needs the {extra!r} extra (missing: {', '.join(missing)}): "
                         f"{install_hint(extra)}")


def install_hint(extra: str) -> str:
    """The command that installs ``extra``."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def require(extra: str, what: str) -> None:
    """Raise ``MissingExtra`` unless every module of ``extra`` can be imported.

    ``what`` names the feature for the message, e.g. "the Redis lock backend".
    """
    missing = [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtra(extra, what, missing)
