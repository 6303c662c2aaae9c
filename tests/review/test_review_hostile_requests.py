"""Hostile requests against the real review server (uvicorn): raw bytes on a socket.

The contract (docs/review.md, "Hostile input"): whatever a request carries in its
path, query string or headers, the answer is a page or a plain error whose size
is bounded by the filters' limits, with the page's security headers, and never a
500. The property test sends syntactically valid HTTP/1.1 (a malformed one is
uvicorn's to refuse, before the page sees it); the regressions pin issue 21's
findings: repeated filter values that grew the page quadratically, a
5,000-digit entry id, two Host headers.
"""

from __future__ import annotations

import os
import re
import socket
import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from review.helpers import serving
from toolguard.review import create_app
from toolguard.review.filters import MAX_QUERY_BYTES, MAX_VALUES, MAX_VALUES_PER_FILTER, PARAMS
from toolguard.review.security import CONTENT_SECURITY_POLICY
from toolguard.store import AuditEntry, GuardedStore, open_store

EXAMPLES = int(os.environ.get("TOOLGUARD_HOSTILE_EXAMPLES", "1000"))
#: What a small store's page may weigh, whatever was asked: far below what 800 repeated
#: filter values made of it before (9 MB).
MAX_RESPONSE = 600_000
READ_CAP = 20_000_000


@dataclass(frozen=True)
class Raw:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


