"""The page's pure parts: filters from a query string, the chart's geometry, the rule lookup."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from toolguard.call.decision import refusal
from toolguard.call.envelope import untrusted_intent
from toolguard.call.recording import audit_entry
from toolguard.errors import (
    BackendUnavailable,
    IdempotencyConflict,
    IntentRejected,
    InvalidArguments,
    InvalidIntent,
    LockError,
    LockLost,
    LockTimeout,
    MissingIdentity,
    NotAuthorized,
    NotOwned,
    OutOfOrder,
    PolicyProblems,
    StaleFencingToken,
    StoreError,
    UnknownTool,
)
from toolguard.review.chart import MAX_BUCKETS, PALETTE, decisions_chart, step_for
from toolguard.review.filters import DEFAULT_LIMIT, parse_filters
from toolguard.review.rules import PolicySource
from toolguard.review.security import is_loopback
from toolguard.review.views import model_message
from toolguard.store import AuditEntry

T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)


def entry(reason: str = "out_of_order", decision: str = "rejected", at: datetime = T0,
          **fields: object) -> AuditEntry:
    return AuditEntry(decision=decision, reason=reason, at=at, **fields)  # type: ignore[arg-type]


# --- filters ---------------------------------------------------------------------------------


def test_no_query_means_the_rejected_intents() -> None:
    page = parse_filters({})
    assert page.decisions == ("rejected",) and page.errors == () and page.limit == DEFAULT_LIMIT
    assert page.filters.query() == {"decision": ["rejected"]}
    assert parse_filters({"decision": ["all"]}).filters.query() == {}
    assert parse_filters({"decision": [""]}).decisions == ()


def test_filters_map_to_the_store_query_like_the_cli() -> None:
    page = parse_filters({"tool": ["set_tier", " enrich_lead "], "agent": ["router"],
                          "reason": ["out_of_order"], "key": ["lead:L-1", "ignored"],
                          "workflow": ["t-1"], "decision": ["Accepted", "replayed"],
                          "since": ["2h"], "until": ["2030-01-01"], "limit": ["7"]})
    query = page.filters.query()
    assert query["tool"] == ["set_tier", "enrich_lead"] and query["agent"] == ["router"]
    assert query["decision"] == ["accepted", "replayed"] and query["key"] == "lead:L-1"
    assert query["workflow"] == "t-1" and page.limit == 7
    assert query["until"] == datetime(2030, 1, 1, tzinfo=UTC)
    assert timedelta(hours=1.99) < datetime.now(UTC) - query["since"] < timedelta(hours=2.01)


def test_links_keep_the_filters_and_change_one() -> None:
    page = parse_filters({"tool": ["a&b=c"], "decision": ["all"], "since": ["2h"]})
    url = page.url(reason="stale_fencing_token")
    assert url.startswith("/?")
    assert parse_qs(url[2:]) == {"decision": ["all"], "tool": ["a&b=c"], "reason": ["stale_fencing_token"],
                                 "since": ["2h"]}
    assert parse_qs(page.url(tool=None)[2:]) == {"decision": ["all"], "since": ["2h"]}
    assert page.url("/x", decision=None, tool=None, since=None) == "/x"


def test_oversized_values_are_cut_not_trusted() -> None:
    page = parse_filters({"tool": ["x" * 5000]})
    assert len(page.filters.tool[0]) == 1000


# --- the chart ----------------------------------------------------------------------------------


def test_the_bucket_width_adapts_to_the_span() -> None:
    start = T0.timestamp()
    assert step_for(start, start + 2) == 1
    assert step_for(start, start + 3600) == 120
    assert step_for(start, start + 86400 * 30) == 86400
    for span in (5, 500, 50_000, 5_000_000):
        step = step_for(start, start + span)
        assert (start + span) // step - start // step + 1 <= MAX_BUCKETS


def test_every_entry_is_drawn_once_in_its_bucket_stacked_by_reason() -> None:
    entries = [entry("out_of_order", at=T0), entry("out_of_order", at=T0 + timedelta(seconds=0.5)),
               entry("stale_fencing_token", at=T0 + timedelta(seconds=0.2)),
               entry("not_authorized", at=T0 + timedelta(seconds=30))]
    chart = decisions_chart(entries)
    assert chart is not None and chart.total == 4 and chart.step_label == "1 s"
    assert sum(s.count for s in chart.segments) == 4
    assert [(s.reason, s.count) for s in chart.series] == [
        ("out_of_order", 2), ("stale_fencing_token", 1), ("not_authorized", 1)]
    first = [s for s in chart.segments if s.since == "2025-03-01T12:00:00Z"]
    assert [(s.series.reason, s.count) for s in first] == [("out_of_order", 2), ("stale_fencing_token", 1)]
    assert all(s.until == "2025-03-01T12:00:01Z" for s in first)
    # stacked: each segment sits on the one below it, and the tallest bar reaches the top tick
    assert first[0].y == pytest.approx(first[1].y + first[1].height)
    top = max(t.position for t in chart.y_ticks if t.label == str(max(int(t.label) for t in chart.y_ticks)))
    assert min(s.y for s in chart.segments) >= top - 0.01
    assert chart.y_ticks[0].label == "0"


def test_reasons_past_the_palette_are_drawn_together_as_other() -> None:
    entries = [entry(f"reason_{n}", at=T0 + timedelta(seconds=n)) for n in range(PALETTE + 3)]
    entries += [entry("reason_0", at=T0)]
    chart = decisions_chart(entries)
    assert chart is not None
    assert len(chart.series) == PALETTE and chart.series[-1].reason is None
    assert chart.series[-1].count == 4 and chart.series[0].reason == "reason_0"
    assert sum(s.count for s in chart.segments) == len(entries)


def test_a_time_window_widens_the_axis_and_nothing_means_no_chart() -> None:
    chart = decisions_chart([entry(at=T0)], start=T0 - timedelta(days=2), end=T0 + timedelta(hours=1))
    assert chart is not None and chart.step_label == "2 h"
    assert decisions_chart([]) is None
    assert decisions_chart([AuditEntry(decision="rejected", reason="x")]) is None  # no time


# --- the rule behind a decision --------------------------------------------------------------------


POLICY = """\
version: 1
defaults:
  ttl_ms: 3000
  agents: [writer]
