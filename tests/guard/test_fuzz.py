"""Property-based fuzzing of tool calls through the adapters, with hypothesis.

Malformed and hostile calls (wrong types, extra fields, huge or deeply nested
values, key-injection strings, NUL, look-alike letters, values that are not
JSON, unknown tools, other agents) go through the LangGraph wrapper (called
directly with a ``ToolCallRequest``) and through the plain-function adapter.
For every call: no exception escapes the adapter, exactly one audit row with a
reason code is written, a refused call changes nothing, an accepted one changes
exactly what it should, and no two different validated argument tuples ever
share a lock key unless the policy says so (``add_score`` and ``tag_leads``
both lock ``lead:{id}`` on purpose).

Bounded: a few hundred examples per property on SQLite, fewer on PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
import decimal
import itertools
from collections import Counter, defaultdict
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, example, given, settings
from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool, StructuredTool
from langgraph.prebuilt.tool_node import ToolCallRequest, ToolInvocationError
from langgraph.runtime import ExecutionInfo
from pydantic import ValidationError

from guard.harness import Harness
from guard.tools import EFFECT, READ, UPSERT
from toolguard.adapters import GuardedToolCalls, guarded
from toolguard.call.context import current
from toolguard.guard import Decision

POLICY: dict[str, Any] = {"version": 1, "tools": {
    "add_score": {"locks": ["lead:{lead_id}"], "agents": ["scorer"],
                  "args": {"delta": {"ge": -100, "le": 100}}},
    "tag_leads": {"locks": ["lead:{lead_ids[*]}"], "agents": ["scorer"]},
    "link_leads": {"locks": ["pair:{a}:{b}"], "agents": ["scorer"]},
}}


def examples(h: Harness, sqlite: int = 500, postgresql: int = 100) -> int:
    return sqlite if h.backend.kind == "sqlite" else postgresql


FUZZ = settings(deadline=None, database=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])

# --- strategies ------------------------------------------------------------------------------

INJECTION = [
    "a", "b", "a:b", "b:c", "a:b:c", ":", "*", "{x}", "{lead_id}", "../", "..%2F", "%3A", "%",
    "%%", "~", "~i1", "~t", "1", "lead:a", "", " ", "a ", "\\", "\n", "\x00", "a\x00b",
    "\u0430",  # Cyrillic a
    "\uff41",  # fullwidth a
    "A", "\u200b", "\u00df", "ss", "\u0130", "i\u0307", "\U0001f600", "-", "_", "a-b", "a_b",
    "a%3Ab", "'; DROP TABLE lead; --", "$ne", "\ud800x"[1:],
]
ids = st.one_of(st.sampled_from(INJECTION), st.text(max_size=8))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                    st.text(max_size=10), st.sampled_from(INJECTION))
json_like = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)


def nested(depth: int) -> Any:
    value: Any = "x"
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


HUGE = [
    "x" * 5_000, 10 ** 5_000, -(10 ** 5_000), list(range(300)), {f"k{i}": i for i in range(300)},
    nested(9), nested(50), nested(3_000), [["y" * 4_000] * 20], float("nan"), float("inf"),
    "\ud800", {"\ud800": 1}, {1: "int key"}, {None: 1},
]
not_json = st.one_of(
    st.binary(max_size=8), st.sets(st.integers(), max_size=3), st.builds(object),
    st.datetimes(), st.decimals(allow_nan=True), st.complex_numbers(),
    st.just(decimal.Decimal("1e999999")), st.just(dt.UTC), st.just(...),
    st.tuples(st.integers()), st.frozensets(st.text(max_size=2), max_size=2),
)
hostile = st.one_of(json_like, st.sampled_from(HUGE), not_json)
extra_fields = st.dictionaries(st.one_of(st.sampled_from(INJECTION), st.text(max_size=6)),
                               hostile, max_size=3)


@st.composite
def arg_sets(draw: Any, tool: str) -> Any:
    """Valid arguments most of the time, perturbed or replaced often."""
    if tool == "add_score":
        args: dict[Any, Any] = {"lead_id": draw(ids), "delta": draw(st.integers(-120, 120))}
    elif tool == "tag_leads":
        args = {"lead_ids": draw(st.lists(ids, max_size=4))}
    else:
        args = {"a": draw(ids), "b": draw(ids)}
    how = draw(st.sampled_from(["valid", "valid", "valid", "value", "drop", "extra", "replace"]))
    if how == "value":
        args[draw(st.sampled_from(sorted(args)))] = draw(hostile)
    elif how == "drop":
        args.pop(draw(st.sampled_from(sorted(args))))
    elif how == "extra":
        args.update(draw(extra_fields))
    elif how == "replace":
        return draw(st.one_of(hostile, st.dictionaries(st.text(max_size=6), hostile, max_size=4)))
    return args


TOOL_NAMES = ["add_score", "add_score", "add_score", "tag_leads", "link_leads"]
HOSTILE_NAMES = ["nope", "ADD_SCORE", "add_score ", "add_score\x00", "", "../add_score", "*"]


@st.composite
def tool_calls(draw: Any) -> dict[str, Any]:
    name = draw(st.sampled_from(TOOL_NAMES))
    args = draw(arg_sets(name))
    if draw(st.sampled_from([False] * 9 + [True])):
        name = draw(st.sampled_from(HOSTILE_NAMES))
    # Mostly usable ids: the envelope has its own property (test_envelope.py); here the odd
    # one (missing, 5,000 characters, a lone surrogate) is refused as invalid_intent.
    if draw(st.sampled_from([True] * 19 + [False])):
        call_id = draw(st.one_of(st.just("call"), st.sampled_from([i for i in INJECTION if i]),
                                 st.text(min_size=1, max_size=6)))
    else:
        call_id = draw(st.sampled_from(["", "c" * 5_000, "c\ud800"]))
    return {"name": name, "args": args, "id": call_id, "type": "tool_call"}


# --- what the tools record ----------------------------------------------------------------------


class Recorder:
    """The keys each accepted call was locked under, and the resource each key named."""

    def __init__(self) -> None:
        self.named: dict[str, set[tuple[str, ...]]] = defaultdict(set)
        self.expected: dict[str, int] = {}
        self.outcomes: Counter[str] = Counter()  # reason codes seen: the strategies' coverage

    def note(self, identities: list[tuple[str, ...]]) -> None:
        keys = current().keys
        if len(identities) == 1 and len(keys) == 1:
            self.named[keys[0]].add(identities[0])
        else:  # one key per distinct identity, in the canonical (sorted) order of the keys
            assert len(keys) == len(set(identities)), (keys, identities)
            for key in keys:
                self.named[key].update(i for i in identities if self._fits(key, i))

    @staticmethod
    def _fits(key: str, identity: tuple[str, ...]) -> bool:
        from toolguard.policies import escape_value

        return key == f"{identity[0]}:" + ":".join(escape_value(v) for v in identity[1:])

    def collisions(self) -> dict[str, set[tuple[str, ...]]]:
        return {key: found for key, found in self.named.items() if len(found) != 1}


def write(tool: str, lead: str, delta: int) -> None:
    ctx = current()
    ctx.tx.execute(EFFECT, (tool, lead, delta, ctx.intent.call_id, max(ctx.tokens.values())))


def lead_tools(recorder: Recorder) -> list[BaseTool]:
    def add_score(lead_id: str, delta: int) -> str:
        """Add to a score."""
        recorder.note([("lead", lead_id)])
        ctx = current()
        row = ctx.tx.execute(READ, (lead_id,)).fetchone()
        ctx.tx.execute(UPSERT, (lead_id, (int(row[0]) if row else 0) + delta))
        write("add_score", lead_id, delta)
        return "ok"

    def tag_leads(lead_ids: list[str]) -> str:
        """Tag leads."""
        recorder.note([("lead", lead) for lead in lead_ids])
        write("tag_leads", ",".join(lead_ids), 0)
        return "ok"

    def link_leads(a: str, b: str) -> str:
        """Link two leads."""
        recorder.note([("pair", a, b)])
        write("link_leads", f"{a}|{b}", 0)
        return "ok"

    return [StructuredTool.from_function(func) for func in (add_score, tag_leads, link_leads)]


def expect_accepted(recorder: Recorder, name: str, args: Any) -> None:
    if name == "add_score":
        lead = args["lead_id"]
        recorder.expected[lead] = recorder.expected.get(lead, 0) + args["delta"]


def snapshot(h: Harness) -> tuple[int, int]:
    (audit,), = h.sql("SELECT count(*) FROM toolguard_audit")
    (effects,), = h.sql("SELECT count(*) FROM effect")
    return int(audit), int(effects)


def last_audit(h: Harness) -> tuple[str, str]:
    (row,) = h.sql("SELECT decision, reason FROM toolguard_audit ORDER BY id DESC LIMIT 1")
    return row[0], row[1]


def covered(recorder: Recorder, h: Harness, reasons: set[str]) -> None:
    """The run exercised both sides: enough accepted calls and the main refusals."""
    total = sum(recorder.outcomes.values())
    assert total >= examples(h) * 0.9, recorder.outcomes
    assert recorder.outcomes["applied"] >= total // 10, recorder.outcomes
    assert reasons <= set(recorder.outcomes), recorder.outcomes


# --- the properties ------------------------------------------------------------------------------


def test_langgraph_wrapper_survives_hostile_calls(harness) -> None:
    h: Harness = harness(POLICY)
    recorder = Recorder()
    tools = {tool.name: tool for tool in lead_tools(recorder)}
    calls = GuardedToolCalls(h.guard, agent="scorer")
    threads = itertools.count()
    tool_errors: list[Exception] = []

    def execute(request: ToolCallRequest) -> ToolMessage:
        """What ToolNode's execute does with its default handler, minus injection."""
        assert request.tool is not None
        call = request.tool_call
        try:
            return request.tool.invoke({**call, "type": "tool_call"})
        except ValidationError as error:  # the tool's own schema refused: ToolNode answers
            text = ToolInvocationError(call["name"], error, call["args"]).message
            return ToolMessage(text, tool_call_id=call["id"], name=call["name"], status="error")
        except Exception as error:  # the default handler lets the tool's own errors through
            tool_errors.append(error)
            raise

    # The refusals the coverage check names are always among the examples, whatever the
    # generator draws on a given run: an unknown tool, arguments the schema refuses.
    @settings(FUZZ, max_examples=examples(h))
    @given(call=tool_calls())
    @example(call={"name": "drop_table", "args": {"lead_id": "a", "delta": 1}, "id": "call-u",
                   "type": "tool_call"})
    @example(call={"name": "add_score", "args": {"lead_id": "a", "delta": "1"}, "id": "call-s",
                   "type": "tool_call"})
    def check(call: dict[str, Any]) -> None:
        info = ExecutionInfo(thread_id=f"fuzz-{next(threads)}", checkpoint_ns="tools:1",
                             checkpoint_id="cp", task_id="1", run_id=None, node_attempt=1)
        runtime = SimpleNamespace(execution_info=info, config={"metadata": {}})
        request = ToolCallRequest(tool_call=call, tool=tools.get(call["name"]), state={},
                                  runtime=runtime)  # type: ignore[arg-type]
        audits, effects = snapshot(h)
        tool_errors.clear()
        try:
            answer = calls.wrap_tool_call(request, execute)
        except BaseException as error:
            if tool_errors and error is tool_errors[-1]:  # the tool's own failure goes on unchanged
                assert snapshot(h) == (audits + 1, effects), "audited once, changed nothing"
                outcome = last_audit(h)
                assert outcome in (("failed", "error"), ("rejected", "invalid_arguments")), outcome
                if outcome[1] == "invalid_arguments":  # the tool fails on them without toolguard too
                    with pytest.raises(type(error)):
                        tools[call["name"]].invoke({**call, "type": "tool_call"})
                recorder.outcomes["tool_raised"] += 1
                return
            raise AssertionError(f"{type(error).__name__} escaped the adapter: {error}") from error

        assert isinstance(answer, ToolMessage)
        assert answer.tool_call_id == str(call["id"])
        new_audits, new_effects = snapshot(h)
        assert new_audits == audits + 1, "every call is audited exactly once"
        decision, reason = last_audit(h)
        assert reason
        recorder.outcomes[reason] += 1
        if answer.status == "success":
            assert decision == "accepted"
            expect_accepted(recorder, call["name"], call["args"])
            assert new_effects == effects + 1
        else:
            assert decision in ("rejected", "failed"), decision
            assert reason == answer.response_metadata["toolguard"]["reason"]
            assert new_effects == effects, "a refused call changes nothing"
        assert h.scores() == recorder.expected

    check()
    assert not recorder.collisions()
    covered(recorder, h, {"applied", "invalid_arguments", "unknown_tool"})


