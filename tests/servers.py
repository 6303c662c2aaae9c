"""Private servers for fault tests: start, kill, restart them without touching shared ones.

The machine's Redis on 6379 is shared by every test run (and other people):
fault tests never restart it, they start their own ``RedisServer`` here.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

__all__ = ["REDIS_SERVER", "RedisServer", "free_port", "private_redis"]

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def stop_process(process: subprocess.Popen[Any], timeout_s: float = 5.0) -> None:
    """SIGTERM a child this test run started, then SIGKILL if it is still there."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout_s)


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A throw-away ``redis-server`` on a free loopback port, without persistence."""

    def __init__(self, binary: str = REDIS_SERVER, port: int | None = None) -> None:
        self.binary = binary
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="toolguard-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while not self._answers_ping():
            if self.process.poll() is not None:
                msg = f"redis-server on port {self.port} exited with {self.process.returncode}"
                raise RuntimeError(msg)
            if time.monotonic() > deadline:
                self.stop()
                msg = f"redis-server on port {self.port} did not answer within {timeout_s}s"
                raise RuntimeError(msg)
            time.sleep(0.01)
        return self

    def _answers_ping(self) -> bool:
        """A raw PING: redis-py's default retries with backoff would add seconds per try."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: the server vanishes with its data, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> None:
        """Kill, then start again on the same port with empty data."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Shut down (SIGTERM, then SIGKILL) and remove the data directory."""
        if self.process is not None:
            stop_process(self.process)
        self.process = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A private Redis per test, for scenarios that kill, restart or flush the server."""
    if not os.access(REDIS_SERVER, os.X_OK):  # same rule as tests/conftest.py: skip only locally
        message = f"redis-server binary not found at {REDIS_SERVER}"
        if ON_CI:
            pytest.fail(f"{message}; CI must provide it", pytrace=False)
        pytest.skip(message)
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()
