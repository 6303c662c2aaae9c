"""``toolguard policy check`` through typer's CliRunner: output, exit codes, no tracebacks."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from toolguard.cli.policy import load_tool_schemas, policy_app

GOOD = """\
version: 1
agents: [enricher, scorer]
tools:
  enrich_lead:
    locks: ["lead:{lead_id}"]
    agents: [enricher]
  update_lead_score:
    locks: ["lead:{lead_id}"]
    agents: [scorer]
    after: [enrich_lead]
    args: {score: {ge: 0, le: 100}}
"""

BAD = """\
version: 1
agents: [enricher]
tools:
  enrich_lead:
    agents: [enricher, ghost]
  update_lead_score:
    locks: ["lead:{lead_id}"]
    after: [update_lead_score2]
  update_lead_score2:
    locks: ["lead:{lead_id}"]
    after: [update_lead_score]
"""

runner = CliRunner()


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def run(*args: str):
    return runner.invoke(policy_app, list(args))


def test_clean_file_exits_0(tmp_path: Path) -> None:
    result = run("check", str(write(tmp_path, "p.yml", GOOD)))
    assert result.exit_code == 0, result.output
    assert "ok" in result.output and "2 tools" in result.output


def test_problems_exit_1_with_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "p.yml", BAD)
    result = run("check", str(path))
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert f"{path}:4: error: tools.enrich_lead: no locks" in lines[0]
    assert any(f"{path}:5: error: tools.enrich_lead.agents[1]: unknown agent 'ghost'" in x for x in lines)
    assert any(f"{path}:11: error: tools.update_lead_score2.after[0]: ordering cycle" in x for x in lines)
    assert lines[-1] == "3 problems found"
    assert "Traceback" not in result.output


def test_invalid_yaml_is_a_problem_not_a_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, "p.yml", "version: 1\ntools: {a: [\n")
    result = run("check", str(path))
    assert result.exit_code == 1 and f"{path}:3: error: invalid YAML" in result.output
    assert "Traceback" not in result.output


def test_square_brackets_are_printed_literally(tmp_path: Path) -> None:
    path = write(tmp_path, "p.yml", 'version: 1\ntools:\n  a: {locks: ["x:{ids[*]}:{more[*]}"]}\n')
    result = run("check", str(path))
    assert result.exit_code == 1 and "only one [*] per template" in result.output


def test_tools_option_checks_arguments(tmp_path: Path) -> None:
    path = write(tmp_path, "p.yml", GOOD.replace('"lead:{lead_id}"]\n    agents: [scorer]',
                                                 '"lead:{lead}"]\n    agents: [scorer]'))
    result = run("check", str(path), "--tools", "policies.tool_schemas:TOOLS")
    assert result.exit_code == 1, result.output
    assert f"{path}:8: error: tools.update_lead_score.locks[0]: {{lead}}: 'lead' is not an argument" in (
        result.output)
    assert run("check", str(write(tmp_path, "g.yml", GOOD)), "--tools",
               "policies.tool_schemas:TOOL_LIST").exit_code == 0


def test_tools_option_reports_policy_tools_that_do_not_exist(tmp_path: Path) -> None:
    path = write(tmp_path, "p.yml", GOOD + '  ghost:\n    locks: ["g:{id}"]\n')
    result = run("check", str(path), "--tools", "policies.tool_schemas:TOOLS")
    assert result.exit_code == 1
    assert f"{path}:12: error: tools.ghost: no tool of this name among the tools given" in result.output


@pytest.mark.parametrize("spec", ["nomodule_xyz:TOOLS", "policies.tool_schemas:MISSING",
                                  "policies.tool_schemas", "policies.tool_schemas:NOT_TOOLS"])
def test_bad_tools_option_is_usage_error(tmp_path: Path, spec: str) -> None:
    result = run("check", str(write(tmp_path, "p.yml", GOOD)), "--tools", spec)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert run("check").exit_code == 2
    assert run("check", str(tmp_path / "missing.yml")).exit_code == 2
    assert run("nonsense").exit_code == 2


def test_several_files_are_merged_or_checked_each(tmp_path: Path) -> None:
    one = write(tmp_path, "one.yml", GOOD)
    two = write(tmp_path, "two.yml", GOOD)
    merged = run("check", str(one), str(two))
    assert merged.exit_code == 1 and "defined twice" in merged.output
    each = run("check", "--each", str(one), str(two))
    assert each.exit_code == 0 and each.output.count("ok ") == 2


def test_folder(tmp_path: Path) -> None:
    write(tmp_path, "a.yml", GOOD)
    assert run("check", str(tmp_path)).exit_code == 0


def test_load_tool_schemas_shapes() -> None:
    assert set(load_tool_schemas("policies.tool_schemas:TOOL_LIST")) == {"update_lead_score", "enrich_lead"}
    with pytest.raises(ValueError):
        load_tool_schemas("no_colon")
