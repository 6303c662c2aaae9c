"""The tests' own upstream: a FastMCP server over stdio whose tools change a SQLite file.

``bump`` adds to a counter and keeps, per counter, how many calls ran at once
(``max_inside``): two calls serialized by the gateway never overlap. ``slow``
writes its process id to ``UPSTREAM_PID_FILE`` and then waits, so a test can
kill the server mid-call. ``forbidden`` is a tool the tests' policy denies: it
records every call that reaches it. ``progress`` reports progress; ``peek_header``
tells what an HTTP header was (with ``UPSTREAM_HTTP_PORT`` it serves streamable
HTTP instead of stdio). With
``UPSTREAM_HOSTILE_SCHEMA=1`` it also lists a tool whose schema uses ``not``.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

os.environ.setdefault("FASTMCP_LOG_LEVEL", "WARNING")

from fastmcp import Context, FastMCP
from fastmcp.tools.base import Tool, ToolResult
from mcp_types import TextContent

DB = Path(os.environ["UPSTREAM_DB"])
_SCHEMA = """
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL DEFAULT 0,
                                     inside INTEGER NOT NULL DEFAULT 0,
                                     max_inside INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS calls (tool TEXT NOT NULL, detail TEXT);
"""


def _db() -> sqlite3.Connection:
    connection = sqlite3.connect(DB, timeout=30, isolation_level=None)
    connection.executescript(_SCHEMA)
    return connection


def _note(tool: str, detail: str = "") -> None:
    with closing(_db()) as db:
        db.execute("INSERT INTO calls VALUES (?, ?)", (tool, detail))


mcp: FastMCP = FastMCP("upstream")


@mcp.tool
async def bump(counter: str, by: int = 1, hold_s: float = 0.0) -> dict[str, Any]:
    """Add ``by`` to ``counter``; hold the write ``hold_s`` seconds (to make overlaps visible)."""
    _note("bump", f"{counter}:{by}")
    with closing(_db()) as db:
        db.execute("INSERT OR IGNORE INTO counters (name) VALUES (?)", (counter,))
        db.execute("UPDATE counters SET inside = inside + 1, max_inside = MAX(max_inside, inside + 1)"
                   " WHERE name = ?", (counter,))
    try:
        await asyncio.sleep(hold_s)
        with closing(_db()) as db:
            db.execute("UPDATE counters SET value = value + ? WHERE name = ?", (by, counter))
            value = db.execute("SELECT value FROM counters WHERE name = ?", (counter,)).fetchone()[0]
    finally:
        with closing(_db()) as db:
            db.execute("UPDATE counters SET inside = inside - 1 WHERE name = ?", (counter,))
    return {"counter": counter, "value": value}


@mcp.tool
async def read_counter(counter: str) -> int:
    """The counter's value (a read: the model decides from it)."""
    with closing(_db()) as db:
        row = db.execute("SELECT value FROM counters WHERE name = ?", (counter,)).fetchone()
    return int(row[0]) if row else 0


@mcp.tool
async def set_counter(counter: str, value: int) -> int:
    """Set the counter to a value the model computed."""
    _note("set_counter", f"{counter}:{value}")
    with closing(_db()) as db:
        db.execute("INSERT INTO counters (name, value) VALUES (?, ?) "
                   "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (counter, value))
    return value


@mcp.tool
async def attach(counter: str, note: str) -> str:
    """A step that must come before ``close`` on the same counter (``after:`` in the policy)."""
    _note("attach", f"{counter}:{note}")
    return "attached"


@mcp.tool
async def close(counter: str) -> str:
    """Runs only after ``attach`` on the same counter (the policy orders it)."""
    _note("close", counter)
    return "closed"


@mcp.tool
async def slow(counter: str, seconds: float = 60.0) -> str:
    """Write this process's id where the test reads it, then wait (the test kills or cancels it)."""
    _note("slow", counter)
    Path(os.environ["UPSTREAM_PID_FILE"]).write_text(str(os.getpid()))
    await asyncio.sleep(seconds)
    return "done"


@mcp.tool
async def forbidden(counter: str) -> str:
    """The policy denies it: any call that reaches here is a gateway bug."""
    _note("forbidden", counter)
    return "reached"


@mcp.tool
async def progress(counter: str, ctx: Context) -> str:
    """Report three progress steps, then answer."""
    for step in range(1, 4):
        await ctx.report_progress(step, 3, f"step {step}")
    return "progressed"


@mcp.tool
async def peek_env(name: str) -> bool:
    """Whether this server's environment has ``name`` (the gateway keeps its secrets to itself)."""
    return name in os.environ


@mcp.tool
async def peek_header(name: str) -> str | None:
    """The HTTP header ``name`` this call came with (served over HTTP), None without it."""
    from fastmcp.server.dependencies import get_http_headers

    return get_http_headers(include_all=True).get(name.lower())


@mcp.tool
async def fails(counter: str) -> ToolResult:
    """Answer with an error result (isError), which the gateway passes on unchanged."""
    _note("fails", counter)
    return ToolResult(content=[TextContent(type="text", text=f"upstream says no to {counter}")],
                      is_error=True)


if os.environ.get("UPSTREAM_HOSTILE_SCHEMA") == "1":
    def _odd(counter: str) -> str:
        return counter

    mcp.add_tool(Tool.from_function(_odd, name="odd").model_copy(update={"parameters": {
        "type": "object", "properties": {"counter": {"not": {"type": "integer"}}}}}))

if __name__ == "__main__":
    if os.environ.get("UPSTREAM_HTTP_PORT"):  # streamable HTTP, for an --upstream URL
        mcp.run(transport="http", host="127.0.0.1", port=int(os.environ["UPSTREAM_HTTP_PORT"]),
                show_banner=False, log_level="warning")
    else:
        mcp.run(transport="stdio", show_banner=False)
