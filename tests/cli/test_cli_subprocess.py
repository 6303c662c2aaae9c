"""The installed entry points, as a script or a user would run them: real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CONSOLE_SCRIPT = Path(sys.executable).with_name("toolguard")


def run(*args: str, module: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "toolguard", *args] if module else [str(CONSOLE_SCRIPT), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGUARD_")}
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


def test_python_m_toolguard_help() -> None:
    result = run("--help")
    assert result.returncode == 0, result.stderr
    assert "Exit codes" in result.stdout and "3  a backend" in result.stdout


@pytest.mark.skipif(not CONSOLE_SCRIPT.exists(), reason="toolguard is not installed next to python")
def test_console_script_audit_json(demo_home: dict) -> None:
    result = run("audit", "--rejected", "--json", "--url", demo_home["url"], module=False)
    assert result.returncode == 0, result.stderr
    assert {row["decision"] for row in json.loads(result.stdout)} == {"rejected"}


def test_expected_failures_are_one_line_and_an_exit_code(demo_home: dict, tmp_path: Path) -> None:
    missing = run("audit", "show", "999999", "--url", demo_home["url"])
    assert missing.returncode == 2 and "no audit entry with id 999999" in missing.stderr
    unreachable = run("doctor", "--lock-url", "redis://127.0.0.1:1/0", "--url",
                      f"sqlite:///{tmp_path}/store.db", "--timeout", "0.5")
    assert unreachable.returncode == 3
    for result in (missing, unreachable):
        assert "Traceback" not in result.stderr + result.stdout


def test_demo_as_a_subprocess(tmp_path: Path) -> None:
    result = run("demo", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and not report["guard_off"]["correct"]
    assert (tmp_path / ".toolguard" / "store.db").exists()


@pytest.mark.skipif(not CONSOLE_SCRIPT.exists(), reason="toolguard is not installed next to python")
def test_demo_hints_run_as_printed_when_toolguard_is_not_on_path(tmp_path: Path) -> None:
    """After the quick start toolguard is .venv/bin/toolguard: the hints say that, not `toolguard`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGUARD_")}
    env["PATH"] = "/usr/bin:/bin"
    result = subprocess.run([str(CONSOLE_SCRIPT), "demo"], capture_output=True, text=True,
                            timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    hint = next(line.strip() for line in result.stdout.splitlines() if "audit --rejected" in line)
    assert hint == f"{CONSOLE_SCRIPT} audit --rejected"
    again = subprocess.run(hint.split(), capture_output=True, text=True, timeout=120, env=env,
                           cwd=tmp_path)
    assert again.returncode == 0 and "refused intents" in again.stdout
