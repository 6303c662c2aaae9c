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

import json
from collections.abc import Callable, Mapping
from typing import Any

import mcp_types
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from fastmcp.tools.base import ToolResult
from mcp.shared.exceptions import MCPError
from pydantic import TypeAdapter

from toolguard.call.intent import canonical_json
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

__all__ = ["REPEATED_META_KEY", "REPLAYED_META_KEY", "FenceToolMiddleware"]

REPLAYED_META_KEY = "toolguard/replayed"
#: Set by toolguard's stdio reader (``toolguard.fences.mcp_stdio``) only: the ``_meta`` key
#: a request named more than once.
REPEATED_META_KEY = "toolguard/repeated-key"
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

    async def on_request(self, context: MiddlewareContext[Any],
                         call_next: CallNext[Any, Any]) -> Any:
        """A ``tools/call`` the MCP SDK refused before any tool hook ran: if its ``_meta`` is
        not an object, it is a fence field toolguard cannot read, refused and audited as such."""
        message = context.message
        if context.method == "tools/call" and isinstance(message, Mapping) and (
                message.get("_meta") is not None and not isinstance(message["_meta"], Mapping)):
            name = message.get("name")
            tool = audit_name(name) if isinstance(name, str) else None
            error = WireError(f"expected an object, got {_json_type(message['_meta'])}",
                              field="_meta")
            raise _mcp_error((await self.gate.refuse(error, tool=tool)).problem)
        return await call_next(context)

    async def on_call_tool(self, context: MiddlewareContext[mcp_types.CallToolRequestParams],
                           call_next: CallNext[mcp_types.CallToolRequestParams, ToolResult]
                           ) -> ToolResult:
        name = audit_name(context.message.name)  # the exact name is in the digest below
        try:
            repeated = await _repeated_meta_key(context) or _marked_repeat(context)
            if repeated is not None:
                msg = ("the key appears more than once in the request's _meta (JSON keeps the "
                       "last one; which was meant is not a guess)")
                raise WireError(msg, field=repeated)
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


class _Pairs(dict[str, Any]):
    """A JSON object that remembers the first key it saw more than once."""

    repeated: str | None = None


def remembering_pairs(pairs: list[tuple[str, Any]]) -> _Pairs:
    """A ``json.loads`` object hook: the object, and which key it named twice first."""
    found = _Pairs(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                found.repeated = key
                break
            seen.add(key)
    return found


def repeated_meta_key(raw: bytes | str) -> str | None:
    """The first key that appears twice in the ``params._meta`` object of the JSON-RPC
    message ``raw``, or None (also for text that is not one JSON-RPC request).

    Numbers are not converted (a 5,000-digit integer costs nothing here), and the
    parser's recursion limit is the MCP SDK's own parser's, which refused anything deeper
    before this runs.
    """
    try:
        message = json.loads(raw, object_pairs_hook=remembering_pairs, parse_int=len, parse_float=len,
                             parse_constant=len)
    except (ValueError, RecursionError):
        return None
    params = message.get("params") if isinstance(message, dict) else None
    meta = params.get("_meta") if isinstance(params, dict) else None
    return meta.repeated if isinstance(meta, _Pairs) else None


async def _repeated_meta_key(context: MiddlewareContext[Any]) -> str | None:
    """``repeated_meta_key`` of this request's raw bytes, when the transport kept them.

    Over streamable HTTP the SDK read the body through the Starlette request it hands
    to the handler, which keeps it: that is the request as it arrived, before any JSON
    object lost a repeated key.
    """
    fastmcp_context = context.fastmcp_context
    request_context = fastmcp_context.request_context if fastmcp_context is not None else None
    http = getattr(request_context, "request", None) if request_context is not None else None
    raw = getattr(http, "_body", None)  # only a body already read: never read the stream again
    if not isinstance(raw, bytes):
        return None
    return repeated_meta_key(raw)


def _marked_repeat(context: MiddlewareContext[Any]) -> str | None:
    """The key toolguard's stdio reader found twice in this request's ``_meta``
    (``toolguard.fences.mcp_stdio``), or None."""
    meta = _request_meta(context)
    if meta is None or REPEATED_META_KEY not in meta:
        return None
    marked = meta[REPEATED_META_KEY]
    return marked if isinstance(marked, str) and marked else REPEATED_META_KEY


def _json_type(value: object) -> str:
    """The JSON name of a parsed value's type, for a refusal that does not echo the value."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__


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

