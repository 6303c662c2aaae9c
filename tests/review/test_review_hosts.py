"""Host header tricks against the loopback-only page (no token): only a loopback name or IP
literal, with at most a numeric port, is answered."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from review.helpers import fetch, serving
from toolguard.review import create_app
from toolguard.store import AuditEntry, open_store


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path: Path = tmp_path_factory.mktemp("hosts") / "h.db"
    store = open_store(f"sqlite:///{path}", install=True)
    store.audit(AuditEntry(decision="rejected", reason="not_authorized", tool="secret_tool"))
    try:
        with serving(create_app(store)) as base:
            yield base
    finally:
        store.close()


@pytest.mark.parametrize("host", [
    "localhost.evil.com", "127.0.0.1.nip.io", "localhost.evil.com:80", "[::1].evil.com",
    "[::1]evil", "[::1]:80.evil.com", "127.0.0.1:80@evil.com", "127.0.0.1:evil", "localhost:",
    "localhost:80:80", "127.0.0.1 evil.com", "evil.com@127.0.0.1", "127.1", "2130706433",
    "localhost..", "[fe80::1%25lo]", "0.0.0.0"])
def test_a_host_that_is_not_plainly_loopback_is_refused(site: str, host: str) -> None:
    reply = fetch(site, host=host)
    assert reply.status == 421, host
    assert "secret_tool" not in reply.body


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8765", "localhost", "LOCALHOST:80",
                                  "localhost.", "[::1]", "[::1]:8765", "127.5.6.7:1"])
def test_loopback_names_with_a_numeric_port_are_served(site: str, host: str) -> None:
    assert fetch(site, host=host).status == 200, host
