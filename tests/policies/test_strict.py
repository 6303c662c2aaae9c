"""Strict argument models (no extras, no coercion) and checking a policy against real schemas."""

from __future__ import annotations

import datetime
import enum
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field, field_validator

from toolguard.errors import InvalidArguments, PolicyProblems
from toolguard.policies import Policy, json_schema_of, load_policy, strict_model, validate_args


class Stage(enum.Enum):
    NEW = "new"
    WON = "won"


class Contact(BaseModel):
    email: str
    phone: str | None = None


class ScoreArgs(BaseModel):
    """Arguments of update_lead_score."""

    lead_id: int
    score: Annotated[int, Field(ge=0)]
    stage: Stage = Stage.NEW
    when: datetime.datetime | None = None
    contact: Contact | None = None
    contacts: list[Contact] = []
    by_name: dict[str, Contact] = {}

    @field_validator("lead_id")
    @classmethod
    def positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("lead ids are positive")
        return value


def invalid(model: type[BaseModel], args: object) -> str:
    with pytest.raises(InvalidArguments) as caught:
        validate_args(model, args)
    return caught.value.message


def test_strict_model_of_a_pydantic_model() -> None:
    strict = strict_model(ScoreArgs)
    assert issubclass(strict, ScoreArgs) and strict_model(ScoreArgs) is strict  # cached
    ok = validate_args(strict, {"lead_id": 1, "score": 3, "stage": "won", "when": "2024-05-01T10:00:00Z",
                                "contacts": [{"email": "a@b"}]})
    assert getattr(ok, "stage") is Stage.WON  # noqa: B009 - a derived model: no static fields
    assert getattr(ok, "when") == datetime.datetime(2024, 5, 1, 10, tzinfo=datetime.UTC)  # noqa: B009
    assert invalid(strict, {"lead_id": "5", "score": 1}) == "args.lead_id: Input should be a valid integer"
    assert invalid(strict, {"lead_id": 5.0, "score": 1}).startswith("args.lead_id: Input should be")
    assert invalid(strict, {"lead_id": 1, "score": 1, "extra": 1}) == "args.extra: unexpected argument"
    assert invalid(strict, {"lead_id": 0, "score": 1}) == "args.lead_id: Value error, lead ids are positive"
    assert invalid(strict, {"lead_id": 1, "score": -1}).startswith("args.score: Input should be greater")
    assert invalid(strict, {"score": 1}) == "args.lead_id: required argument missing"


@pytest.mark.parametrize(("args", "where"), [
    ({"contact": {"email": "x", "admin": True}}, "args.contact.admin"),
    ({"contacts": [{"email": "x"}, {"email": "y", "admin": True}]}, "args.contacts[1].admin"),
    ({"by_name": {"a": {"email": "x", "admin": True}}}, "args.by_name.a.admin"),
])
def test_nested_models_forbid_extras(args: dict[str, Any], where: str) -> None:
    message = invalid(strict_model(ScoreArgs), {"lead_id": 1, "score": 1, **args})
    assert message == f"{where}: unexpected argument"


def test_the_original_lax_model_would_have_accepted() -> None:
    lax = ScoreArgs.model_validate({"lead_id": "5", "score": 1, "extra": 1})
    assert lax.lead_id == 5  # the silent coercion strict_model exists to refuse


def test_messages_never_echo_input() -> None:
    message = invalid(strict_model(ScoreArgs), {"lead_id": "secret-value-123", "score": 1})
    assert "secret-value-123" not in message


def test_non_object_args_and_non_json() -> None:
    strict = strict_model(ScoreArgs)
    assert invalid(strict, ["a"]) == "args: expected an object of named arguments, got a list"
    assert invalid(strict, "{}") == "args: expected an object of named arguments, got a string"
    assert invalid(strict, {"lead_id": float("nan")}).startswith("args: not JSON")


def test_strict_model_of_a_function() -> None:
    def update(lead_id: int, note: str = "", _private: int = 0, json: str = "", *rest: Any,
               **more: Any) -> None:
        """Plain function tool."""

    model = strict_model(update)
    out = validate_args(model, {"lead_id": 3, "_private": 1, "json": "j"})
    assert out.model_dump(by_alias=True) == {"lead_id": 3, "note": "", "_private": 1, "json": "j"}
    assert invalid(model, {"lead_id": "3"}) == "args.lead_id: Input should be a valid integer"
    assert invalid(model, {"lead_id": 3, "other": 1}) == "args.other: unexpected argument"


SCHEMA = {
    "title": "transfer",
    "type": "object",
    "properties": {
        "from_id": {"type": "integer", "minimum": 1},
        "to_id": {"type": "integer"},
        "memo": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]},
        "kind": {"enum": ["a", "b"]},
        "tree": {"$ref": "#/$defs/Node"},
        "meta": {"type": "object"},
    },
    "required": ["from_id", "to_id"],
    "$defs": {"Node": {"type": "object", "properties": {
        "name": {"type": "string"}, "child": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}}},
}


