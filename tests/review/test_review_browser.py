"""The review page in a real browser: Debian's Chromium driven by Playwright.

``toolguard serve`` runs as a real process over the demo's audit log; the test
clicks through the decision tabs, the chart's legend and bars, the filter form
and a decision's page, and saves screenshots under ``.artifacts/review/``
(and the test's ``tmp_path``). On CI (``CI=true``) a missing Chromium or
Playwright fails the test instead of skipping it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from review.helpers import DEMO_POLICY, IMG, SCRIPT, TOOL, served_by_the_cli, serving
from toolguard.review import create_app
from toolguard.store import GuardedStore

#: Playwright's sync API runs its event loop in this thread (see tests/conftest.py).
pytestmark = pytest.mark.sync_playwright

ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
CHROMIUM = os.environ.get("TOOLGUARD_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("TOOLGUARD_TEST_ARTIFACTS",
                                Path(__file__).parents[2] / ".artifacts")) / "review"


def _unavailable(message: str) -> None:
    if ON_CI:
        pytest.fail(f"{message}; CI must provide it (.ci/run installs Debian's chromium)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("Playwright for Python is not installed (the dev extra has it)")
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        _unavailable(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


class Tab:
    """One browser page that records what must never happen: console errors, dialogs."""

    def __init__(self, browser: Any, base: str) -> None:
        self.base = base
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.problems: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.problems.append(m.text))
        self.page.on("pageerror", lambda e: self.problems.append(str(e)))
        self.page.on("dialog", lambda d: (self.problems.append(f"dialog: {d.message}"), d.dismiss()))
        self.page.on("response", lambda r: r.status >= 400 and self.problems.append(
            f"{r.status} {r.url}"))

    def open(self, path: str = "/") -> Any:
        self.page.goto(self.base + path)
        return self.page

    def rows(self) -> list[dict[str, str]]:
        """The list's rows as the visitor reads them."""
        return self.page.eval_on_selector_all("table.entries tbody tr", """rows => rows.map(r => ({
            id: r.querySelector('td.id').innerText, decision: r.cells[2].innerText,
            reason: r.cells[3].innerText, who: r.cells[4].innerText}))""")

    def shot(self, tmp_path: Path, name: str) -> Path:
        path = tmp_path / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, ARTIFACTS / path.name)
        return path


def test_the_demos_rejected_intents_in_chromium(browser: Any, demo_home: dict[str, Any],
                                                 demo_store: GuardedStore, tmp_path: Path) -> None:
    rejected = demo_store.query_audit(decision="rejected", limit=None)
    stale = next(e for e in rejected if e.reason == "stale_fencing_token")
    with served_by_the_cli("--url", demo_home["url"], "--policy", str(DEMO_POLICY)) as (base, _):
        tab = Tab(browser, base)
        page = tab.open()
        # the page opens on what was refused, newest first
        assert page.locator("h1").inner_text() == "Rejected intents"
        assert [r["id"] for r in tab.rows()] == [f"#{e.id}" for e in rejected]
        shown = {r["reason"] for r in tab.rows()}
        assert shown >= {  # the pipeline's, then the epilogues' (controls, decisions)
            "stale_fencing_token", "out_of_order", "invalid_arguments", "not_authorized",
            "approval_required", "budget_exceeded", "stale_read"}
        # A loaded machine may delay a renewal or a grant past its bound: the guard then refuses
        # that call too (the model retries it), and the page shows it like any other refusal.
        assert shown - {"stale_fencing_token", "out_of_order", "invalid_arguments", "not_authorized",
                        "approval_required", "budget_exceeded", "stale_read"} <= {
            "lease_lost", "lock_timeout"}
        assert page.locator("svg.bars rect").count() >= 2  # the chart, drawn by the server
        tab.shot(tmp_path, "review-rejected")

        # the chart's legend filters by reason
        page.locator("ul.legend a", has_text="stale_fencing_token").click()
        page.wait_for_url("**reason=stale_fencing_token**")
        assert [r["id"] for r in tab.rows()] == [f"#{stale.id}"]
        assert "reason stale_fencing_token" in page.locator("p.chips").inner_text()

        # one decision's page says why
        page.locator("td.id a", has_text=f"#{stale.id}").click()
        page.wait_for_url(f"**/entry/{stale.id}")
        assert page.locator("pre.model-message").inner_text() == (
            "rejected by toolguard (stale_fencing_token): another call on this resource wrote "
            "first; nothing was written. Read the resource again before retrying.")
        location = page.locator("code.location").inner_text()
        assert location.startswith(f"{DEMO_POLICY}:") and page.locator("pre.source .marked").inner_text() \
            .strip().endswith('locks: ["lead:{lead_id}"]')
        (key,) = stale.keys
        lease = page.locator("section.lease tbody tr").inner_text()
        assert key in lease and str(stale.tokens[key]) in lease and str(demo_store.high_water(key)) in lease
        attempts = page.locator("section.attempts tbody tr")
        assert attempts.count() == 2 and "applied" in attempts.nth(1).inner_text()
        tab.shot(tmp_path, "review-stale-fencing-token")
        attempts.nth(1).locator("a").click()  # the retry that applied, under the same key
        assert page.locator("h1 .decision").inner_text() == "accepted"
        page.go_back()
        page.locator("p.crumbs a").click()
        assert page.locator("h1").inner_text() == "Rejected intents"

        # the filter form, then the tabs, keep each other's filters
        page.fill("input[name=tool]", "set_tier")
        page.fill("input[name=agent]", "router")
        page.click("form.filters button[type=submit]")
        page.wait_for_url("**tool=set_tier**")
        rows = tab.rows()
        assert rows and all(r["who"] == "router → set_tier" and r["reason"] == "out_of_order" for r in rows)
        page.locator("nav.tabs a", has_text="all").click()
        expected = demo_store.query_audit(tool="set_tier", agent="router", limit=None)
        assert [r["id"] for r in tab.rows()] == [f"#{e.id}" for e in expected]
        assert {r["decision"] for r in tab.rows()} == {"rejected", "accepted"}
        page.locator("a.clear").click()
        assert len(tab.rows()) == len(demo_store.query_audit(limit=None))

        # a bar of the chart opens its reason in its time bucket
        page = tab.open()
        bar = page.locator("svg.bars a").first
        title = bar.locator("title").text_content()
        bar.click()
        page.wait_for_url("**until=**")
        reason = title.rsplit(" · ", 1)[1].split(":")[0]
        assert {r["reason"] for r in tab.rows()} == {reason}
        assert len(tab.rows()) == int(title.rsplit(": ", 1)[1])
        assert tab.problems == []
        page.close()


