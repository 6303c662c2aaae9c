"""Fixtures: fenced services in processes of their own (uvicorn on a free loopback port).

``service`` is the REST app, ``mcp_service`` the FastMCP server, each on a
service store of its own (a PostgreSQL schema, or a SQLite file); the agent
side (``agent``) is a ToolGuard with Redis locks and a store separate from the
service's, as it would be in production.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from pg_server import private_postgres  # noqa: F401  (fixture for the store-restart tests)
from psycopg import sql

from toolguard.store import GuardedStore, open_store

TESTS = Path(__file__).resolve().parents[1]


class ServiceProcess:
    """One uvicorn process serving ``factory``; ``kill()`` and ``start()`` to restart it."""

    def __init__(self, factory: str, store_url: str, schema: str | None, port: int,
                 env: dict[str, str] | None = None, log: Path | None = None,
                 http: str | None = None) -> None:
        self.factory = factory
        self.log = log  # the server's stderr goes there (else a pipe, read if it exits early)
        self.http = http  # uvicorn's --http implementation (h11, httptools)
        self.env = env or {}
        self.store_url = store_url
        self.schema = schema
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> ServiceProcess:
        env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "FENCES_STORE_URL": self.store_url, "FENCES_SCHEMA": self.schema or "", **self.env}
        stderr = self.log.open("ab") if self.log is not None else subprocess.PIPE
        http = ["--http", self.http] if self.http else []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", self.factory, "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning", "--no-access-log", *http],
            env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        if self.log is not None:
            stderr.close()  # the child has its own copy
        deadline = time.monotonic() + timeout_s
        probe = "/health" if self.factory.endswith("create_app") else "/mcp"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                error = (self.log.read_text(errors="replace") if self.log is not None
                         else self.process.stderr.read().decode() if self.process.stderr else "")
                pytest.fail(f"the service exited: {error[-2000:]}")
            try:
                httpx.get(self.url + probe, timeout=1.0)
                return self
            except httpx.HTTPError:
                time.sleep(0.1)
        pytest.fail(f"the service did not answer on {self.url} within {timeout_s}s")

    def log_text(self) -> str:
        """What the server wrote to stderr so far (its warnings and tracebacks)."""
        return self.log.read_text(errors="replace") if self.log is not None else ""

    def kill(self) -> None:
        """SIGKILL: no shutdown, no rollback sent; the database ends its transactions."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def drop_schema(postgres_url: str, schema: str) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture(params=["postgresql", "sqlite"])
def service_store_url(request, unique, tmp_path) -> Iterator[tuple[str, str | None]]:
    """Where the service keeps its fences, intents, audit and ``leads`` (not the agent's store)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/service.db", None
        return
    postgres_url = request.getfixturevalue("postgres_url")
    schema = f"svc_{unique}"
    try:
        yield postgres_url, schema
    finally:
        drop_schema(postgres_url, schema)


def _service(factory: str, store: tuple[str, str | None],
             log: Path | None = None) -> Iterator[ServiceProcess]:
    from servers import free_port

    process = ServiceProcess(factory, store[0], store[1], free_port(), log=log)
    try:
        yield process.start()
    finally:
        process.stop()


def logged_service(factory: str, store: tuple[str, str | None],
                   tmp_path: Path) -> Iterator[ServiceProcess]:
    """A service whose stderr goes to ``tmp_path/server.log`` (read for warnings after)."""
    yield from _service(factory, store, log=tmp_path / "server.log")


@pytest.fixture
def service(service_store_url) -> Iterator[ServiceProcess]:
    yield from _service("fences.service_app:create_app", service_store_url)


@pytest.fixture
def mcp_service(service_store_url) -> Iterator[ServiceProcess]:
    yield from _service("fences.service_app:create_mcp_app", service_store_url)


@contextlib.contextmanager
def opened_store(process: ServiceProcess) -> Iterator[GuardedStore]:
    """The store a running service keeps its fences, intents, audit and leads in."""
    options = {"schema": process.schema} if process.schema else {}
    with open_store(process.store_url, **options) as store:
        yield store


@pytest.fixture
def service_store(service: ServiceProcess) -> Iterator[GuardedStore]:
    """The running service's store, read by the tests (fences, intents, audit, leads)."""
    with opened_store(service) as store:
        yield store


@pytest.fixture
def mcp_store(mcp_service: ServiceProcess) -> Iterator[GuardedStore]:
    """The running MCP server's store."""
    with opened_store(mcp_service) as store:
        yield store


def audit(store: GuardedStore, **filters: object) -> list:
    """The store's audit rows, oldest first."""
    return store.query_audit(newest_first=False, limit=None, **filters)


def leads(store: GuardedStore) -> dict[str, tuple[int, int]]:
    with store.connection() as conn:
        rows = conn.execute("SELECT id, score, writes FROM leads").fetchall()
    return {row[0]: (row[1], row[2]) for row in rows}


def intents(store: GuardedStore) -> int:
    with store.connection() as conn:
        return int(conn.execute("SELECT count(*) FROM toolguard_intent").fetchone()[0])


POLICY = """\
version: 1
defaults: {ttl_ms: %(ttl)d, wait_timeout_s: 10}
tools:
  set_score:
    locks: ["lead:{lead_id}"]
    fenced: false          # the service checks the tokens; the guard requires a stable key
  add_score:
    locks: ["lead:{lead_id}"]
    fenced: false
"""


def make_guard(tmp_path: Path, name: str, lock_url: str, *, ttl_ms: int = 10_000,
               asynchronous: bool = False):
    """A ToolGuard for one agent process: its own store file, the shared lock server."""
    from toolguard import ToolGuard, load_policy
    from toolguard.locks import connect, connect_async
    from toolguard.store import open_async_store

    policy_file = tmp_path / f"policy-{name}.yml"
    policy_file.write_text(POLICY % {"ttl": ttl_ms})
    store_url = f"sqlite:///{tmp_path}/agent-{name}.db"
    open_store(store_url, install=True).close()
    if asynchronous:
        return ToolGuard(load_policy(policy_file), async_locks=connect_async(lock_url),
                         async_store=open_async_store(store_url))
    return ToolGuard(load_policy(policy_file), locks=connect(lock_url),
                     store=open_store(store_url))
