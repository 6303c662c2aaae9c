"""Fixtures: the gateway as a real process (``toolguard mcp proxy``), upstreams, SDK clients.

``Gateway`` starts ``python -m toolguard mcp ...`` listening on a free loopback
port; ``stdio_session`` launches it over stdio as a desktop client would. The
third-party servers (``mcp-server-git``, ``mcp-server-sqlite``) are installed
from the package index, each into a virtualenv of its own under
``~/.cache/toolguard-tests`` (``TOOLGUARD_TEST_CACHE``), made once and reused:
their ``mcp`` pins must not meet the project's environment.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, closing
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
POLICY = HERE / "policy.yml"
UPSTREAM = [sys.executable, str(HERE / "upstream_server.py")]
CACHE = Path(os.environ.get("TOOLGUARD_TEST_CACHE") or Path.home() / ".cache" / "toolguard-tests")


def toolguard(*args: str) -> list[str]:
    return [sys.executable, "-m", "toolguard", *args]


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a gateway and its upstream: no TOOLGUARD_* from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGUARD_")}
    env.update({"PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}",
                "UPSTREAM_DB": str(tmp_path / "upstream.db"),
                "UPSTREAM_PID_FILE": str(tmp_path / "upstream.pid"),
                "TOOLGUARD_EXAMPLE_DB": str(tmp_path / "board.db"),
                "FASTMCP_LOG_LEVEL": "WARNING", **extra})
    return env


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Gateway:
    """One ``toolguard mcp ...`` process serving streamable HTTP on ``port``."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str], port: int) -> None:
        self.args, self.cwd, self.env, self.port = args, cwd, env, port
        self.process: subprocess.Popen[bytes] | None = None
        self.log = cwd / f"gateway-{port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self, timeout_s: float = 120.0) -> Gateway:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(self.args, cwd=self.cwd, env=self.env,
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"the gateway exited {self.process.returncode}: {self.output()[-3000:]}")
            try:
                httpx.get(self.url, timeout=1.0)
                return self
            except httpx.HTTPError:
                time.sleep(0.2)
        pytest.fail(f"the gateway did not listen on {self.url}: {self.output()[-3000:]}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the gateway's own process group (it and the upstream it started)."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


@pytest.fixture
def gateways(tmp_path: Path) -> Iterator[list[Gateway]]:
    started: list[Gateway] = []
    yield started
    for gateway in started:
        gateway.stop()


@pytest.fixture
def start_gateway(tmp_path: Path, gateways: list[Gateway]):
    """``start_gateway(*proxy args, upstream=[...])``: ``toolguard mcp proxy`` on a free port."""

    def start(*args: str, upstream: list[str] | None = None, env: dict[str, str] | None = None,
              policy: Path = POLICY) -> Gateway:
        port = free_port()
        tail = ["--", *(UPSTREAM if upstream is None else upstream)] if upstream != [] else []
        command = toolguard("mcp", "proxy", "--policy", str(policy), "--listen",
                            f"127.0.0.1:{port}", *args, *tail)
        gateway = Gateway(command, tmp_path, env or clean_env(tmp_path), port)
        gateways.append(gateway)
        return gateway.start()

    return start


@asynccontextmanager
async def http_session(url: str, token: str | None = None) -> AsyncIterator[Any]:
    """The MCP SDK's own client over streamable HTTP."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {token}"} if token else None
    client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(120.0))
    async with client, streamable_http_client(url, http_client=client) as streams, \
            ClientSession(streams[0], streams[1]) as session:
        await session.initialize()
        yield session


@asynccontextmanager
async def stdio_session(args: list[str], cwd: Path, env: dict[str, str],
                        **session_options: Any) -> AsyncIterator[Any]:
    """The MCP SDK's own client launching ``args`` over stdio, as a desktop client does."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=args[0], args=args[1:], env=env, cwd=str(cwd))
    with (cwd / "stdio-gateway.log").open("a") as errlog:
        async with stdio_client(params, errlog=errlog) as streams, \
                ClientSession(streams[0], streams[1], **session_options) as session:
            await session.initialize()
            yield session


def audit_rows(tmp_path: Path) -> list[Any]:
    """The gateway's audit log (the embedded SQLite store in the gateway's folder)."""
    from toolguard.store import open_store

    store = open_store(f"sqlite:///{tmp_path / '.toolguard' / 'store.db'}")
    try:
        return list(store.query_audit(newest_first=False, limit=None))
    finally:
        store.close()


def upstream_calls(tmp_path: Path, tool: str | None = None) -> list[tuple[str, str]]:
    """Every call that reached the tests' upstream."""
    path = tmp_path / "upstream.db"
    if not path.exists():
        return []
    with closing(sqlite3.connect(path)) as db:
        try:
            rows = db.execute("SELECT tool, detail FROM calls").fetchall()
        except sqlite3.OperationalError:
            return []
    return [row for row in rows if tool is None or row[0] == tool]


def counter(tmp_path: Path, name: str) -> tuple[int, int]:
    """(value, max_inside) of a counter of the tests' upstream."""
    with closing(sqlite3.connect(tmp_path / "upstream.db")) as db:
        row = db.execute("SELECT value, max_inside FROM counters WHERE name = ?", (name,)).fetchone()
    return (row[0], row[1]) if row else (0, 0)


def server_venv(package: str, version: str, *pins: str) -> Path:
    """The ``bin`` folder of a virtualenv holding ``package==version`` from the index (made once,
    cached).

    ``pins`` are extra requirements (``mcp<2`` for a server written against the SDK 1.x API);
    the folder's name says the version and them, so a change makes a new virtualenv.
    """
    suffix = "".join(f"-{''.join(c if c.isalnum() else '_' for c in pin)}" for pin in (version, *pins))
    venv = CACHE / "venvs" / f"{package}{suffix}"
    binary = venv / "bin" / package
    if binary.exists():
        return venv / "bin"
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / f"{package}{suffix}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers install it once
        if not binary.exists():
            subprocess.run([_base_python(), "-m", "venv", "--clear", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"{package}=={version}", *pins],
                           check=True)
    return venv / "bin"


def _base_python() -> str:
    """The interpreter the project's venv was made from (a venv inside a venv works too)."""
    return getattr(sys, "_base_executable", sys.executable)
