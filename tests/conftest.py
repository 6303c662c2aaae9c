"""Shared fixtures: the machine's Redis and PostgreSQL, and private servers for fault tests.

On CI (``CI=true``) a missing server is a failure, never a skip.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

REDIS_URL = os.environ.get("TOOLGUARD_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("TOOLGUARD_TEST_DATABASE_URL",
                              "postgresql://postgres@127.0.0.1:5432/test")
ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_server(name: str, reachable: bool, detail: str) -> None:
    """Skip locally, fail on CI: a server test that did not run is not a pass."""
    if reachable:
        return
    message = f"{name} is not reachable ({detail})"
    if ON_CI:
        pytest.fail(f"{message}; CI must provide it", pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def redis_url() -> str:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
        ok, detail = True, ""
    except Exception as error:
        ok, detail = False, str(error)
    require_server("Redis", ok, f"{REDIS_URL}: {detail}")
    return REDIS_URL


@pytest.fixture(scope="session")
def postgres_url() -> str:
    import psycopg

    try:
        with psycopg.connect(POSTGRES_URL, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
        ok, detail = True, ""
    except Exception as error:
        ok, detail = False, str(error)
    require_server("PostgreSQL", ok, f"{POSTGRES_URL}: {detail}")
    return POSTGRES_URL


@pytest.fixture
def unique() -> str:
    """A fresh namespace so tests sharing a server never see each other's keys."""
    return uuid.uuid4().hex[:12]


@pytest.fixture
def sqlite_path(tmp_path) -> Iterator[str]:
    yield str(tmp_path / "toolguard.db")


@pytest.fixture(autouse=True)
def _no_blocking_in_the_event_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test runs under ``blockbuster`` (see ``blocking.py``): a blocking call that
    toolguard's code makes inside a running event loop raises ``BlockingError``. Outside a
    loop (sync tests, worker threads) nothing changes. A test marked
    ``sync_playwright`` is left out: Playwright's sync API keeps an event loop running in the
    test's own thread, so the test's plain sync calls would read as calls inside a loop."""
    if request.node.get_closest_marker("sync_playwright") is not None:
        yield
        return
    from blocking import no_blocking

    with no_blocking():
        yield


@pytest.fixture(autouse=True)
def _no_terminal_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Output under test is piped: a COLUMNS/LINES exported by the runner (pytest-xdist
    workers, a CI shell) would make the CLI wrap at that width instead."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)


# --- the fault scenarios x invariants table ------------------------------------------------------
# Scenarios record their cells in fault.report.RESULTS in the process that ran them. Each
# test's new rows ride on its report (user_properties), so the table is also whole when
# pytest-xdist runs the tests in worker processes; the controlling process prints it.

_SENT: set[str] = set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when != "teardown" or "fault.report" not in sys.modules:
        return
    from fault.report import RESULTS

    for scenario, cells in RESULTS.items():
        if scenario not in _SENT:
            _SENT.add(scenario)
            report.user_properties.append(
                ("fault_scenario", (scenario, {k: (c.ok, c.detail) for k, c in cells.items()})))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    rows = [value for name, value in report.user_properties if name == "fault_scenario"]
    if not rows:
        return
    from fault.report import RESULTS
    from fault.workload import Cell

    for scenario, cells in rows:
        RESULTS.setdefault(scenario, {k: Cell(ok, detail) for k, (ok, detail) in cells.items()})


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if "fault.report" not in sys.modules:
        return
    from fault.report import RESULTS, table

    if not RESULTS:
        return
    terminalreporter.section("fault scenarios x invariants")
    for line in table(details=config.get_verbosity() > 0):
        terminalreporter.write_line(line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``nightly`` (the property runs at ten times the examples) are left out
    unless asked for (``-m nightly``): deselected, so a run never counts them as skipped."""
    if "nightly" in (config.getoption("-m") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("nightly") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
