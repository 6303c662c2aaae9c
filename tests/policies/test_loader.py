"""Loading policies: the happy path, merging folders, and file:line for every broken file."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from toolguard.call.intent import Intent, Limits
from toolguard.errors import PolicyError, PolicyProblems
from toolguard.policies import (
    ArgConstraint,
    KeyTemplate,
    Policy,
    Problem,
    ToolPolicy,
    load_policy,
)

GOOD = """\
version: 1
defaults: {ttl_ms: 8000, wait_timeout_s: 2, on_unknown_tool: deny, limits: {max_string: 1000}}
agents: [lead_enricher, intent_scorer, email_verifier, router]
tools:
  enrich_lead:
    locks: ["lead:{lead_id}"]
    agents: [lead_enricher]
  update_lead_score:
    locks: ["lead:{lead_id}"]
    agents: [intent_scorer]
    args: {score: {ge: 0, le: 100}, contact.country: {choices: [DE, FR]}}
    after: [enrich_lead]
    after_wait_s: 3
    fenced: true
    idempotency_key: "{lead_id}:{score}"
    redact: [email, contact.phone]
    ttl_ms: 12000
    limits: {max_items: 10}
  call_crm:
    locks: ["lead:{lead_id}"]
    fenced: false
  tag_leads:
    locks: ["lead:{lead_ids[*]}"]
  transfer:
    locks: ["account:{from_id}", "account:{to_id}"]
  search:
    read_only: true
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def problems_of(*paths: Path) -> list[Problem]:
    with pytest.raises(PolicyProblems) as caught:
        load_policy(list(paths) if len(paths) > 1 else paths[0])
    assert isinstance(caught.value, PolicyError) and caught.value.reason == "invalid_policy"
    return list(caught.value.problems)  # type: ignore[arg-type]


def only_problem(path: Path) -> Problem:
    found = problems_of(path)
    assert len(found) == 1, [str(p) for p in found]
    return found[0]


def test_good_policy_loads_with_inherited_settings(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, "p.yml", GOOD))
    score = policy.tools["update_lead_score"]
    assert score.name == "update_lead_score"
    assert score.ttl_ms == 12000 and score.wait_timeout_s == 2 and score.after_wait_s == 3
    assert score.limits == Limits(max_string=1000, max_items=10)  # merged field by field
    assert score.args[next(iter(score.args))] == ArgConstraint(ge=0, le=100)
    assert [str(p) for p in score.redact] == ["email", "contact.phone"]
    assert score.idempotency_key == KeyTemplate.parse("{lead_id}:{score}")
    assert policy.tools["tag_leads"].agents == ("*",) and policy.tools["tag_leads"].ttl_ms == 8000
    assert policy.tools["call_crm"].fenced is False
    assert policy.tools["search"].read_only and policy.tools["search"].locks == ()
    assert policy.location("tools", "update_lead_score", "after", 0).line == 12


def test_dump_round_trips(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, "p.yml", GOOD))
    again = Policy.from_dict(policy.model_dump(mode="json"))
    assert again.model_dump() == policy.model_dump()


def test_from_dict_and_python_objects_are_checked_too() -> None:
    policy = Policy(tools={"a": ToolPolicy(locks=("lead:{id}",), agents=("x",))})
    assert policy.tools["a"].locks[0].render({"id": 1}) == ("lead:~i1",)
    with pytest.raises(PolicyProblems) as caught:
        Policy(tools={"a": ToolPolicy(after=("missing",), locks=("l:{id}",))})
    assert str(caught.value) == "tools.a.after[0]: unknown tool 'missing'"
    with pytest.raises(PolicyProblems) as caught:
        Policy.from_dict({"version": 1, "tools": {"a": {"lokcs": []}}}, source="inline")
    assert caught.value.file == "inline"
    assert "unknown field 'lokcs' — did you mean 'locks'?" in str(caught.value)


def test_key_fn_is_carried(tmp_path: Path) -> None:
    def key(intent: Intent) -> str:
        return "k"

    policy = load_policy(write(tmp_path, "p.yml", GOOD), key_fn=key)
    assert policy.key_fn is key
    assert Policy.from_dict({"version": 1}).key_fn is None


def test_folder_is_merged(tmp_path: Path) -> None:
    write(tmp_path, "a.yml", """\
        version: 1
        agents: [x]
        tools:
          one: {locks: ["lead:{id}"], agents: [x]}
        """)
    write(tmp_path, "b.yaml", """\
        version: 1
        agents: [y]
        defaults: {ttl_ms: 500}
        tools:
          two: {locks: ["lead:{id}"], after: [one], agents: [y]}
        """)
    write(tmp_path, "notes.txt", "not a policy")
    policy = load_policy(tmp_path)
    assert set(policy.tools) == {"one", "two"} and policy.agents == ("x", "y")
    assert policy.tools["one"].ttl_ms == 500  # defaults apply across files
    assert policy.location("agents", 1) .file == str(tmp_path / "b.yaml")


