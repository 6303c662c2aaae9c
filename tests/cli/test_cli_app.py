"""The top-level app: help that explains itself, exit codes, the mounted sub-apps."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from toolguard.cli import app

DEMO_POLICY = Path(__file__).resolve().parents[2] / "toolguard" / "demo" / "policy.yml"


def test_help_documents_exit_codes(runner: CliRunner) -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for line in ("0  ok", "1  a check or verification failed", "2  usage error",
                 "3  a backend (lock server or store) cannot be reached"):
        assert line in result.stdout
    for command in ("demo", "audit", "doctor", "policy", "db"):
        assert command in result.stdout


def test_no_arguments_prints_help(runner: CliRunner) -> None:
    result = runner.invoke(app, [])
    assert result.exit_code in (0, 2)
    assert "Usage" in result.output


@pytest.mark.parametrize("command", [["demo"], ["audit"], ["audit", "list"], ["audit", "show"],
                                     ["audit", "stats"], ["doctor"], ["policy", "check"],
                                     ["db", "status"]])
def test_every_command_explains_itself(runner: CliRunner, command: list[str]) -> None:
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.stdout and len(result.stdout.splitlines()) > 5


def test_version(runner: CliRunner) -> None:
    assert runner.invoke(app, ["--version"]).stdout.startswith("toolguard ")
    assert runner.invoke(app, ["version"]).exit_code == 0


def test_unknown_command_and_option_are_usage_errors(runner: CliRunner) -> None:
    assert runner.invoke(app, ["frobnicate"]).exit_code == 2
    assert runner.invoke(app, ["audit", "--frobnicate"]).exit_code == 2


def test_policy_check_is_mounted(runner: CliRunner, tmp_path: Path) -> None:
    ok = runner.invoke(app, ["policy", "check", str(DEMO_POLICY)])
    assert ok.exit_code == 0 and "6 tools" in ok.stdout
    broken = tmp_path / "broken.yml"
    broken.write_text("version: 1\ntools:\n  x:\n    agents: [a]\n")
    bad = runner.invoke(app, ["policy", "check", str(broken)])
    assert bad.exit_code == 1 and "broken.yml:" in bad.stdout
    assert runner.invoke(app, ["policy", "check", str(tmp_path / "missing.yml")]).exit_code == 2


def test_db_is_mounted(runner: CliRunner, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/store.db"
    assert runner.invoke(app, ["db", "status", "--url", url]).exit_code == 1
    assert runner.invoke(app, ["db", "init", "--url", url]).exit_code == 0
    assert runner.invoke(app, ["db", "status", "--url", url]).exit_code == 0
