"""Intents, default idempotency keys, the args hash and limits on untrusted input."""

from __future__ import annotations

import datetime
import uuid

import pytest
from pydantic import BaseModel, ValidationError

from toolguard.call.envelope import envelope_problem
from toolguard.call.intent import (
    Intent,
    Limits,
    WorkflowIdentity,
    args_hash,
    bounded_key,
    canonical_json,
    check_limits,
    default_idempotency_key,
    json_args,
    node_path,
)
from toolguard.errors import InvalidArguments


def test_intent_is_frozen_and_forbids_unknown_fields() -> None:
    intent = Intent(tool="t", args={"a": 1}, call_id="c1")
    with pytest.raises(ValidationError):
        intent.tool = "other"
    with pytest.raises(ValidationError):
        Intent(tool="t", trusted=True)  # type: ignore[call-arg]
    assert intent.id and intent.id != Intent(tool="t").id


def test_intent_keeps_any_raw_args() -> None:
    assert Intent(tool="t", args="not an object").args == "not an object"
    assert Intent(tool="t", args=[1, {"x": None}]).args == [1, {"x": None}]


def test_intent_fields_are_strict() -> None:
    with pytest.raises(ValidationError):
        Intent(tool="t", call_id=7)  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        Intent(tool="t", node_attempt="2")  # type: ignore[arg-type]


def test_from_tool_call_never_raises_and_never_coerces() -> None:
    for call_id in (7, True, ["c"], {"id": 1}, b"c"):
        intent = Intent.from_tool_call({"name": "t", "args": {}, "id": call_id})
        assert intent.call_id is None and intent.problem and intent.problem.startswith("id:")
    for text, problem in (("c" * 257, "id: 257 characters, at most 256"),
                          ("c\ud800", "id: not valid Unicode (a lone surrogate at position 1)")):
        intent = Intent.from_tool_call({"name": "t", "args": {}, "id": text})
        assert envelope_problem(intent) == problem
    assert Intent.from_tool_call({"name": 7}).problem == "name: expected a string, got a number"
    assert Intent.from_tool_call("not a call").problem == "name: missing"
    assert envelope_problem(Intent.from_tool_call({"name": "t"}, agent="")) == "agent: empty"
    assert envelope_problem(Intent(tool="t", call_id="c" * 300)) == "id: 300 characters, at most 256"
    ok = Intent.from_tool_call({"name": "t", "id": "c" * 256}, agent="a")
    assert envelope_problem(ok) is None and ok.call_id == "c" * 256


def test_bounded_key() -> None:
    assert bounded_key("thread:t/tools/c") == "thread:t/tools/c"
    long = "thread:t/tools/" + "%F0%9F%98%80" * 256
    hashed = bounded_key(long)
    assert len(hashed) < 200 and hashed.startswith(long[:64]) and "%h" in hashed
    assert bounded_key(long + "x") != hashed
    assert bounded_key("a\x00") != "a\x00" and "\x00" not in bounded_key("a\x00")
    assert bounded_key("a\ud800").isascii()
    assert bounded_key(hashed) != hashed  # a key that looks hashed is hashed again: no collision


def test_from_tool_call() -> None:
    flow = WorkflowIdentity(thread_id="th", checkpoint_ns="ns", run_id="r")
    intent = Intent.from_tool_call({"name": "update", "args": {"x": 1}, "id": "call_1"},
                                   agent="scorer", workflow=flow, node_attempt=3)
    assert (intent.tool, intent.args, intent.call_id, intent.agent, intent.node_attempt) == (
        "update", {"x": 1}, "call_1", "scorer", 3)


def test_default_key_uses_thread_node_path_and_call() -> None:
    flow = WorkflowIdentity(thread_id="t1", checkpoint_ns="tools:abc", run_id="r1", checkpoint_id="cp")
    key = default_idempotency_key(Intent(tool="x", call_id="call/1", workflow=flow, node_attempt=5))
    assert key == "thread:t1/tools/call%2F1"
    # node_attempt, checkpoint_id and the task id change on retries and across supersteps:
    # none of them changes the key
    again = Intent(tool="x", call_id="call/1", node_attempt=9,
                   workflow=flow.model_copy(update={"checkpoint_id": "other", "run_id": "r2",
                                                    "checkpoint_ns": "tools:def"}))
    assert default_idempotency_key(again) == key


def test_task_scope_keeps_the_task_ids() -> None:
    flow = WorkflowIdentity(thread_id="t1", checkpoint_ns="tools:abc")
    intent = Intent(tool="x", call_id="c", workflow=flow)
    assert default_idempotency_key(intent, "task") == "thread:t1/tools%3Aabc/c"
    later = intent.model_copy(update={"workflow": flow.model_copy(
        update={"checkpoint_ns": "tools:def"})})
    assert default_idempotency_key(later, "task") != default_idempotency_key(intent, "task")


