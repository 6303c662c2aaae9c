"""The envelope of a tool call (id, name, agent) is untrusted input, checked like the arguments.

Rules (DESIGN 11): the id is a non-empty ``str`` of at most 256 characters of
valid Unicode, never coerced (``7`` is not ``"7"``); the name is such a string
too. A model-facing call (ToolNode wrapper, ``create_agent`` middleware,
LangChain tool invoked with a tool call) without an id is refused unless the
tool's policy gives an ``idempotency_key`` template; a direct Python call
without an id runs once, without replay protection. Whatever arrives, the
decision is audited exactly once, as ``invalid_intent`` when the envelope is
bad, and no exception escapes the adapter but the tool's own: the LangChain
and LangGraph adapters are transparent, so what the tool raises (or its own
schema's refusal of the arguments) comes out unchanged, after it was audited.

Every test runs on SQLite and on Redis + PostgreSQL (``harness``).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any
from unittest.mock import Mock

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.prebuilt.tool_node import ToolCallRequest, ToolInvocationError
from langgraph.runtime import ExecutionInfo
from pydantic import ValidationError

from guard.harness import Harness, HarnessFactory, LoopThread
from guard.test_fuzz import FUZZ, last_audit, snapshot
from guard.tools import EFFECT
from toolguard.adapters import GuardedToolCalls, guard_tool, guarded
from toolguard.call.context import current
from toolguard.errors import ToolGuardError
from toolguard.guard import Decision

POLICY: dict[str, Any] = {"version": 1, "tools": {
    "add_note": {"locks": ["lead:{lead_id}"], "agents": ["scorer"]},
    "keyed_note": {"locks": ["lead:{lead_id}"], "agents": ["scorer"],
                   "idempotency_key": "{lead_id}:{text}"},
}}

#: Ids and names that break a rule, with the rule they break.
BAD_IDS: list[tuple[Any, str]] = [
    (7, "int"), (True, "bool"), (1.5, "float"), (["c1"], "list"), ({"id": "c1"}, "dict"),
    (b"c1", "bytes"), ("c" * 257, "257 characters"), ("c" * 3_000, "3000 characters"),
    ("c\ud800", "lone surrogate"), ("\udfff", "lone surrogate"),
]


def note_tools(runs: list[str]) -> list[BaseTool]:
    """``add_note`` and ``keyed_note``, each with a sync and an async body."""

    def make(name: str) -> BaseTool:
        def body(lead_id: str, text: str) -> str:
            ctx = current()
            ctx.tx.execute(EFFECT, (name, lead_id, 0, ctx.intent.call_id, 1))
            runs.append(text)
            return f"noted {text}"

        async def abody(lead_id: str, text: str) -> str:
            ctx = current()
            await ctx.atx.execute(EFFECT, (name, lead_id, 0, ctx.intent.call_id, 1))
            runs.append(text)
            return f"noted {text}"

        return StructuredTool.from_function(func=body, coroutine=abody, name=name,
                                            description=f"{name} on a lead")

    return [make("add_note"), make("keyed_note")]


def request(call: dict[str, Any], tools: dict[str, BaseTool], *, thread: str = "t-1",
            metadata: dict[str, Any] | None = None) -> ToolCallRequest:
    """What ToolNode hands a wrapper, for a call in superstep ``tools:<task>`` of ``thread``."""
    info = ExecutionInfo(thread_id=thread, checkpoint_ns="tools:task-1", checkpoint_id="cp",
                         task_id="task-1", run_id=None, node_attempt=1)
    runtime = SimpleNamespace(execution_info=info, config={"metadata": dict(metadata or {})})
    name = call.get("name")
    tool = tools.get(name) if isinstance(name, str) else None
    return ToolCallRequest(tool_call=call, tool=tool, state={}, runtime=runtime)  # type: ignore[arg-type]


def execute(req: ToolCallRequest) -> ToolMessage:
    """What ToolNode's ``execute`` does, minus argument injection.

    LangChain needs an ``id`` key and hands back the bare output for a call
    whose id is None (ToolNode itself then fails on it); answer with a
    message, as a tool that builds its own ``ToolMessage`` would.
    """
    assert req.tool is not None
    output = req.tool.invoke({"id": None, **req.tool_call, "type": "tool_call"})
    if isinstance(output, ToolMessage):
        return output
    return ToolMessage(content=str(output), tool_call_id="", name=req.tool.name)


def reason_of(answer: ToolMessage) -> str:
    return str(answer.response_metadata["toolguard"]["reason"])


def ask(calls: GuardedToolCalls, req: ToolCallRequest) -> ToolMessage:
    """The wrapper's answer to one call (a ToolMessage: it never answers with a Command here)."""
    output = calls.wrap_tool_call(req, execute)
    assert isinstance(output, ToolMessage), output
    return output


