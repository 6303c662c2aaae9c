"""A broken policy reports every problem at once, so it is fixed in one pass, not one per run."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from toolguard.cli.policy import policy_app
from toolguard.errors import PolicyProblems
from toolguard.policies import load_policy

BROKEN = """\
version: 1
tools:
  a:
    locks: ["x:{id}"]
    after: [nope]
    fenced: maybe
  b:
    ttl_ms: -5
  c:
    locks: ["x:{id}"]
    after: [c]
  d:
    locks: ["x:{id}"]
    lokcs: []
"""


def messages(path: Path) -> list[str]:
    with pytest.raises(PolicyProblems) as caught:
        load_policy(path)
    return [str(p) for p in caught.value.problems]


def test_field_errors_do_not_hide_the_whole_policy_checks(tmp_path: Path) -> None:
    path = tmp_path / "p.yml"
    path.write_text(BROKEN)
    found = messages(path)
    expected = [
        (5, "tools.a.after[0]: unknown tool 'nope'"),
        (6, "tools.a.fenced"),
        (7, "tools.b: no locks"),
        (8, "tools.b.ttl_ms"),
        (11, "tools.c.after[0]: 'c' cannot run after itself"),
        (14, "tools.d: unknown field 'lokcs' — did you mean 'locks'?"),
    ]
    assert len(found) == len(expected), found
    for (line, text), message in zip(expected, found, strict=True):  # in file order
        assert message.startswith(f"{path}:{line}: {text}"), (line, text, message)


def test_a_dropped_field_causes_no_invented_problem(tmp_path: Path) -> None:
    """``locks:`` with a bad template is reported once, not again as 'no locks'."""
    path = tmp_path / "p.yml"
    path.write_text(textwrap.dedent("""\
        version: 1
        tools:
          enrich:
            locks: ["lead:{lead id}"]
          score:
            locks: ["lead:{lead_id}"]
            after: [enrich, missing]
    """))
    found = messages(path)
    assert len(found) == 2, found
    assert "tools.enrich.locks" in found[0]
    assert "no locks" not in " ".join(found) and "lock no resource" not in " ".join(found)
    assert "unknown tool 'missing'" in found[1]


def test_a_duplicate_key_does_not_hide_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "p.yml"
    path.write_text("version: 1\ntools:\n  a:\n    locks: ['x:{id}']\n    locks: ['y:{id}']\n"
                    "    after: [ghost]\n")
    found = messages(path)
    assert any("defined twice" in m for m in found) and any("unknown tool 'ghost'" in m for m in found)


def test_the_readme_style_policy_reports_after_and_unknown_args(tmp_path: Path) -> None:
    """The old README block: an `after:` naming an undefined tool, and a constraint on a
    field the tool does not have (only seen against the tool's signature)."""
    path = tmp_path / "p.yml"
    path.write_text(textwrap.dedent("""\
        version: 1
        tools:
          update_lead_score:
            locks: ["lead:{lead_id}"]
            args:
              contact.country: {enum: [DE, FR, US]}
            after: [enrich_lead]
    """))
    assert [m.split(": ", 1)[1] for m in messages(path)] == [
        "tools.update_lead_score.after[0]: unknown tool 'enrich_lead'"]

    def update_lead_score(lead_id: str, score: int) -> int:
        return score

    path.write_text(path.read_text().replace("after: [enrich_lead]", ""))
    with pytest.raises(PolicyProblems) as caught:
        load_policy(path).check_against({"update_lead_score": update_lead_score})
    assert "'contact' is not an argument of the tool" in str(caught.value)


# --- toolguard policy check ---------------------------------------------------------------


def test_check_without_tools_says_templates_were_not_checked(tmp_path: Path) -> None:
    path = tmp_path / "p.yml"
    path.write_text('version: 1\ntools:\n  transfer:\n    locks: ["account:{acount_id}"]\n')
    result = CliRunner().invoke(policy_app, ["check", str(path)])
    assert result.exit_code == 0, result.output
    assert "not checked against the tools' arguments" in result.stdout and "--tools" in result.stdout


def test_check_with_tools_catches_a_template_naming_no_argument(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "banking.py").write_text("def transfer(account_id: str, amount: int) -> None: ...\n"
                                         "TOOLS = [transfer]\n")
    path = tmp_path / "p.yml"
    path.write_text('version: 1\ntools:\n  transfer:\n    locks: ["account:{acount_id}"]\n')
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(policy_app, ["check", str(path), "--tools", "banking:TOOLS"])
    assert result.exit_code == 1, result.output
    assert f"{path}:4" in result.stdout and "did you mean 'account_id'" in result.stdout
    assert "not checked" not in result.stdout


def test_each_splits_a_folder_into_its_files(tmp_path: Path) -> None:
    folder = tmp_path / "policies"
    folder.mkdir()
    (folder / "a.yml").write_text('version: 1\ntools:\n  x:\n    locks: ["k:{id}"]\n')
    (folder / "b.yml").write_text('version: 1\ntools:\n  x:\n    locks: ["k:{id}"]\n')
    merged = CliRunner().invoke(policy_app, ["check", str(folder)])
    assert merged.exit_code == 1 and "defined twice" in merged.stdout  # one policy: x twice
    each = CliRunner().invoke(policy_app, ["check", str(folder), "--each"])
    assert each.exit_code == 0, each.output
    assert f"ok {folder / 'a.yml'}: 1 tool" in each.stdout
    assert f"ok {folder / 'b.yml'}: 1 tool" in each.stdout
