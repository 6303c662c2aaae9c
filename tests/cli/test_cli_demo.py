"""``toolguard demo``: the lead qualifier end to end through the CLI."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from toolguard.cli import app


def test_demo_json_report(demo_home: dict) -> None:
    report = demo_home["report"]
    assert report["ok"] is True
    off, on = report["guard_off"], report["guard_on"]
    assert off["correct"] is False and on["correct"] is True
    kinds = {f["kind"] for f in off["findings"]}
    assert {"lost_update", "double_applied", "tier_before_scoring", "unchecked_write"} <= kinds
    assert on["findings"] == [] and on["mismatches"] == []
    assert on["rejected_by_reason"]["stale_fencing_token"] == 1
    assert len(on["stale_rejections"]) == 1
    assert (demo_home["home"] / "store.db").exists() and (demo_home["home"] / "locks.db").exists()


def test_demo_prints_the_summary_and_replays_on_a_second_run(runner: CliRunner,
                                                             tmp_path: Path) -> None:
    home = tmp_path / "demo"
    first = runner.invoke(app, ["demo", "--dir", str(home)])
    assert first.exit_code == 0, first.output
    text = first.stdout
    for expected in ("Lead records with the guard on", "Guard off vs guard on",
                     "stale_fencing_token", "refused (audit #", "Score / tier per lead",
                     "toolguard audit --rejected --url", "toolguard audit show "):
        assert expected in text, expected
    assert "Traceback" not in first.output
    second = runner.invoke(app, ["demo", "--dir", str(home)])
    assert second.exit_code == 0, second.output
    assert "Every write intent was replayed" in second.stdout, second.stdout


def test_demo_on_the_default_folder_needs_no_url_in_the_hint(runner: CliRunner,
                                                             tmp_path: Path) -> None:
    result = runner.invoke(app, ["demo"])  # cwd is tmp_path: ./.toolguard
    assert result.exit_code == 0, result.output
    assert "toolguard audit --rejected\n" in result.stdout
    assert (tmp_path / ".toolguard" / "store.db").exists()


def test_demo_unreachable_lock_server_exits_3(runner: CliRunner, tmp_path: Path,
                                             monkeypatch) -> None:
    monkeypatch.setenv("TOOLGUARD_REDIS_URL", "redis://127.0.0.1:1/0")
    result = runner.invoke(app, ["demo", "--dir", str(tmp_path)])
    assert result.exit_code == 3
    assert "cannot reach" in result.stderr and "Traceback" not in result.output


def test_demo_bad_policy_is_a_usage_error(runner: CliRunner, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yml"
    policy.write_text("version: 1\ntools:\n  enrich_lead:\n    lokcs: []\n")
    result = runner.invoke(app, ["demo", "--dir", str(tmp_path), "--policy", str(policy)])
    assert result.exit_code == 2
    assert "policy.yml:4" in result.stderr
