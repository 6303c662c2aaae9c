"""MCP tools called from a guarded tool carry the lease's fences in ``tools/call`` ``_meta``.

>>> session = FencedSession(session)          # an mcp ClientSession or a fastmcp Client
>>> tools = await guarded_mcp_tools(guard, session, agent="intent_scorer")

``FencedSession`` wraps anything with an MCP ``call_tool(name, arguments, ...,
meta=...)`` (the official SDK's ``ClientSession``, FastMCP's ``Client``) and
delegates everything else. Each ``call_tool`` made inside a guarded call gets
the ``toolguard/*`` ``_meta`` entries (see ``toolguard.fences.wire``), after the
lease is checked: a call made after the lease was lost raises ``LockLost``
before it leaves. A refusal by a fenced MCP server (a JSON-RPC error whose
``data`` is a toolguard problem) raises the typed error. Code that loads tools
through another library can hand it the wrapped session: every ``call_tool``
goes through it.

``guarded_mcp_tools`` lists the server's tools and returns one guarded
LangChain tool per MCP tool (same name, description and argument schema); the
policy decides their locks, and the server checks the tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from toolguard.errors import GuardMisconfigured
from toolguard.fences.outgoing import outgoing_fences
from toolguard.fences.problems import error_from_problem

if TYPE_CHECKING:
    from toolguard.fences.claims import FenceSigner

__all__ = ["FencedSession", "guarded_mcp_tools", "raise_for_refusal"]


def raise_for_refusal(error: BaseException) -> None:
    """Raise the typed toolguard error if ``error`` is a fenced MCP server's refusal."""
    data = getattr(getattr(error, "error", None), "data", None)
    if isinstance(data, dict):
        typed = error_from_problem(data)
        if typed is not None:
            raise typed from error


class FencedSession:
    """An MCP client session whose ``call_tool`` forwards the running guarded call's fences.

    ``signer`` (a ``FenceSigner`` for the server's audience) signs them, from the
    call's lease, for a server in signed mode.
    """

    def __init__(self, session: Any, *, signer: FenceSigner | None = None) -> None:
        from toolguard.fences.claims import check_signer

        self.session = session
        self.signer = check_signer(signer, "FencedSession")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None, *args: Any,
                        meta: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        fences = outgoing_fences(idempotent=True, signer=self.signer)
        fenced = {**(meta or {}), **fences.meta()}
        try:
            return await self.session.call_tool(name, arguments, *args, meta=fenced, **kwargs)
        except Exception as error:
            raise_for_refusal(error)
            raise


def _caller(session: FencedSession, name: str, failure: type[Exception]) -> Any:
    async def call(**arguments: Any) -> str:
        result = await session.call_tool(name, arguments)
        text = "\n".join(getattr(block, "text", "") for block in result.content)
        if getattr(result, "is_error", False):
            raise failure(text or f"{name} failed")
        return text

    return call


async def guarded_mcp_tools(guard: Any, session: Any, *, agent: str | None = None,
                            agent_from: Literal["metadata"] | None = None,
                            signer: FenceSigner | None = None) -> list[Any]:
    """Guarded LangChain tools for every tool the MCP server lists, forwarding fences.

    ``session`` is a connected ``ClientSession`` or FastMCP ``Client`` (wrapped
    in ``FencedSession(session, signer=signer)`` here if it is not already; a
    ``FencedSession`` given with a ``signer`` here too is a mistake that raises). An MCP error result raises
    ``ToolException``, so the guard rolls the call back and audits it as failed.
    The identity is ``agent``, or ``agent_from="metadata"`` (each run's
    ``toolguard_agent``), as for ``guard_tool``; with neither this raises
    ``GuardMisconfigured`` before it lists anything.
    """
    from langchain_core.tools import StructuredTool, ToolException

    from toolguard.adapters import guard_tool
    from toolguard.adapters.identity import check_identity_source

    # before listing: an identity mistake is the caller's, whatever the server offers
    check_identity_source(agent, agent_from, "guarded_mcp_tools", resolver=False)
    if isinstance(session, FencedSession):
        if signer is not None and session.signer is not signer:
            msg = "guarded_mcp_tools: the FencedSession has its own signer; give it only once"
            raise GuardMisconfigured(msg)
        fenced = session
    else:
        fenced = FencedSession(session, signer=signer)
    listed = await fenced.list_tools()
    tools = getattr(listed, "tools", listed)
    out = []
    for tool in tools:
        name = tool.name
        call = _caller(fenced, name, ToolException)
        schema = dict(getattr(tool, "input_schema", None) or getattr(tool, "inputSchema", {}))
        wrapped = StructuredTool.from_function(coroutine=call, name=name,
                                               description=tool.description or name,
                                               args_schema=schema)
        out.append(guard_tool(guard, wrapped, agent=agent, agent_from=agent_from))
    return out
