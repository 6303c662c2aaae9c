"""FastMCP middleware: an MCP server checks and advances the fences of the tool calls it serves.

>>> from fastmcp import FastMCP
>>> from toolguard.fences import FenceToolMiddleware, current_fence
>>> mcp = FastMCP("crm", middleware=[FenceToolMiddleware(store=store)])
>>> @mcp.tool
... async def set_score(lead_id: str, score: int) -> int:
...     tx = current_fence().tx        # the transaction the fences were checked in
...     await tx.execute("UPDATE leads SET score = %s WHERE id = %s", (score, lead_id))
...     return score

The same steps as the ASGI middleware (``toolguard.fences.asgi``), for
``tools/call``: the fences and the idempotency key come from the request's
``_meta``; a replay returns the recorded result (its ``_meta`` says
``toolguard/replayed``); an error result (``isError``) or an exception rolls
the tool's writes back. Refusals are JSON-RPC errors whose ``data`` is the same
RFC 9457 problem object the HTTP side sends, with the codes listed in
``toolguard.fences.problems``. Every decision is audited in the server's store.

``require(tool_name)`` says which tools need fences; by default every tool
does (a tool call is a state change unless you say otherwise). A tool that
does not require them still gets fenced when the call carries fences.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import mcp_types
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from fastmcp.tools.base import ToolResult
from mcp.shared.exceptions import MCPError
from pydantic import TypeAdapter

from toolguard.errors import GuardMisconfigured, ToolGuardError
from toolguard.fences.claims import ClaimVerifier
from toolguard.fences.gate import (
    Answer,
    Applied,
    Declined,
    FenceGate,
    Outcome,
    Refused,
    ServiceFence,
    audit_name,
)
from toolguard.fences.inflight import InFlightRegistry
from toolguard.fences.problems import FencesRequired, KeyNotFenced, Problem
from toolguard.fences.wire import (
    FENCING_TOKEN_HEADER,
    IDEMPOTENCY_KEY_HEADER,
    META_KEYS,
    WireError,
    parse_meta,
    request_digest,
)
from toolguard.intent import canonical_json

__all__ = ["REPLAYED_META_KEY", "FenceToolMiddleware"]

REPLAYED_META_KEY = "toolguard/replayed"
#: The bound on a fenced call's arguments (canonical JSON), as ``FenceMiddleware`` bounds bodies.
DEFAULT_MAX_ARGUMENT_BYTES = 1 << 20
_CONTENT = TypeAdapter(list[mcp_types.ContentBlock])


def _every_tool(_name: str) -> bool:
    return True


class FenceToolMiddleware(Middleware):
    """Fences every ``tools/call`` that carries fences or whose tool ``require(name)`` names.

    ``store`` is the server's own installed ``AsyncGuardedStore``; ``inflight``
    as for ``FenceMiddleware``; ``max_argument_bytes`` bounds a fenced call's
    arguments as canonical JSON (``request_too_large``, as a REST body over
    ``max_body_bytes``); ``claims`` and ``audience`` as for ``FenceMiddleware``.
    """

    def __init__(self, *, store: Any, require: Callable[[str], bool] = _every_tool,
                 inflight: InFlightRegistry | None = None,
                 max_argument_bytes: int = DEFAULT_MAX_ARGUMENT_BYTES,
                 claims: ClaimVerifier | None = None, audience: str | None = None) -> None:
        self.gate = FenceGate(store, inflight=inflight, where="FenceToolMiddleware",
                              claims=claims, audience=audience)
        if (not isinstance(max_argument_bytes, int) or isinstance(max_argument_bytes, bool)
                or max_argument_bytes < 0):
            msg = (f"FenceToolMiddleware: max_argument_bytes must be an int >= 0, "
                   f"got {max_argument_bytes!r}")
            raise GuardMisconfigured(msg)
        self.max_argument_bytes = max_argument_bytes
        given: object = require  # untyped callers may pass anything
        if not callable(given):
            msg = f"FenceToolMiddleware: require must be a function of the tool name, got {require!r}"
            raise GuardMisconfigured(msg)
        self.require = require

    async def on_call_tool(self, context: MiddlewareContext[mcp_types.CallToolRequestParams],
                           call_next: CallNext[mcp_types.CallToolRequestParams, ToolResult]
                           ) -> ToolResult:
        name = audit_name(context.message.name)  # the exact name is in the digest below
        try:
            fences = parse_meta(_request_meta(context))
        except WireError as error:
            raise _mcp_error((await self.gate.refuse(error, tool=name)).problem) from None
        if not fences.present and not self.require(context.message.name):
            return await call_next(context)
        missing = tuple(META_KEYS[h] for h, v in ((FENCING_TOKEN_HEADER, fences.tokens),
                                                  (IDEMPOTENCY_KEY_HEADER, fences.idempotency_key))
                        if not v)
        if missing:
            msg = f"tool {name!r} needs {' and '.join(missing)} in _meta (a fenced call through toolguard)"
            refused = await self.gate.refuse(FencesRequired(msg, missing=missing), tool=name,
                                             fences=fences)
            raise _mcp_error(refused.problem)
        try:
            arguments = canonical_json(context.message.arguments or {})
        except (TypeError, ValueError) as error:
            refused = await self.gate.refuse(WireError(f"arguments are not JSON: {error}",
                                                       field="arguments"), tool=name, fences=fences)
            raise _mcp_error(refused.problem) from None
        size = len(arguments.encode("utf-8", "surrogatepass"))
        if size > self.max_argument_bytes:
            msg = (f"the arguments are {size} bytes as JSON, more than {self.max_argument_bytes}: "
                   f"nothing was run")
            refused = await self.gate.refuse(ToolGuardError(msg, reason="request_too_large"),
                                             tool=name, fences=fences)
            raise _mcp_error(refused.problem)
        digest = request_digest("tools/call", context.message.name, arguments)

        async def serve(_: ServiceFence) -> Answer:
            try:
                result = await call_next(context)
            except Exception as error:  # FastMCP wraps the tool's exception in a ToolError
                refusal = _key_not_fenced(error)
                if refusal is not None:
                    raise refusal from None
                raise
            if result.is_error:
                return Answer(result, commit=False, detail="error result: rolled back")
            return Answer(result, record=_record(result), detail="ok")

        return _result(await self.gate.run(fences, tool=name, digest=digest, handler=serve))


def _key_not_fenced(error: BaseException) -> KeyNotFenced | None:
    """The ``KeyNotFenced`` the tool raised (``current_fence().require``), under FastMCP's wrap."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None or isinstance(seen, KeyNotFenced):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _request_meta(context: MiddlewareContext[Any]) -> Mapping[str, Any] | None:
    """The client's ``_meta`` of this request (FastMCP rebuilds ``context.message`` without it)."""
    fastmcp_context = context.fastmcp_context
    request = fastmcp_context.request_context if fastmcp_context is not None else None
    meta = getattr(request, "meta", None) if request is not None else None
    if meta is None:
        meta = getattr(context.message, "meta", None)
    if meta is not None and not isinstance(meta, Mapping):
        meta = meta.model_dump(by_alias=True) if hasattr(meta, "model_dump") else dict(meta)
    return meta


def _record(result: ToolResult) -> dict[str, Any]:
    return {"content": [block.model_dump(mode="json", by_alias=True, exclude_none=True)
                        for block in result.content],
            "structured_content": result.structured_content, "meta": result.meta}


def _result(outcome: Outcome) -> ToolResult:
    if isinstance(outcome, Applied | Declined):
        result: ToolResult = outcome.value  # the gate keeps whatever the handler answered
        return result
    if isinstance(outcome, Refused):
        raise _mcp_error(outcome.problem)
    record = outcome.record
    meta = {**(record.get("meta") or {}), REPLAYED_META_KEY: True}
    return ToolResult(content=_CONTENT.validate_python(record["content"]),
                      structured_content=record.get("structured_content"), meta=meta)


def _mcp_error(problem: Problem) -> MCPError:
    return MCPError(problem.mcp_code, f"{problem.title}: {problem.detail}", problem.body())

