"""The telemetry example: the demo's guarded run, with toolguard's spans and metrics.

One ``execute_tool`` span per audit row, the decisions metric equal to the audit
log, and the calls the scenario is about visible as span trees: the stalled
enricher's write refused by the fence (with the lease's loss on its
transaction), the router held back by ``after:``.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from examples.telemetry import main, print_report, run
from toolguard.runtime import telemetry


def test_the_demo_run_reports_one_span_per_decision_and_metrics_equal_to_the_audit_log(
        tmp_path: Path) -> None:
    observed = run(home=tmp_path)

    assert observed.report.correct
    calls = observed.calls()
    assert len(calls) == len(observed.report.audit) > 30
    assert observed.counts("toolguard.decisions", "gen_ai.tool.name", "gen_ai.agent.name",
                           "toolguard.decision", "toolguard.reason") == observed.audit_counts()
    (stale,) = [c for c in calls if c.attributes["toolguard.reason"] == "stale_fencing_token"]
    steps = {s.name: s for s in observed.children(stale)}
    assert set(steps) == {telemetry.SPAN_VALIDATE, telemetry.SPAN_LOCK_WAIT,
                          telemetry.SPAN_TRANSACTION}
    assert steps[telemetry.SPAN_TRANSACTION].attributes["error.type"] == "stale_fencing_token"
    assert sum(observed.counts(telemetry.METRIC_STALE_TOKENS).values()) == 1
    held_back = [c for c in calls
                 if any(s.name == telemetry.SPAN_ORDER_WAIT for s in observed.children(c))]
    assert {c.attributes["gen_ai.tool.name"] for c in held_back} == {"set_tier"}
    assert sum(observed.counts(telemetry.METRIC_ORDER_WAITS).values()) >= 1
    replays = sum(e.decision == "replayed" for e in observed.report.audit)
    assert sum(observed.counts(telemetry.METRIC_REPLAYS).values()) == replays

    out = io.StringIO()
    print_report(observed, out)
    text = out.getvalue()
    assert "execute_tool enrich_lead" in text and "event:toolguard.lease.lost" in text
    assert "<- differs" not in text


def test_console_mode_writes_the_sdk_json(tmp_path: Path, capsys) -> None:
    assert main(["--dir", str(tmp_path), "--console"]) == 0

    printed = capsys.readouterr().out
    spans = [json.loads(line) for line in printed.splitlines() if line.startswith('{"name"')]
    assert any(s["name"] == "execute_tool set_tier" for s in spans)
    assert '"toolguard.decisions"' in printed  # the console metric exporter's dump


def test_a_run_after_the_demo_shows_the_scenario_not_only_replays(
        tmp_path: Path, monkeypatch) -> None:
    """Issue 23.8: with the demo's folder (``./.toolguard``) reused, every call was a replay."""
    from toolguard.demo import run_pipeline

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TOOLGUARD_HOME", raising=False)
    demo_home = tmp_path / ".toolguard"
    demo_home.mkdir()
    run_pipeline(guarded=True, lock_url=f"sqlite:///{demo_home / 'locks.db'}",
                 store_url=f"sqlite:///{demo_home / 'store.db'}")  # what `toolguard demo` ran

    observed = run()
    assert observed.home is not None and observed.home != demo_home
    decisions = {e.decision for e in observed.report.audit}
    assert "accepted" in decisions
    assert any(e.reason == "stale_fencing_token" for e in observed.report.audit)