def audit_rows(h: Harness) -> list[tuple[str, str, str | None]]:
    return [(e.decision, e.reason, e.intent_id) for e in h.audit()]


# --- the id ------------------------------------------------------------------------------


@pytest.mark.parametrize(("bad_id", "what"), BAD_IDS, ids=[w for _, w in BAD_IDS])
def test_a_bad_id_is_refused_as_invalid_intent_on_every_adapter(
        harness: HarnessFactory, bad_id: Any, what: str) -> None:
    h: Harness = harness(POLICY)
    runs: list[str] = []
    tools = {t.name: t for t in note_tools(runs)}
    calls = GuardedToolCalls(h.guard, agent="scorer")
    lc_tool = guard_tool(h.guard, tools["add_note"], agent="scorer")
    call = {"name": "add_note", "args": {"lead_id": "a", "text": "x"}, "id": bad_id,
            "type": "tool_call"}

    @guarded(h.guard, agent="scorer", name="add_note")
    def add_note(lead_id: str, text: str) -> str:
        runs.append(text)
        return "noted"

    answer = ask(calls, request(call, tools))
    assert isinstance(answer, ToolMessage) and answer.status == "error"
    assert reason_of(answer) == "invalid_intent", answer.content
    assert "rejected" in answer.content and "id" in answer.content

    lc_answer = lc_tool.invoke(call)
    assert isinstance(lc_answer, ToolMessage) and reason_of(lc_answer) == "invalid_intent"

    decision = add_note.run({"lead_id": "a", "text": "x"}, call_id=bad_id, thread_id="t-1")
    assert (decision.kind, decision.reason) == ("rejected", "invalid_intent")

    assert runs == [] and h.effects() == []
    assert [(d, r) for d, r, _ in audit_rows(h)] == [("rejected", "invalid_intent")] * 3
    assert h.sql("SELECT count(*) FROM toolguard_intent") == [(0,)]  # no row left behind


def test_an_int_id_is_not_the_string_id(harness: HarnessFactory) -> None:
    """``7`` used to be coerced to ``"7"``: one identity for two different calls."""
    h: Harness = harness(POLICY)
    runs: list[str] = []
    tools = {t.name: t for t in note_tools(runs)}
    calls = GuardedToolCalls(h.guard, agent="scorer")
    args = {"lead_id": "a", "text": "x"}

    as_text = ask(calls, request({"name": "add_note", "args": args, "id": "7"}, tools))
    as_int = ask(calls, request({"name": "add_note", "args": args, "id": 7}, tools))

    assert as_text.status == "success" and as_text.content == "noted x"
    assert as_int.status == "error" and reason_of(as_int) == "invalid_intent"
    assert runs == ["x"]
    assert [(d, r) for d, r, _ in audit_rows(h)] == [("accepted", "applied"),
                                                     ("rejected", "invalid_intent")]


def test_the_longest_allowed_id_is_accepted_and_audited(harness: HarnessFactory) -> None:
    """256 characters of four-byte UTF-8 (3,072 bytes percent-encoded in the key): the key
    must be bounded before it reaches an index, or PostgreSQL cannot store it."""
    h: Harness = harness(POLICY)
    runs: list[str] = []
    tools = {t.name: t for t in note_tools(runs)}
    calls = GuardedToolCalls(h.guard, agent="scorer")
    long_id = "\U0001f600" * 256
    call = {"name": "add_note", "args": {"lead_id": "a", "text": "x"}, "id": long_id}

    first = ask(calls, request(call, tools))
    again = ask(calls, request(call, tools))

    assert (first.status, again.status) == ("success", "success")
    assert runs == ["x"]  # the second is a replay
    assert [(d, r) for d, r, _ in audit_rows(h)] == [("accepted", "applied"),
                                                     ("replayed", "duplicate")]
    (key,) = {e.idempotency_key for e in h.audit()}
    assert key is not None and len(key.encode()) <= 512


