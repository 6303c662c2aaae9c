"""Characters that change how a page reads without being seen: bidi overrides, C1 controls,
bytes that are not UTF-8. The review page shows them as visible escapes."""

from __future__ import annotations

import html
import sqlite3
from pathlib import Path

import pytest

from review.helpers import fetch, serving
from toolguard.review import create_app
from toolguard.store import AuditEntry, open_store

BIDI = "\u202egnp.exe"
RAW = ("\u202e", "\u2066", "\x9b", "\x1b")


def test_bidi_and_control_characters_are_shown_as_escapes(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/b.db", install=True)
    try:
        store.audit(AuditEntry(decision="rejected", reason="not_authorized", tool=f"t{BIDI}",
                               agent="a\u2066x\x9b", detail=f"d{BIDI}\x1b[2J\nsecond line",
                               args={"note": f"n{BIDI}"}, keys=(f"k:{BIDI}",),
                               idempotency_key="k1"))
        with serving(create_app(store)) as base:
            pages = {path: fetch(base, path) for path in ("/", "/?decision=all", "/entry/1")}
    finally:
        store.close()
    for path, reply in pages.items():
        assert reply.status == 200, path
        for raw in RAW:
            assert raw not in reply.body, (path, raw)
        assert "t\\u202egnp.exe" in reply.body, path
    entry = pages["/entry/1"].body
    assert "a\\u2066x\\x9b" in entry and "d\\u202egnp.exe\\x1b[2J\nsecond line" in entry
    assert '"n\\u202egnp.exe"' in html.unescape(entry)


def test_a_row_whose_text_is_not_utf8_does_not_break_the_page(tmp_path: Path) -> None:
    """Another program wrote bytes that are not UTF-8 into the SQLite file."""
    store = open_store(f"sqlite:///{tmp_path}/u.db", install=True)
    store.audit(AuditEntry(decision="rejected", reason="not_authorized", tool="ok"))
    raw = sqlite3.connect(tmp_path / "u.db")
    raw.execute("INSERT INTO toolguard_audit (decision, reason, tool, agent, detail) VALUES "
                "('rejected', 'not_authorized', CAST(X'ff41' AS TEXT), CAST(X'c3' AS TEXT), "
                "CAST(X'80' AS TEXT))")
    raw.commit()
    raw.close()
    try:
        with serving(create_app(store)) as base:
            for path in ("/", "/?decision=all", "/entry/2"):
                reply = fetch(base, path)
                assert reply.status in (200, 503), (path, reply.body[-300:])
                assert "Internal Server Error" not in reply.body, path
    finally:
        store.close()


MALFORMED = [
    "UPDATE toolguard_audit SET at = 'garbage' WHERE id = 2",
    "UPDATE toolguard_audit SET keys = 'notjson', tokens = '[1]' WHERE id = 2",
    "UPDATE toolguard_audit SET args = '{bad', duration_ms = 'slow' WHERE id = 2",
    "UPDATE toolguard_audit SET tokens = '{\"k\": \"x\"}', keys = '[1, {}]' WHERE id = 2",
    "UPDATE toolguard_audit SET decision = 7, reason = X'00' WHERE id = 2",
    "UPDATE toolguard_audit SET policy_version = '' WHERE id = 2",
]


@pytest.mark.parametrize("statement", MALFORMED)
def test_a_row_with_malformed_columns_is_shown_not_a_500(tmp_path: Path, statement: str) -> None:
    """The SQLite file's owner (or another program) wrote values no store writes."""
    from typer.testing import CliRunner

    from toolguard.cli import app as cli_app

    url = f"sqlite:///{tmp_path}/m.db"
    store = open_store(url, install=True)
    for tool in ("first", "second"):
        store.audit(AuditEntry(decision="rejected", reason="not_authorized", tool=tool,
                               keys=("k:1",), tokens={"k:1": 1}, args={"a": 1}))
    raw = sqlite3.connect(tmp_path / "m.db")
    raw.execute("DROP TRIGGER toolguard_audit_no_update")
    raw.execute(statement)
    raw.commit()
    raw.close()
    try:
        with serving(create_app(store)) as base:
            for path in ("/", "/?decision=all", "/entry/2", "/entry/1"):
                reply = fetch(base, path)
                assert reply.status == 200, (path, reply.body[-300:])
    finally:
        store.close()
    for args in (["audit", "--url", url], ["audit", "show", "2", "--url", url],
                 ["audit", "stats", "--url", url]):
        result = CliRunner().invoke(cli_app, args)
        assert result.exit_code == 0, (args, result.output, result.exception)
