"""A guard on the embedded SQLite store (sync and asyncio pairs), for the texts of its decisions."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from toolguard.guard import ToolGuard
from toolguard.locks import connect, connect_async
from toolguard.policies import Policy
from toolguard.store import open_async_store, open_store

#: ``make_guard(policy)``: a guard on a fresh SQLite store (closed after the test).
GuardFactory = Callable[[Mapping[str, Any]], ToolGuard]


@pytest.fixture
def make_guard(tmp_path: Path) -> Iterator[GuardFactory]:
    opened: list[Any] = []

    def make(policy: Mapping[str, Any]) -> ToolGuard:
        url, lock_url = f"sqlite:///{tmp_path / 'store.db'}", f"sqlite:///{tmp_path / 'locks.db'}"
        store = open_store(url, install=True)
        locks = connect(lock_url)
        opened.extend([store, locks])
        return ToolGuard(Policy.from_dict(dict(policy)), locks=locks, store=store,
                         async_locks=connect_async(lock_url), async_store=open_async_store(url))

    yield make
    for each in reversed(opened):
        each.close()
