"""A private PostgreSQL server for tests that stop, kill or restart it.

The machine's PostgreSQL on 5432 is shared: fault tests never stop it, they
start their own ``PgServer`` (``initdb`` + ``pg_ctl`` on a free loopback port,
data under a temp dir). PostgreSQL refuses to run as root, so as root the
binaries run as the ``postgres`` OS user (``runuser``) on a directory chowned
to it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["PG_BIN", "PgServer", "pg_available", "private_postgres"]

PG_BIN = Path(os.environ.get("TOOLGUARD_PG_BIN", "/usr/lib/postgresql/15/bin"))
OS_USER = "postgres"
ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pg_available(bin_dir: Path = PG_BIN) -> str | None:
    """None if a private server can be started here, else why not."""
    for tool in ("initdb", "pg_ctl"):
        if not os.access(bin_dir / tool, os.X_OK):
            return f"{bin_dir / tool} not found"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(OS_USER)
        except KeyError:
            return f"running as root and there is no {OS_USER!r} OS user to run PostgreSQL as"
        if shutil.which("runuser") is None:
            return "running as root and runuser is not installed"
    return None


class PgServer:
    """A throw-away PostgreSQL cluster: trust auth (or a password), fsync off, loopback only."""

    def __init__(self, bin_dir: Path = PG_BIN, port: int | None = None,
                 password: str | None = None) -> None:
        self.bin_dir = bin_dir
        self.port = port or _free_port()
        #: With a password: scram-sha-256 auth for every connection (else trust).
        self.password = password
        self.dir = Path(tempfile.mkdtemp(prefix="toolguard-pg-"))
        self.data = self.dir / "data"
        self.logfile = self.dir / "server.log"
        self.initialized = False
        if os.geteuid() == 0:
            shutil.chown(self.dir, user=OS_USER, group=OS_USER)

    @property
    def url(self) -> str:
        login = f"postgres:{self.password}" if self.password else "postgres"
        return f"postgresql://{login}@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin_dir / argv[0]), *argv[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", OS_USER, "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                check=False, cwd=self.dir)
        if result.returncode != 0:
            log = self.logfile.read_text() if self.logfile.exists() else ""
            msg = (f"{' '.join(argv[:2])} failed ({result.returncode}): {result.stderr.strip()}\n"
                   f"{log[-2000:]}")
            raise RuntimeError(msg)
        return result

    def init(self) -> PgServer:
        auth = ["--auth=trust"]
        if self.password:
            secret = self.dir / "pwfile"
            secret.write_text(self.password + "\n")
            if os.geteuid() == 0:
                shutil.chown(secret, user=OS_USER, group=OS_USER)
            auth = ["--auth=scram-sha-256", f"--pwfile={secret}"]
        self._run("initdb", "-D", str(self.data), "-U", "postgres", *auth,
                  "-E", "UTF8", "--no-sync", "--no-instructions")
        self.initialized = True
        return self

    def start(self) -> PgServer:
        """Start (initdb first if needed) and wait until it accepts connections."""
        if not self.initialized:
            self.init()
        options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
                   f"-c fsync=off -c synchronous_commit=off -c full_page_writes=off")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.logfile), "-o", options,
                  "-w", "-t", "30", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        """Shut down: ``fast`` aborts open transactions, ``immediate`` is a crash."""
        if self.running():
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop")

    def kill(self) -> None:
        """SIGKILL the postmaster, as in a crash (children exit on their own)."""
        pid = self.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self._alive(pid):
                time.sleep(0.02)

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def pid(self) -> int | None:
        pidfile = self.data / "postmaster.pid"
        try:
            return int(pidfile.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def running(self) -> bool:
        pid = self.pid()
        return pid is not None and self._alive(pid)

    def cleanup(self) -> None:
        """Stop (immediately) and remove the cluster."""
        with contextlib.suppress(Exception):
            self.stop("immediate")
        with contextlib.suppress(Exception):
            self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PgServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


@pytest.fixture
def private_postgres() -> Iterator[PgServer]:
    """A private PostgreSQL per test, for scenarios that stop, kill or restart the server."""
    problem = pg_available()
    if problem is not None:  # same rule as tests/conftest.py: skip only locally
        if ON_CI:
            pytest.fail(f"{problem}; CI must provide it", pytrace=False)
        pytest.skip(problem)
    server = PgServer().start()
    try:
        yield server
    finally:
        server.cleanup()
