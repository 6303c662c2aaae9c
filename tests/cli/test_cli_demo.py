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
    assert "A second run: every write applied in an earlier run was replayed" in second.stdout
    # Nobody writes in a second run, so the stalled call does not wait for a writer.
    assert "skipped: enrich_lead was applied in an earlier run" in second.stdout, second.stdout
    assert "lead_enricher paused" not in second.stdout
    assert "Write intents with the guard on (this run): 26 replayed  2 rejected" in second.stdout
    assert "accepted" not in second.stdout.split("Write intents")[1].splitlines()[0]


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


def test_next_hints_name_the_store_unless_it_is_the_default(tmp_path: Path) -> None:
    from toolguard.cli.demo import next_commands

    default = f"sqlite:///{tmp_path / '.toolguard' / 'store.db'}"  # cwd is tmp_path
    assert next_commands(default, 27, "toolguard") == [
        "toolguard audit --rejected", "toolguard audit show 27      # the stalled worker's write",
        "toolguard audit stats"]
    postgres = "postgresql://app:secret@db.internal:5432/crm"
    lines = next_commands(postgres, None, ".venv/bin/toolguard")
    assert lines == [".venv/bin/toolguard audit --rejected --url 'postgresql://app:***@db.internal:5432/crm'",
                     ".venv/bin/toolguard audit stats --url 'postgresql://app:***@db.internal:5432/crm'"]


def test_demo_bad_policy_reports_every_problem_before_running(runner: CliRunner,
                                                              tmp_path: Path) -> None:
    from toolguard.demo import POLICY_PATH

    policy = tmp_path / "broken.yml"
    policy.write_text(POLICY_PATH.read_text().replace("{lead_id}", "{lead_idd}"))
    result = runner.invoke(app, ["demo", "--dir", str(tmp_path / "d"), "--policy", str(policy)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) >= 4 and all("'lead_idd' is not an argument" in line for line in lines)
    assert "guard off" not in result.stdout and not (tmp_path / "d").exists()  # nothing ran
