"""The LangGraph prebuilt suite run: its marker, so that ``-m langgraph_suite`` runs it alone."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "langgraph_suite: LangGraph's own prebuilt test suite with toolguard injected "
        "(fetches the sdist with pip, about a minute)")
