"""A small MCP server that changes state, to put the gateway in front of (``toolguard mcp example``).

A ticket board in one SQLite file: ``open_ticket``, ``attach_log``,
``close_ticket`` (which the bundled policy orders ``after: [attach_log]``) and
``list_tickets``. It knows nothing of toolguard: every guarantee comes from the
gateway. Run it alone with ``python -m toolguard.gateway.example`` (stdio);
``TOOLGUARD_EXAMPLE_DB`` says where the board lives (default
``./.toolguard/example-tickets.db``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["POLICY_PATH", "SERVER_MODULE"]

#: The bundled policy for this server.
POLICY_PATH = Path(__file__).with_name("policy.yml")
#: ``python -m SERVER_MODULE`` runs the server over stdio.
SERVER_MODULE = "toolguard.gateway.example"
