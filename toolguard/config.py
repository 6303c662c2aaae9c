"""One settings object: ``TOOLGUARD_*`` environment variables, overridable in code.

With nothing set, locks and store live in two embedded SQLite files under
``./.toolguard/``, so the demo and the quick start need no server. They are two
files on purpose: SQLite has one writer per file, and a fenced transaction that
holds the store's write lock must never stall lease renewals.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings"]


class Settings(BaseSettings):
    """Where locks and the store live, and the defaults every lock gets."""

    model_config = SettingsConfigDict(env_prefix="TOOLGUARD_", extra="ignore")

    lock_url: str | None = Field(
        default=None,
        description="Lock backend URL (redis://, sqlite:///, postgresql://, etcd://). "
                    "Defaults to TOOLGUARD_REDIS_URL, else the embedded SQLite file.")
    redis_url: str | None = None
    database_url: str | None = Field(
        default=None, description="PostgreSQL URL for the guarded store; else embedded SQLite.")
    # Relative until a SQLite URL is made from it: reading the working directory here would
    # be a system call in the event loop of every connect_async()/open_async_store().
    home: Path = Field(default=Path(".toolguard"),
                       description="Folder of the embedded SQLite files (default: ./.toolguard).")
    ttl_ms: int = 10_000
    wait_timeout_s: float = 5.0

    def resolved_lock_url(self) -> str:
        if self.lock_url:
            return self.lock_url
        if self.redis_url:
            return self.redis_url
        return f"sqlite:///{self.home.absolute() / 'locks.db'}"

    def resolved_store_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home.absolute() / 'store.db'}"
