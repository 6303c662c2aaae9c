"""The README's gateway command, run as written (on a free port), in front of the bundled example."""

from __future__ import annotations

import asyncio
import shlex
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, Gateway, audit_rows, clean_env, free_port, http_session

#: Each test starts real processes (the gateway, its upstream): slow on a loaded machine.
pytestmark = pytest.mark.timeout(900)


def readme_command() -> list[str]:
    """The README's one gateway command: the part after ``&&`` on the ``mcp example`` line."""
    (line,) = [line for line in (ROOT / "README.md").read_text().splitlines()
               if "toolguard mcp example" in line and line.startswith(".venv/")]
    return shlex.split(line.split("&&", 1)[1])


def test_the_readme_command_serves_the_example_behind_the_gateway(tmp_path: Path,
                                                                  gateways: list[Gateway]) -> None:
    words = readme_command()
    assert words[:3] == [".venv/bin/toolguard", "mcp", "example"]
    assert words[3:] == ["--listen", "127.0.0.1:8931"]
    port = free_port()  # the README's port may be taken on a shared machine: the rest is as written
    command = [sys.executable, "-m", "toolguard", *words[1:-1], f"127.0.0.1:{port}"]
    gateway = Gateway(command, tmp_path, clean_env(tmp_path), port)
    gateways.append(gateway)
    gateway.start()

    async def run():
        async with http_session(gateway.url) as session:
            opened = await session.call_tool("open_ticket", {"title": "printer on fire"})
            ticket = opened.structured_content["id"]
            early = await session.call_tool("close_ticket", {"ticket_id": ticket,
                                                             "resolution": "fixed"})
            logged = await session.call_tool("attach_log", {"ticket_id": ticket,
                                                            "text": "token=s3cret"})
            closed = await session.call_tool("close_ticket", {"ticket_id": ticket,
                                                              "resolution": "fixed"})
            listed = await session.call_tool("list_tickets", {})
            return early, logged, closed, listed

    early, logged, closed, listed = asyncio.run(run())
    assert (early.meta or {})["toolguard/reason"] == "out_of_order"
    assert not logged.is_error and not closed.is_error, (logged.content, closed.content)
    assert listed.structured_content["result"][0]["status"] == "closed"
    rows = audit_rows(tmp_path)
    assert [(r.tool, r.reason, r.agent) for r in rows] == [
        ("open_ticket", "applied", "example"), ("close_ticket", "out_of_order", "example"),
        ("attach_log", "applied", "example"), ("close_ticket", "applied", "example"),
        ("list_tickets", "applied", "example")]
    assert "s3cret" not in str(rows[2].args)  # redacted before it was written
