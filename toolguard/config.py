"""One settings object: ``TOOLGUARD_*`` environment variables, overridable in code.

With nothing set, locks and store both live in one embedded SQLite file, so the
demo and the quick start need no server.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "default_sqlite_path"]


def default_sqlite_path() -> Path:
    return Path.cwd() / ".toolguard" / "toolguard.db"


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
    sqlite_path: Path = Field(default_factory=default_sqlite_path)
    ttl_ms: int = 10_000
    wait_timeout_s: float = 5.0

    def resolved_lock_url(self) -> str:
        if self.lock_url:
            return self.lock_url
        if self.redis_url:
            return self.redis_url
        return f"sqlite:///{self.sqlite_path}"

    def resolved_store_url(self) -> str:
        return self.database_url or f"sqlite:///{self.sqlite_path}"
