"""Wiring mistakes raise ``GuardMisconfigured`` when the guard is built, naming the slot.

``ToolGuard(policy, locks=connect(...), store=open_async_store(...))`` used to
construct; every call then failed inside the flow with ``TypeError: '<' not
supported between instances of 'coroutine' and 'int'`` (coroutines never
awaited, no audit row), async locks in ``locks=`` were audited as
``invalid_fencing_token``, and the reverse gave a bare ``TypeError``. Every slot,
with the other face of every backend, is refused at construction (and when
assigned later); nothing is opened or written on the way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from guard.tools import LEAD_POLICY
from toolguard.controls.approvals import ApprovalBook, AsyncApprovalBook
from toolguard.controls.quotas import async_quota_backend, quota_backend
from toolguard.errors import GuardMisconfigured
from toolguard.guard import ToolGuard
from toolguard.locks import connect, connect_async
from toolguard.policies import Policy
from toolguard.store import open_async_store, open_store

POLICY = Policy.from_dict(LEAD_POLICY)


class Made:
    """Sync and asyncio objects of one backend kind, closed after the test."""

    def __init__(self, kind: str, tmp_path: Path, postgres_url: str, redis_url: str,
                 unique: str) -> None:
        self.kind = kind
        if kind == "sqlite":
            store_url, lock_url, options = f"sqlite:///{tmp_path}/s.db", f"sqlite:///{tmp_path}/l.db", {}
        else:
            store_url, lock_url = postgres_url, (redis_url if kind == "redis" else postgres_url)
            options = {"schema": f"tg_wiring_{unique}"}
        self.store = open_store(store_url, **options)
        self.async_store = open_async_store(store_url, **options)
        lock_options = {"prefix": f"tgwiring:{unique}"} if kind == "redis" else {}
        self.locks = connect(lock_url, **lock_options)
        self.async_locks = connect_async(lock_url, **lock_options)
        if kind == "redis":
            self.quotas: Any = quota_backend(redis_url, prefix=f"tgwq{unique}")
            self.async_quotas: Any = async_quota_backend(redis_url, prefix=f"tgwq{unique}")
        else:
            self.quotas = quota_backend(self.store)
            self.async_quotas = async_quota_backend(self.async_store)
        self.approvals = ApprovalBook(self.store)
        self.async_approvals = AsyncApprovalBook(self.async_store)

    def close(self) -> None:
        async def aclose() -> None:
            await self.async_locks.aclose()
            await self.async_store.close()
            closer = getattr(self.async_quotas, "aclose", None)
            if closer is not None and self.kind == "redis":
                await closer()

        asyncio.run(aclose())
        self.locks.close()
        self.store.close()


@pytest.fixture(params=["sqlite", "postgresql", "redis"])
def made(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> Iterator[Made]:
    postgres = request.getfixturevalue("postgres_url") if request.param != "sqlite" else ""
    redis = request.getfixturevalue("redis_url") if request.param == "redis" else ""
    objects = Made(request.param, tmp_path, postgres, redis, unique)
    try:
        yield objects
    finally:
        objects.close()


#: slot -> (the object of the other face, the pair the guard still needs to be complete)
CROSSED: dict[str, Callable[[Made], dict[str, Any]]] = {
    "locks": lambda m: {"locks": m.async_locks, "store": m.store},
    "store": lambda m: {"locks": m.locks, "store": m.async_store},
    "async_locks": lambda m: {"async_locks": m.locks, "async_store": m.async_store},
    "async_store": lambda m: {"async_locks": m.async_locks, "async_store": m.store},
    "quotas": lambda m: {"locks": m.locks, "store": m.store, "quotas": m.async_quotas},
    "async_quotas": lambda m: {"async_locks": m.async_locks, "async_store": m.async_store,
                               "async_quotas": m.quotas},
    "approvals": lambda m: {"locks": m.locks, "store": m.store, "approvals": m.async_approvals},
    "async_approvals": lambda m: {"async_locks": m.async_locks, "async_store": m.async_store,
                                  "async_approvals": m.approvals},
}

TWIN = {"locks": "async_locks", "store": "async_store", "quotas": "async_quotas",
        "approvals": "async_approvals"}
TWIN.update({v: k for k, v in TWIN.items()})


@pytest.mark.parametrize("slot", list(CROSSED))
def test_the_other_face_in_a_slot_raises_at_construction_naming_it(made: Made, slot: str) -> None:
    with pytest.raises(GuardMisconfigured) as raised:
        ToolGuard(POLICY, **CROSSED[slot](made))
    text = str(raised.value)
    assert f"{slot}=" in text and f"belongs in {TWIN[slot]}=" in text, text


def test_the_issues_example_raises_and_the_right_wiring_builds(made: Made) -> None:
    with pytest.raises(GuardMisconfigured, match="store= got Async"):
        ToolGuard(POLICY, locks=made.locks, store=made.async_store)
    ToolGuard(POLICY, locks=made.locks, store=made.store, async_locks=made.async_locks,
              async_store=made.async_store)


@pytest.mark.parametrize("slot", ["locks", "store", "async_locks", "async_store"])
def test_assigning_the_other_face_later_raises_too(made: Made, slot: str) -> None:
    guard = ToolGuard(POLICY, locks=made.locks, store=made.store, async_locks=made.async_locks,
                      async_store=made.async_store)
    wrong = getattr(made, TWIN[slot])
    with pytest.raises(GuardMisconfigured, match=f"{slot}= got"):
        setattr(guard, slot, wrong)
    assert getattr(guard, slot) is getattr(made, slot)  # the slot kept what it had


@pytest.mark.parametrize("slot", ["locks", "store", "quotas", "approvals"])
def test_something_else_entirely_is_named_too(made: Made, slot: str) -> None:
    options = {"locks": made.locks, "store": made.store, slot: object()}
    with pytest.raises(GuardMisconfigured, match=f"{slot}= got object; it takes"):
        ToolGuard(POLICY, **options)
