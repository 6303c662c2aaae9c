"""Fixtures for the guard suite: every test that takes ``backend`` runs on both setups."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from guard.harness import KINDS, Backend, Harness
from toolguard.guard import ToolGuard


@pytest.fixture(params=KINDS)
def backend(request: pytest.FixtureRequest, unique: str, tmp_path: Any) -> Iterator[Backend]:
    """SQLite locks + SQLite store, or Redis locks + a PostgreSQL schema of the test's own."""
    yield from Backend.for_test(request, unique, tmp_path)


@pytest.fixture
def harness(backend: Backend) -> Iterator[Callable[..., Harness]]:
    """``harness(policy)``: a guard on ``backend`` with the test tables; closed afterwards."""
    opened: list[Harness] = []

    def make(policy: Any, **options: Any) -> Harness:
        made = Harness(backend, policy, **options)
        opened.append(made)
        return made

    try:
        yield make
    finally:
        for each in opened:
            each.close()


def make_backend(setup: str, request: pytest.FixtureRequest, tmp_path: Path,
                 unique: str) -> Backend:
    store_kind, lock_kind = (part.split("-")[0] for part in setup.split("/"))
    if store_kind == "sqlite":
        store_url, store_options = f"sqlite:///{tmp_path}/store.db", {}
    else:
        store_url = request.getfixturevalue("postgres_url")
        store_options = {"schema": f"tg_cancel_{unique}"}
    if lock_kind == "sqlite":
        lock_url, lock_options = f"sqlite:///{tmp_path}/locks.db", {}
    elif lock_kind == "redis":
        lock_url, lock_options = request.getfixturevalue("redis_url"), {"prefix": f"tgc:{unique}"}
    elif lock_kind == "postgres":
        lock_url = request.getfixturevalue("postgres_url")
        lock_options = {"schema": f"tg_cancel_locks_{unique}"}
    else:
        from etcd_server import require_etcd, shared_etcd_url

        require_etcd()
        lock_url, lock_options = shared_etcd_url(), {"prefix": f"tgc-{unique}"}
    return Backend(store_kind, store_url, lock_url, store_options, lock_options)


@pytest.fixture
def case_harness(request: pytest.FixtureRequest, tmp_path: Path,
                 unique: str) -> Iterator[Callable[[str, dict[str, Any]], Harness]]:
    made: list[tuple[Harness, Backend]] = []

    def build(setup: str, policy: dict[str, Any]) -> Harness:
        backend = make_backend(setup, request, tmp_path, unique)
        h = Harness(backend, policy)
        # the kill switch read on every call: the same await points on every run
        h.guard = ToolGuard(h.policy, locks=h.locks, store=h.store, pause_cache_s=0)
        made.append((h, backend))
        return h

    yield build
    for h, backend in made:
        h.close()
        backend.drop()
        schema = backend.lock_options.get("schema")
        if schema:
            import psycopg

            with psycopg.connect(backend.lock_url, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
