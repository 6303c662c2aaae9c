"""Helpers for the review page tests: a real server, plain HTTP requests, hostile rows.

Pages are fetched from a real uvicorn server on a free loopback port (over
``http.client``, so the Host header and the redirects are exactly what was
sent), never through an in-process shortcut.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from toolguard.call.intent import Intent, WorkflowIdentity
from toolguard.guard import ToolGuard
from toolguard.locks import connect
from toolguard.policies import Policy
from toolguard.store import AuditEntry, GuardedStore

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

URL_LINE = re.compile(r"toolguard review: (http://127\.0\.0\.1:\d+)/ \(read-only\)")


@contextlib.contextmanager
def served_by_the_cli(*args: str, env: Mapping[str, str] | None = None
                      ) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``python -m toolguard serve --port 0 ARGS``; yields its URL, stops it with SIGTERM."""
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "toolguard", "serve", "--port", "0", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        match = URL_LINE.search(first)
        if match is None:
            process.kill()
            _, err = process.communicate(timeout=10)
            pytest.fail(f"toolguard serve printed {first!r}; stderr: {err}")
        yield match.group(1), process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
