"""``toolguard demo``: the lead qualifier end to end through the CLI, its CRM included."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
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
    assert_crm_report(off["crm"], on["crm"])
    assert (demo_home["home"] / "crm.db").exists()  # the CRM's own store, beside the agents'
    assert {"crm_double_push", "crm_late_push"} <= kinds
    controls = report["controls"]  # the epilogue: one approval, one budget refusal
    assert controls["decisions"] == [["rejected", "approval_required"], ["accepted", "applied"],
                                     ["rejected", "budget_exceeded"]]
    assert controls["approval_id"].startswith("ap_") and controls["retry_after_s"] > 0


def assert_crm_report(off: dict, on: dict) -> None:
    """The CRM's side in the JSON report: guard off it applied what came, guard on it decided."""
    assert off["fenced"] is False and off["decisions"] == {} and off["late_copy"]["landed"]
    assert on["fenced"] is True and on["mismatches"] == []
    assert on["decisions"] == {"accepted": 12, "replayed": 1, "rejected": 1}
    assert len(on["stale_rejections"]) == 1 and len(on["replays"]) == 1
    assert on["late_copy"] == {"lead_id": "L-103", "agent": "lead_enricher", "status": 409,
                               "reason": "stale_fencing_token", "replayed": False,
                               "landed": False}
    assert on["lost_answers"] == 1
    assert sorted(on["records"]) == ["L-101", "L-102", "L-103", "L-104", "L-105", "L-106"]
    assert {record["pushes"] for record in on["records"].values()} == {2}


def test_demo_prints_the_summary_and_replays_on_a_second_run(runner: CliRunner,
                                                             tmp_path: Path) -> None:
    home = tmp_path / "demo"
    first = runner.invoke(app, ["demo", "--dir", str(home)])
    assert first.exit_code == 0, first.output
    text = first.stdout
    for expected in ("Lead records with the guard on", "Guard off vs guard on",
                     "stale_fencing_token", "refused (audit #", "Score / tier per lead",
                     "toolguard audit --rejected --url", "toolguard audit show ",
                     "The CRM's own decisions", "refused by the CRM: 409 (CRM audit #",
                     "the stuck push reached the CRM at last: HTTP 409 stale_fencing_token",
                     "the connection dropped: the answer is lost",
                     "6/6 records equal to the expected ones, each pushed once",
                     "Production controls: an approval and a budget",
                     "waits: approval_required (request ap_",
                     "sales-manager (scripted) approves ap_",
                     "the router's same call runs: applied",
                     "refused budget_exceeded: 25 + 10 points is over its 30 a day"):
        assert expected in text, expected
    assert "Traceback" not in first.output
    assert_crm_hints_run_as_printed(runner, text, home)
    second = runner.invoke(app, ["demo", "--dir", str(home)])
    assert second.exit_code == 0, second.output
    assert "A second run: every write applied in an earlier run was replayed" in second.stdout
    # Nobody writes in a second run, so the stalled call does not wait for a writer.
    assert "skipped: enrich_lead was applied in an earlier run" in second.stdout, second.stdout
    assert "lead_enricher paused" not in second.stdout
    assert "Write intents with the guard on (this run): 38 replayed  2 rejected" in second.stdout
    assert "accepted" not in second.stdout.split("Write intents")[1].splitlines()[0]
    assert "no request reached the CRM" in second.stdout  # every push replayed by the agents
    assert "was approved in an earlier run: replayed" in second.stdout
    assert "refused budget_exceeded" in second.stdout
    assert "stuck in the network" not in second.stdout.split("guard off")[-1].split("Lead")[0]


def assert_crm_hints_run_as_printed(runner: CliRunner, text: str, home: Path) -> None:
    """The printed commands for the CRM's audit log run as printed and show its two decisions."""
    hints = [line.strip() for line in text.splitlines() if "crm.db" in line and " audit " in line]
    assert len(hints) == 2, hints
    assert all(f"--url 'sqlite:///{home / 'crm.db'}'" in hint for hint in hints)
    found = []
    for hint in hints:
        words = shlex.split(hint.split("#")[0])
        result = runner.invoke(app, [*words[1:], "--json"])  # words[0]: how toolguard was started
        assert result.exit_code == 0, result.output
        found += [(e["decision"], e["reason"], e["agent"]) for e in json.loads(result.stdout)]
    assert found == [("rejected", "stale_fencing_token", "lead_enricher"),
                     ("replayed", "duplicate", "router")]


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


def test_next_hints_read_the_crm_store_too(tmp_path: Path) -> None:
    from toolguard.cli.demo import next_commands

    default = f"sqlite:///{tmp_path / '.toolguard' / 'store.db'}"  # cwd is tmp_path
    crm = f"sqlite:///{tmp_path / '.toolguard' / 'crm.db'}"
    lines = next_commands(default, None, "toolguard", crm_store=crm)
    assert f"toolguard audit --rejected --url '{crm}'      # the CRM's own log: its 409" in lines
    assert f"toolguard audit --decision replayed --url '{crm}'      # ... and its replay" in lines
    assert "toolguard audit --tool push_to_crm      # the CRM pushes, as the agents saw them" in lines
    postgres = "postgresql://app:secret@db.internal:5432/crm"
    lines = next_commands(postgres, None, "toolguard", crm_store=postgres,
                          crm_schema="toolguard_demo_crm")
    assert ("toolguard audit --rejected --url 'postgresql://app:***@db.internal:5432/crm' "
            "--schema toolguard_demo_crm      # the CRM's own log: its 409") in lines


def test_demo_without_the_crm_libraries_names_the_extra(runner: CliRunner, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvicorn" else real(name, *a))
    result = runner.invoke(app, ["demo", "--dir", str(tmp_path / "d")])
    assert result.exit_code == 2, result.output
    assert "its CRM service" in result.stderr and "uvicorn" in result.stderr
    assert "pip install 'toolguard-fenced[langgraph]'" in result.stderr
    assert not (tmp_path / "d").exists()


def test_demo_on_postgresql_and_redis(runner: CliRunner, postgres_url: str, redis_url: str,
                                      unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's second command: TOOLGUARD_REDIS_URL and TOOLGUARD_DATABASE_URL set."""
    import psycopg
    from store.envs import demo_crm_schema, drop_schema

    from toolguard.demo.crm import PG_SCHEMA

    schema = f"tg_demo_{unique}"  # the agents' store, by the URL's search_path
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    url = f"{postgres_url}?options=-csearch_path%3D{schema}"
    monkeypatch.setenv("TOOLGUARD_DATABASE_URL", url)
    monkeypatch.setenv("TOOLGUARD_REDIS_URL", redis_url)
    with demo_crm_schema(postgres_url):
        try:
            result = runner.invoke(app, ["demo", "--json"])
            assert result.exit_code == 0, result.output
            report = json.loads(result.stdout)
            off, on = report["guard_off"], report["guard_on"]
            assert on["correct"] is True and off["correct"] is False
            assert on["store"].startswith("postgresql://") and on["locks"].startswith("redis://")
            assert on["crm"]["store"].endswith(f"(schema {PG_SCHEMA})")
            assert_crm_report(off["crm"], on["crm"])
            crm = runner.invoke(app, ["audit", "--rejected", "--schema", PG_SCHEMA, "--json"])
            assert crm.exit_code == 0, crm.output
            (refused,) = json.loads(crm.stdout)
            assert (refused["reason"], refused["tool"]) == ("stale_fencing_token", "PUT /leads/L-103")
        finally:
            drop_schema(postgres_url, schema)


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
