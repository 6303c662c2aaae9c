"""A guard on the embedded SQLite store, for the texts a call's decision produces."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from toolguard.guard import ToolGuard
from toolguard.locks import connect
from toolguard.policies import Policy
from toolguard.store import open_store

#: ``make_guard(policy)``: a sync guard on a fresh SQLite store (closed after the test).
GuardFactory = Callable[[Mapping[str, Any]], ToolGuard]


@pytest.fixture
def make_guard(tmp_path: Path) -> Iterator[GuardFactory]:
    opened: list[Any] = []

    def make(policy: Mapping[str, Any]) -> ToolGuard:
        store = open_store(f"sqlite:///{tmp_path / 'store.db'}", install=True)
        locks = connect(f"sqlite:///{tmp_path / 'locks.db'}")
        opened.extend([store, locks])
        return ToolGuard(Policy.from_dict(dict(policy)), locks=locks, store=store)

    yield make
    for each in reversed(opened):
        each.close()