def test_hostile_audit_contents_stay_inert_in_chromium(browser: Any,
                                                      hostile: tuple[GuardedStore, dict[str, int]],
                                                      tmp_path: Path) -> None:
    store, ids = hostile
    with serving(create_app(store)) as base:
        tab = Tab(browser, base)
        page = tab.open("/?decision=all")
        visible = page.locator("table.entries").inner_text()
        assert TOOL in visible and IMG.strip('"><')[:10] in visible  # shown as text
        tab.shot(tmp_path, "review-hostile")
        for path in ["/", *(f"/entry/{n}" for n in ids.values())]:
            page = tab.open(path)
            assert page.evaluate("() => window.__pwned") is None, path
            assert page.evaluate("() => document.scripts.length") == 0, path
            assert page.evaluate("() => document.querySelectorAll('img, iframe, object').length") == 0
        assert SCRIPT in page.locator("pre.json").inner_text()  # the raw row: its arguments as text
        assert tab.problems == []
        page.close()


def test_hostile_agent_detail_and_arguments_read_as_text_in_chromium(
        browser: Any, hostile: tuple[GuardedStore, dict[str, int]]) -> None:
    """The raw row's agent (an <img onerror>), detail (</pre><script>) and arguments, and a
    bidi override, on its own page: shown as the characters they are, nothing runs."""
    from toolguard.store import AuditEntry

    store, ids = hostile
    store.audit(AuditEntry(decision="rejected", reason="not_authorized", tool="add_note",
                           agent="bob\u202egnp.exe", detail="x"))
    bidi = store.query_audit(limit=1)[0].id
    with serving(create_app(store)) as base:
        tab = Tab(browser, base)
        page = tab.open(f"/entry/{ids['raw']}")
        assert page.locator("pre.detail").inner_text() == f"</pre>{SCRIPT}"
        assert IMG in page.locator("p.who-line").inner_text()
        assert SCRIPT in page.locator("pre.json").inner_text()
        assert page.evaluate("() => window.__pwned") is None
        assert page.evaluate("() => document.querySelectorAll('script, img').length") == 0
        page = tab.open(f"/entry/{bidi}")
        assert "bob\\u202egnp.exe" in page.locator("p.who-line").inner_text()
        assert tab.problems == []
        page.close()


#: Elements that may be wider than the screen because they scroll inside themselves.
_SCROLLERS = "pre.source, table.plain"


def test_the_pages_fit_a_phone_screen(browser: Any, demo_store: GuardedStore,
                                      tmp_path: Path) -> None:
    """At 390 px (a phone) nothing is wider than the screen: the page never scrolls sideways,
    the list's rows are cards, and only the policy's source and the attempts table scroll
    inside themselves."""
    refused = demo_store.query_audit(decision="rejected", limit=None)
    pages = {"list": "/", "all": "/?decision=all", "errors": "/?decision=all&tool=set_tier"
             "&since=last%20tuesday&limit=0",
             **{f"entry-{e.id}": f"/entry/{e.id}" for e in refused}}
    with serving(create_app(demo_store)) as base:
        page = browser.new_page(viewport={"width": 390, "height": 844})
        try:
            for name, path in pages.items():
                page.goto(base + path)
                width, client = page.evaluate(
                    "[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
                assert client == 390 and width <= client, (name, width)
                wide = page.evaluate(f"""() => Array.from(document.querySelectorAll('body *'))
                    .filter(e => !e.closest({_SCROLLERS!r}) && e.getClientRects().length
                            && e.getBoundingClientRect().right > 391)
                    .map(e => e.tagName + '.' + e.className)""")
                assert wide == [], (name, wide)
                page.screenshot(path=str(tmp_path / f"phone-{name}.png"), full_page=True)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            for shot in ("list", "errors", f"entry-{refused[0].id}"):
                shutil.copy(tmp_path / f"phone-{shot}.png", ARTIFACTS / f"phone-{shot}.png")
        finally:
            page.close()