@pytest.mark.parametrize("missing", [None, "", "absent"])
def test_a_model_call_without_an_id_is_refused_unless_the_policy_keys_it(
        harness: HarnessFactory, missing: Any) -> None:
    h: Harness = harness(POLICY)
    runs: list[str] = []
    tools = {t.name: t for t in note_tools(runs)}
    calls = GuardedToolCalls(h.guard, agent="scorer")
    lc_tool = guard_tool(h.guard, tools["add_note"], agent="scorer")

    def call(name: str, text: str) -> dict[str, Any]:
        made: dict[str, Any] = {"name": name, "args": {"lead_id": "a", "text": text},
                                "type": "tool_call"}
        if missing != "absent":
            made["id"] = missing
        return made

    unkeyed = ask(calls, request(call("add_note", "x"), tools))
    assert unkeyed.status == "error" and reason_of(unkeyed) == "invalid_intent"
    assert "id" in unkeyed.content
    lc_answer = lc_tool.invoke(call("add_note", "x"))
    assert isinstance(lc_answer, ToolMessage) and reason_of(lc_answer) == "invalid_intent"

    # The same call sent twice must not apply twice: with a key template it is a replay.
    keyed = [ask(calls, request(call("keyed_note", "y"), tools))
             for _ in range(2)]
    assert [m.status for m in keyed] == ["success", "success"]
    assert runs == ["y"]
    assert [(d, r) for d, r, _ in audit_rows(h)] == [
        ("rejected", "invalid_intent"), ("rejected", "invalid_intent"),
        ("accepted", "applied"), ("replayed", "duplicate")]


def test_a_direct_python_call_without_an_id_runs_once_without_replay_protection(
        harness: HarnessFactory) -> None:
    h: Harness = harness(POLICY)
    runs: list[str] = []

    @guarded(h.guard, agent="scorer")
    def add_note(lead_id: str, text: str) -> str:
        ctx = current()
        ctx.tx.execute(EFFECT, ("add_note", lead_id, 0, ctx.intent.call_id, 1))
        runs.append(text)
        return "noted"

    assert add_note("a", "x") == "noted"
    assert add_note.run({"lead_id": "a", "text": "y"}).kind == "accepted"
    assert add_note.run({"lead_id": "a", "text": "y"}, call_id="").kind == "accepted"
    assert runs == ["x", "y", "y"]  # no id: each call is its own intent
    assert [(d, r) for d, r, _ in audit_rows(h)] == [("accepted", "applied")] * 3


# --- the name and the identity fields --------------------------------------------------------


@pytest.mark.parametrize("name", [7, None, ["add_note"], "", "n" * 257, "add\ud800note"],
                         ids=["int", "none", "list", "empty", "257", "surrogate"])
def test_a_bad_name_is_refused_as_invalid_intent(harness: HarnessFactory, name: Any) -> None:
    h: Harness = harness(POLICY)
    tools = {t.name: t for t in note_tools([])}
    calls = GuardedToolCalls(h.guard, agent="scorer")

    answer = ask(calls, request({"name": name, "args": {"lead_id": "a", "text": "x"}, "id": "c1"},
                                tools))

    assert answer.status == "error" and reason_of(answer) == "invalid_intent"
    assert [(d, r) for d, r, _ in audit_rows(h)] == [("rejected", "invalid_intent")]


def test_only_langgraphs_execution_info_gives_the_workflow_identity(harness: HarnessFactory) -> None:
    """The thread, run and checkpoint come from LangGraph's ``ExecutionInfo``, checked, never
    coerced. A stand-in runtime (LangGraph's own tests use a ``Mock``, which answers every
    attribute) exposes no identity: its call runs as one without a thread, not refused for
    a thread id that nobody gave, and not replayed under one."""
    h: Harness = harness(POLICY)
    runs: list[str] = []
    tools = {t.name: t for t in note_tools(runs)}
    calls = GuardedToolCalls(h.guard, agent="scorer")
    call: Any = {"name": "add_note", "args": {"lead_id": "a", "text": "x"}, "id": "c1"}

    def with_runtime(runtime: Any) -> ToolCallRequest:
        return ToolCallRequest(tool_call=call, tool=tools["add_note"], state={},
                               runtime=runtime)

    stand_in = [ask(calls, with_runtime(Mock())) for _ in range(2)]
    odd_thread = ask(calls, with_runtime(SimpleNamespace(execution_info=ExecutionInfo(
        checkpoint_id="cp", checkpoint_ns="tools:task-1", task_id="task-1",
        thread_id=["t-1"]))))  # type: ignore[arg-type]

    assert [m.status for m in stand_in] == ["success", "success"]
    assert runs == ["x", "x"]  # no workflow identity: each call is its own intent
    assert (odd_thread.status, reason_of(odd_thread)) == ("error", "invalid_intent")
    assert "thread id" in odd_thread.content
    assert [(d, r) for d, r, _ in audit_rows(h)] == [("accepted", "applied")] * 2 + [
        ("rejected", "invalid_intent")]


