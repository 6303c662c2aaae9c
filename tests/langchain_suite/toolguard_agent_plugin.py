"""pytest plugin: a tool-call middleware appended or prepended to every LangChain ``create_agent``.

Loaded into LangChain's own agent test suite (``-p toolguard_agent_plugin``) to
check that ``ToolGuardMiddleware`` changes nothing a ``create_agent`` user
relies on beyond what any tool-call middleware changes. ``create_agent`` is
replaced (in ``langchain.agents`` and ``langchain.agents.factory``, before the
suite's conftests import it) by a function that adds one middleware to the
``middleware=`` list and calls the real one; the suite's tests are not touched.

Every guard is built as a user must build one: a policy naming the agent's
tools (those given to ``create_agent`` and those its middlewares bring) as
``read_only: true`` for any agent, a host-given agent identity (``AGENT``),
and a lock manager and a store for both paths (embedded SQLite files in
``TOOLGUARD_SUITE_DIR``, one pair for the whole run). LangChain's tests run on
their own in-memory checkpointers, reusing thread ids (``"1"``) and the fake
model's call ids (``"1"``, ``"2"``) from test to test; the idempotency key of a
guarded call is therefore toolguard's default key prefixed with the running
test's id, so that each test is an application of its own, as it would be with
a store of its own.

Environment:

- ``TOOLGUARD_SUITE_COMPOSITION``: ``innermost`` (``ToolGuardMiddleware``
  appended: directly around the tool), ``outermost`` (prepended: around every
  other middleware's ``wrap_tool_call``), ``passthrough`` (the control: a
  middleware that only calls its handler, appended) or ``plain`` (nothing).
- ``TOOLGUARD_SUITE_DIR``: where the store (with the audit log), the lock file
  and ``summary.json`` go. The summary has, per test, its outcome (and the
  failure's message), the ``create_agent`` calls it made, the calls the added
  middleware saw on each path (``calls``, ``async_calls``), whether LangChain's
  ``blockbuster`` fixture ran it, the decision of every audit row its guarded
  calls left (one per call) and the detail of any that names a ``BlockingError``
  (a blocking call toolguard made in the event loop).
- ``TOOLGUARD_SUITE_ONLY``: a file of test ids, one a line: every other test is
  deselected (after collection, so module-level agents are built as in a full run).
- ``TOOLGUARD_SUITE_UNKNOWN``: the policy's ``on_unknown_tool`` (default ``allow``).
- ``TOOLGUARD_SUITE_METADATA``: ``1`` puts toolguard's decision under
  ``response_metadata["toolguard"]`` (default ``0``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sqlite3
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import langchain.agents
import pytest
from langchain.agents import factory
from langchain.agents.middleware import AgentMiddleware
from langchain_core.tools import BaseTool
from langchain_core.tools import tool as as_tool

from toolguard import ToolGuard
from toolguard.adapters import ToolGuardMiddleware
from toolguard.call.intent import Intent, default_idempotency_key
from toolguard.locks import connect, connect_async
from toolguard.policies import Policy
from toolguard.store import open_async_store, open_store

COMPOSITIONS = ("plain", "passthrough", "innermost", "outermost")
#: The host-given identity every guarded call runs as (the policy admits any agent).
AGENT = "langchain-suite"

Handler = Callable[[Any], Any]
AsyncHandler = Callable[[Any], Awaitable[Any]]


class ToolSuitePassthrough(AgentMiddleware):
    """The control: wraps every tool call and only calls its handler, where toolguard's would be."""

    def wrap_tool_call(self, request: Any, handler: Handler) -> Any:
        return handler(request)

    async def awrap_tool_call(self, request: Any, handler: AsyncHandler) -> Any:
        return await handler(request)


class _Counted(AgentMiddleware):
    """Counts the tool calls ``inner`` sees; keeps ``inner``'s name (LangChain's traces use it)."""

    def __init__(self, inner: AgentMiddleware, calls: _Counter,
                 async_calls: _Counter) -> None:
        super().__init__()
        self.inner = inner
        self.calls = calls
        self.async_calls = async_calls

    @property
    def name(self) -> str:
        return self.inner.name

    def wrap_tool_call(self, request: Any, handler: Handler) -> Any:
        self.calls.add()
        return self.inner.wrap_tool_call(request, handler)

    async def awrap_tool_call(self, request: Any, handler: AsyncHandler) -> Any:
        self.calls.add()
        self.async_calls.add()
        return await self.inner.awrap_tool_call(request, handler)


class _Counter:
    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.value += 1


