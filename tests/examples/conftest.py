"""The repository root on sys.path, so ``examples`` imports without an install.

No ``__init__.py`` in this folder on purpose: a ``tests/examples`` package
would shadow the repository's ``examples``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True)
def _no_toolguard_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Settings from the tests' arguments only; default files land in a temporary folder."""
    for name in ("TOOLGUARD_LOCK_URL", "TOOLGUARD_REDIS_URL", "TOOLGUARD_DATABASE_URL",
                 "TOOLGUARD_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
