"""Fixtures for the review page: a demo run to review, hostile audit rows, a real server.

Pages are fetched from a real uvicorn server on a free loopback port (over
``http.client``, so the Host header and the redirects are exactly what was
sent), never through an in-process shortcut.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from typer.testing import CliRunner

from toolguard.cli import app as cli_app
from toolguard.guard import ToolGuard
from toolguard.intent import Intent, WorkflowIdentity
from toolguard.locks import connect
from toolguard.policies import Policy
from toolguard.store import AuditEntry, GuardedStore, open_store

ENV = ("TOOLGUARD_LOCK_URL", "TOOLGUARD_REDIS_URL", "TOOLGUARD_DATABASE_URL", "TOOLGUARD_HOME",
       "TOOLGUARD_REVIEW_TOKEN")
DEMO_POLICY = Path(__file__).parents[2] / "toolguard" / "demo" / "policy.yml"

#: What a hostile model (or anyone who can write audit rows) might put in them.
SCRIPT = "<script>window.__pwned = 'script'</script>"
IMG = "\"><img src=x onerror=\"window.__pwned='img'\">"
SVG = "<svg onload=\"window.__pwned='svg'\"></svg>"
TOOL = "<img src=x onerror=alert(1)>"
REASON = "</code><script>window.__pwned='reason'</script>"


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Mapping[str, str]
    body: str

    @property
    def text(self) -> str:
        return self.body


def fetch(base: str, path: str = "/", *, method: str = "GET", headers: Mapping[str, str] | None = None,
          host: str | None = None) -> Reply:
    """One request, no redirects followed; ``host`` overrides the Host header."""
    address = base.removeprefix("http://").rstrip("/")
    name, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(name.strip("[]"), int(port), timeout=10)
    try:
        sent = dict(headers or {})
        if host is not None:
            conn.putrequest(method, path, skip_host=True)
            conn.putheader("Host", host)
        else:
            conn.putrequest(method, path)
        for key, value in sent.items():
            conn.putheader(key, value)
        conn.endheaders()
        response = conn.getresponse()
        body = response.read().decode("utf-8", "replace")
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, body)
    finally:
        conn.close()


@contextlib.contextmanager
def serving(app: Any, host: str = "127.0.0.1") -> Iterator[str]:
    """Run ``app`` on a free port in a thread; yield its base URL; stop it on exit."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():  # startup is a few milliseconds
        time.sleep(0.01)
    assert server.started, "the review server did not start"
    try:
        yield f"http://[{host}]:{port}" if family == socket.AF_INET6 else f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(autouse=True)
def _no_toolguard_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``toolguard demo --json --dir D`` run once: the audit log the page is made for."""
    home = tmp_path_factory.mktemp("review-demo")
    saved = {name: os.environ.pop(name) for name in ENV if name in os.environ}
    try:
        result = CliRunner().invoke(cli_app, ["demo", "--dir", str(home), "--json"])
    finally:
        os.environ.update(saved)
    assert result.exit_code == 0, result.output
    return {"home": home, "url": f"sqlite:///{home}/store.db", "report": json.loads(result.stdout)}


@pytest.fixture
def demo_store(demo_home: dict[str, Any]) -> Iterator[GuardedStore]:
    store = open_store(demo_home["url"])
    try:
        yield store
    finally:
        store.close()


HOSTILE_POLICY = {"version": 1, "tools": {
    "add_note": {"locks": ["lead:{lead_id}"], "args": {"text": {"max_length": 200}}},
}}


def seed_hostile(store: GuardedStore, lock_url: str) -> dict[str, int]:
    """Rows a hostile model produces through a real guard, plus rows written as-is.

    Returns the id of each kind of row: ``accepted`` (HTML in the arguments),
    ``unknown_tool`` (HTML as the tool name), ``invalid`` (HTML in a refused
    argument), ``raw`` (HTML in every text column, written straight to the log).
    """
    locks = connect(lock_url)
    try:
        guard = ToolGuard(Policy.from_dict(HOSTILE_POLICY), locks=locks, store=store)
        flow = WorkflowIdentity(thread_id=f"thread-{SVG}")

        def execute(ctx: Any) -> str:
            return "noted"

        calls = {
            "accepted": Intent(tool="add_note", args={"lead_id": "L-1", "text": SCRIPT + IMG},
                               call_id="call-1", agent="note_taker", workflow=flow),
            "unknown_tool": Intent(tool=TOOL, args={"x": SCRIPT}, call_id="call-2",
                                   agent="note_taker", workflow=flow),
            "invalid": Intent(tool="add_note", args={"lead_id": "L-1", "text": SVG * 20},
                              call_id="call-3", agent="note_taker", workflow=flow),
        }
        for intent in calls.values():
            guard.run(intent, execute)
    finally:
        locks.close()
    store.audit(AuditEntry(
        decision="rejected", reason=REASON, tool=TOOL, agent=IMG, intent_id=SCRIPT,
        idempotency_key=f"key-{SCRIPT}", workflow=f"javascript:{SCRIPT}", keys=(f"lead:{IMG}",),
        tokens={f"lead:{IMG}": 7}, args={SVG: SCRIPT, "nested": [IMG]}, detail=f"</pre>{SCRIPT}"))
    rows = store.query_audit(limit=None, newest_first=False)
    by_call = {e.intent_id: e.id for e in rows}
    return {"accepted": by_call["call-1"], "unknown_tool": by_call["call-2"],
            "invalid": by_call["call-3"], "raw": rows[-1].id}  # type: ignore[dict-item]


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[tuple[GuardedStore, dict[str, int]]]:
    store = open_store(f"sqlite:///{tmp_path}/hostile-store.db", install=True)
    try:
        yield store, seed_hostile(store, f"sqlite:///{tmp_path}/hostile-locks.db")
    finally:
        store.close()
