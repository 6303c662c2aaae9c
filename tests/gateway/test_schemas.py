"""Upstream input schemas: strict models, or a refusal at start-up that names the tool and the construct."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from toolguard.errors import InvalidArguments
from toolguard.gateway import UnjudgeableSchema, tool_model
from toolguard.gateway.schemas import unjudgeable
from toolguard.policies import validate_args

from .conftest import UPSTREAM, clean_env, toolguard

#: Each test starts real processes (the gateway, its upstream): slow on a loaded machine.
pytestmark = pytest.mark.timeout(900)


class Commit(BaseModel):
    repo_path: str
    message: str = Field(max_length=100)
    files: list[str] = Field(min_length=1)
    amend: bool | None = None


def test_a_pydantic_generated_schema_becomes_a_strict_model() -> None:
    model = tool_model("git_commit", Commit.model_json_schema())
    validate_args(model, {"repo_path": "r", "message": "m", "files": ["a"]})
    for hostile in ({"repo_path": "r", "message": "m", "files": []},
                    {"repo_path": "r", "message": "m" * 101, "files": ["a"]},
                    {"repo_path": 1, "message": "m", "files": ["a"]},
                    {"repo_path": "r", "message": "m", "files": ["a"], "force": True}):
        with pytest.raises(InvalidArguments):
            validate_args(model, hostile)


@pytest.mark.parametrize(("schema", "named"), [
    ({"type": "object", "properties": {"x": {"not": {"type": "integer"}}}}, "properties.x.not"),
    ({"type": "object", "properties": {"x": {"type": "string"}}, "if": {}, "then": {}}, "inputSchema.if"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
    ({"type": "object", "properties": {"x": {"allOf": [{"type": "string"}, {"minLength": 2}]}}},
     "properties.x.allOf"),
    ({"type": "object", "properties": {"x": {"$ref": "https://example.com/s.json"}}}, "$ref"),
    ({"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}, "uniqueItems"),
    ({"type": "object", "properties": {"x": {"enum": [{"a": 1}]}}}, "properties.x.enum"),
    ({"type": "object", "properties": {"a": {"type": "string"}},
      "additionalProperties": {"type": "integer"}}, "additionalProperties"),
    ({"type": "array"}, "inputSchema.type"),
])
def test_constructs_toolguard_cannot_enforce_are_refused_by_name(schema: dict, named: str) -> None:
    with pytest.raises(UnjudgeableSchema) as error:
        tool_model("odd_tool", schema)
    assert "'odd_tool'" in str(error.value)
    assert named in str(error.value)


def test_annotations_are_not_constructs() -> None:
    schema = {"type": "object", "title": "T", "description": "d", "$schema": "x",
              "properties": {"when": {"type": "string", "format": "date-time", "examples": ["x"],
                                      "x-vendor": 1}}}
    assert list(unjudgeable(schema)) == []


def test_the_gateway_refuses_to_start_in_front_of_a_schema_it_cannot_enforce(tmp_path: Path) -> None:
    policy = tmp_path / "odd.yml"
    policy.write_text("version: 1\ndefaults: {fenced: false}\n"
                      "tools:\n  odd: {locks: ['c:{counter}'], agents: ['*']}\n")
    done = subprocess.run(toolguard("mcp", "proxy", "--policy", str(policy), "--agent", "a", "--",
                                    *UPSTREAM), capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=clean_env(tmp_path, UPSTREAM_HOSTILE_SCHEMA="1"),
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "the upstream tool 'odd' has an input schema toolguard cannot enforce" in done.stderr
    assert "inputSchema.properties.counter.not" in done.stderr


def test_a_template_naming_an_argument_the_upstream_lacks_stops_the_start_up(tmp_path: Path) -> None:
    policy = tmp_path / "typo.yml"
    policy.write_text("version: 1\ndefaults: {fenced: false}\n"
                      "tools:\n  bump: {locks: ['c:{countr}'], agents: ['*']}\n")
    done = subprocess.run(toolguard("mcp", "proxy", "--policy", str(policy), "--agent", "a", "--",
                                    *UPSTREAM), capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=clean_env(tmp_path), stdin=subprocess.DEVNULL)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "typo.yml:4" in done.stderr and "{countr}" in done.stderr
