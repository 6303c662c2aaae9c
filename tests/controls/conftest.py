"""``store``: the production controls' store tests run on PostgreSQL (own schema) and SQLite."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from store.envs import StoreEnv, drop_schema

from toolguard.controls.approvals import ApprovalBook
from toolguard.guard import ToolGuard
from toolguard.store import GuardedStore


@pytest.fixture(params=["postgresql", "sqlite"])
def store_env(request: pytest.FixtureRequest, unique: str, tmp_path: Path) -> Iterator[StoreEnv]:
    if request.param == "postgresql":
        env = StoreEnv("postgresql", request.getfixturevalue("postgres_url"), "", f"tgc:{unique}",
                       {"schema": f"tg_controls_{unique}"})
    else:
        env = StoreEnv("sqlite", f"sqlite:///{tmp_path}/store.db", "", f"tgc:{unique}")
    try:
        yield env
    finally:
        if env.kind == "postgresql" and env.schema:
            drop_schema(env.url, env.schema)


@pytest.fixture
def store(store_env: StoreEnv) -> Iterator[GuardedStore]:
    opened = store_env.open()
    opened.install()
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, unique: str, tmp_path: Path) -> Iterator[Any]:
    """A guard's setup: SQLite locks + store, or Redis locks + a PostgreSQL schema of its own."""
    from guard.harness import Backend

    yield from Backend.for_test(request, unique, tmp_path)


@pytest.fixture
def harness(backend: Any) -> Iterator[Callable[..., Any]]:
    """``harness(policy, **guard_options)``: a ``Harness`` whose guard takes the options.

    ``approval_clock=`` gives the guard an approval book on that clock.
    """
    from guard.harness import Harness

    opened: list[Harness] = []

    def make(policy: Any, *, approval_clock: Any = None, **options: Any) -> Harness:
        made = Harness(backend, policy)
        if approval_clock is not None:
            options["approvals"] = ApprovalBook(made.store, clock=approval_clock)
        if options:
            made.guard = ToolGuard(made.policy, locks=made.locks, store=made.store, **options)
        opened.append(made)
        return made

    try:
        yield make
    finally:
        for each in opened:
            each.close()