def test_node_path_drops_task_ids_and_keeps_agents_apart() -> None:
    assert node_path("") == ""
    assert node_path("tools") == "tools"
    assert node_path("tools:1f0c-aa") == "tools"
    assert node_path("scorer:9a|tools:1f0c") == "scorer|tools"
    assert node_path("router:9a|tools:1f0c") != node_path("scorer:9a|tools:1f0c")


def test_default_key_falls_back_to_run_then_none() -> None:
    run_only = Intent(tool="x", call_id="c", workflow=WorkflowIdentity(run_id="r/1"))
    assert default_idempotency_key(run_only) == "run:r%2F1//c"
    assert default_idempotency_key(Intent(tool="x", call_id="c")) is None
    assert default_idempotency_key(Intent(tool="x", workflow=WorkflowIdentity(thread_id="t"))) is None


def test_default_key_parts_cannot_run_together() -> None:
    a = Intent(tool="x", call_id="c", workflow=WorkflowIdentity(thread_id="a/b", checkpoint_ns="c"))
    b = Intent(tool="x", call_id="c", workflow=WorkflowIdentity(thread_id="a", checkpoint_ns="b/c"))
    assert default_idempotency_key(a) != default_idempotency_key(b)


class Args(BaseModel):
    lead: uuid.UUID
    when: datetime.datetime
    tags: list[str]


def test_args_hash_is_canonical() -> None:
    assert args_hash({"a": 1, "b": [1, 2]}) == args_hash({"b": [1, 2], "a": 1})
    assert args_hash({"a": 1}) != args_hash({"a": "1"})
    assert args_hash({"a": 1}) != args_hash({"a": True})
    assert canonical_json({"b": "é", "a": None}) == '{"a":null,"b":"é"}'
    lead = uuid.uuid4()
    model = Args(lead=lead, when=datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC), tags=["x"])
    as_json = json_args(model)
    assert as_json["lead"] == str(lead)
    assert args_hash(model) == args_hash(as_json)
    assert len(args_hash(model)) == 64


def test_args_hash_refuses_nan() -> None:
    with pytest.raises(ValueError):
        args_hash({"a": float("nan")})


# --- limits ----------------------------------------------------------------------


def message(args: object, limits: Limits | None = None) -> str:
    with pytest.raises(InvalidArguments) as caught:
        check_limits(args, limits or Limits())
    assert caught.value.reason == "invalid_arguments"
    return caught.value.message


def test_normal_args_pass() -> None:
    check_limits({"lead_id": 42, "score": 7.5, "ok": True, "note": None, "tags": ["a", "b"],
                  "contact": {"email": "a@b.c"}})


def test_long_string_names_the_path() -> None:
    args = {"items": [{"name": "x"}] * 3 + [{"name": "y" * 5000}]}
    assert message(args) == "args.items[3].name: string longer than 4096"


def test_deep_nesting_names_the_path_and_does_not_recurse() -> None:
    deep: object = "leaf"
    for _ in range(100_000):  # far beyond the recursion limit: checked iteratively
        deep = [deep]
    text = message({"a": deep})
    assert text.startswith("args.a[0][0][0][0][0][0]") and "nested deeper than 8 levels" in text


def test_too_many_items_and_keys() -> None:
    assert message({"ids": list(range(300))}) == "args.ids: more than 256 items"
    assert message({f"k{i}": i for i in range(300)}) == "args: more than 256 keys"
    assert message({"x": {"a": 1, "b": 2}}, Limits(max_keys=1)) == "args.x: more than 1 keys"


def test_total_size() -> None:
    args = {"parts": ["x" * 4000] * 20}  # each string fits, the whole does not
    assert message(args) == "args: larger than 65536 bytes as JSON"


def test_size_is_counted_as_compact_json() -> None:
    args = {"a": "é\"", "b": [1, True, None]}
    import json

    exact = len(json.dumps(args, separators=(",", ":"), ensure_ascii=False).encode())
    check_limits(args, Limits(max_bytes=exact))
    assert "larger than" in message(args, Limits(max_bytes=exact - 1))


def test_huge_integer_and_long_key() -> None:
    assert "integer longer than 4096 digits" in message({"n": 10 ** 5000})
    assert message({"k" * 5000: 1}).endswith("key longer than 4096")
    assert message({"a b": "x" * 10}, Limits(max_string=5)) == 'args["a b"]: string longer than 5'


def test_non_json_values_are_rejected() -> None:
    assert message({"b": b"bytes"}) == "args.b: bytes is not a JSON value"
    assert message({"f": float("inf")}) == "args.f: not a finite number"
    assert message({1: "x"}) == "args: object key of type int, expected a string"
    assert "lone surrogate" in message({"s": "\ud800"})


def test_per_tool_limits_override() -> None:
    check_limits({"s": "x" * 5000}, Limits(max_string=10_000))
