"""``GatewayMiddleware``: every ``tools/call`` through the proxy runs through ``ToolGuard.arun``.

The call's envelope is built by the gateway, not by the client: the tool name
and the arguments are the client's (untrusted, validated against the upstream
tool's strict model), the agent comes from ``Identity``, and the idempotency
key from the client's ``toolguard/idempotency-key`` ``_meta`` entry (scoped to
the agent), else from the JSON-RPC request id (scoped to the MCP session): a
call retried with either replays the recorded answer and never reaches the
upstream twice.

Inside the guarded call the request goes on to the upstream (FastMCP's proxy)
with the lease's fences in its ``_meta`` (``upstream_meta``), signed for the
upstream's audience when the gateway has a ``FenceSigner``, so a fenced upstream
(``FenceToolMiddleware``, signed mode or not) refuses a stale holder itself.
Every ``toolguard/*`` entry the client sent is the gateway's to set: a client
that sends fences, an agent or an intent id is refused (``invalid_intent``), audited once.

What reaches the client: the upstream's answer unchanged (its error results
and JSON-RPC errors too), a replay with ``toolguard/replayed`` in its
``_meta``, or toolguard's refusal as an error result whose text the model
reads and whose ``_meta`` says ``toolguard/decision``, ``toolguard/reason`` and,
for a call waiting for a person, ``toolguard/approval-id``. Such a call asks
the person through MCP elicitation when the client supports it.

An upstream that goes away during the call (killed, disconnected) leaves the
call's outcome unknown: it may have applied. The guard records it so (one
``unknown`` row, the idempotency key marked), releases the lease, and the
client gets an error result saying to retry with the same key.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import mcp_types
from fastmcp.server.dependencies import get_access_token, get_http_headers
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from fastmcp.tools.base import Tool, ToolResult
from mcp.shared.exceptions import MCPError
from pydantic import TypeAdapter

from toolguard.call.context import CallContext
from toolguard.call.decision import Decision, ToolFailed
from toolguard.call.envelope import untrusted_intent
from toolguard.call.intent import Intent
from toolguard.errors import IntentRejected
from toolguard.fences.outgoing import outgoing_fences
from toolguard.fences.wire import META_KEYS
from toolguard.gateway.identity import Identity
from toolguard.guard import ToolGuard
from toolguard.policies import Policy, authorize

if TYPE_CHECKING:
    from toolguard.fences.claims import FenceSigner

__all__ = [
    "APPROVAL_META_KEY",
    "DECISION_META_KEY",
    "IDEMPOTENCY_META_KEY",
    "REASON_META_KEY",
    "REPLAYED_META_KEY",
    "GatewayMiddleware",
    "UpstreamLost",
    "upstream_meta",
]

IDEMPOTENCY_META_KEY = "toolguard/idempotency-key"
#: The conversation a client names: the agent's reads in it are checked when it writes (without
#: it, the agent's reads count across its sessions).
THREAD_META_KEY = "toolguard/thread"
REPLAYED_META_KEY = "toolguard/replayed"
DECISION_META_KEY = "toolguard/decision"
REASON_META_KEY = "toolguard/reason"
APPROVAL_META_KEY = "toolguard/approval-id"
_OURS = "toolguard/"
_CONTENT = TypeAdapter(list[mcp_types.ContentBlock])
#: Transport errors that mean the upstream connection is gone mid-call.
_TRANSPORT_LOST = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream,
                   ConnectionError, EOFError)
_LOST_TEXT = ("rejected: upstream_lost: the upstream MCP server went away during the call, so "
              "whether it applied is unknown; call again with the same idempotency key and "
              "toolguard reconciles it")


class UpstreamLost(BaseException):
    """The upstream connection ended during the call: its outcome is unknown.

    A ``BaseException`` like ``CancelledError``: the guard releases the lease,
    marks the idempotency key unknown and audits one ``unknown`` row, as for a
    cancelled call, and the middleware turns it into the client's answer.
    """


class UpstreamErrorResult(ToolFailed):
    """The upstream answered with an error result: rolled back, passed on unchanged."""

    reason = "tool_error"

    def __init__(self, result: ToolResult) -> None:
        text = "\n".join(getattr(block, "text", "") for block in result.content)[:2_000]
        super().__init__(text or "the upstream tool answered with an error", reason="tool_error")
        self.result = result


class UpstreamRaised(ToolFailed):
    """The upstream answered with a JSON-RPC error: audited as failed, re-raised unchanged."""

    def __init__(self, error: MCPError) -> None:
        super().__init__(f"the upstream answered with error {error.error.code}: "
                         f"{error.error.message}"[:2_000], reason="upstream_error")
        self.error = error


def upstream_meta(downstream: Mapping[str, Any] | None, ctx: CallContext,
                  signer: FenceSigner | None = None) -> dict[str, Any]:
    """The ``_meta`` the upstream gets: the client's own entries, then the lease's fences.

    With ``signer`` the fences carry claims signed from the gateway's lease for
    the upstream's audience (a lease already lost raises ``LockLost``: nothing is
    sent); without, they travel unsigned, for an upstream that trusts its network.
    """
    forwarded = {k: v for k, v in (downstream or {}).items() if not k.startswith(_OURS)}
    if ctx.tokens:
        forwarded.update(outgoing_fences(idempotent=True, signer=signer).meta())
    return forwarded


class GatewayMiddleware(Middleware):
    """Guards ``tools/call`` with ``guard`` and filters ``tools/list`` to what the agent may call.

    ``identity`` says which agent each connection is; ``hide_unlisted`` keeps
    out of ``tools/list`` every tool the policy would refuse this agent;
    ``elicit`` asks the person through MCP elicitation (when the client
    supports it) for a call that needs approval; ``signer`` signs the fences
    forwarded to an upstream in signed mode.
    """

    def __init__(self, guard: ToolGuard, identity: Identity, *, hide_unlisted: bool = False,
                 elicit: bool = True, signer: FenceSigner | None = None) -> None:
        from toolguard.fences.claims import check_signer

        self.signer = check_signer(signer, "GatewayMiddleware")
        self.process_scope = uuid.uuid4().hex  # over stdio, the gateway process is the connection
        self.guard = guard
        self.identity = identity
        self.hide_unlisted = hide_unlisted
        self.elicit = elicit

    # --- tools/list -------------------------------------------------------------------

    async def on_list_tools(self, context: MiddlewareContext[mcp_types.ListToolsRequest],
                            call_next: CallNext[mcp_types.ListToolsRequest, Sequence[Tool]]
                            ) -> Sequence[Tool]:
        tools = await call_next(context)
        if not self.hide_unlisted:
            return tools
        agent = self.identity.agent_of(get_access_token())
        policy = self.guard.policy
        return [tool for tool in tools if may_call(policy, tool.name, agent)]

    # --- tools/call -------------------------------------------------------------------

    async def on_call_tool(self, context: MiddlewareContext[mcp_types.CallToolRequestParams],
                           call_next: CallNext[mcp_types.CallToolRequestParams, ToolResult]
                           ) -> ToolResult:
        fastmcp_context = context.fastmcp_context
        request = fastmcp_context.request_context if fastmcp_context is not None else None
        downstream = dict(request.meta or {}) if request is not None else {}
        intent = self._intent(context, request, downstream)

        async def execute(ctx: CallContext) -> Any:
            if request is not None:
                request.meta = upstream_meta(downstream, ctx, self.signer)  # what FastMCP's proxy forwards
            try:
                result = await call_next(context)
            except Exception as error:  # FastMCP wraps what the upstream raised in a ToolError
                raise _upstream_failure(error) from error
            if result.is_error:
                raise UpstreamErrorResult(result)
            return _record(result)

        try:
            decision = await self.guard.arun(intent, execute)
            if (decision.reason == "approval_required" and decision.approval_id
                    and self.elicit and _can_elicit(fastmcp_context)):
                decision = await self._ask_person(decision, fastmcp_context, intent, execute)
        except UpstreamLost:
            return _refused_result(_LOST_TEXT, "unknown", "upstream_lost")
        return _answer(decision)

    def _intent(self, context: MiddlewareContext[mcp_types.CallToolRequestParams],
                request: Any, downstream: Mapping[str, Any]) -> Intent:
        """The call as an untrusted intent; a hostile ``_meta`` is kept as its ``problem``."""
        agent = self.identity.agent_of(get_access_token())
        session = self._connection(context)
        key = downstream.get(IDEMPOTENCY_META_KEY)
        request_id = getattr(request, "request_id", None)
        if key is not None:
            call_id: Any = key
            thread = f"mcp-key:{agent or ''}"
        else:
            call_id = request_id
            thread = f"mcp-session:{session}"
        conversation = downstream.get(THREAD_META_KEY, "")
        intent = untrusted_intent(tool=context.message.name, args=context.message.arguments or {},
                                  call_id=call_id, agent=agent, thread_id=thread,
                                  conversation=conversation)
        problem = _meta_problem(downstream)
        if problem is not None and intent.problem is None:
            intent = intent.model_copy(update={"problem": problem})
        return intent

    def _connection(self, context: MiddlewareContext[Any]) -> str:
        """What a request id is unique within: the HTTP session, else this gateway process.

        Over streamable HTTP without a session (the stateless protocol era) a
        request id names nothing beyond its request: such a call gets a scope of
        its own, so it is never taken for another client's call; a client that
        retries then sends ``toolguard/idempotency-key``.
        """
        headers = get_http_headers(include_all=True)
        if not headers:
            return f"process:{self.process_scope}"
        session = headers.get("mcp-session-id")
        if session:
            return f"http:{session[:128]}"
        return f"request:{uuid.uuid4().hex}"

    async def _ask_person(self, decision: Decision, fastmcp_context: Any, intent: Intent,
                          execute: Any) -> Decision:
        """Ask through MCP elicitation; decide the request; run the call again if approved."""
        book = self.guard.controls.async_approvals
        approval_id = decision.approval_id
        if book is None or approval_id is None:
            return decision
        request = getattr(decision.error, "request", None)
        request = request if isinstance(request, Mapping) else {}
        why = request.get("description") or "approval required"
        shown = json.dumps(request.get("args"), ensure_ascii=False, default=str)[:2_000]
        message = (f"{intent.tool} needs your approval ({why}). Agent: {intent.agent}. "
                   f"Arguments (redacted as the policy says): {shown}. Approval {approval_id}.")
        try:
            answer = await fastmcp_context.elicit(message, response_type=bool)
        except Exception:  # the client could not answer: the request stays pending
            return decision
        action = getattr(answer, "action", None)
        if action == "cancel":
            return decision
        approved = action == "accept" and bool(getattr(answer, "data", False))
        with contextlib.suppress(IntentRejected):  # decided meanwhile (toolguard approve)
            await book.decide(approval_id, "approve" if approved else "reject",
                              by=f"mcp-elicitation:{intent.agent or 'unknown'}")
        return await self.guard.arun(intent, execute)


def _upstream_failure(error: Exception) -> BaseException:
    """What an exception from the proxied call means: the upstream lost, its error, or a bug."""
    for cause in _chain(error):
        if isinstance(cause, MCPError):
            if cause.error.code == mcp_types.CONNECTION_CLOSED or (
                    cause.error.code == mcp_types.INTERNAL_ERROR
                    and "connect" in cause.error.message.lower()):
                return UpstreamLost(cause.error.message)
            return UpstreamRaised(cause)
        if isinstance(cause, _TRANSPORT_LOST):
            return UpstreamLost(f"{type(cause).__name__}: {cause}")
    return error


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen and len(seen) < 16:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def may_call(policy: Policy, tool: str, agent: str | None) -> bool:
    """Whether ``policy`` would let ``agent`` call ``tool`` (for ``tools/list``)."""
    rule = policy.tools.get(tool)
    if rule is None:
        return policy.defaults.on_unknown_tool == "allow" and agent is not None
    try:
        authorize(rule, agent)
    except IntentRejected:
        return False
    return True


#: The ``toolguard/*`` ``_meta`` entries a client may set.
_CLIENTS = (IDEMPOTENCY_META_KEY, THREAD_META_KEY)


def _meta_problem(meta: Mapping[str, Any]) -> str | None:
    """What is wrong with the client's ``toolguard/*`` ``_meta`` entries (None: nothing)."""
    for key in meta:
        if not isinstance(key, str) or not key.startswith(_OURS) or key in _CLIENTS:
            continue
        if key in META_KEYS.values() or key == REPLAYED_META_KEY:
            return (f"_meta.{key}: set by the gateway, never by the client (fences, agent and "
                    f"intent come from toolguard)")
        return f"_meta: unknown toolguard entry {key[:64]!r}"
    for key in _CLIENTS:
        given: Any = meta.get(key)
        if given is not None and not isinstance(given, str):
            return f"_meta.{key}: expected a string"
    return None


