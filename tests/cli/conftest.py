"""Fixtures for the CLI tests: a clean environment and one demo run to review."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_ha import redis_cluster_url, redis_sentinel_url, shared_cluster  # noqa: F401  (session fixtures)
from typer.testing import CliRunner

from toolguard.cli import app

ENV = ("TOOLGUARD_LOCK_URL", "TOOLGUARD_REDIS_URL", "TOOLGUARD_DATABASE_URL", "TOOLGUARD_HOME")


@pytest.fixture(autouse=True)
def _no_toolguard_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """``toolguard demo --json --dir D`` run once; the audit tests read its store."""
    home = tmp_path_factory.mktemp("demo")
    saved = {name: os.environ.pop(name) for name in ENV if name in os.environ}
    try:
        result = CliRunner().invoke(app, ["demo", "--dir", str(home), "--json"])
    finally:
        os.environ.update(saved)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    yield {"home": home, "url": f"sqlite:///{home}/store.db", "locks": f"sqlite:///{home}/locks.db",
           "report": report}