def test_strict_model_of_a_json_schema() -> None:
    model = strict_model(SCHEMA)
    ok = validate_args(model, {"from_id": 1, "to_id": 2, "memo": None, "kind": "a",
                               "tree": {"name": "r", "child": {"name": "c", "child": None}},
                               "meta": {"anything": [1]}})
    assert ok.model_dump(by_alias=True)["tree"]["child"]["name"] == "c"
    assert invalid(model, {"from_id": "1", "to_id": 2}) == "args.from_id: Input should be a valid integer"
    assert invalid(model, {"from_id": 0, "to_id": 2}).startswith("args.from_id: Input should be greater")
    assert invalid(model, {"from_id": 1, "to_id": 2, "x": 1}) == "args.x: unexpected argument"
    assert invalid(model, {"from_id": 1, "to_id": 2, "kind": "c"}).startswith("args.kind: Input should be")
    assert invalid(model, {"from_id": 1, "to_id": 2, "memo": "x" * 11}).startswith("args.memo")
    assert invalid(model, {"from_id": 1, "to_id": 2, "tree": {"child": {"bad": 1}}}) == (
        "args.tree.child.bad: unexpected argument")


def test_langchain_like_tool_objects() -> None:
    class FakeTool:
        name = "update_lead_score"
        args_schema = ScoreArgs

    assert strict_model(FakeTool()) is strict_model(ScoreArgs)
    assert json_schema_of(FakeTool())["properties"]["lead_id"]["type"] == "integer"
    with pytest.raises(TypeError):
        strict_model(42)


# --- Policy.check_against ------------------------------------------------------------


class EnrichArgs(BaseModel):
    lead_id: str


class TagArgs(BaseModel):
    lead_ids: list[int]
    contact: Contact


def checked(tmp_path: Path, body: str, **schemas: object) -> list[str]:
    path = tmp_path / "p.yml"
    path.write_text("version: 1\ntools:\n" + body, encoding="utf-8")
    policy = load_policy(path)
    try:
        policy.check_against(schemas or {"update_lead_score": ScoreArgs})
    except PolicyProblems as error:
        return [str(problem).replace(f"{path}:", "L") for problem in error.problems]
    return []


def test_check_against_accepts_a_matching_policy(tmp_path: Path) -> None:
    assert checked(tmp_path, """\
  update_lead_score:
    locks: ["lead:{lead_id}", "c:{contacts[*].email}"]
    args: {score: {le: 100}, contact.email: {pattern: ".+@.+"}, contacts: {max_items: 3}}
    redact: [contact.phone, by_name]
    idempotency_key: "{lead_id}:{score}"
""") == []


def test_check_against_names_unknown_fields_with_lines(tmp_path: Path) -> None:
    assert checked(tmp_path, """\
  update_lead_score:
    locks:
      - "lead:{lead}"
      - "c:{contact.mail}"
    args:
      scroe: {le: 100}
    redact: [emial]
""") == [
        "L5: tools.update_lead_score.locks[0]: {lead}: 'lead' is not an argument of the tool "
        "(did you mean 'lead_id'?); known: by_name, contact, contacts, lead_id, score, stage, when",
        "L6: tools.update_lead_score.locks[1]: {contact.mail}: 'contact.mail' is not a field of "
        "contact (did you mean 'email'?); known: email, phone",
        "L8: tools.update_lead_score.args.scroe: 'scroe' is not an argument of the tool "
        "(did you mean 'score'?); known: by_name, contact, contacts, lead_id, score, stage, when",
        "L9: tools.update_lead_score.redact[0]: 'emial' is not an argument of the tool; known: "
        "by_name, contact, contacts, lead_id, score, stage, when",
    ]


def test_check_against_types(tmp_path: Path) -> None:
    found = checked(tmp_path, """\
  update_lead_score:
    locks: ["lead:{contacts}", "x:{score[*]}", "y:{contact}"]
    args: {score: {max_length: 3}, stage: {ge: 1}}
""")
    assert found == [
        "L4: tools.update_lead_score.locks[0]: {contacts} is a list: a key needs a scalar; "
        "use {contacts[*]} for one key per element",
        "L4: tools.update_lead_score.locks[1]: {score[*]}: 'score' is not a list, so [*] cannot expand it",
        "L4: tools.update_lead_score.locks[2]: {contact} is an object: a key needs a scalar",
        "L5: tools.update_lead_score.args.score: string constraint on an argument of type integer",
        "L5: tools.update_lead_score.args.stage: number constraint on an argument of type string",
    ]


def test_check_against_catches_keys_of_different_types(tmp_path: Path) -> None:
    found = checked(tmp_path, """\
  enrich:
    locks: ["lead:{lead_id}"]
  tag:
    locks: ["lead:{lead_ids[*]}"]
""", enrich=EnrichArgs, tag=TagArgs)
    assert len(found) == 1
    assert found[0].startswith("L6: tools.tag.locks[0]: 'lead:{lead_ids[*]}' renders field 1 from an "
                               "integer here but from a string in tool 'enrich'")


def test_check_against_missing_tools(tmp_path: Path) -> None:
    body = '  ghost:\n    locks: ["g:{id}"]\n'
    assert checked(tmp_path, body, other=EnrichArgs) == []
    policy = Policy.from_dict({"version": 1, "tools": {"ghost": {"locks": ["g:{id}"]}}})
    with pytest.raises(PolicyProblems, match="no tool of this name"):
        policy.check_against({}, missing_ok=False)


def test_check_against_json_schema_and_free_form_objects(tmp_path: Path) -> None:
    assert checked(tmp_path, """\
  transfer:
    locks: ["account:{from_id}", "account:{to_id}", "m:{meta.anything}"]
    args: {memo: {max_length: 5}, tree.child.name: {min_length: 1}}
""", transfer=SCHEMA) == []
