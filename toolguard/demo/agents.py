"""The lead qualifier's agents: a scripted stand-in for the model, and the LangGraph graph.

Four agents per lead (``AGENTS``), each a model node (``ScriptedAgentModel``,
deterministic, so the demo runs offline) and a real ``ToolNode`` whose calls go
through the scenario's faults (``toolguard.demo.harness.Faults``) and, guarded,
through ``GuardedToolCalls``. ``build_graph`` wires them; ``run_lead`` runs one
lead's thread to the end, answering every review. Separate from the tools
(``toolguard.demo.tools``) and the run (``toolguard.demo.lead_qualifier``):
this is the only module that builds and runs the LangGraph graph.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypedDict

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from toolguard.demo.harness import DemoEvent, Faults
from toolguard.demo.scenario import AGENTS, SCRIPT, follow_up
from toolguard.demo.tools import RETRY_HINT

__all__ = ["RETRYABLE", "TASKS", "ScriptedAgentModel", "build_graph", "run_lead"]

#: Refusals after which a model tries the same call again (a fresh tool-call id).
RETRYABLE = frozenset({"stale_fencing_token", "out_of_order", "lease_lost", "not_owned",
                       "lock_timeout"})

TASKS = {
    "lead_enricher": "Enrich this lead with firmographic data.",
    "intent_scorer": "Score this lead's buying intent from its recent signals.",
    "email_verifier": "Verify this lead's e-mail address.",
    "router": "Set this lead's sales tier.",
}


# --- the scripted model ---------------------------------------------------------------------


_LEAD_IN_PROMPT = re.compile(r"lead_id=(\S+)")


class ScriptedAgentModel(BaseChatModel):
    """A deterministic stand-in for an LLM: the scenario's calls, then follow-ups.

    Turn 1 emits the planned calls for the lead named in the prompt
    (``lead_id=...``); later turns read the tool results: a retryable refusal
    (a stale token, out of order...) or a tool error that says to send the
    same call again (``RETRY_HINT``) sends it again under a new id, an
    ``invalid_arguments`` refusal sends the planned fallback, a success sends
    the agent's next step (its CRM push, see ``follow_up``), anything else ends
    the turn. Call ids are ``agent:lead:turn:index``: stable across runs.
    """

    agent: str
    plan: Any  # lead id -> tuple[PlannedCall, ...]
    max_turns: int = 6

    @property
    def _llm_type(self) -> str:
        return "toolguard-scripted"

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedAgentModel:
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        prompt = next((m for m in messages if isinstance(m, HumanMessage)), None)
        match = _LEAD_IN_PROMPT.search(str(prompt.content) if prompt else "")
        lead_id = match.group(1) if match else ""
        turn = 1 + sum(isinstance(m, AIMessage) for m in messages)
        if turn == 1:
            calls = [(p.tool, dict(p.args)) for p in self.plan.get(lead_id, ())]
        elif turn <= self.max_turns:
            calls = self._follow_up(messages, lead_id)
        else:
            calls = []
        if not calls:
            reply = AIMessage(content=f"{self.agent}: done with {lead_id}")
        else:
            reply = AIMessage(content="", tool_calls=[
                {"name": name, "args": args, "id": f"{self.agent}:{lead_id}:{turn}:{index}",
                 "type": "tool_call"} for index, (name, args) in enumerate(calls)])
        return ChatResult(generations=[ChatGeneration(message=reply)])

    def _follow_up(self, messages: list[BaseMessage], lead_id: str) -> list[tuple[str, dict[str, Any]]]:
        last = next(m for m in reversed(messages) if isinstance(m, AIMessage))
        results: dict[str | None, ToolMessage] = {m.tool_call_id: m for m in messages
                                                  if isinstance(m, ToolMessage)}
        calls = []
        for call in last.tool_calls:
            result = results.get(call["id"])
            if result is None:
                continue
            if result.status != "error":
                step = follow_up(call["name"], lead_id)
                if step is not None:
                    calls.append((step.tool, dict(step.args)))
                continue
            reason = (result.response_metadata.get("toolguard") or {}).get("reason")
            if reason in RETRYABLE or RETRY_HINT in str(result.content):
                calls.append((call["name"], dict(call["args"])))
            elif reason == "invalid_arguments":
                for planned in self.plan.get(lead_id, ()):
                    if (planned.tool, dict(planned.args)) == (call["name"], call["args"]) \
                            and planned.fallback is not None:
                        calls.append((planned.tool, dict(planned.fallback)))
        return calls


# --- the graph ---------------------------------------------------------------------------------


def build_graph(tools: list[Any], faults: Faults) -> Any:
    from langchain_core.messages import AnyMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph
    from langgraph.graph.message import add_messages
    from langgraph.prebuilt import ToolNode
    from langgraph.types import RetryPolicy

    messages = Annotated[list[AnyMessage], add_messages]
    # one message list per agent: a schema computed at run time, which type checkers cannot read
    schema: Any = TypedDict
    state = schema("LeadState", {"lead_id": str, **{agent: messages for agent in AGENTS}})
    graph = StateGraph(state)
    retry = RetryPolicy(max_attempts=3, initial_interval=0.01, jitter=False, retry_on=ConnectionError)
    for agent in AGENTS:
        model = ScriptedAgentModel(agent=agent, plan=SCRIPT[agent])

        def think(values: Mapping[str, Any], agent: str = agent, model: Any = model) -> dict[str, Any]:
            history = list(values.get(agent) or [])
            new = [] if history else [HumanMessage(f"{TASKS[agent]} lead_id={values['lead_id']}")]
            return {agent: [*new, model.invoke(history + new)]}

        def route(values: Mapping[str, Any], agent: str = agent) -> str:
            return f"{agent}_tools" if values[agent][-1].tool_calls else END

        # langgraph's add_node overloads solve the node's input type to Never under mypy, so
        # no plain function matches them (not even one taking a class TypedDict state)
        graph.add_node(agent, think)  # type: ignore[call-overload]
        graph.add_node(f"{agent}_tools", ToolNode(tools, messages_key=agent,
                                                  wrap_tool_call=faults.wrap(agent)),
                       retry_policy=retry)
        graph.add_edge(START, agent)
        graph.add_conditional_edges(agent, route, [f"{agent}_tools", END])
        graph.add_edge(f"{agent}_tools", agent)
    return graph.compile(checkpointer=InMemorySaver())


def run_lead(graph: Any, lead_id: str, pipeline: str,
             notify: Callable[[DemoEvent], None]) -> int:
    """Run one lead's thread to the end, answering every review; returns the interrupts seen."""
    from langgraph.types import Command

    config = {"configurable": {"thread_id": f"{pipeline}/{lead_id}"}, "recursion_limit": 50}
    result = graph.invoke({"lead_id": lead_id}, config)
    interrupts = 0
    while result.get("__interrupt__"):
        pending = result["__interrupt__"]
        interrupts += len(pending)
        for item in pending:
            question = item.value.get("question") if isinstance(item.value, Mapping) else item.value
            notify(DemoEvent("interrupt", lead_id, agent="intent_scorer",
                             detail=f"review requested: {question}"))
        answers = {item.id: {"approved": True, "by": "demo-reviewer"} for item in pending}
        notify(DemoEvent("resume", lead_id, detail="approved; resuming the thread"))
        result = graph.invoke(Command(resume=answers), config)
    notify(DemoEvent("lead_done", lead_id))
    return interrupts

