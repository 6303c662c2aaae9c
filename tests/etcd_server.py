"""Throw-away etcd servers for tests: one member for the backend tests, three for fault tests.

Members listen on free loopback ports with a data directory in tmpfs when there is
one (etcd fsyncs every write). Heartbeat and election timeouts are short so a
cluster elects a leader quickly and etcd's minimum lease TTL is 1 s (by default it
is ``ceil(1.5 * election timeout)`` = 2 s).

The ``etcd_url`` fixture (session scope) shares one member per test session; the
contract registry reaches the same member through ``shared_etcd_url()``. Locally a
missing ``etcd`` binary skips; on CI (``CI=true``) it fails, and so does a server
that does not start.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import free_port, stop_process

__all__ = [
    "ETCD_BINARY",
    "EtcdCluster",
    "EtcdMember",
    "etcd_cluster",
    "etcd_url",
    "require_etcd",
    "shared_etcd_url",
]

ETCD_BINARY = os.environ.get("TOOLGUARD_TEST_ETCD", shutil.which("etcd") or "/usr/bin/etcd")
ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
HEARTBEAT_MS = 50
ELECTION_MS = 500


def _data_root() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def _die_with_parent() -> None:
    """In the child: SIGKILL it when the test process dies, so no etcd outlives a crashed run."""
    with contextlib.suppress(Exception):  # Linux only; elsewhere stop() and atexit clean up
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def require_etcd() -> None:
    """Skip locally, fail on CI, when the etcd binary is not installed."""
    if os.access(ETCD_BINARY, os.X_OK):
        return
    message = f"etcd binary not found at {ETCD_BINARY} (Debian: apt-get install etcd-server)"
    if ON_CI:
        pytest.fail(f"{message}; CI must provide it", pytrace=False)
    pytest.skip(message)


class EtcdMember:
    """One etcd process; ``start`` waits until its ``/health`` says true."""

    def __init__(self, name: str, data_dir: str, *, binary: str = ETCD_BINARY) -> None:
        self.name = name
        self.data_dir = data_dir
        self.binary = binary
        self.client_port = free_port()
        self.peer_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._log = Path(data_dir).with_suffix(".log")
        self._cluster = ("", "")

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def url(self) -> str:
        """The toolguard lock URL of this member."""
        return f"etcd://127.0.0.1:{self.client_port}"

    def launch(self, initial_cluster: str, token: str) -> None:
        """Start the process without waiting (members of a new cluster start together)."""
        self._cluster = (initial_cluster, token)
        command = [
            self.binary, "--name", self.name, "--data-dir", self.data_dir,
            "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", token,
            "--heartbeat-interval", str(HEARTBEAT_MS), "--election-timeout", str(ELECTION_MS),
            "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn",
        ]
        with self._log.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=log,
                                            preexec_fn=_die_with_parent)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1) as reply:
                return json.loads(reply.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def wait_healthy(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                msg = f"etcd {self.name} exited with {code}: {self.log_tail()}"
                raise RuntimeError(msg)
            if time.monotonic() > deadline:
                msg = f"etcd {self.name} not healthy within {timeout_s}s: {self.log_tail()}"
                raise RuntimeError(msg)
            time.sleep(0.05)

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL, as in a crash; the data directory stays for a restart."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        """SIGTERM (then SIGKILL); the data directory stays."""
        if self.process is not None:
            stop_process(self.process)
        self.process = None

    def restart(self, timeout_s: float = 20.0) -> None:
        """Start again on the same ports with the same data (a member rejoining)."""
        self.stop()
        self.launch(*self._cluster)  # an existing data dir wins over the bootstrap flags
        self.wait_healthy(timeout_s)


class EtcdCluster:
    """``size`` members on loopback, started together; a single member when ``size`` is 1."""

    def __init__(self, size: int = 1, *, binary: str = ETCD_BINARY) -> None:
        self.root = tempfile.mkdtemp(prefix="toolguard-etcd-", dir=_data_root())
        self.members = [EtcdMember(f"m{i}", os.path.join(self.root, f"m{i}"), binary=binary)
                        for i in range(size)]

    @property
    def url(self) -> str:
        """A lock URL naming every member (the backend fails over between them)."""
        return "etcd://" + ",".join(f"127.0.0.1:{m.client_port}" for m in self.members)

    def start(self, timeout_s: float = 20.0, attempts: int = 3) -> EtcdCluster:
        """Start every member and wait for all to be healthy; retry on a port race."""
        for attempt in range(attempts):
            initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
            token = f"tg-{uuid.uuid4().hex[:8]}"
            for member in self.members:
                member.launch(initial, token)
            try:
                for member in self.members:
                    member.wait_healthy(timeout_s)
                return self
            except RuntimeError:
                self.stop(remove=False)
                if attempt == attempts - 1:
                    raise
                for member in self.members:  # fresh ports and data
                    shutil.rmtree(member.data_dir, ignore_errors=True)
                    member.client_port, member.peer_port = free_port(), free_port()
        return self

    def stop(self, *, remove: bool = True) -> None:
        for member in self.members:
            member.stop()
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


_shared: EtcdCluster | None = None
_shared_error: str | None = None
_shared_lock = threading.Lock()


def _stop_shared() -> None:
    global _shared
    if _shared is not None:
        _shared.stop()
        _shared = None


def shared_etcd_url() -> str:
    """The session's one-member etcd (started on first use, stopped at exit).

    Skips locally / fails on CI when the binary is missing; a server that does
    not start is an error everywhere.
    """
    global _shared, _shared_error
    require_etcd()
    with _shared_lock:
        if _shared_error is not None:
            pytest.fail(_shared_error, pytrace=False)
        if _shared is None:
            try:
                _shared = EtcdCluster(1).start()
            except RuntimeError as error:
                _shared_error = f"etcd did not start: {error}"
                pytest.fail(_shared_error, pytrace=False)
            atexit.register(_stop_shared)
        return _shared.url


@pytest.fixture(scope="session")
def etcd_url() -> Iterator[str]:
    """``etcd://127.0.0.1:PORT`` of a private single-member etcd shared by the session."""
    yield shared_etcd_url()


@pytest.fixture
def etcd_cluster() -> Iterator[EtcdCluster]:
    """A private three-member cluster per test, for scenarios that kill members."""
    require_etcd()
    cluster = EtcdCluster(3).start()
    try:
        yield cluster
    finally:
        cluster.stop()