def test_same_tool_in_two_files_names_both(tmp_path: Path) -> None:
    first = write(tmp_path, "a.yml", 'version: 1\ntools:\n  one: {locks: ["x:{id}"]}\n')
    second = write(tmp_path, "b.yml", 'version: 1\ntools:\n\n  one: {locks: ["y:{id}"]}\n')
    problem = only_problem(tmp_path)
    assert (problem.file, problem.line) == (str(second), 4)
    assert f"defined twice (first at {first}:3)" in problem.message


def test_defaults_in_two_files(tmp_path: Path) -> None:
    write(tmp_path, "a.yml", "version: 1\ndefaults: {ttl_ms: 1}\n")
    second = write(tmp_path, "b.yml", "version: 1\ndefaults: {ttl_ms: 2}\n")
    problem = only_problem(tmp_path)
    assert (problem.file, problem.line) == (str(second), 2)
    assert "defaults: defined twice" in problem.message


BROKEN = {
    "unknown field": ("""\
        version: 1
        tools:
          a:
            locks: ["lead:{id}"]
            lokcs: ["x"]
        """, 5, "tools.a: unknown field 'lokcs' — did you mean 'locks'?"),
    "unknown top-level field": ("version: 1\ntool: {}\n", 2, "unknown field 'tool' — did you mean 'tools'?"),
    "unknown constraint": ("""\
        version: 1
        tools:
          a:
            locks: ["lead:{id}"]
            args:
              score: {gte: 1}
        """, 6, "tools.a.args.score: unknown constraint 'gte' — did you mean 'ge'?"),
    "ge above le": ("""\
        version: 1
        tools:
          a:
            locks: ["lead:{id}"]
            args:
              n: {min_length: 1}
              score: {ge: 10, le: 5}
        """, 7, "tools.a.args.score: ge=10 and le=5 leave no allowed value"),
    "gt equal lt": ('version: 1\ntools:\n  a:\n    locks: ["l:{id}"]\n    args: {s: {gt: 1, lt: 1}}\n',
                    5, "gt=1 and lt=1 leave no allowed value"),
    "two lower bounds": ('version: 1\ntools:\n  a:\n    locks: ["l:{id}"]\n    args: {s: {gt: 1, ge: 1}}\n',
                         5, "at most one lower bound"),
    "min above max": ('version: 1\ntools:\n  a:\n    locks: ["l:{id}"]\n    args:\n'
                      '      s: {min_length: 3, max_length: 2}\n', 6,
                      "min_length=3 is greater than max_length=2"),
    "invalid regex": ('version: 1\ntools:\n  a:\n    locks: ["l:{id}"]\n    args:\n'
                      '      s: {pattern: "([a-z"}\n',
                      6, "invalid regular expression '([a-z'"),
    "empty enum": ('version: 1\ntools:\n  a:\n    locks: ["l:{id}"]\n    args:\n      s: {enum: []}\n',
                   6, "enum needs at least one value"),
    "enum and choices": ('version: 1\ntools:\n  a:\n    locks: ["l:{id}"]\n    args:\n'
                         '      s: {enum: [a], choices: [b]}\n', 6, "either enum or choices"),
    "empty constraint": ('version: 1\ntools:\n  a:\n    locks: ["l:{id}"]\n    args:\n      s: {}\n',
                         6, "an empty constraint"),
    "bad constraint path": ('version: 1\ntools:\n  a:\n    locks: ["l:{id}"]\n    args:\n'
                            '      "a b": {ge: 1}\n', 6, "invalid field path 'a b'"),
    "bad template": ('version: 1\ntools:\n  a:\n    locks:\n      - "l:{id}"\n      - "l:{id"\n',
                     6, "tools.a.locks[1]: unclosed '{'"),
    "adjacent placeholders": ('version: 1\ntools:\n  a:\n    locks: ["l:{a}{b}"]\n', 4, "need a separator"),
    "constant idempotency key": ('version: 1\ntools:\n  a:\n    locks: ["l:{a}"]\n'
                                 '    idempotency_key: "same"\n', 5, "names no argument"),
    "after unknown tool": ("""\
        version: 1
        tools:
          a:
            locks: ["lead:{id}"]
            after:
              - b
        """, 6, "tools.a.after[0]: unknown tool 'b'"),
    "after itself": ('version: 1\ntools:\n  a:\n    locks: ["l:{id}"]\n    after: [a]\n', 5,
                     "cannot run after itself"),
    "after without shared resource": ("""\
        version: 1
        tools:
          a: {locks: ["lead:{id}"], after: [b]}
          b: {locks: ["account:{id}"]}
        """, 3, "lock no resource of the same kind"),
    "cycle": ("""\
        version: 1
        tools:
          a: {locks: ["lead:{id}"], after: [b]}
          b: {locks: ["lead:{id}"], after: [c]}
          c:
            locks: ["lead:{id}"]
            after: [a]
        """, 7, "ordering cycle: a -> b -> c -> a"),
    "fenced without locks": ("version: 1\ntools:\n  a:\n    agents: ['*']\n", 3,
                             "tools.a: no locks: a fenced tool needs a lock key"),
    "unfenced without locks": ("version: 1\ntools:\n  a:\n    fenced: false\n", 3,
                               "no locks: an unfenced tool relies on its lock"),
    "unknown agent": ('version: 1\nagents: [x]\ntools:\n  a:\n    locks: ["l:{id}"]\n    agents:\n'
                      '      - x\n      - y\n', 8, "tools.a.agents[1]: unknown agent 'y'"),
    "unknown default agent": ("version: 1\nagents: [x]\ndefaults:\n  agents: [z]\n", 4,
                              "defaults.agents[0]: unknown agent 'z'"),
    "redacted field in a key": ('version: 1\ntools:\n  a:\n    locks: ["e:{contact.email}"]\n'
                                '    redact: [contact]\n', 3,
                                "redacted field 'contact' is used in key template"),
    "bad value": ("version: 1\ndefaults:\n  on_unknown_tool: maybe\n", 3,
                  "defaults.on_unknown_tool: Input should be 'deny' or 'allow'"),
    "non-positive ttl": ('version: 1\ntools:\n  a:\n    locks: ["l:{id}"]\n    ttl_ms: 0\n', 5,
                         "tools.a.ttl_ms: Input should be greater than 0"),
    "tool is not a mapping": ("version: 1\ntools:\n  a: [x]\n", 3, "tools.a: expected a mapping"),
    "invalid YAML": ("version: 1\ntools:\n  a: {locks: [\n", 4, "invalid YAML"),
    "bad indentation": ("version: 1\ntools:\n  a:\n    locks: []\n   fenced: true\n", 5, "invalid YAML"),
    "tab": ("version: 1\ntools:\n\ta: {}\n", 3, "invalid YAML"),
    "duplicate key": ("version: 1\ntools:\n  a: {locks: ['x:{a}']}\n  a: {locks: ['y:{a}']}\n", 4,
                      "tools.a: defined twice (first at line 3)"),
    "boolean key": ("version: 1\ntools:\n  yes: {locks: ['x:{a}']}\n", 3, "key True is not a string"),
    "unknown tag": ("version: 1\ntools: !!python/object:os.system {}\n", 2, "invalid YAML"),
    "empty file": ("", 1, "the file is empty"),
    "not a mapping": ("- a\n- b\n", 1, "a policy file is a mapping"),
    "missing version": ("tools: {}\n", 1, "missing 'version: 1'"),
    "wrong version": ("\nversion: 2\n", 2, "unsupported policy version 2"),
    "bad limits": ("version: 1\ndefaults:\n  limits:\n    max_depth: 0\n    max_bites: 3\n", 4,
                   "defaults.limits.max_depth: Input should be greater than 0"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_file_gives_file_line_and_reason(tmp_path: Path, case: str) -> None:
    text, line, expected = BROKEN[case]
    path = write(tmp_path, "policy.yml", text)
    found = problems_of(path)
    first = found[0]
    assert (first.file, first.line) == (str(path), line), [str(p) for p in found]
    assert expected in first.message, [str(p) for p in found]
    assert str(first).startswith(f"{path}:{line}: ")


def test_error_message_lists_every_problem_with_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "p.yml", 'version: 1\ntools:\n  a: {lokcs: 1, locks: ["l:{a}{b}"]}\n')
    with pytest.raises(PolicyProblems) as caught:
        load_policy(path)
    lines = str(caught.value).splitlines()
    assert len(lines) == len(caught.value.problems) == 2
    assert all(line.startswith(f"{path}:3: tools.a") for line in lines), lines
    assert "more problem" not in str(caught.value)
    assert caught.value.line == 3


def test_a_typo_leads_with_its_fix_not_its_consequence(tmp_path: Path) -> None:
    """``lock:`` for ``locks:`` says so first; the tool's 'no locks' is its consequence, not news."""
    path = write(tmp_path, "p.yml", """\
        version: 1
        tools:
          x:
            lock: ["acct:{id}"]
          y:
            locks: ["acct:{id}"]
            ttl_ms: -1
          z:
            read_only: true
            lokcs: []
        """)
    with pytest.raises(PolicyProblems) as caught:
        load_policy(path)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith(f"{path}:4: tools.x: unknown field 'lock' — did you mean 'locks'?")
    assert lines[1].startswith(f"{path}:7: tools.y.ttl_ms: ")
    assert lines[2].startswith(f"{path}:10: tools.z: unknown field 'lokcs' — did you mean 'locks'?")
    assert len(lines) == 3, lines
    assert not any("no locks" in line for line in lines)


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(PolicyProblems, match="no such policy file"):
        load_policy(tmp_path / "nope.yml")
    with pytest.raises(PolicyProblems, match=r"no \*\.yml or \*\.yaml"):
        load_policy(tmp_path)


def test_anchors_and_merge_keys_work(tmp_path: Path) -> None:
    path = write(tmp_path, "p.yml", """\
        version: 1
        tools:
          a: &base {locks: ["lead:{id}"], ttl_ms: 900}
          b:
            <<: *base
            fenced: false
        """)
    policy = load_policy(path)
    assert policy.tools["b"].ttl_ms == 900 and policy.tools["b"].fenced is False