class _Installer:
    """Builds the middleware of each ``create_agent`` and keeps the run's store and locks."""

    def __init__(self, composition: str, folder: Path, *, on_unknown_tool: str,
                 metadata: bool) -> None:
        self.composition = composition
        self.on_unknown_tool = on_unknown_tool
        self.metadata = metadata
        self.calls = _Counter()
        self.async_calls = _Counter()
        self.agents = _Counter()
        #: The running test's id: the namespace of its idempotency keys.
        self.test_id = "collection"
        self.audit_path = folder / "audit.db"
        if composition == "passthrough":
            return
        url, lock_url = f"sqlite:///{self.audit_path}", f"sqlite:///{folder / 'locks.db'}"
        self.store = open_store(url, install=True)
        self.async_store = open_async_store(url)
        self.locks = connect(lock_url)
        self.async_locks = connect_async(lock_url)

    def key(self, intent: Intent) -> str | None:
        """toolguard's default idempotency key, within the running test."""
        key = default_idempotency_key(intent)
        return None if key is None else f"test:{self.test_id}/{key}"

    def policy(self, tools: Sequence[Any], middleware: Sequence[Any]) -> Policy:
        names = _tool_names([*tools, *(t for m in middleware for t in getattr(m, "tools", ()))])
        data = {"version": 1, "tools": {name: {"read_only": True} for name in names},
                "defaults": {"agents": ["*"], "on_unknown_tool": self.on_unknown_tool}}
        return Policy.from_dict(data, key_fn=self.key)

    def middleware(self, tools: Sequence[Any], middleware: Sequence[Any]) -> AgentMiddleware:
        self.agents.add()
        if self.composition == "passthrough":
            return _Counted(ToolSuitePassthrough(), self.calls, self.async_calls)
        guard = ToolGuard(self.policy(tools, middleware), locks=self.locks, store=self.store,
                          async_locks=self.async_locks, async_store=self.async_store)
        return _Counted(ToolGuardMiddleware(guard, agent=AGENT, metadata=self.metadata), self.calls,
                        self.async_calls)

    def last_audit_id(self) -> int:
        if self.composition == "passthrough":
            return 0
        with sqlite3.connect(self.audit_path) as conn:
            (last,) = conn.execute("SELECT coalesce(max(id), 0) FROM toolguard_audit").fetchone()
        return int(last)

    def compose(self, middleware: Sequence[Any], ours: AgentMiddleware) -> list[Any]:
        """The first middleware listed is the outermost."""
        if self.composition == "outermost":
            return [ours, *middleware]
        return [*middleware, ours]

    def close(self) -> None:
        if self.composition == "passthrough":
            return

        async def close_async() -> None:
            await self.async_locks.aclose()
            await self.async_store.close()

        asyncio.run(close_async())
        self.locks.close()
        self.store.close()

    def audit_rows(self) -> list[tuple[int, str, str, str]]:
        """``(id, test or "", "decision/reason", detail)`` of every audit row, oldest first.

        The test is the one named in the row's idempotency key (``key``): a cancelled
        call's row may be written after its test ended. Rows refused before their key
        was made name no test.
        """
        if self.composition == "passthrough":
            return []
        with sqlite3.connect(self.audit_path) as conn:
            rows = conn.execute("SELECT id, idempotency_key, decision, reason, detail "
                                "FROM toolguard_audit ORDER BY id").fetchall()
        return [(row_id, _test_of(key or ""), f"{decision}/{reason}", detail or "")
                for row_id, key, decision, reason, detail in rows]


def _test_of(key: str) -> str:
    """The test id ``_Installer.key`` put in front of toolguard's default key."""
    if not key.startswith("test:"):
        return ""
    for scope in ("/thread:", "/run:"):
        if scope in key:
            return key[len("test:"):key.index(scope)]
    return ""


def _tool_names(tools: Sequence[Any]) -> list[str]:
    """The names ``create_agent``'s ToolNode gives these tools (provider tools, dicts, run remotely)."""
    names = []
    for given in tools:
        if isinstance(given, BaseTool):
            names.append(given.name)
        elif callable(given):
            try:
                names.append(as_tool(given).name)
            except Exception:  # create_agent itself refuses it: no name to list
                continue
    return sorted(set(names))


