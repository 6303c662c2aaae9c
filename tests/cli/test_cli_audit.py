"""``toolguard audit``: list, show, stats, filters, JSON/CSV, and failures as exit codes."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from toolguard.cli import app
from toolguard.cli._common import parse_moment


def audit(runner: CliRunner, demo_home: dict, *args: str):
    return runner.invoke(app, ["audit", *args, "--url", demo_home["url"]])


def test_rejected_answers_what_was_refused_and_why(runner: CliRunner, demo_home: dict) -> None:
    result = audit(runner, demo_home, "--rejected")
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "refused intents" in text
    for reason in ("stale_fencing_token", "out_of_order", "invalid_arguments", "not_authorized"):
        assert reason in text
    assert "lead_enricher → enrich_lead" in text and "the store has already seen" in text
    assert "accepted " not in text


def test_list_filters_json(runner: CliRunner, demo_home: dict) -> None:
    result = audit(runner, demo_home, "list", "--json", "--reason", "stale_fencing_token")
    rows = json.loads(result.stdout)
    assert [r["reason"] for r in rows] == ["stale_fencing_token"]
    assert rows[0]["keys"] == ["lead:L-103"] and rows[0]["at"].endswith("Z")
    by_tool = json.loads(audit(runner, demo_home, "--json", "--tool", "set_tier",
                               "--decision", "accepted").stdout)
    assert len(by_tool) == 6 and {r["tool"] for r in by_tool} == {"set_tier"}
    by_agent = json.loads(audit(runner, demo_home, "--json", "-a", "router", "--rejected").stdout)
    # the pipeline's refusals, and the epilogue's request for approval and budget refusal
    assert {r["reason"] for r in by_agent} == {"out_of_order", "not_authorized",
                                               "approval_required", "budget_exceeded"}
    by_key = json.loads(audit(runner, demo_home, "--json", "--key", "lead:L-103", "-n", "0").stdout)
    assert by_key and all("lead:L-103" in r["keys"] for r in by_key)
    limited = json.loads(audit(runner, demo_home, "--json", "--limit", "3").stdout)
    assert len(limited) == 3 and limited[0]["id"] > limited[-1]["id"]
    oldest = json.loads(audit(runner, demo_home, "--json", "-n", "2", "--oldest-first").stdout)
    assert oldest[0]["id"] < oldest[1]["id"]


def test_time_window(runner: CliRunner, demo_home: dict) -> None:
    recent = json.loads(audit(runner, demo_home, "--json", "--since", "1h", "-n", "0").stdout)
    assert recent
    future = (datetime.now(UTC) + timedelta(days=1)).date().isoformat()
    assert json.loads(audit(runner, demo_home, "--json", "--since", future).stdout) == []
    assert json.loads(audit(runner, demo_home, "--json", "--until", "2000-01-01").stdout) == []


def test_csv(runner: CliRunner, demo_home: dict) -> None:
    result = audit(runner, demo_home, "--rejected", "--csv", "-n", "0")
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert rows and {r["decision"] for r in rows} == {"rejected"}
    stale = next(r for r in rows if r["reason"] == "stale_fencing_token")
    assert json.loads(stale["tokens"])["lead:L-103"] > 0 and stale["keys"] == "lead:L-103"


def test_show_one_entry_in_full(runner: CliRunner, demo_home: dict) -> None:
    stale_id = demo_home["report"]["guard_on"]["stale_rejections"][0]
    result = audit(runner, demo_home, "show", str(stale_id))
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())  # the table wraps long values
    for expected in ("stale_fencing_token", "lead_enricher", "enrich_lead", "tokens",
                     "firmographics-api", "the store has already seen"):
        assert expected in text
    data = json.loads(audit(runner, demo_home, "show", str(stale_id), "--json").stdout)
    assert data["id"] == stale_id and data["args"]["lead_id"] == "L-103"


def test_show_prints_the_rule_of_the_version_that_decided(runner: CliRunner,
                                                          demo_home: dict) -> None:
    """No --policy needed: the store keeps the deciding version; --policy compares."""
    demo = Path(__file__).parents[2] / "toolguard" / "demo"
    budget = json.loads(audit(runner, demo_home, "--json", "--reason", "budget_exceeded").stdout)
    (entry,) = budget
    result = audit(runner, demo_home, "show", str(entry["id"]))
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert f"policy rule  tools.grant_discount.quotas[0] at {demo / 'controls.yml'}:" in text
    assert "the one that decided" in text and "on_unknown_tool" not in text
    assert "- {budget: 30, arg: percent" in text
    compared = audit(runner, demo_home, "show", str(entry["id"]), "--policy",
                     str(demo / "policy.yml"))
    assert compared.exit_code == 0, compared.output
    assert "grant_discount has no rule in this policy version" in compared.stdout
    assert "another version" in compared.stdout and "on_unknown_tool" not in compared.stdout
    stale_id = demo_home["report"]["guard_on"]["stale_rejections"][0]
    same = audit(runner, demo_home, "show", str(stale_id), "--policy", str(demo / "policy.yml"))
    assert "this same version" in same.stdout and "tools.enrich_lead.locks" in same.stdout


def test_decision_all_lists_every_decision(runner: CliRunner, demo_home: dict) -> None:
    """As on the review page, `all` means every decision."""
    every = json.loads(audit(runner, demo_home, "--json", "--decision", "all", "-n", "0").stdout)
    listed = json.loads(audit(runner, demo_home, "list", "--json", "-n", "0").stdout)
    assert len(every) == len(listed) and {r["decision"] for r in every} >= {"accepted", "rejected"}
    stats = audit(runner, demo_home, "stats", "--decision", "all", "--json")
    assert stats.exit_code == 0 and json.loads(stats.stdout)["total"] == len(every)


def test_redacted_arguments_stay_redacted(runner: CliRunner, demo_home: dict) -> None:
    rows = json.loads(audit(runner, demo_home, "--json", "--tool", "verify_email", "-n", "0").stdout)
    assert rows and all(r["args"]["email"] == "[redacted]" for r in rows if r["args"])
    assert "@" not in audit(runner, demo_home, "--tool", "verify_email", "--csv", "-n", "0").stdout


def test_stats(runner: CliRunner, demo_home: dict) -> None:
    data = json.loads(audit(runner, demo_home, "stats", "--json").stdout)
    assert data["total"] == sum(data["by_decision"].values())
    reasons = {(r["decision"], r["reason"]): r["count"] for r in data["by_reason"]}
    assert reasons[("rejected", "stale_fencing_token")] == 1
    assert data["by_tool"]["set_tier"]["accepted"] == 6 and data["buckets"] is None
    daily = json.loads(audit(runner, demo_home, "stats", "--by", "day", "--json").stdout)
    assert daily["buckets"] and sum(b["total"] for b in daily["buckets"]) == data["total"]
    hourly = audit(runner, demo_home, "--rejected", "stats", "--by", "hour")
    assert hourly.exit_code == 0 and "Per hour (UTC)" in hourly.stdout
    assert "accepted" not in hourly.stdout.split("By tool")[0]
    table = audit(runner, demo_home, "stats")
    assert "By decision and reason" in table.stdout and "By tool" in table.stdout
    long = list(csv.DictReader(io.StringIO(audit(runner, demo_home, "stats", "--csv").stdout)))
    assert sum(int(r["count"]) for r in long) == data["total"]


@pytest.mark.parametrize("args", [
    ["show", "not-a-number"], ["show", "999999"], ["--since", "last tuesday"],
    ["--since", "1h", "--until", "2h"], ["--decision", "acceptd"], ["--limit", "-1"],
    ["stats", "--by", "week"], ["--json", "--csv"],
])
def test_bad_input_is_a_usage_error(runner: CliRunner, demo_home: dict, args: list[str]) -> None:
    result = audit(runner, demo_home, *args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


def test_store_without_schema_exits_1(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(app, ["audit", "--url", f"sqlite:///{tmp_path}/empty.db"])
    assert result.exit_code == 1
    assert "toolguard db init" in result.stderr


def test_unreachable_store_exits_3(runner: CliRunner) -> None:
    result = runner.invoke(app, ["audit", "--url", "postgresql://nobody@127.0.0.1:1/none",
                                 "--timeout", "1"])
    assert result.exit_code == 3, result.output
    assert "cannot reach" in result.stderr and "Traceback" not in result.output


def test_bad_url_is_a_usage_error(runner: CliRunner) -> None:
    result = runner.invoke(app, ["audit", "--url", "mysql://x/y"])
    assert result.exit_code == 2
    assert "scheme" in result.stderr


def test_empty_result_says_so(runner: CliRunner, demo_home: dict) -> None:
    result = audit(runner, demo_home, "--reason", "lock_timeout")
    assert result.exit_code == 0 and "No audit entries" in result.stdout


def test_parse_moment() -> None:
    now = datetime(2025, 1, 31, 12, 0, tzinfo=UTC)
    assert parse_moment("30m", now=now) == now - timedelta(minutes=30)
    assert parse_moment("2 h ago", now=now) == now - timedelta(hours=2)
    assert parse_moment("7d", now=now) == now - timedelta(days=7)
    assert parse_moment("today", now=now) == datetime(2025, 1, 31, tzinfo=UTC)
    assert parse_moment("2025-01-30T10:00:00") == datetime(2025, 1, 30, 10, tzinfo=UTC)
    assert parse_moment("2025-01-30T10:00:00+02:00").utcoffset() == timedelta(hours=2)
    with pytest.raises(ValueError, match="not a time"):
        parse_moment("yesterday-ish")