def _can_elicit(fastmcp_context: Any) -> bool:
    """Whether this client said it can answer an elicitation, on a connection that can ask."""
    if fastmcp_context is None:
        return False
    try:
        if fastmcp_context._is_modern_protocol():
            return False
        session = fastmcp_context.session
        capabilities = session.client_capabilities
    except (RuntimeError, AttributeError):
        return False
    return capabilities is not None and getattr(capabilities, "elicitation", None) is not None


def _record(result: ToolResult) -> dict[str, Any]:
    """An upstream result as JSON, recorded for replays."""
    return {"content": [block.model_dump(mode="json", by_alias=True, exclude_none=True)
                        for block in result.content],
            "structured_content": result.structured_content, "meta": result.meta}


def _answer(decision: Decision) -> ToolResult:
    if decision.ok:
        record = decision.result if isinstance(decision.result, Mapping) else {}
        meta = dict(record.get("meta") or {})
        if decision.kind == "replayed":
            meta[REPLAYED_META_KEY] = True
        return ToolResult(content=_CONTENT.validate_python(record.get("content") or []),
                          structured_content=record.get("structured_content"),
                          meta=meta or None)
    error = decision.error
    if isinstance(error, UpstreamErrorResult):
        return error.result
    if isinstance(error, UpstreamRaised):
        raise error.error
    return _refused_result(decision.model_text(), decision.kind, decision.reason,
                           decision.approval_id)


def _refused_result(text: str, kind: str, reason: str,
                    approval_id: str | None = None) -> ToolResult:
    meta: dict[str, Any] = {DECISION_META_KEY: kind, REASON_META_KEY: reason}
    if approval_id:
        meta[APPROVAL_META_KEY] = approval_id
    return ToolResult(content=[mcp_types.TextContent(type="text", text=text)], meta=meta,
                      is_error=True)
