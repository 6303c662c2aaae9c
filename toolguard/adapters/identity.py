"""Who is calling, and from where: the envelope of a tool call turned into an ``Intent``.

Every adapter builds its intent here, so the rules for the call id, the agent
identity and the workflow identity (``toolguard.call.envelope``) are the same
whether a call comes through a ToolNode, a ``create_agent`` middleware or a
LangChain tool. Nothing here raises or coerces: a broken envelope becomes an
intent the guard refuses as ``invalid_intent``, audited.

Identity comes from the host: the adapter's ``agent=`` or, when the adapter
is built with ``agent_from="metadata"``, the run's metadata ``toolguard_agent``;
never from the model, never guessed from a node name. No identity is refused
(``missing_identity``), and an adapter built with no identity source at all
raises ``GuardMisconfigured`` at once (``check_identity_source``): every one of
its calls would be refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from toolguard.call.envelope import untrusted_intent
from toolguard.call.intent import Intent, Origin
from toolguard.errors import GuardMisconfigured

__all__ = ["AGENT_METADATA_KEY", "AgentFrom", "agent_from_metadata", "check_identity_source",
           "intent_from_call"]

#: The run-metadata key that names the calling agent (``config={"metadata": {...}}``).
AGENT_METADATA_KEY = "toolguard_agent"
#: Where an adapter without ``agent=`` reads the identity: ``"metadata"``, each run's metadata
#: ``toolguard_agent`` (LangGraph, LangChain); ``"call"``, each ``run(agent=...)`` (functions).
AgentFrom = Literal["metadata", "call"]

_NO_SOURCE = ("{where} has no agent identity: every call would be refused missing_identity. "
              "Give agent=\"<name>\"{resolver}, or agent_from=\"{source}\" {how}.")
_HOW = {"metadata": "to read it from each run's config={\"metadata\": {\"toolguard_agent\": ...}}",
        "call": "to give it to each call (run(args, agent=...), arun(args, agent=...))"}


def check_identity_source(agent: Any, agent_from: Any, where: str, *,
                          source: AgentFrom = "metadata", resolver: bool = True) -> None:
    """Raise ``GuardMisconfigured`` unless the adapter has exactly one identity source.

    ``source`` is the ``agent_from`` this adapter understands; ``resolver`` whether
    ``agent`` may be a function of the request.
    """
    if agent_from is not None and agent_from != source:
        msg = f"{where}: agent_from={agent_from!r:.40} is not known; use agent_from={source!r}"
        raise GuardMisconfigured(msg)
    if agent is not None and agent_from is not None:
        msg = (f"{where}: give one identity source, agent= or agent_from={source!r}, not both "
               f"(agent= would win over every {source} identity silently)")
        raise GuardMisconfigured(msg)
    if agent is None and agent_from is None:
        msg = _NO_SOURCE.format(where=where, source=source, how=_HOW[source],
                                resolver=" (or a function of the request)" if resolver else "")
        raise GuardMisconfigured(msg)


def intent_from_call(call: Any, *, agent: Any, runtime: Any = None, config: Any = None,
                     origin: Origin = "model", expected_tool: str | None = None) -> Intent:
    """An ``Intent`` from a tool call plus whatever identity LangGraph exposes; never raises.

    Without a checkpointer LangGraph gives neither a thread nor a run id (unless
    the caller put ``run_id`` in the config). The superstep's checkpoint id then
    stands in for the run: it is the same on every ``RetryPolicy`` re-run of the
    node and new for every invocation, so a retried call still finds its
    idempotency record. ``origin="python"`` marks a direct call (not a model's
    tool call), which may come without an id. ``expected_tool`` is the name of
    the one tool an adapter stands for: a call naming another is refused.
    """
    fields: Mapping[str, Any] = call if isinstance(call, Mapping) else {}
    settings: Mapping[str, Any] = config if isinstance(config, Mapping) else {}
    configurable = settings.get("configurable")
    configurable = configurable if isinstance(configurable, Mapping) else {}
    info = _execution_info(runtime, configurable)
    thread_id = _first(getattr(info, "thread_id", None), configurable.get("thread_id"))
    run_id = _first(getattr(info, "run_id", None), settings.get("run_id"))
    checkpoint_id = getattr(info, "checkpoint_id", None)
    if thread_id is None and run_id is None and isinstance(checkpoint_id, str) and checkpoint_id:
        run_id = f"step:{checkpoint_id}"
    attempt = getattr(info, "node_attempt", 1)
    args = fields.get("args")
    intent = untrusted_intent(
        tool=fields.get("name"), args=args, call_id=fields.get("id"),
        agent=agent, thread_id=thread_id, run_id=run_id,
        checkpoint_ns=_first(getattr(info, "checkpoint_ns", None),
                             configurable.get("checkpoint_ns")),
        checkpoint_id=checkpoint_id, node_attempt=1 if attempt is None else attempt,
        origin=origin, expected_tool=expected_tool)
    if args is None and origin == "model":
        # A model's call always carries its arguments as an object ({} for none): one
        # without them ("args": null, or no "args") is refused as invalid arguments,
        # never read as {} and run (ToolNode itself could not run it either).
        intent = intent.model_copy(update={"args": None})
    return intent


def _execution_info(runtime: Any, configurable: Mapping[str, Any]) -> Any:
    """LangGraph's ``ExecutionInfo`` of the running task, or None.

    A tool invoked by ToolNode gets only the config; the runtime rides in it.
    Only LangGraph's own type counts: its fields are then checked like the rest
    of the envelope (a thread id that is not a string is refused). Anything
    else in its place (a stand-in runtime, e.g. a test's ``Mock``, answers every
    attribute) is no execution info at all, as with a LangGraph that has none.
    """
    try:
        from langgraph.runtime import ExecutionInfo
    except ImportError:  # a LangGraph without execution info: the config is all there is
        return None
    for source in (runtime, configurable.get("__pregel_runtime")):
        info = getattr(source, "execution_info", None)
        if isinstance(info, ExecutionInfo):
            return info
    return None


def agent_from_metadata(request: Any) -> Any:
    """The run's metadata ``toolguard_agent``, as given (``None`` when absent).

    Never the graph node's name: a node called ``tools`` is not an agent, and
    authorizing as one would grant a call to an agent that does not exist.
    The value is checked like the rest of the envelope (a non-empty string).
    """
    config = getattr(getattr(request, "runtime", None), "config", None)
    metadata = config.get("metadata") if isinstance(config, Mapping) else None
    return metadata.get(AGENT_METADATA_KEY) if isinstance(metadata, Mapping) else None


def _first(*values: Any) -> Any:
    """The first value that is not None or empty text (any other value is checked later)."""
    return next((v for v in values if v is not None and not (type(v) is str and not v)), None)