class _Recorder:
    """Per test: its outcome, its agents, the calls the middleware saw and their audit rows."""

    def __init__(self, composition: str, folder: Path, installer: _Installer | None) -> None:
        self.composition = composition
        self.folder = folder
        self.installer = installer
        self.tests: dict[str, dict[str, Any]] = {}

    def _entry(self, nodeid: str) -> dict[str, Any]:
        return self.tests.setdefault(nodeid, {"outcome": "passed", "agents": 0, "calls": 0,
                                              "async_calls": 0, "decisions": []})

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        only = os.environ.get("TOOLGUARD_SUITE_ONLY")
        if not only:
            return
        chosen = set(Path(only).read_text().splitlines())
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in chosen])
        items[:] = [item for item in items if item.nodeid in chosen]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        installer = self.installer
        if installer is None:
            yield
            self._entry(item.nodeid)["blockbuster"] = _under_blockbuster(item)
            return
        installer.test_id = item.nodeid
        calls, agents = installer.calls.value, installer.agents.value
        async_calls = installer.async_calls.value
        yield
        entry = self._entry(item.nodeid)
        entry["blockbuster"] = _under_blockbuster(item)
        entry["calls"] = installer.calls.value - calls
        entry["async_calls"] = installer.async_calls.value - async_calls
        entry["agents"] = installer.agents.value - agents
        entry["last_audit_id"] = installer.last_audit_id()
        installer.test_id = "between-tests"

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self._entry(report.nodeid)
        if hasattr(report, "wasxfail"):
            entry["outcome"] = "xpassed" if report.passed else "xfailed"
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            crash = getattr(report.longrepr, "reprcrash", None)
            entry["error"] = str(getattr(crash, "message", report.longrepr))[:500]
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"

    def _attribute_audit_rows(self) -> None:
        """Each test's audit rows: those its keys name, and the unnamed ones written while it ran."""
        if self.installer is None:
            return
        # In the order the tests ran (their last ids never decrease): a row belongs to the
        # first test that ended after it was written.
        windows = [(entry.pop("last_audit_id"), test) for test, entry in self.tests.items()
                   if "last_audit_id" in entry]
        for entry in self.tests.values():
            entry["decisions"], entry["blocking"] = [], []
        for row_id, named, decision, detail in self.installer.audit_rows():
            test = named if named in self.tests else next(
                (test for last, test in windows if row_id <= last), "")
            if test:
                self.tests[test]["decisions"].append(decision)
                if "BlockingError" in detail:
                    self.tests[test]["blocking"].append(detail)

    def write(self) -> None:
        self._attribute_audit_rows()
        summary = {"composition": self.composition, "tests": self.tests}
        (self.folder / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))


def _under_blockbuster(item: pytest.Item) -> bool:
    """LangChain's conftest gives every test its autouse ``blockbuster`` fixture."""
    return "blockbuster" in getattr(item, "fixturenames", ())


_installer: _Installer | None = None
_original_create_agent = factory.create_agent


@functools.wraps(_original_create_agent)
def _create_agent_with_middleware(model: Any, tools: Any = None, *args: Any,
                                  middleware: Sequence[Any] = (), **kwargs: Any) -> Any:
    if _installer is None:
        return _original_create_agent(model, tools, *args, middleware=middleware, **kwargs)
    ours = _installer.middleware(list(tools or ()), list(middleware))
    return _original_create_agent(model, tools, *args,
                                  middleware=_installer.compose(list(middleware), ours), **kwargs)


def _composition() -> str:
    composition = os.environ.get("TOOLGUARD_SUITE_COMPOSITION", "innermost")
    if composition not in COMPOSITIONS:
        msg = f"TOOLGUARD_SUITE_COMPOSITION must be one of {COMPOSITIONS}, got {composition!r}"
        raise pytest.UsageError(msg)
    return composition


def _folder(config: pytest.Config) -> Path:
    folder = Path(os.environ.get("TOOLGUARD_SUITE_DIR") or config.rootpath / ".toolguard-suite")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser,
                                  args: list[str]) -> None:
    """Patch before the suite's conftests and test modules import ``create_agent``."""
    global _installer
    composition = _composition()
    if composition != "plain":
        _installer = _Installer(composition, _folder(early_config),
                                on_unknown_tool=os.environ.get("TOOLGUARD_SUITE_UNKNOWN", "allow"),
                                metadata=os.environ.get("TOOLGUARD_SUITE_METADATA", "0") == "1")
        factory.create_agent = _create_agent_with_middleware  # type: ignore[assignment]
        langchain.agents.create_agent = _create_agent_with_middleware  # type: ignore[assignment]


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Recorder(_composition(), _folder(config), _installer),
                                  "toolguard_recorder")


def pytest_unconfigure(config: pytest.Config) -> None:
    global _installer
    recorder = config.pluginmanager.get_plugin("toolguard_recorder")
    if recorder is not None:
        recorder.write()
    if _installer is not None:
        factory.create_agent = _original_create_agent  # type: ignore[assignment]
        langchain.agents.create_agent = _original_create_agent  # type: ignore[assignment]
        _installer.close()
        _installer = None


def pytest_report_header(config: pytest.Config) -> str:
    return f"toolguard: {_composition()} (a tool-call middleware in every create_agent)"
