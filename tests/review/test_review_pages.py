"""The review page over HTTP: what it lists, what a decision's page says, and what it refuses.

Every page is fetched from a real uvicorn server; the lists are checked
against ``store.query_audit`` with the same filters, so the page can never
quietly show other rows than ``toolguard audit`` would.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from markupsafe import escape

from review.helpers import DEMO_POLICY, IMG, REASON, SCRIPT, SVG, TOOL, fetch, serving
from toolguard.review import CONTENT_SECURITY_POLICY, create_app
from toolguard.store import AuditEntry, GuardedStore, open_store

ROW = re.compile(r'<td class="id"><a href="/entry/(\d+)">')


def listed(body: str) -> list[int]:
    """The entry ids in the page's table, in page order."""
    return [int(n) for n in ROW.findall(body)]


@pytest.fixture(scope="module")
def demo_site(demo_home: dict[str, Any]) -> Iterator[str]:
    """One server for the module: the pages only read, so the tests cannot disturb each other."""
    store = open_store(demo_home["url"])
    try:
        with serving(create_app(store, policy=DEMO_POLICY, store_label="demo")) as base:
            yield base
    finally:
        store.close()


# --- the list --------------------------------------------------------------------------------


def test_the_page_opens_on_the_rejected_intents_with_counts_per_decision(
        demo_site: str, demo_store: GuardedStore) -> None:
    page = fetch(demo_site)
    assert page.status == 200, page.body
    everything = demo_store.query_audit(limit=None)
    rejected = [e.id for e in everything if e.decision == "rejected"]
    assert listed(page.body) == rejected  # newest first, nothing else
    assert "<h1>Rejected intents</h1>" in page.body
    for reason in ("stale_fencing_token", "out_of_order", "invalid_arguments", "not_authorized"):
        assert f">{reason}</a>" in page.body
    counts = Counter(e.decision for e in everything)
    for decision in ("rejected", "unknown", "replayed", "accepted"):
        assert re.search(rf'>{decision} <span class="count">{counts[decision]}</span>', page.body), decision
    assert f'>all <span class="count">{len(everything)}</span>' in page.body
    assert listed(fetch(demo_site, "/?decision=all").body) == [e.id for e in everything]


@pytest.mark.parametrize("query, filters", [
    ("tool=set_tier&decision=all", {"tool": ["set_tier"]}),
    ("agent=router", {"agent": ["router"], "decision": ["rejected"]}),
    ("reason=out_of_order&reason=not_authorized&decision=all",
     {"reason": ["out_of_order", "not_authorized"]}),
    ("key=lead%3AL-103&decision=all", {"key": "lead:L-103"}),
    ("workflow=lead-qualifier%2FL-105&decision=all", {"workflow": "lead-qualifier/L-105"}),
    ("decision=accepted&decision=replayed", {"decision": ["accepted", "replayed"]}),
    ("decision=all&limit=3", {"limit": 3}),
])
def test_filters_select_what_the_store_query_selects(demo_site: str, demo_store: GuardedStore,
                                                     query: str, filters: dict[str, Any]) -> None:
    page = fetch(demo_site, f"/?{query}")
    assert page.status == 200, page.body
    expected = [e.id for e in demo_store.query_audit(**{"limit": None, **filters})]
    assert expected, "the filter must select something for the test to mean anything"
    assert listed(page.body) == expected


def test_time_filters_take_the_cli_forms(demo_site: str, demo_store: GuardedStore) -> None:
    assert listed(fetch(demo_site, "/?decision=all&since=1h").body) == [
        e.id for e in demo_store.query_audit(limit=None)]
    assert listed(fetch(demo_site, "/?decision=all&until=2000-01-01").body) == []
    stale = demo_store.query_audit(reason="stale_fencing_token", limit=1)[0]
    assert stale.at is not None
    window = (f"since={(stale.at - timedelta(milliseconds=1)).isoformat()}"
              f"&until={(stale.at + timedelta(milliseconds=1)).isoformat()}")
    ids = listed(fetch(demo_site, f"/?decision=all&{window}".replace("+", "%2B")).body)
    assert stale.id in ids
    assert ids == [e.id for e in demo_store.query_audit(
        since=stale.at - timedelta(milliseconds=1), until=stale.at + timedelta(milliseconds=1),
        limit=None)]


