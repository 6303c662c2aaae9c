"""Fixtures of the fault suite, and the scenarios x invariants table printed at the end.

Every server a fault test kills, pauses or cuts off is its own, on a free
loopback port: a private ``redis-server``, a private PostgreSQL (``initdb``), a
three-member etcd cluster, and ``TcpProxy`` instances in front of them. The
shared Redis (6379) and PostgreSQL (5432) are only ever used as they are.
Locally a missing binary skips; on CI (``CI=true``) it fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from pg_server import ON_CI, PgServer, pg_available
from proxy import TcpProxy
from servers import private_redis  # noqa: F401  (fixture)
from store.envs import drop_schema


class DurablePgServer(PgServer):
    """A private PostgreSQL whose commits survive a SIGKILL of every server process.

    ``PgServer`` runs with ``synchronous_commit=off``: a commit can then be
    acknowledged before its WAL leaves shared memory, and a crash loses it. That
    is a durability setting, not a toolguard property, so the crash scenarios
    run with ``synchronous_commit=on`` (``fsync`` stays off: the OS does not
    crash here, only the server processes).
    """

    def start(self) -> DurablePgServer:
        if not self.initialized:
            self.init()
        options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
                   f"-c fsync=off -c synchronous_commit=on -c max_connections=100")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.logfile), "-o", options,
                  "-w", "-t", "30", "start")
        return self

    def children(self) -> list[int]:
        """The postmaster's child processes (backends, checkpointer, ...), from /proc."""
        pid = self.pid()
        if pid is None:
            return []
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
        return found

    def crash(self) -> None:
        """SIGKILL the postmaster and every backend at once, then wait until all are gone."""
        pid = self.pid()
        victims = [p for p in (pid, *self.children()) if p is not None]
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_running(p) for p in victims):
            time.sleep(0.02)
        # A crash leaves the lock files behind, naming a PID that may still be an unreaped
        # zombie (which PostgreSQL would take for a live postmaster).
        for leftover in (self.data / "postmaster.pid", self.dir / f".s.PGSQL.{self.port}.lock"):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its (re)parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def need(problem: str | None) -> None:
    """Skip locally, fail on CI, when a binary a scenario needs is missing."""
    if problem is None:
        return
    if ON_CI:
        pytest.fail(f"{problem}; CI must provide it", pytrace=False)
    pytest.skip(problem)


@pytest.fixture
def durable_postgres() -> Iterator[DurablePgServer]:
    """A private PostgreSQL per test, for scenarios that crash it."""
    need(pg_available())
    server = DurablePgServer().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def proxies() -> Iterator[Callable[[int], TcpProxy]]:
    """``proxies(port)``: a started loopback proxy to ``127.0.0.1:port`` (closed at teardown)."""
    made: list[TcpProxy] = []

    def make(port: int) -> TcpProxy:
        proxy = TcpProxy(("127.0.0.1", port)).start()
        made.append(proxy)
        return proxy

    yield make
    for proxy in made:
        proxy.close()


@pytest.fixture
def pg_schema(postgres_url: str, unique: str) -> Iterator[str]:
    """A schema of its own in the shared PostgreSQL (dropped afterwards)."""
    schema = f"tg_fault_{unique}"
    yield schema
    with contextlib.suppress(psycopg.Error):
        drop_schema(postgres_url, schema)


