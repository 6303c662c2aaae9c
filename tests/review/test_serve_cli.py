"""``toolguard serve``: what it refuses before it listens, and the real command end to end."""

from __future__ import annotations

import signal
import sqlite3
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from review.helpers import DEMO_POLICY, ENV, fetch, served_by_the_cli
from toolguard.cli import app
from toolguard.store import open_store


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_serve_is_a_command(runner: CliRunner) -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "serve" in result.stdout


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_a_non_loopback_address_needs_a_token(runner: CliRunner, demo_home: dict, host: str) -> None:
    result = runner.invoke(app, ["serve", "--host", host, "--url", demo_home["url"]])
    assert result.exit_code == 2, result.output
    assert "is not a loopback address" in result.stderr and "--token" in result.stderr


def test_a_short_token_is_a_usage_error(runner: CliRunner, demo_home: dict) -> None:
    result = runner.invoke(app, ["serve", "--token", "short", "--url", demo_home["url"]])
    assert result.exit_code == 2 and "at least 16 characters" in result.stderr
    env = runner.invoke(app, ["serve", "--host", "0.0.0.0", "--url", demo_home["url"]],
                        env={"TOOLGUARD_REVIEW_TOKEN": "short"})
    assert env.exit_code == 2 and "at least 16 characters" in env.stderr


def test_a_missing_embedded_store_is_not_created(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(app, ["serve"])  # cwd is tmp_path: ./.toolguard/store.db
    assert result.exit_code == 2 and "no audit log at" in result.stderr and "toolguard demo" in result.stderr
    assert not (tmp_path / ".toolguard").exists()


def test_a_store_without_the_schema_says_so(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    sqlite3.connect(path).close()
    result = runner.invoke(app, ["serve", "--url", f"sqlite:///{path}"])
    assert result.exit_code == 1 and "toolguard db init" in result.stderr, result.output


def test_an_unreachable_postgresql_store_exits_3(runner: CliRunner) -> None:
    result = runner.invoke(app, ["serve", "--url", "postgresql://nobody:secret@127.0.0.1:1/x",
                                 "--timeout", "0.5"])
    assert result.exit_code == 3, result.output
    assert "secret" not in result.output and "Traceback" not in result.output


def test_a_broken_policy_is_reported_with_its_line(runner: CliRunner, demo_home: dict,
                                                   tmp_path: Path) -> None:
    policy = tmp_path / "policy.yml"
    policy.write_text("version: 1\ntools:\n  x:\n    lokcs: []\n")
    result = runner.invoke(app, ["serve", "--policy", str(policy), "--url", demo_home["url"]])
    assert result.exit_code == 2 and "policy.yml:4" in result.stderr


def test_a_port_in_use_is_a_usage_error(runner: CliRunner, demo_home: dict) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(app, ["serve", "--port", str(port), "--url", demo_home["url"]])
    assert result.exit_code == 2 and "cannot listen" in result.stderr


def test_without_the_review_extra_the_command_says_what_to_install(
        runner: CliRunner, demo_home: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now raises ImportError
    result = runner.invoke(app, ["serve", "--url", demo_home["url"]])
    assert result.exit_code == 2 and "pip install 'toolguard-fenced[review]'" in result.stderr


def test_the_command_serves_the_demo_and_stops_cleanly(demo_home: dict) -> None:
    with served_by_the_cli("--url", demo_home["url"], "--policy", str(DEMO_POLICY)) as (base, process):
        page = fetch(base)
        assert page.status == 200 and "stale_fencing_token" in page.body
        assert fetch(base, host="attacker.example").status == 421
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=10)
        # uvicorn shuts down, then re-raises the signal so the exit status tells why it ended
        assert process.returncode in (0, -signal.SIGTERM) and "Traceback" not in err, err


def test_the_command_takes_the_store_and_the_token_from_the_environment(demo_home: dict) -> None:
    token = "cli-token-abcdefghijklmnop"
    env = {"TOOLGUARD_DATABASE_URL": demo_home["url"], "TOOLGUARD_REVIEW_TOKEN": token}
    with served_by_the_cli(env=env) as (base, process):
        assert fetch(base).status == 401
        page = fetch(base, headers={"Authorization": f"Bearer {token}"})
        assert page.status == 200 and "stale_fencing_token" in page.body
        assert process.stdout is not None
        assert "needs the access token" in process.stdout.readline()


def test_serve_after_the_demo_shows_each_refusals_rule_as_the_docs_do(tmp_path: Path) -> None:
    """docs/review.md: `toolguard demo`, then `toolguard serve`, in the same folder, no flags:
    each refusal's page names the rule of the policy version that decided."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ENV}  # the embedded default
    demo = subprocess.run([sys.executable, "-m", "toolguard", "demo"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr
    store = open_store(f"sqlite:///{tmp_path}/.toolguard/store.db")
    try:
        refused = store.query_audit(decision="rejected", limit=None)
    finally:
        store.close()
    with served_by_the_cli() as (base, _):  # cwd is tmp_path (the conftest's)
        for entry in refused:
            body = fetch(base, f"/entry/{entry.id}").body
            assert 'class="location"' in body and "the one that decided" in body, entry.reason
            if entry.reason == "budget_exceeded":
                assert "on_unknown_tool" not in body and "quotas[0]" in body
