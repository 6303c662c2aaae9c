"""pytest plugin: toolguard's ``GuardedToolCalls`` in every LangGraph ``ToolNode``.

Loaded into LangGraph's own prebuilt test suite (``-p toolguard_suite_plugin``)
to check that the wrapper changes nothing a ToolNode user relies on. Every
``ToolNode`` built while the suite runs gets a ``ToolGuard`` of its own with the
most permissive legal policy: each of the node's tools ``read_only: true``,
agents ``"*"``. Every guard is built as a user must build one: with a lock
manager and a store for both paths (embedded SQLite files in
``TOOLGUARD_SUITE_DIR``), and a host-given agent (``AGENT``). The suite's tests
are not touched.

Environment:

- ``TOOLGUARD_SUITE_COMPOSITION``: ``outermost`` (toolguard wraps the test's own
  ``wrap_tool_call``), ``innermost`` (toolguard sits directly around ToolNode's
  ``execute``, inside the test's wrapper), ``passthrough`` (the control: a
  wrapper that does nothing, where toolguard's would be) or ``plain`` (nothing).
- ``TOOLGUARD_SUITE_DIR``: where the embedded SQLite store (with the audit
  log), the lock file and ``summary.json`` go. The summary has, per test, its outcome and the
  decision of every audit row its guarded calls left, with the number of
  calls the wrapper saw (the caller checks one row per call).
- ``TOOLGUARD_SUITE_UNKNOWN``: the policy's ``on_unknown_tool`` (default ``deny``).
- ``TOOLGUARD_SUITE_METADATA``: ``0`` turns off ``response_metadata["toolguard"]``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from langgraph.prebuilt.tool_node import ToolNode

from toolguard import ToolGuard
from toolguard.adapters import GuardedToolCalls
from toolguard.locks import connect, connect_async
from toolguard.policies import Policy
from toolguard.store import open_async_store, open_store

COMPOSITIONS = ("plain", "passthrough", "outermost", "innermost")
#: The host-given identity every guarded call runs as (the policy admits any agent).
AGENT = "langgraph-suite"

Wrapper = Callable[[Any, Callable[[Any], Any]], Any]
AsyncWrapper = Callable[[Any, Callable[[Any], Awaitable[Any]]], Awaitable[Any]]


class _Installer:
    """Builds one guard per ToolNode and counts the calls its wrapper sees."""

    def __init__(self, composition: str, folder: Path, *, on_unknown_tool: str,
                 metadata: bool) -> None:
        self.composition = composition
        self.on_unknown_tool = on_unknown_tool
        self.metadata = metadata
        self.audit_path = folder / "audit.db"
        url, lock_url = f"sqlite:///{self.audit_path}", f"sqlite:///{folder / 'locks.db'}"
        self.store = open_store(url, install=True)
        self.async_store = open_async_store(url)
        self.locks = connect(lock_url)
        self.async_locks = connect_async(lock_url)
        self.calls = 0
        self._lock = threading.Lock()

    def policy(self, node: ToolNode) -> Policy:
        tools = {name: {"read_only": True} for name in node.tools_by_name}
        defaults = {"agents": ["*"], "on_unknown_tool": self.on_unknown_tool}
        return Policy.from_dict({"version": 1, "defaults": defaults, "tools": tools})

    def _counted(self, wrapper: Wrapper) -> Wrapper:
        @functools.wraps(wrapper)
        def counted(request: Any, execute: Callable[[Any], Any]) -> Any:
            with self._lock:
                self.calls += 1
            return wrapper(request, execute)

        return counted

    def _acounted(self, wrapper: AsyncWrapper) -> AsyncWrapper:
        @functools.wraps(wrapper)
        async def counted(request: Any, execute: Callable[[Any], Awaitable[Any]]) -> Any:
            with self._lock:
                self.calls += 1
            return await wrapper(request, execute)

        return counted

    def install(self, node: ToolNode) -> None:
        if self.composition == "passthrough":
            ours, aours = self._counted(_passthrough), self._acounted(_apassthrough)
        else:
            guard = ToolGuard(self.policy(node), locks=self.locks, store=self.store,
                              async_locks=self.async_locks, async_store=self.async_store)
            calls = GuardedToolCalls(guard, agent=AGENT, metadata=self.metadata)
            ours = self._counted(calls.wrap_tool_call)
            aours = self._acounted(calls.awrap_tool_call)
        theirs, atheirs = node._wrap_tool_call, node._awrap_tool_call
        if theirs is None and atheirs is None:
            node._wrap_tool_call, node._awrap_tool_call = ours, aours
            return
        outermost = self.composition != "innermost"
        # ToolNode's async path falls back to the sync wrapper when no async one was
        # given; keep that shape, so a test's sync-only wrapper still runs under ainvoke.
        if theirs is None:
            node._wrap_tool_call = ours
        else:
            node._wrap_tool_call = _nest(ours, theirs) if outermost else _nest(theirs, ours)
        if atheirs is not None:
            node._awrap_tool_call = _anest(aours, atheirs) if outermost else _anest(atheirs, aours)

    def close(self) -> None:
        async def close_async() -> None:
            await self.async_locks.aclose()
            await self.async_store.close()

        asyncio.run(close_async())
        self.locks.close()
        self.store.close()

    def audit_rows_after(self, last_id: int) -> tuple[int, list[str]]:
        """``(newest id, ["decision/reason", ...])`` of the audit rows after ``last_id``."""
        with sqlite3.connect(self.audit_path) as conn:
            rows = conn.execute("SELECT id, decision, reason FROM toolguard_audit WHERE id > ? "
                                "ORDER BY id", (last_id,)).fetchall()
        return (rows[-1][0] if rows else last_id), [f"{d}/{r}" for _, d, r in rows]


def _passthrough(request: Any, execute: Callable[[Any], Any]) -> Any:
    """The control: a wrapper that does nothing, installed where toolguard's would be."""
    return execute(request)