tools:
  update_score:
    locks: ["lead:{lead_id}"]
    args:
      score: {ge: 0, le: 100}
  set_tier:
    locks: ["lead:{lead_id}"]
    agents: [router]
    after: [update_score]
    idempotency_key: "{lead_id}"
"""


@pytest.fixture
def policy(tmp_path: Path) -> PolicySource:
    path = tmp_path / "policy.yml"
    path.write_text(POLICY)
    return PolicySource(path)


@pytest.mark.parametrize("reason, tool, detail, line, field", [
    ("not_authorized", "set_tier", "agent 'x' may not call set_tier", 12, "tools.set_tier.agents"),
    # update_score inherits agents: from defaults, so the page points there
    ("not_authorized", "update_score", "", 4, "defaults.agents"),
    ("lease_lost", "update_score", "", 3, "defaults.ttl_ms"),
    ("invalid_arguments", "update_score", "args.score: must be <= 100", 9, "tools.update_score.args.score"),
    ("invalid_arguments", "update_score", "something else", 8, "tools.update_score.args"),
    ("out_of_order", "set_tier", "set_tier must run after update_score on lead:1, and ...", 13,
     "tools.set_tier.after[0]"),
    ("idempotency_conflict", "set_tier", "", 14, "tools.set_tier.idempotency_key"),
    ("stale_fencing_token", "update_score", "", 7, "tools.update_score.locks"),
    ("applied", "set_tier", "", 10, "tools.set_tier"),
    # on_unknown_tool is not written: the defaults: block it would be in
    ("unknown_tool", "<b>drop_table</b>", "", 2, "defaults.on_unknown_tool"),
])
def test_the_rule_is_found_at_the_field_the_reason_is_about(policy: PolicySource, reason: str, tool: str,
                                                            detail: str, line: int, field: str) -> None:
    view = policy.rule_for(entry(reason, tool=tool, detail=detail))
    assert view is not None
    assert view.field == field
    assert view.location.line == line and view.location.file == policy.files[0]
    assert [source.number for source in view.lines if source.marked] == [line]
    assert view.known is (tool in ("set_tier", "update_score"))


def test_the_rule_block_is_the_tool_and_nothing_after_it(policy: PolicySource) -> None:
    view = policy.rule_for(entry("not_authorized", tool="set_tier"))
    assert view is not None
    assert [line.number for line in view.lines] == [10, 11, 12, 13, 14]
    assert view.lines[0].text == "  set_tier:" and view.settings["agents"] == "router"
    assert view.settings["after"] == "update_score (waits 5s)"
    assert policy.rule_for(entry("error", tool=None)) is None


def test_a_broken_policy_fails_at_start_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yml"
    path.write_text("version: 1\ntools:\n  x:\n    lokcs: []\n")
    with pytest.raises(PolicyProblems, match=r"broken\.yml:\d") as raised:
        PolicySource(path)
    assert any("broken.yml:4" in str(problem) and "lokcs" in str(problem)
               for problem in raised.value.problems)


# --- what the model read, and loopback -----------------------------------------------------------


STALE_TEXT = ("rejected by toolguard (stale_fencing_token): another call on this resource wrote "
              "first; nothing was written. Read the resource again before retrying.")


def test_the_model_message_is_what_toolguard_answered_and_no_more() -> None:
    refused = model_message(entry("not_authorized", detail="agent 'r' may not call x"))
    assert refused.text == "rejected by toolguard (not_authorized): agent 'r' may not call x"
    # the detail keeps the tokens and hosts for the operator; the model read a fixed text
    stale = model_message(entry("stale_fencing_token", detail="lead:a: token 5 is below 7"))
    assert stale.text == STALE_TEXT
    down = model_message(entry("backend_unavailable", decision="failed",
                               detail="redis: Error 111 connecting to 127.0.0.1:6390"))
    assert down.text == ("not completed (backend_unavailable): a service toolguard needs is "
                         "unavailable; try again later.")
    for reason in ("error", "tool_error"):  # the tool's own failure: the adapters pass it on
        failed = model_message(entry(reason, decision="failed", detail="RuntimeError: boom"))
        assert failed.text is None and "passed on unchanged" in failed.note
    configuration = model_message(entry("configuration", decision="failed", detail="no pair"))
    assert configuration.text is None and "raised to the developer" in configuration.note
    for decision in ("accepted", "replayed", "unknown"):
        message = model_message(entry("applied", decision=decision))
        assert message.text is None and message.note


@pytest.mark.parametrize("error", [
    NotAuthorized("agent 'r' may not call set_tier"), MissingIdentity("no agent"),
    InvalidIntent("invalid tool call: id: expected a string, got int"),
    InvalidArguments("args.score: must be <= 100"), UnknownTool("unknown tool 'x'"),
    OutOfOrder("set_tier must run after enrich_lead on lead:a"),
    IntentRejected("an unfenced tool needs a stable idempotency key",
                   reason="missing_idempotency_key"),
    LockTimeout("could not take lead:a within 5s", keys=["lead:a"]),
    LockLost("lease on lead:a expired"), NotOwned("lead:a belongs to another owner"),
    LockError("lock server said no"), StaleFencingToken("lead:a: token 5 is below 7"),
    IdempotencyConflict("key k was used with other arguments"),
    BackendUnavailable("redis: Error 111 connecting to 127.0.0.1:6390"),
    StoreError("database is locked"),
], ids=lambda error: type(error).__name__)
def test_the_page_says_what_the_guard_told_the_model(error: Exception) -> None:
    """The page reads the audit row; the model read ``Decision.model_text()``: the same text."""
    decision = refusal(untrusted_intent(tool="set_tier", call_id="c1", agent="router"), error)
    row = audit_entry(decision, None, time.monotonic())
    assert model_message(row).text == decision.model_text()


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LOCALHOST", True), ("0.0.0.0", False), ("::", False), ("10.0.0.1", False),
    ("localhost.attacker.example", False), ("127.0.0.1.nip.io", False), ("", False),
])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
