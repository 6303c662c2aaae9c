"""The example ticket board as a FastMCP server (see the package docstring)."""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Annotated, Any

from fastmcp import FastMCP
from pydantic import Field

__all__ = ["board_path", "build_server"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tickets (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'open',
    resolution TEXT
);
CREATE TABLE IF NOT EXISTS logs (
    ticket_id INTEGER NOT NULL REFERENCES tickets(id),
    text TEXT NOT NULL
);
"""


def board_path() -> Path:
    """Where the board lives: ``TOOLGUARD_EXAMPLE_DB``, else ``./.toolguard/example-tickets.db``."""
    given = os.environ.get("TOOLGUARD_EXAMPLE_DB")
    return Path(given) if given else Path.cwd() / ".toolguard" / "example-tickets.db"


def _connect() -> sqlite3.Connection:
    path = board_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(path, timeout=10)
    connection.executescript(_SCHEMA)
    return connection


def build_server() -> FastMCP:
    """The server: four tools on the board, no toolguard inside."""
    mcp: FastMCP = FastMCP("example-tickets")

    @mcp.tool
    def open_ticket(title: Annotated[str, Field(min_length=1, max_length=200)]) -> dict[str, Any]:
        """Open a ticket; returns its id."""
        with closing(_connect()) as db, db:
            cursor = db.execute("INSERT INTO tickets (title) VALUES (?)", (title,))
        return {"id": cursor.lastrowid, "title": title, "status": "open"}

    @mcp.tool
    def attach_log(ticket_id: int, text: Annotated[str, Field(max_length=10_000)]) -> dict[str, Any]:
        """Attach a log excerpt to a ticket."""
        with closing(_connect()) as db, db:
            if db.execute("SELECT 1 FROM tickets WHERE id = ?", (ticket_id,)).fetchone() is None:
                msg = f"no ticket {ticket_id}"
                raise ValueError(msg)
            db.execute("INSERT INTO logs (ticket_id, text) VALUES (?, ?)", (ticket_id, text))
            count = db.execute("SELECT COUNT(*) FROM logs WHERE ticket_id = ?",
                               (ticket_id,)).fetchone()[0]
        return {"ticket_id": ticket_id, "logs": count}

    @mcp.tool
    def close_ticket(ticket_id: int, resolution: Annotated[str, Field(max_length=500)]
                     ) -> dict[str, Any]:
        """Close a ticket with a resolution."""
        with closing(_connect()) as db, db:
            changed = db.execute("UPDATE tickets SET status = 'closed', resolution = ? "
                                 "WHERE id = ? AND status = 'open'", (resolution, ticket_id))
        if changed.rowcount == 0:
            msg = f"ticket {ticket_id} is not open"
            raise ValueError(msg)
        return {"id": ticket_id, "status": "closed", "resolution": resolution}

    @mcp.tool
    def list_tickets() -> list[dict[str, Any]]:
        """Every ticket, with how many logs it has."""
        with closing(_connect()) as db:
            rows = db.execute("SELECT t.id, t.title, t.status, t.resolution, COUNT(l.text) "
                              "FROM tickets t LEFT JOIN logs l ON l.ticket_id = t.id "
                              "GROUP BY t.id ORDER BY t.id").fetchall()
        return [{"id": r[0], "title": r[1], "status": r[2], "resolution": r[3], "logs": r[4]}
                for r in rows]

    return mcp