def test_guarded_function_run_never_raises_on_a_bad_envelope(harness: HarnessFactory) -> None:
    """``run`` used to let a ``pydantic.ValidationError`` escape, unaudited."""
    h: Harness = harness(POLICY)

    @guarded(h.guard, agent="scorer")
    def add_note(lead_id: str, text: str) -> str:
        return "noted"

    bad: list[dict[str, Any]] = [
        {"call_id": 7}, {"call_id": ["c"]}, {"agent": 7}, {"agent": ["scorer"]},
        {"thread_id": ["t"]}, {"thread_id": "t\ud800"}, {"run_id": {"r": 1}},
        {"node_attempt": "2"}, {"node_attempt": -1}, {"call_id": "c\x00", "thread_id": 5.5},
    ]
    decisions = [add_note.run({"lead_id": "a", "text": "x"}, **identity) for identity in bad]

    assert all(isinstance(d, Decision) for d in decisions)
    assert [(d.kind, d.reason) for d in decisions] == [("rejected", "invalid_intent")] * len(bad)
    assert len(h.audit()) == len(bad)


def test_the_audit_row_of_a_refused_envelope_is_bounded(harness: HarnessFactory) -> None:
    h: Harness = harness(POLICY)
    tools = {t.name: t for t in note_tools([])}
    calls = GuardedToolCalls(h.guard, agent="scorer")
    call = {"name": "x" * 5_000, "args": {"lead_id": "a"}, "id": "c" * 5_000}

    answer = ask(calls, request(call, tools))

    assert reason_of(answer) == "invalid_intent"
    (entry,) = h.audit()
    for text in (entry.tool, entry.intent_id, entry.idempotency_key, entry.detail):
        assert text is None or len(text) <= 2_000
    assert entry.detail and "id" in entry.detail


# --- the property ------------------------------------------------------------------------------


ENVELOPE_TEXT = st.one_of(
    st.none(), st.just(""), st.integers(), st.booleans(), st.floats(allow_nan=True),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(),
                                                         max_size=2),
    st.binary(max_size=4), st.text(max_size=12),
    st.sampled_from(["c1", "c2", "\ud800", "a\udfffb", "\x00", "a\x00b", "c" * 256, "c" * 257,
                     "\U0001f600" * 256, "c" * 3_000, "'; DROP TABLE toolguard_audit; --"]),
)
VALID, HOSTILE, ABSENT = "valid", "hostile", "absent"
#: Mostly valid, so that the rules after the envelope are reached too (hypothesis draws the
#: first choice most readily).
CHOICE = st.sampled_from([VALID, VALID, VALID, HOSTILE])
NAMES = st.sampled_from(["add_note", "add_note", "keyed_note", "nope"])
AGENTS = st.sampled_from(["scorer", "scorer", "scorer", "mallory", None])
GOOD_ARGS = st.fixed_dictionaries({"lead_id": st.sampled_from(["a", "b", "x" * 3_000, "\x00"]),
                                   "text": st.text(max_size=6)})
BAD_ARGS = st.one_of(st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
                     st.integers(), st.none())


def valid_text(value: Any) -> bool:
    if not isinstance(value, str) or not value or len(value) > 256:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@st.composite