@pytest.mark.parametrize("query, message", [
    ("since=yesterday-ish", "since: &#39;yesterday-ish&#39; is not a time"),
    ("since=1h&until=2h", "since is not before until"),
    ("decision=maybe", "decision &#39;maybe&#39; is not one of"),
    ("limit=0", "limit must be a whole number from 1 to 5000"),
    ("limit=lots", "limit must be a whole number"),
])
def test_a_bad_filter_is_reported_on_the_page(demo_site: str, query: str, message: str) -> None:
    page = fetch(demo_site, f"/?{query}")
    assert page.status == 400
    assert message in page.body
    assert '<form class="filters"' in page.body  # the visitor can fix it right there


def test_the_chart_counts_every_entry_shown_by_reason(demo_site: str, demo_store: GuardedStore) -> None:
    page = fetch(demo_site)
    rejected = Counter(e.reason for e in demo_store.query_audit(decision="rejected", limit=None))
    titles = re.findall(r"<title>[^<]* UTC · ([a-z_]+): (\d+)</title>", page.body)
    drawn: Counter[str] = Counter()
    for reason, count in titles:
        drawn[reason] += int(count)
    assert drawn == rejected
    for reason, count in rejected.items():
        assert re.search(rf'reason={reason}"[^>]*>{reason}</a>\s*<span class="count">{count}</span>',
                         page.body), reason


# --- one decision ----------------------------------------------------------------------------


def test_a_stale_write_page_says_why_with_the_lease_and_every_attempt(
        demo_site: str, demo_store: GuardedStore) -> None:
    stale = demo_store.query_audit(reason="stale_fencing_token", limit=1)[0]
    page = fetch(demo_site, f"/entry/{stale.id}")
    assert page.status == 200, page.body
    body = page.body
    assert "a newer lock holder had written" in body  # the CLI's meaning of the reason
    said = ("rejected by toolguard (stale_fencing_token): another call on this resource wrote "
            "first; nothing was written. Read the resource again before retrying.")
    assert f'<pre class="model-message">{escape(said)}</pre>' in body  # not the detail's tokens
    # the lease: the refused token, and the newer one the store had accepted
    (key,) = stale.keys
    high = demo_store.high_water(key)
    assert high > stale.tokens[key]
    assert re.search(rf"<code>{key}</code></a></td>\s*<td class=\"num\">{stale.tokens[key]}</td>\s*"
                     rf"<td class=\"num\">{high}</td>", body)
    # every attempt under the idempotency key: the refused one and the retry that applied
    attempts = demo_store.query_audit(idempotency_key=stale.idempotency_key, limit=None,
                                      newest_first=False)
    assert [a.reason for a in attempts] == ["stale_fencing_token", "applied"]
    assert f"#{stale.id} (this)" in body and f'href="/entry/{attempts[1].id}"' in body
    # the policy rule: enrich_lead's locks, at its line in the demo policy
    line = _line_of(DEMO_POLICY, "enrich_lead:", "locks:")
    assert f'<code class="location">{DEMO_POLICY}:{line}</code>' in body
    assert "tools.enrich_lead.locks" in body
    assert escape('"employees": 80') in body  # the arguments as audited


def test_redacted_arguments_stay_redacted(demo_site: str, demo_store: GuardedStore) -> None:
    check = demo_store.query_audit(tool="verify_email", limit=1)[0]
    assert check.args["email"] == "[redacted]"
    body = fetch(demo_site, f"/entry/{check.id}").body
    assert escape('"email": "[redacted]"') in body and "@" not in body


def test_a_refusal_page_points_at_the_rule_that_refused(demo_site: str, demo_store: GuardedStore) -> None:
    cases = {"not_authorized": ("update_intent_score:", "agents:"),
             "invalid_arguments": ("update_intent_score:", "points:"),
             "out_of_order": ("set_tier:", "after:")}
    for reason, (tool, field) in cases.items():
        entry = demo_store.query_audit(reason=reason, limit=1)[0]
        body = fetch(demo_site, f"/entry/{entry.id}").body
        line = _line_of(DEMO_POLICY, tool, field)
        assert f'<code class="location">{DEMO_POLICY}:{line}</code>' in body, reason
        assert re.search(rf'<span class="line marked"><span class="number">{line}</span>', body), reason


