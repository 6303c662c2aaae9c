"""The production controls a guard runs its calls through, built once from its stores.

``Controls.build(...)`` makes the kill switch boards (``PauseBoard``), the
approval books and the quota steps for the sync and asyncio stores the guard
was given, unless the caller passed their own. Quotas live on the store's own
server by default (``quota_backend(store)``); ``quotas=`` (a backend or a
Redis URL) overrides it. Configuration mistakes raise here, at construction,
to the developer: quotas in the policy with no backend, or one that cannot be
reached; approvals in the policy with no store to keep requests in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toolguard.controls.approvals import ApprovalBook, AsyncApprovalBook
from toolguard.controls.pause import AsyncPauseBoard, PauseBoard
from toolguard.controls.quotas import (
    AsyncQuotaBackend,
    AsyncQuotas,
    QuotaBackend,
    Quotas,
    async_quota_backend,
    quota_backend,
)
from toolguard.errors import ConfigurationError, GuardMisconfigured
from toolguard.policies import Policy
from toolguard.store import AsyncGuardedStore, GuardedStore

__all__ = ["Controls", "needs_approvals", "needs_quotas"]

#: A scope no quota is ever named after: reading it proves the backend answers.
_PROBE = "toolguard/probe"


def needs_quotas(policy: Policy) -> bool:
    return bool(policy.defaults.quotas) or any(rule.quotas for rule in policy.tools.values())


def needs_approvals(policy: Policy) -> bool:
    return any(rule.approval is not None for rule in policy.tools.values())


def _backend(given: Any, store: Any, make: Any) -> Any:
    target = given if given is not None else store
    if target is None:
        return None
    if given is not None and not isinstance(given, str):
        return given  # a backend object, used as given
    try:
        return make(target)
    except ConfigurationError:
        if given is not None:
            raise
        return None  # no backend for this store kind: a policy with quotas is refused below


@dataclass(slots=True)
class Controls:
    """Pause boards, approval books and quota steps for each path (None: not available)."""

    pauses: PauseBoard | None = None
    async_pauses: AsyncPauseBoard | None = None
    approvals: ApprovalBook | None = None
    async_approvals: AsyncApprovalBook | None = None
    quotas: Quotas | None = None
    async_quotas: AsyncQuotas | None = None
    options: dict[str, Any] | None = None
    built_for: tuple[int, int] = (0, 0)

    @classmethod
    def build(cls, policy: Policy, *, store: GuardedStore | None,
              async_store: AsyncGuardedStore | None,
              quotas: QuotaBackend | str | None = None,
              async_quotas: AsyncQuotaBackend | str | None = None,
              pauses: bool = True, pause_cache_s: float = 1.0,
              approvals: ApprovalBook | None = None,
              async_approvals: AsyncApprovalBook | None = None, probe: bool = True) -> Controls:
        """The controls for these stores; raises ``GuardMisconfigured`` for a policy they cannot
        run. ``probe``: ask the sync quota backend once (a round trip: not in an event loop)."""
        sync_backend: QuotaBackend | None = _backend(quotas, store, quota_backend)
        async_backend: AsyncQuotaBackend | None = _backend(
            async_quotas if async_quotas is not None else
            (quotas if isinstance(quotas, str) else None), async_store, async_quota_backend)
        built = cls(
            pauses=PauseBoard(store, cache_s=pause_cache_s) if pauses and store else None,
            async_pauses=(AsyncPauseBoard(async_store, cache_s=pause_cache_s)
                          if pauses and async_store else None),
            approvals=approvals or (ApprovalBook(store) if store is not None else None),
            async_approvals=async_approvals or (AsyncApprovalBook(async_store)
                                                if async_store is not None else None),
            quotas=Quotas(sync_backend) if sync_backend is not None else None,
            async_quotas=AsyncQuotas(async_backend) if async_backend is not None else None,
        )
        built.options = {"quotas": quotas, "async_quotas": async_quotas, "pauses": pauses,
                         "pause_cache_s": pause_cache_s, "approvals": approvals,
                         "async_approvals": async_approvals}
        built.built_for = (id(store), id(async_store))
        built.check(policy, probe=probe)
        return built

    def follow(self, policy: Policy, store: GuardedStore | None,
               async_store: AsyncGuardedStore | None) -> Controls:
        """These controls, or new ones if the guard's stores were replaced since (same options).

        Called at a call's start, maybe in its event loop: the new ones are not probed (a
        backend that cannot be reached fails that call as it would)."""
        if (id(store), id(async_store)) == self.built_for or self.options is None:
            return self
        return Controls.build(policy, store=store, async_store=async_store, **self.options,
                              probe=False)

    def check(self, policy: Policy, *, probe: bool = False) -> None:
        """Raise ``GuardMisconfigured`` if ``policy`` asks for a control these stores lack."""
        if needs_approvals(policy) and self.approvals is None and self.async_approvals is None:
            msg = ("the policy asks for approvals, and this guard has no store to keep approval "
                   "requests in: give the ToolGuard a store")
            raise GuardMisconfigured(msg)
        if not needs_quotas(policy):
            return
        if self.quotas is None and self.async_quotas is None:
            msg = ("the policy has quotas, and this guard has no quota backend: give it a "
                   "PostgreSQL or SQLite store, or quotas= (a Redis URL or a quota backend)")
            raise GuardMisconfigured(msg)
        if probe and self.quotas is not None:
            try:
                self.quotas.backend.usage(_PROBE)
            except Exception as error:
                msg = (f"the policy has quotas, and their backend ({self.quotas.backend.name}) "
                       f"cannot be reached: {type(error).__name__}: {error}; check its server, "
                       f"or run `toolguard db init` for a store older than the quota tables")
                raise GuardMisconfigured(msg) from error