def envelopes(draw: Any) -> tuple[dict[str, Any], Any]:
    """``(tool call, agent)``: each part valid most of the time, anything at all otherwise."""
    call: dict[str, Any] = {
        "name": draw(NAMES) if draw(CHOICE) == VALID else draw(ENVELOPE_TEXT),
        "args": draw(GOOD_ARGS) if draw(CHOICE) == VALID else draw(BAD_ARGS),
        "type": "tool_call"}
    how = draw(st.sampled_from([VALID, VALID, VALID, HOSTILE, ABSENT]))
    if how == VALID:
        call["id"] = draw(st.text(min_size=1, max_size=12))
    elif how == HOSTILE:
        call["id"] = draw(ENVELOPE_TEXT)
    agent = draw(AGENTS) if draw(CHOICE) == VALID else draw(st.one_of(st.none(), ENVELOPE_TEXT))
    return call, agent


def expect_envelope_refusal(call: dict[str, Any], agent: Any, *, model: bool,
                            tool_name: str | None = None) -> bool:
    """True when the envelope alone must make the decision ``invalid_intent``."""
    name, call_id = call.get("name"), call.get("id")
    if not valid_text(name) or (tool_name is not None and name != tool_name):
        return True
    if call_id not in (None, "") and not valid_text(call_id):
        return True
    if agent is not None and not valid_text(agent):
        return True
    keyed = name == "keyed_note" or name not in POLICY["tools"]
    return call_id in (None, "") and model and not keyed


