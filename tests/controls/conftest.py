"""``store``: the production controls' store tests run on PostgreSQL (own schema) and SQLite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from store.envs import StoreEnv, drop_schema

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