def test_without_flags_every_refusal_shows_the_rule_of_the_version_that_decided(
        demo_store: GuardedStore) -> None:
    """The store keeps each policy version a guard decided under: no --policy needed, and
    a budget refusal points at the tool's quota, never at the unknown-tool default."""
    refused = demo_store.query_audit(decision="rejected", limit=None)
    assert {e.reason for e in refused} >= {"stale_fencing_token", "not_authorized",
                                           "budget_exceeded", "approval_required"}
    with serving(create_app(demo_store)) as base:
        for entry in refused:
            body = fetch(base, f"/entry/{entry.id}").body
            assert entry.policy_version and f"{entry.policy_version[:12]}</code>, the one that " \
                "decided" in body, (entry.id, entry.reason)
            assert 'class="location"' in body and "has no rule in this policy" not in body, \
                (entry.id, entry.reason)
            if entry.reason == "budget_exceeded":
                assert "on_unknown_tool" not in body
                assert f"tools.{entry.tool}.quotas[0]" in body
                assert re.search(r'<span class="line marked"><span class="number">\d+</span>'
                                 r'\s*- \{budget: 30', body), body
        stale = demo_store.query_audit(reason="stale_fencing_token", limit=1)[0]
        body = fetch(base, f"/entry/{stale.id}").body
        line = _line_of(DEMO_POLICY, "enrich_lead:", "locks:")
        assert f'<code class="location">{DEMO_POLICY}:{line}</code>' in body


def test_with_a_policy_on_disk_the_page_compares_it(demo_store: GuardedStore,
                                                     tmp_path: Path) -> None:
    budget = demo_store.query_audit(reason="budget_exceeded", limit=1)[0]
    stale = demo_store.query_audit(reason="stale_fencing_token", limit=1)[0]
    edited = tmp_path / "policy.yml"
    edited.write_text(DEMO_POLICY.read_text(encoding="utf-8").replace("ttl_ms: ", "ttl_ms: 1"),
                      encoding="utf-8")
    with serving(create_app(demo_store, policy=DEMO_POLICY)) as base:
        assert "is this same version" in fetch(base, f"/entry/{stale.id}").body
        body = fetch(base, f"/entry/{budget.id}").body  # decided under the controls' policy
        assert "is another version" in body and f"tools.{budget.tool}.quotas" in body
        assert "has no rule in this policy version" in body  # the file does not know the tool
        assert "on_unknown_tool" not in body
    with serving(create_app(demo_store, policy=edited)) as base:
        body = fetch(base, f"/entry/{stale.id}").body
        assert "is another version" in body and f"{edited}:" in body


@pytest.mark.parametrize("path", ["/entry/0", "/entry/999999", f"/entry/{2**64}", "/entry/-1",
                                  "/entry/abc", "/nowhere"])
def test_an_unknown_entry_is_a_404(demo_site: str, path: str) -> None:
    assert fetch(demo_site, path).status == 404


# --- read-only, headers, hosts ---------------------------------------------------------------------


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
@pytest.mark.parametrize("path", ["/", "/entry/1", "/login", "/static/review.css"])
def test_nothing_but_reading(demo_site: str, demo_store: GuardedStore, method: str, path: str) -> None:
    before = len(demo_store.query_audit(limit=None))
    assert fetch(demo_site, path, method=method).status == 405
    assert len(demo_store.query_audit(limit=None)) == before


@pytest.mark.parametrize("path", ["/", "/entry/1", "/entry/999999", "/static/review.css", "/?since=x"])
def test_every_response_carries_the_strict_headers(demo_site: str, path: str) -> None:
    headers = fetch(demo_site, path).headers
    assert headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "script-src" not in CONTENT_SECURITY_POLICY and "default-src 'none'" in CONTENT_SECURITY_POLICY
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["x-frame-options"] == "DENY"
    assert headers["referrer-policy"] == "no-referrer"


def test_only_loopback_names_are_answered_without_a_token(demo_site: str) -> None:
    port = demo_site.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "127.0.0.1", f"[::1]:{port}"):
        assert fetch(demo_site, host=host).status == 200, host
    # a page on another site that rebinds its own name to 127.0.0.1 must read nothing
    for host in (f"attacker.example:{port}", "attacker.example", "127.0.0.1.attacker.example",
                 f"0.0.0.0:{port}", ""):
        reply = fetch(demo_site, host=host)
        assert reply.status == 421, host
        assert "stale_fencing_token" not in reply.body


def test_the_page_has_no_script_at_all(demo_site: str, demo_store: GuardedStore) -> None:
    for path in ["/", "/?decision=all", *(f"/entry/{e.id}" for e in demo_store.query_audit(limit=None))]:
        body = fetch(demo_site, path).body
        assert "<script" not in body.lower(), path
        assert not re.search(r"<[^>]*\son[a-z]+=", body), path  # no event-handler attribute


