"""FastMCP over stdio, with the one thing its line reader loses kept for the fences.

The MCP SDK parses each stdin line into a dict, and a JSON object that names a
key twice keeps only the last one. For ``_meta`` that matters: a fencing token
given twice (``k=5`` then ``k=1``) would be applied with whichever came last,
while the sender may have meant the first. Over streamable HTTP
``FenceToolMiddleware`` reads the request's raw body and refuses the repeat;
over stdio there is no raw body left by the time a tool hook runs.

``run_stdio_async(server)`` serves a FastMCP server over stdio as
``server.run_async(transport="stdio")`` does, reading stdin through
``MarkedLines``: a ``tools/call`` line whose ``_meta`` repeats a key gets the
name of that key under ``REPEATED_META_KEY`` in its ``_meta`` (every other line
passes through untouched), and the middleware refuses it as
``invalid_fence_header``, audited once, nothing run. A client that sends
``REPEATED_META_KEY`` itself is refused the same way: the key is toolguard's.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from toolguard.fences.mcp_server import REPEATED_META_KEY, remembering_pairs, repeated_meta_key

__all__ = ["REPEATED_META_KEY", "MarkedLines", "mark_repeated", "run_stdio_async"]



class _Number(str):
    """A JSON number's text as it arrived (never converted: any size costs nothing)."""


def mark_repeated(line: str) -> str:
    """``line`` itself, or (when its ``params._meta`` names a key twice) the same request
    with that key's name under ``REPEATED_META_KEY`` in its ``_meta``.

    The request is written back with every number's text as it arrived. If it cannot
    be written back (nested past Python's recursion limit), what is sent on is the
    request's id and tool name with only the mark: refused all the same, never applied.
    """
    if repeated_meta_key(line) is None:
        return line
    try:
        message = json.loads(line, object_pairs_hook=remembering_pairs, parse_int=_Number,
                             parse_float=_Number, parse_constant=_Number)
        params = message["params"]
        meta = params["_meta"]
        key = meta.repeated
        meta[REPEATED_META_KEY] = key
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        return line  # not one request after all: the SDK's parser answers it as before
    try:
        return _dumped(message) + "\n"
    except RecursionError:
        name = params.get("name")
        bare = {"jsonrpc": "2.0", "id": message.get("id"), "method": message.get("method"),
                "params": {"name": name if isinstance(name, str) else "", "arguments": {},
                           "_meta": {REPEATED_META_KEY: key}}}
        return _dumped(bare) + "\n"


def _dumped(value: object) -> str:
    """JSON text of a parsed value, numbers written as they arrived."""
    if isinstance(value, _Number):
        return str.__str__(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k, ensure_ascii=False)}:{_dumped(v)}"
                              for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_dumped(item) for item in value) + "]"
    return json.dumps(value, ensure_ascii=False)


class MarkedLines:
    """Lines of an async text stream, each passed through ``mark_repeated``."""

    def __init__(self, lines: AsyncIterable[str]) -> None:
        self.lines = lines

    def __aiter__(self) -> AsyncIterator[str]:
        return self._marked()

    async def _marked(self) -> AsyncIterator[str]:
        async for line in self.lines:
            yield mark_repeated(line)


async def run_stdio_async(server: Any) -> None:
    """Serve the FastMCP ``server`` over this process's stdin and stdout, stdin read through
    ``MarkedLines`` (see the module docstring)."""
    import anyio
    from fastmcp.server.context import reset_transport, set_transport
    from mcp.server.stdio import stdio_server

    wrapper = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
    stdin: Any = MarkedLines(anyio.wrap_file(wrapper))
    token = set_transport("stdio")
    try:
        async with server._lifespan_manager(), stdio_server(stdin=stdin) as (read, write):
            await server._mcp_server.run(read, write,
                                         server._mcp_server.create_initialization_options())
    finally:
        reset_transport(token)
        wrapper.detach()  # stdin's buffer stays open: it is not this server's to close