ADAPTERS = ["tool_node", "tool_node_async", "langchain_tool", "langchain_tool_async",
            "function", "function_async"]


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_every_envelope_gets_exactly_one_audit_row(harness: HarnessFactory, adapter: str) -> None:
    h: Harness = harness(POLICY)
    runs: list[str] = []
    tools = {t.name: t for t in note_tools(runs)}
    threads = itertools.count()
    calls = GuardedToolCalls(h.guard, agent_from="metadata")  # identity: part of the envelope
    lc_tools = {name: guard_tool(h.guard, tool, agent_from="metadata") for name, tool in tools.items()}
    body = "coroutine" if adapter == "function_async" else "func"
    functions = {name: guarded(h.guard, name=name, agent_from="call")(getattr(tool, body))
                 for name, tool in tools.items()}
    loop = LoopThread(h) if adapter.endswith("_async") else None
    seen: dict[str, int] = {}
    tool_errors: list[Exception] = []

    def handled(req: ToolCallRequest, error: Exception) -> ToolMessage:
        """ToolNode's default handler: the tool's own schema refused, ToolNode answers;
        anything else the tool raised goes on unchanged."""
        if not isinstance(error, ValidationError):
            tool_errors.append(error)
            raise error
        call = req.tool_call
        text = ToolInvocationError(str(call["name"]), error, call["args"]).message
        return ToolMessage(text, tool_call_id=str(call.get("id") or ""), name=str(call["name"]),
                           status="error")

    def node_execute(req: ToolCallRequest) -> ToolMessage:
        try:
            return execute(req)
        except Exception as error:
            return handled(req, error)

    async def aexecute(req: ToolCallRequest) -> ToolMessage:
        assert req.tool is not None
        try:
            output = await req.tool.ainvoke({"id": None, **req.tool_call, "type": "tool_call"})
        except Exception as error:
            return handled(req, error)
        if isinstance(output, ToolMessage):
            return output
        return ToolMessage(content=str(output), tool_call_id="", name=req.tool.name)

    def tool_raised(call: dict[str, Any], error: Exception) -> str:
        """The reason of a call whose tool's own exception came out of the adapter, unchanged.

        A ToolNode lets through what its handler does not answer; a guarded LangChain tool
        raises what the tool raises. The guard audited it first as the tool's failure: a
        call toolguard refused never reaches the tool, so nothing of it is raised.
        """
        decision, reason = last_audit(h)
        assert (decision, reason) == ("failed", "error"), error
        if adapter.startswith("tool_node"):
            assert tool_errors and error is tool_errors[-1], error
        return reason

    def decide(call: dict[str, Any], agent: Any, thread: str) -> str | None:
        """The reason code the caller was given for a refusal, None when it succeeded."""
        tool_errors.clear()
        if adapter.startswith("function"):
            return answer_of(call, agent, thread)
        try:
            return answer_of(call, agent, thread)
        except ToolGuardError:
            raise  # toolguard's own errors never reach the caller of a model's call
        except Exception as error:
            return tool_raised(call, error)

    def target(call: dict[str, Any]) -> str:
        """The tool an adapter that is bound to one tool stands for."""
        name = call["name"]
        return name if isinstance(name, str) and name in tools else "add_note"

    def answer_of(call: dict[str, Any], agent: Any, thread: str) -> str | None:
        metadata = {} if agent is None else {"toolguard_agent": agent}
        if adapter in ("tool_node", "tool_node_async"):
            req = request(call, tools, thread=thread, metadata=metadata)
            if loop is None:
                answer = calls.wrap_tool_call(req, node_execute)
            else:
                answer = loop.run(calls.awrap_tool_call(req, aexecute))
        elif adapter.startswith("langchain_tool"):  # invoked directly: may be handed another name
            tool, config = lc_tools[target(call)], {"metadata": metadata,
                                                    "configurable": {"thread_id": thread}}
            answer = (tool.invoke(call, config) if loop is None  # type: ignore[arg-type]
                      else loop.run(tool.ainvoke(call, config)))  # type: ignore[arg-type]
        else:
            function, identity = functions[call["name"]], {
                "agent": agent, "call_id": call.get("id"), "thread_id": thread}
            decision = (function.run(call["args"], **identity) if loop is None
                        else loop.run(function.arun(call["args"], **identity)))
            assert isinstance(decision, Decision)
            return None if decision.ok else decision.reason
        if not isinstance(answer, ToolMessage):  # LangChain's bare output for an id-less call
            assert call.get("id") in (None, "") and adapter.startswith("langchain_tool"), answer
            return None
        return None if answer.status == "success" else reason_of(answer)

    @settings(FUZZ, max_examples=150 if h.backend.kind == "sqlite" else 60)
    @given(envelope=envelopes())
    def check(envelope: tuple[dict[str, Any], Any]) -> None:
        call, agent = envelope
        if adapter.startswith("function"):  # the function's own name is the tool, not input
            call = {**call, "name": target(call)}
        audits, effects = snapshot(h)
        try:
            refused = decide(call, agent, f"p-{next(threads)}")
        except BaseException as error:
            raise AssertionError(f"{type(error).__name__} escaped the adapter: {error!r}") from error
        new_audits, new_effects = snapshot(h)
        assert new_audits == audits + 1, "every decision is audited exactly once"
        (row,) = h.sql("SELECT decision, reason FROM toolguard_audit ORDER BY id DESC LIMIT 1")
        decision, reason = row
        if refused is None:
            assert decision in ("accepted", "replayed"), (decision, reason)
        else:
            assert decision in ("rejected", "failed") and reason == refused, (row, refused)
        bound = target(call) if adapter.startswith("langchain_tool") else None
        model = not adapter.startswith("function")
        if expect_envelope_refusal(call, agent, model=model, tool_name=bound):
            assert reason == "invalid_intent", (call, agent, reason)
        else:
            assert reason != "invalid_intent", (call, agent, reason)
        assert new_effects == effects + (decision == "accepted"), "a refusal changes nothing"
        seen[reason] = seen.get(reason, 0) + 1

    try:
        check()
    finally:
        if loop is not None:
            loop.close()
    # The strategies reached every step after the envelope too.
    assert {"applied", "invalid_intent", "missing_identity", "not_authorized",
            "invalid_arguments", "duplicate"} <= set(seen), seen


@pytest.mark.parametrize("message", ["bad \x00 byte", "lone \ud800 surrogate", "e" * 10_000],
                         ids=["nul", "surrogate", "long"])
def test_a_tool_error_with_unstorable_text_is_still_audited_once(
        harness: HarnessFactory, message: str) -> None:
    """The store audits a failed fenced write with the error's text: NUL (refused by
    PostgreSQL), lone surrogates (not UTF-8) and a long text must not cost the decision
    its row. (The stores already handled this; kept as a guard for the property.)"""
    h: Harness = harness(POLICY)

    @guarded(h.guard, agent="scorer")
    def add_note(lead_id: str, text: str) -> str:
        current().tx.execute(EFFECT, ("add_note", lead_id, 0, "c1", 1))
        raise ValueError(message)

    decision = add_note.run({"lead_id": "a", "text": "x"}, call_id="c1", thread_id="t")

    assert (decision.kind, decision.reason) == ("failed", "error")
    (entry,) = h.audit(intent_id="c1")
    assert (entry.decision, entry.reason) == ("failed", "error")
    assert entry.detail and len(entry.detail) <= 4_000
    assert h.effects() == []