def test_function_adapter_survives_hostile_calls(harness) -> None:
    h: Harness = harness(POLICY)
    recorder = Recorder()
    runs = itertools.count()

    @guarded(h.guard, agent="scorer")
    def add_score(lead_id: str, delta: int) -> int:
        recorder.note([("lead", lead_id)])
        ctx = current()
        row = ctx.tx.execute(READ, (lead_id,)).fetchone()
        score = (int(row[0]) if row else 0) + delta
        ctx.tx.execute(UPSERT, (lead_id, score))
        write("add_score", lead_id, delta)
        return score

    @guarded(h.guard, agent="scorer")
    def link_leads(a: str, b: str) -> str:
        recorder.note([("pair", a, b)])
        write("link_leads", f"{a}|{b}", 0)
        return "ok"

    functions = {"add_score": add_score, "link_leads": link_leads}

    @settings(FUZZ, max_examples=examples(h))
    @given(name=st.sampled_from(sorted(functions)), data=st.data(),
           agent=st.sampled_from(["scorer", "scorer", "scorer", "mallory", None, "sc\x00orer"]),
           call_id=st.one_of(st.none(), st.sampled_from(INJECTION), st.just("c" * 5_000)))
    @example(name="add_score", data=None, agent="mallory", call_id="call-m")  # not authorized
    @example(name="add_score", data=None, agent="scorer", call_id="call-s")   # schema refusal
    def check(name: str, data: Any, agent: str | None, call_id: str | None) -> None:
        args = data.draw(arg_sets(name)) if data is not None else (
            {"lead_id": "a", "delta": 1} if agent == "mallory" else {"lead_id": "a", "delta": "1"})
        audits, effects = snapshot(h)
        try:
            decision = functions[name].run(args, agent=agent, call_id=call_id,
                                           thread_id=f"fuzz-{next(runs)}")
        except BaseException as error:
            raise AssertionError(f"{type(error).__name__} escaped the adapter: {error}") from error

        assert isinstance(decision, Decision)
        new_audits, new_effects = snapshot(h)
        assert new_audits == audits + 1, "every call is audited exactly once"
        assert last_audit(h) == (decision.kind, decision.reason)
        recorder.outcomes[decision.reason] += 1
        if decision.ok:
            assert decision.kind == "accepted" and new_effects == effects + 1
            expect_accepted(recorder, name, args)
        else:
            assert new_effects == effects, "a refused call changes nothing"
            assert decision.error is not None and decision.error.reason == decision.reason
        assert h.scores() == recorder.expected

    check()
    assert not recorder.collisions()
    covered(recorder, h, {"applied", "invalid_arguments", "not_authorized"})


