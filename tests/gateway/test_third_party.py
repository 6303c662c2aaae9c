"""Servers nobody here wrote, from the package index, behind the gateway: mcp-server-git and -sqlite.

Each is installed into a virtualenv of its own (``server_venv``); the policies
are the guide's own (docs/gateway.md), so the guide is tested against them.
"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path

import pytest
from docs.markdown import blocks  # the docs suite's reader: the guide's own policy blocks

from .conftest import ROOT, audit_rows, clean_env, server_venv, stdio_session, toolguard

#: Each test starts real processes (the gateway, its upstream): slow on a loaded machine.
pytestmark = pytest.mark.timeout(900)

GUIDE = ROOT / "docs" / "gateway.md"
#: The versions tested, which the guide names: a new release is tested before the guide says so.
GIT_SERVER = ("mcp-server-git", "2026.10.19")
SQLITE_SERVER = ("mcp-server-sqlite", "2025.4.25")
#: mcp-server-sqlite is written against the MCP SDK's 1.x server API, which 2.x removed.
SQLITE_SDK = "mcp<2"
KEY = "toolguard/idempotency-key"


def guide_policy(tmp_path: Path, name: str) -> Path:
    (block,) = [b for b in blocks(GUIDE) if b.lang == "yaml" and b.args == (name,)]
    path = tmp_path / name
    path.write_text(block.text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def git_server() -> Path:
    return server_venv(*GIT_SERVER) / "mcp-server-git"


@pytest.fixture(scope="module")
def sqlite_server() -> Path:
    return server_venv(*SQLITE_SERVER, SQLITE_SDK) / "mcp-server-sqlite"


def test_the_guide_names_the_tested_versions() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    for name, version in (GIT_SERVER, SQLITE_SERVER):
        assert f"| `{name}` | {version} |" in text, name
    assert f"'{SQLITE_SERVER[0]}=={SQLITE_SERVER[1]}' '{SQLITE_SDK}'" in text


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def meta(reply) -> dict:
    return dict(reply.meta or {})


def test_mcp_server_git_commits_once_in_order_and_only_for_allowed_agents(
        tmp_path: Path, git_server: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    (repo / "a.txt").write_text("one\n")
    policy = guide_policy(tmp_path, "git-policy.yml")
    env = clean_env(tmp_path)

    def gateway(agent: str) -> list[str]:
        return toolguard("mcp", "proxy", "--policy", str(policy), "--agent", agent, "--",
                         str(git_server), "--repository", str(repo))

    async def run():
        async with stdio_session(gateway("coder"), tmp_path, env) as coder:
            early = await coder.call_tool("git_commit", {"repo_path": str(repo), "message": "x"})
            added = await coder.call_tool("git_add", {"repo_path": str(repo), "files": ["a.txt"]})
            commit = {"repo_path": str(repo), "message": "first"}
            first = await coder.call_tool("git_commit", commit, meta={KEY: "c-1"})
            retry = await coder.call_tool("git_commit", commit, meta={KEY: "c-1"})
            status = await coder.call_tool("git_status", {"repo_path": str(repo)})
            reset = await coder.call_tool("git_reset", {"repo_path": str(repo)})
        return early, added, first, retry, status, reset

    early, added, first, retry, status, reset = asyncio.run(run())
    assert meta(early)["toolguard/reason"] == "out_of_order"
    assert not added.is_error and not first.is_error, (added.content, first.content)
    assert meta(retry)["toolguard/replayed"] is True
    assert not status.is_error
    assert meta(reset)["toolguard/reason"] == "not_authorized"
    assert _git(repo, "log", "--format=%s").split() == ["first"]   # one commit, not two
    rows = audit_rows(tmp_path)
    assert [(r.tool, r.reason) for r in rows] == [
        ("git_commit", "out_of_order"), ("git_add", "applied"), ("git_commit", "applied"),
        ("git_commit", "duplicate"), ("git_status", "applied"), ("git_reset", "not_authorized")]


def test_mcp_server_sqlite_applies_a_retried_insert_once(tmp_path: Path,
                                                         sqlite_server: Path) -> None:
    db = tmp_path / "data.db"
    with closing(sqlite3.connect(db)) as connection, connection:
        connection.execute("CREATE TABLE events (id INTEGER PRIMARY KEY, what TEXT)")
    policy = guide_policy(tmp_path, "sqlite-policy.yml")
    args = toolguard("mcp", "proxy", "--policy", str(policy), "--agent", "loader", "--",
                     str(sqlite_server), "--db-path", str(db))
    insert = {"query": "INSERT INTO events (what) VALUES ('paid')"}

    async def run():
        async with stdio_session(args, tmp_path, clean_env(tmp_path)) as loader:
            first = await loader.call_tool("write_query", insert, meta={KEY: "ins-1"})
            again = await loader.call_tool("write_query", insert, meta={KEY: "ins-1"})
            table = await loader.call_tool("create_table", {"query": "CREATE TABLE t (x)"})
            read = await loader.call_tool("read_query", {"query": "SELECT COUNT(*) FROM events"})
        return first, again, table, read

    first, again, table, read = asyncio.run(run())
    assert not first.is_error, first.content
    assert meta(again)["toolguard/replayed"] is True
    assert meta(table)["toolguard/reason"] == "approval_required"   # the SDK client cannot elicit
    assert meta(table)["toolguard/approval-id"]
    assert not read.is_error
    with closing(sqlite3.connect(db)) as connection:
        assert connection.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 1
        tables = {r[0] for r in connection.execute("SELECT name FROM sqlite_master")}
    assert "t" not in tables
    assert [r.reason for r in audit_rows(tmp_path)] == ["applied", "duplicate",
                                                        "approval_required", "applied"]


def test_mcp_check_reports_missed_tools_and_unknown_arguments(tmp_path: Path,
                                                              git_server: Path) -> None:
    policy = tmp_path / "partial.yml"
    policy.write_text("version: 1\n"
                      "defaults: {on_unknown_tool: deny, fenced: false}\n"
                      "tools:\n"
                      "  git_status: {read_only: true, agents: ['*']}\n"
                      "  git_commit:\n"
                      "    locks: ['repo:{repository}']\n"
                      "    agents: ['*']\n"
                      "  git_push: {read_only: true, agents: ['*']}\n")
    done = subprocess.run(toolguard("mcp", "check", "--policy", str(policy), "--",
                                    str(git_server)),
                          capture_output=True, text=True, env=clean_env(tmp_path), cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert "missed: git_add: listed by the upstream, not in the policy; every call is refused " \
           "unknown_tool" in lines
    assert any(line.startswith("absent: git_push") for line in lines)
    assert any("partial.yml:6" in line and "{repository}" in line for line in lines), lines