# --- hostile audit contents ------------------------------------------------------------------------


def test_hostile_audit_contents_are_escaped_everywhere(hostile: tuple[GuardedStore, dict[str, int]]) -> None:
    store, ids = hostile
    with serving(create_app(store, store_label=f"sqlite:///{SCRIPT}")) as base:
        pages = {"list": fetch(base, "/?decision=all").body,
                 "rejected": fetch(base, "/").body,
                 "filtered": fetch(base, f"/?decision=all&tool={_q(TOOL)}&agent={_q(IMG)}").body,
                 **{name: fetch(base, f"/entry/{n}").body for name, n in ids.items()}}
    for name, body in pages.items():
        lowered = body.lower()
        assert "<script" not in lowered, name
        assert "<img" not in lowered and "<svg onload" not in lowered, name
    assert escape(SCRIPT) in pages["accepted"]  # the arguments, shown as text
    assert escape(TOOL) in pages["unknown_tool"] and escape(TOOL) in pages["list"]
    raw = pages["raw"]
    for value in (REASON, IMG, f"</pre>{SCRIPT}", f"javascript:{SCRIPT}", json.dumps(SVG)):
        assert escape(value) in raw, value
    # the one link built from a stored value starts with our own path, never the value
    assert 'href="javascript' not in raw and 'href="/?decision=all&amp;workflow=javascript' in raw
    assert [int(n) for n in ROW.findall(pages["filtered"])] == [ids["raw"]]


def test_hostile_reason_codes_are_escaped_in_the_chart(hostile: tuple[GuardedStore, dict[str, int]]) -> None:
    store, _ = hostile
    with serving(create_app(store)) as base:
        body = fetch(base, "/").body
    assert f"{escape(REASON)}: 1</title>" in body
    assert "<script" not in body.lower()


# --- PostgreSQL --------------------------------------------------------------------------------------


def test_the_page_reads_a_postgresql_store_the_same_way(postgres_url: str, unique: str) -> None:
    import psycopg
    from psycopg import sql

    schema = f"tg_review_{unique}"
    store = open_store(postgres_url, schema=schema, install=True)
    try:
        for n, (decision, reason, key) in enumerate([("accepted", "applied", "lead:a"),
                                                     ("rejected", "stale_fencing_token", "lead:a"),
                                                     ("rejected", "not_authorized", "lead:b")]):
            store.audit(AuditEntry(decision=decision, reason=reason, tool="set_tier", agent="router",
                                   keys=(key,), tokens={key: 10 + n}, idempotency_key=f"k-{key}",
                                   args={"lead_id": key}, detail=f"{reason} on {key}"))
        rows = store.query_audit(limit=None)
        with serving(create_app(store, store_label="pg")) as base:
            assert listed(fetch(base, "/").body) == [e.id for e in rows if e.decision == "rejected"]
            assert listed(fetch(base, "/?decision=all&key=lead%3Aa").body) == [
                e.id for e in store.query_audit(key="lead:a", limit=None)]
            stale = store.query_audit(reason="stale_fencing_token", limit=1)[0]
            body = fetch(base, f"/entry/{stale.id}").body
            assert "stale_fencing_token on lead:a" in body
            assert body.count('<tr class="this">') == 1 and f'href="/entry/{rows[-1].id}"' in body
    finally:
        store.close()
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def test_a_store_that_does_not_answer_is_a_503_page_not_a_traceback() -> None:
    store = open_store("postgresql://reader:hunter2@127.0.0.1:1/nowhere", min_size=0, max_size=1,
                       timeout_s=0.5)
    try:
        with serving(create_app(store)) as base:
            for path in ("/", "/entry/1"):
                reply = fetch(base, path)
                assert reply.status == 503, path
                assert "The store did not answer" in reply.body and "backend_unavailable" in reply.body
                assert "hunter2" not in reply.body and "Traceback" not in reply.body
    finally:
        store.close()


def _q(value: str) -> str:
    from urllib.parse import quote

    return quote(value, safe="")


def _line_of(path: Path, block: str, field: str) -> int:
    """The 1-based line of ``field`` inside the YAML block that starts with ``block``."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == block)
    return next(i for i in range(start + 1, len(lines)) if lines[i].strip().startswith(field)) + 1
