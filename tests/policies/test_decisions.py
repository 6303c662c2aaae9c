"""The pure decisions: unknown tools, authorization, constraints, keys, idempotency, redaction."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from toolguard.call.intent import Intent, WorkflowIdentity
from toolguard.errors import (
    GuardMisconfigured,
    InvalidArguments,
    MissingIdentity,
    NotAuthorized,
    UnknownTool,
)
from toolguard.policies import (
    REDACTED,
    Policy,
    authorize,
    check_constraints,
    idempotency_key,
    lock_keys,
    lookup_tool,
    ordering_keys,
    redact,
    redacted_args,
)

POLICY = Policy.from_dict({
    "version": 1,
    "agents": ["scorer", "enricher"],
    "tools": {
        "enrich": {"locks": ["lead:{lead_id}"], "agents": ["enricher"]},
        "score": {
            "locks": ["lead:{lead_id}", "owner:{owner}"],
            "agents": ["scorer"],
            "after": ["enrich"],
            "args": {
                "score": {"ge": 0, "le": 100},
                "note": {"max_length": 5, "pattern": "[a-z]*"},
                "stage": {"enum": ["new", "won", 3, True]},
                "tags": {"max_items": 2},
                "contacts[*].email": {"pattern": ".+@.+"},
            },
            "idempotency_key": "{lead_id}:{score}",
            "redact": ["contacts[*].email", "secret"],
        },
        "tag": {"locks": ["lead:{ids[*]}"]},
        "search": {"read_only": True},
    },
})


def test_unknown_tool_is_denied_by_default() -> None:
    with pytest.raises(UnknownTool) as caught:
        lookup_tool(POLICY, "drop_tables" + "x" * 500)
    assert caught.value.reason == "unknown_tool"
    assert len(caught.value.message) < 200  # an untrusted name is not echoed in full


def test_unknown_tool_can_be_allowed() -> None:
    policy = Policy.from_dict({"version": 1, "defaults": {"on_unknown_tool": "allow", "ttl_ms": 77}})
    tool = lookup_tool(policy, "anything")
    assert tool.name == "anything" and tool.locks == () and tool.fenced is False and tool.ttl_ms == 77
    assert lookup_tool(POLICY, "score") is POLICY.tools["score"]


def test_authorize() -> None:
    score = POLICY.tools["score"]
    authorize(score, "scorer")
    with pytest.raises(NotAuthorized) as caught:
        authorize(score, "enricher")
    assert caught.value.reason == "not_authorized"
    assert caught.value.message == "agent 'enricher' may not call score (allowed: scorer)"
    with pytest.raises(MissingIdentity, match="without an agent identity") as missing:
        authorize(score, None)
    assert missing.value.reason == "missing_identity"
    authorize(POLICY.tools["tag"], "anyone")
    with pytest.raises(MissingIdentity):  # "*" is every identified agent, never "nobody"
        authorize(POLICY.tools["tag"], None)


GOOD_ARGS = {"lead_id": "L1", "owner": 7, "score": 50, "note": "ok", "stage": "won", "tags": ["a"],
             "contacts": [{"email": "a@b"}]}


def test_constraints_accept_good_args_and_skip_absent_ones() -> None:
    check_constraints(POLICY.tools["score"], GOOD_ARGS)
    check_constraints(POLICY.tools["score"], {"lead_id": "L1", "note": None})


@pytest.mark.parametrize(("change", "message"), [
    ({"score": 101}, "args.score: must be <= 100"),
    ({"score": -1}, "args.score: must be >= 0"),
    ({"score": "50"}, "args.score: must be a number"),
    ({"score": True}, "args.score: must be a number"),
    ({"note": "toolong"}, "args.note: longer than 5 characters"),
    ({"note": "AB"}, "args.note: does not match the pattern '[a-z]*'"),
    ({"note": "ab\n"}, "args.note: does not match"),  # the whole string must match
    ({"note": 5}, "args.note: must be a string"),
    ({"stage": "lost"}, 'args.stage: must be one of ["new", "won", 3, true]'),
    ({"stage": 1}, "args.stage: must be one of"),  # 1 is not true
    ({"tags": ["a", "b", "c"]}, "args.tags: more than 2 items"),
    ({"contacts": [{"email": "a@b"}, {"email": "nope"}]}, "args.contacts[1].email: does not match"),
])
def test_constraint_violations_name_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArguments) as caught:
        check_constraints(POLICY.tools["score"], {**GOOD_ARGS, **change})
    assert caught.value.message.startswith(message)


def test_enum_matches_json_values() -> None:
    check_constraints(POLICY.tools["score"], {**GOOD_ARGS, "stage": 3.0})
    check_constraints(POLICY.tools["score"], {**GOOD_ARGS, "stage": True})


class ScoreArgs(BaseModel):
    lead_id: str
    owner: int
    score: int


def test_lock_keys_from_models_and_dicts() -> None:
    args = ScoreArgs(lead_id="a:b", owner=7, score=5)
    assert lock_keys(POLICY.tools["score"], args) == ("lead:a%3Ab", "owner:~i7")
    assert lock_keys(POLICY.tools["score"], args.model_dump()) == ("lead:a%3Ab", "owner:~i7")
    assert lock_keys(POLICY.tools["tag"], {"ids": ["b", "a", "b"]}) == ("lead:a", "lead:b")
    assert lock_keys(POLICY.tools["search"], {"q": "x"}) == ()


def test_no_lock_key_at_all_is_refused() -> None:
    with pytest.raises(InvalidArguments, match="no lock key could be rendered"):
        lock_keys(POLICY.tools["tag"], {"ids": []})


def test_ordering_keys_are_the_shared_resources() -> None:
    keys = ordering_keys(POLICY.tools["score"], POLICY.tools["enrich"], GOOD_ARGS)
    assert keys == ("lead:L1",)


def test_idempotency_key_from_template_is_prefixed_with_the_tool() -> None:
    intent = Intent(tool="score", call_id="c")
    key = idempotency_key(intent, POLICY.tools["score"], {"lead_id": "L1", "score": 5})
    assert key == "score:L1:~i5"
    with pytest.raises(InvalidArguments, match=r"args\.score: the idempotency key"):
        idempotency_key(intent, POLICY.tools["score"], {"lead_id": "L1"})


def test_idempotency_key_default_and_custom() -> None:
    intent = Intent(tool="tag", call_id="c", workflow=WorkflowIdentity(thread_id="t"))
    assert idempotency_key(intent, POLICY.tools["tag"], {"ids": ["a"]}) == "thread:t//c"
    assert idempotency_key(intent, POLICY.tools["tag"], {}, key_fn=lambda i: f"mine:{i.call_id}") == "mine:c"
    assert idempotency_key(Intent(tool="tag"), POLICY.tools["tag"], {}) is None


def test_idempotency_key_is_bounded_and_a_broken_key_function_is_a_configuration_error() -> None:
    intent = Intent(tool="tag", call_id="\U0001f600" * 256, workflow=WorkflowIdentity(thread_id="t"))
    key = idempotency_key(intent, POLICY.tools["tag"], {})
    assert key is not None and len(key.encode()) <= 512
    with pytest.raises(GuardMisconfigured, match="returned int"):
        idempotency_key(intent, POLICY.tools["tag"], {}, key_fn=lambda i: 7)  # type: ignore[arg-type,return-value]


def test_the_tool_policy_narrows_the_scope_to_the_task() -> None:
    policy = Policy.from_dict({"version": 1, "defaults": {"idempotency_scope": "task"}, "tools": {
        "a": {"read_only": True}, "b": {"read_only": True, "idempotency_scope": "thread"}}})
    flow = WorkflowIdentity(thread_id="t", checkpoint_ns="tools:task-1")
    intent = Intent(tool="a", call_id="c", workflow=flow)
    assert idempotency_key(intent, policy.tools["a"], {}) == "thread:t/tools%3Atask-1/c"
    assert idempotency_key(intent, policy.tools["b"], {}) == "thread:t/tools/c"


def test_redaction_of_nested_paths() -> None:
    raw: dict[str, Any] = {"lead_id": "L1", "secret": {"k": 1},
                           "contacts": [{"email": "a@b", "name": "A"}, {"name": "B"}]}
    out = redacted_args(POLICY.tools["score"], raw)
    assert out == {"lead_id": "L1", "secret": REDACTED,
                   "contacts": [{"email": REDACTED, "name": "A"}, {"name": "B"}]}
    assert raw["contacts"][0]["email"] == "a@b"  # the input is not changed


def test_redact_helper() -> None:
    data = {"contact": {"email": "x", "phone": "y"}, "by_id": {"a": {"pw": 1}, "b": {"pw": 2}}, "n": 1}
    assert redact(data, ["contact.email", "by_id[*].pw", "missing.path", "n.deeper"]) == {
        "contact": {"email": REDACTED, "phone": "y"}, "by_id": {"a": {"pw": REDACTED}, "b": {"pw": REDACTED}},
        "n": 1}
    assert redact(ScoreArgs(lead_id="L", owner=1, score=2), ["owner"], mask=None) == {
        "lead_id": "L", "owner": None, "score": 2}
    assert redact("not an object", ["a"]) == "not an object"


class TransferArgs(BaseModel):
    from_id: str
    to_id: str
    amount: int
    email: str = ""


def test_the_whole_pure_flow_of_one_call() -> None:
    """limits -> strict schema -> constraints -> authorize -> keys -> idempotency -> hash -> audit."""
    from toolguard.call.intent import args_hash, check_limits
    from toolguard.policies import strict_model, validate_args

    policy = Policy.from_dict({"version": 1, "tools": {"transfer": {
        "locks": ["account:{from_id}", "account:{to_id}"], "agents": ["router"],
        "args": {"amount": {"gt": 0}}, "redact": ["email"], "limits": {"max_string": 64}}}})
    intent = Intent(tool="transfer", agent="router", call_id="c1",
                    workflow=WorkflowIdentity(thread_id="t1", checkpoint_ns=""),
                    args={"from_id": "a:b", "to_id": "a", "amount": 5, "email": "x@y"})
    tool = lookup_tool(policy, intent.tool)
    check_limits(intent.args, tool.limits)
    args = validate_args(strict_model(TransferArgs), intent.args)
    check_constraints(tool, args)
    authorize(tool, intent.agent)
    assert lock_keys(tool, args) == ("account:a", "account:a%3Ab")
    assert idempotency_key(intent, tool, args) == "thread:t1//c1"
    assert args_hash(args) == args_hash({"amount": 5, "email": "x@y", "from_id": "a:b", "to_id": "a"})
    assert redacted_args(tool, intent.args)["email"] == REDACTED

    with pytest.raises(InvalidArguments, match=r"args\.to_id: string longer than 64"):
        check_limits({**intent.args, "to_id": "x" * 65}, tool.limits)
    with pytest.raises(InvalidArguments, match=r"args\.amount: Input should be a valid integer"):
        validate_args(strict_model(TransferArgs), {**intent.args, "amount": "5"})
    with pytest.raises(InvalidArguments, match=r"args\.amount: must be > 0"):
        check_constraints(tool, {**intent.args, "amount": 0})
