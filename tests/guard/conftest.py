"""Fixtures for the guard suite: every test that takes ``backend`` runs on both setups."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from guard.harness import KINDS, Backend, Harness


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