async def _apassthrough(request: Any, execute: Callable[[Any], Awaitable[Any]]) -> Any:
    return await execute(request)


def _nest(outer: Wrapper, inner: Wrapper) -> Wrapper:
    """``outer`` around ``inner`` around ToolNode's execute (as ``create_agent`` chains them)."""

    def composed(request: Any, execute: Callable[[Any], Any]) -> Any:
        return outer(request, lambda req: inner(req, execute))

    return composed


def _anest(outer: AsyncWrapper, inner: AsyncWrapper) -> AsyncWrapper:
    async def composed(request: Any, execute: Callable[[Any], Awaitable[Any]]) -> Any:
        async def call_inner(req: Any) -> Any:
            return await inner(req, execute)

        return await outer(request, call_inner)

    return composed


class _Recorder:
    """Per test: its outcome, the calls the wrapper saw and the audit rows they left."""

    def __init__(self, composition: str, folder: Path, installer: _Installer | None) -> None:
        self.composition = composition
        self.folder = folder
        self.installer = installer
        self.tests: dict[str, dict[str, Any]] = {}
        self._calls_before = 0
        self._last_audit_id = 0

    def _entry(self, nodeid: str) -> dict[str, Any]:
        return self.tests.setdefault(nodeid, {"outcome": "passed", "calls": 0, "decisions": []})

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        if self.installer is not None:
            self._calls_before = self.installer.calls
        yield
        entry = self._entry(item.nodeid)
        if self.installer is not None:
            entry["calls"] = self.installer.calls - self._calls_before
            self._last_audit_id, entry["decisions"] = \
                self.installer.audit_rows_after(self._last_audit_id)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self._entry(report.nodeid)
        if hasattr(report, "wasxfail"):
            entry["outcome"] = "xpassed" if report.passed else "xfailed"
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"

    def write(self) -> None:
        summary = {"composition": self.composition, "tests": self.tests}
        (self.folder / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))


_installer: _Installer | None = None
_original_init = ToolNode.__init__


def _guarded_init(self: ToolNode, *args: Any, **kwargs: Any) -> None:
    _original_init(self, *args, **kwargs)
    if _installer is not None:
        _installer.install(self)


def _composition() -> str:
    composition = os.environ.get("TOOLGUARD_SUITE_COMPOSITION", "outermost")
    if composition not in COMPOSITIONS:
        msg = f"TOOLGUARD_SUITE_COMPOSITION must be one of {COMPOSITIONS}, got {composition!r}"
        raise pytest.UsageError(msg)
    return composition


def pytest_configure(config: pytest.Config) -> None:
    global _installer
    composition = _composition()
    folder = Path(os.environ.get("TOOLGUARD_SUITE_DIR") or config.rootpath / ".toolguard-suite")
    folder.mkdir(parents=True, exist_ok=True)
    if composition != "plain":
        _installer = _Installer(composition, folder,
                                on_unknown_tool=os.environ.get("TOOLGUARD_SUITE_UNKNOWN", "deny"),
                                metadata=os.environ.get("TOOLGUARD_SUITE_METADATA", "1") != "0")
        ToolNode.__init__ = _guarded_init  # type: ignore[method-assign]
    config.pluginmanager.register(_Recorder(composition, folder, _installer), "toolguard_recorder")


def pytest_unconfigure(config: pytest.Config) -> None:
    global _installer
    recorder = config.pluginmanager.get_plugin("toolguard_recorder")
    if recorder is not None:
        recorder.write()
    if _installer is not None:
        ToolNode.__init__ = _original_init  # type: ignore[method-assign]
        _installer.close()
        _installer = None


def pytest_report_header(config: pytest.Config) -> str:
    return f"toolguard: {_composition()} (GuardedToolCalls in every ToolNode)"