def test_look_alike_and_separator_values_name_different_resources(harness) -> None:
    """The classic collisions, spelled out: each pair below is two resources, two keys."""
    h: Harness = harness(POLICY)
    recorder = Recorder()

    @guarded(h.guard, agent="scorer")
    def link_leads(a: str, b: str) -> str:
        recorder.note([("pair", a, b)])
        return "ok"

    @guarded(h.guard, agent="scorer")
    def tag_leads(lead_ids: list[str]) -> str:
        recorder.note([("lead", lead) for lead in lead_ids])
        return "ok"

    pairs = [("a:b", "c"), ("a", "b:c"), ("a", "b%3Ac"), ("a%3Ab", "c"), ("{x}", "*"),
             ("../", "a"), (".", "./a")]
    keys = {}
    for a, b in pairs:
        decision = link_leads.run({"a": a, "b": b}, call_id=f"{a}|{b}", thread_id="t")
        assert decision.ok, decision
        keys[(a, b)] = decision.keys
    assert len(set(keys.values())) == len(pairs), keys
    leads = ["a", "A", "\u0430", "\uff41", "a\x00", "a ", "~i1", "1", "%61", "lead:a", "*"]
    decision = tag_leads.run({"lead_ids": leads}, call_id="tags", thread_id="t")
    assert decision.ok and len(decision.keys) == len(leads), decision.keys
    assert not recorder.collisions()
    (entry,) = h.audit(intent_id="tags")
    assert set(entry.keys) == set(decision.keys)  # keys are audited as locked
