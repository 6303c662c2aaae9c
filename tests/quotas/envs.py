"""The three quota backends as picklable descriptions, so spawned workers open their own."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from toolguard.call.facts import CallFacts
from toolguard.controls.quotas import AsyncQuotaBackend, QuotaBackend, async_quota_backend, quota_backend
from toolguard.policies import Policy, ToolPolicy
from toolguard.store import open_async_store, open_store

__all__ = ["QuotaEnv", "facts", "rule"]


@dataclass(frozen=True)
class QuotaEnv:
    kind: str  # "redis" | "postgresql" | "sqlite"
    url: str
    unique: str

    @property
    def schema(self) -> str:
        return f"tg_quota_{self.unique}"

    def install(self) -> None:
        if self.kind != "redis":
            store = self._store()
            try:
                store.install()
            finally:
                store.close()

    def _store(self) -> Any:
        options = {"schema": self.schema} if self.kind == "postgresql" else {}
        return open_store(self.url, **options)

    def open(self) -> tuple[QuotaBackend, Any]:
        """A backend and what to close afterwards (the store, or the backend itself)."""
        if self.kind == "redis":
            backend = quota_backend(self.url, prefix=f"tgq-{self.unique}")
            return backend, backend
        store = self._store()
        return quota_backend(store), store

    def open_async(self) -> tuple[AsyncQuotaBackend, Any]:
        if self.kind == "redis":
            backend = async_quota_backend(self.url, prefix=f"tgq-{self.unique}")
            return backend, backend
        options = {"schema": self.schema} if self.kind == "postgresql" else {}
        store = open_async_store(self.url, **options)
        return async_quota_backend(store), store


def rule(quotas: list[dict[str, Any]], *, locks: tuple[str, ...] = ("acct:{id}",),
         name: str = "pay") -> ToolPolicy:
    """A tool named ``name`` with these quotas (validated like a policy file)."""
    policy = Policy.from_dict({"version": 1, "tools": {name: {"locks": list(locks), "quotas": quotas}}})
    return policy.tools[name]


def facts(*, key: str | None = None, agent: str | None = "agent-a", amount: Any = 1,
          keys: tuple[str, ...] = ("acct:~i1",), workflow: str | None = "thread-1",
          tool: str = "pay", args: dict[str, Any] | None = None) -> CallFacts:
    """One call's facts; every call gets its own idempotency key unless ``key`` is given."""
    return CallFacts(tool=tool, agent=agent, args=args if args is not None else {"id": 1,
                                                                                 "amount": amount},
                     idempotency_key=key or uuid.uuid4().hex, args_hash="h",
                     attempt=uuid.uuid4().hex, policy_digest="d", keys=keys, workflow=workflow)
