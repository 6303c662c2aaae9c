"""Fixtures for the review page: a demo run to review, hostile audit rows."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from review.helpers import ENV, seed_hostile
from toolguard.cli import app as cli_app
from toolguard.store import GuardedStore, open_store


@pytest.fixture(autouse=True)
def _no_toolguard_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``toolguard demo --json --dir D`` run once: the audit log the page is made for."""
    home = tmp_path_factory.mktemp("review-demo")
    saved = {name: os.environ.pop(name) for name in ENV if name in os.environ}
    try:
        result = CliRunner().invoke(cli_app, ["demo", "--dir", str(home), "--json"])
    finally:
        os.environ.update(saved)
    assert result.exit_code == 0, result.output
    return {"home": home, "url": f"sqlite:///{home}/store.db", "report": json.loads(result.stdout)}


@pytest.fixture
def demo_store(demo_home: dict[str, Any]) -> Iterator[GuardedStore]:
    store = open_store(demo_home["url"])
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[tuple[GuardedStore, dict[str, int]]]:
    store = open_store(f"sqlite:///{tmp_path}/hostile-store.db", install=True)
    try:
        yield store, seed_hostile(store, f"sqlite:///{tmp_path}/hostile-locks.db")
    finally:
        store.close()