def raw_request(base: str, request: bytes) -> Raw:
    """Send ``request`` as is; read the whole answer (the request says Connection: close)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        chunks, size = [], 0
        while size < READ_CAP:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    data = b"".join(chunks)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:])]
    return Raw(status, headers, body)


def http(target: str, headers: list[tuple[str, str]] | None = None, *,
         host: str | None = "127.0.0.1") -> bytes:
    lines = [f"GET {target} HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {host}")
    lines += [f"{k}: {v}" for k, v in headers or []]
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def assert_guarded(reply: Raw) -> None:
    assert reply.status < 500, reply
    assert reply.header("content-security-policy") == CONTENT_SECURITY_POLICY, reply.headers
    assert reply.header("x-content-type-options") == "nosniff"
    assert len(reply.body) <= MAX_RESPONSE, (reply.status, len(reply.body))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardedStore]:
    home: Path = tmp_path_factory.mktemp("hostile-requests")
    opened = open_store(f"sqlite:///{home}/store.db", install=True)
    try:
        for i in range(30):
            opened.audit(AuditEntry(decision="rejected" if i % 3 else "accepted",
                                    reason="not_authorized" if i % 3 else "applied",
                                    tool=f"t{i % 4}", agent=f"agent-{i % 5}",
                                    keys=(f"lead:L-{i}",), tokens={f"lead:L-{i}": i + 1},
                                    workflow=f"w{i % 2}"))
        yield opened
    finally:
        opened.close()


@pytest.fixture(scope="module")
def site(store: GuardedStore) -> Iterator[str]:
    with serving(create_app(store)) as base:
        yield base


# --- the regressions of issue 21 ------------------------------------------------------------------


def test_repeated_filter_values_are_bounded(site: str) -> None:
    """800 values of one filter (a 7.9 KB request) made a 9 MB page: now at most 16 apply."""
    query = "&".join(f"tool=t{i}" for i in range(800))
    reply = raw_request(site, http(f"/?decision=all&{query}"))
    assert_guarded(reply)
    assert reply.status == 400
    body = reply.body.decode()
    assert f"tool: {800 - MAX_VALUES_PER_FILTER} values left out" in body
    assert body.count('class="chip"') == MAX_VALUES_PER_FILTER
    spread = "&".join(f"{name}=v{i}" for i in range(40) for name in ("tool", "agent", "reason"))
    reply = raw_request(site, http(f"/?decision=all&{spread}"))
    assert_guarded(reply)
    assert reply.body.decode().count('class="chip"') <= MAX_VALUES
    long = "&".join(f"agent={'x' * 900}{i}" for i in range(10))  # the byte budget
    reply = raw_request(site, http(f"/?decision=all&{long}"))
    assert_guarded(reply)
    assert reply.body.decode().count('class="chip"') <= MAX_QUERY_BYTES // 900


def test_a_huge_entry_id_is_a_404_with_the_headers(site: str) -> None:
    for target in (f"/entry/{'9' * 5000}", f"/entry/{'1' * 20}", "/entry/%EF%BC%91",
                   "/entry/1e3", "/entry/0x10", "/entry/+1"):
        reply = raw_request(site, http(target))
        assert reply.status == 404, (target, reply.status)
        assert_guarded(reply)


def test_two_host_headers_are_a_400(site: str) -> None:
    for second in ("127.0.0.1", "evil.example", "localhost"):
        reply = raw_request(site, http("/", [("Host", second)]))
        assert reply.status == 400, second
        assert_guarded(reply)
    reply = raw_request(site, http("/", [("Authorization", "Bearer a"),
                                         ("Authorization", "Bearer b")]))
    assert reply.status == 400
    assert_guarded(reply)


def test_a_rejected_filter_shows_no_chip(site: str) -> None:
    for query, name, value in (("since=last%20tuesday", "since", "last+tuesday"),
                               ("until=never", "until", "never"),
                               ("decision=bogus", "decision", "bogus"),
                               ("limit=-5", "limit", "-5")):
        reply = raw_request(site, http(f"/?{query}"))
        assert reply.status == 400, query
        body = reply.body.decode()
        assert f"{name} <code>" not in body, query  # no chip says it applies
        assert not re.search(rf'href="[^"]*{name}={re.escape(value)}', body), query  # no link
    reply = raw_request(site, http("/?since=2h&tool=t1"))
    body = reply.body.decode()
    assert reply.status == 200 and "since <code>2h</code>" in body and "tool <code>t1</code>" in body


def test_an_unexpected_failure_is_a_500_with_the_headers(store: GuardedStore) -> None:
    class Broken:
        dialect = store.dialect

        def query_audit(self, **_: Any) -> list[AuditEntry]:
            msg = "a bug"
            raise RuntimeError(msg)

    with serving(create_app(Broken())) as base:  # type: ignore[arg-type]
        reply = raw_request(base, http("/"))
    assert reply.status == 500
    assert reply.header("content-security-policy") == CONTENT_SECURITY_POLICY
    assert b"a bug" not in reply.body and b"Traceback" not in reply.body


# --- the property: any request, a bounded guarded answer ---------------------------------------

_TOKEN = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"
_VISIBLE = "".join(chr(c) for c in range(0x21, 0x7F))
text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)
names = st.one_of(st.sampled_from([*PARAMS, "token", "x"]), st.text(_TOKEN, min_size=1,
                                                                   max_size=12))
values = st.one_of(text, st.sampled_from(["all", "rejected", "2h", "0001-01-01", "-1", "9" * 400,
                                          "\x00", "today", "t1", "agent-1", "lead:L-3"]),
                   st.integers().map(str))
pairs = st.lists(st.tuples(names, values), max_size=40)
repeated = st.tuples(st.sampled_from(["tool", "agent", "reason", "decision"]), values,
                     st.integers(0, 600))
segments = st.one_of(st.just("entry"), st.just("static"), text.map(lambda t: quote(t, safe="")),
                     st.integers().map(str), st.text("0123456789", min_size=1, max_size=6000))
paths = st.lists(segments, min_size=0, max_size=4).map(lambda parts: "/" + "/".join(parts))
headers = st.lists(st.tuples(st.one_of(st.sampled_from(["Host", "Cookie", "Authorization",
                                                        "Accept", "X-Forwarded-Host", "Range",
                                                        "If-None-Match", "Accept-Encoding"]),
                                       st.text(_TOKEN, min_size=1, max_size=20)),
                             st.text(_VISIBLE + " ", max_size=200).map(str.strip)),
                   max_size=6)


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(path=paths, query=pairs, flood=repeated, extra=headers, host=st.sampled_from(
    ["127.0.0.1", "localhost", "127.0.0.1:8765", "[::1]", None, "evil.example"]))
def test_any_request_gets_a_bounded_answer_with_the_headers(
        site: str, path: str, query: list[tuple[str, str]], flood: tuple[str, str, int],
        extra: list[tuple[str, str]], host: str | None) -> None:
    name, value, times = flood
    items = [*query, *[(name, f"{value}{i}") for i in range(times)]]
    encoded = "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in items)
    target = path + (f"?{encoded}" if encoded else "")
    if len(target) > 60_000:  # beyond what uvicorn reads in a request line
        target = target[:60_000].rsplit("%", 1)[0]
    reply = raw_request(site, http(target, extra, host=host))
    assert_guarded(reply)
