"""`.ci/run`'s choice of PostgreSQL (`.ci/postgres.sh`), run against clusters of the test's own.

A fresh Debian's packaged cluster wants a password for host connections
(scram-sha-256, `pg_createcluster`'s default since PostgreSQL 14), so the
quick start's second command cannot use it as configured: it must fall back to
a private cluster of its own, working, and stopped again at the end. The shared
server on 5432 is never used here: every URL points at a cluster this test started.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import psycopg
import pytest

from tests.pg_server import ON_CI, PgServer, pg_available

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "postgres.sh"

# What .ci/run does with the script, then what the tests would do with the URL it picked.
DRIVER = """
set -euo pipefail
. .ci/postgres.sh
trap pg_cleanup EXIT
pg_pick || exit 2  # as .ci/run: pg_pick || die ...
echo "URL=$TOOLGUARD_TEST_DATABASE_URL"
echo "PID=$PG_PRIVATE_PID"
echo "DIR=$PG_PRIVATE_DIR"
psql "$TOOLGUARD_TEST_DATABASE_URL" -Atqc \
  "CREATE TABLE t (x int); INSERT INTO t VALUES (7); SELECT current_database() || ':' || sum(x) FROM t"
"""


class DebianDefaultCluster(PgServer):
    """A cluster with `pg_createcluster`'s authentication: scram-sha-256 on host, peer on local."""

    def init(self) -> DebianDefaultCluster:
        secret = self.dir / "pwfile"
        secret.write_text("not-known-to-ci\n")
        if os.geteuid() == 0:
            shutil.chown(secret, user="postgres", group="postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth-host=scram-sha-256",
                  "--auth-local=peer", f"--pwfile={secret}", "-E", "UTF8", "--no-sync",
                  "--no-instructions")
        self.initialized = True
        return self


@pytest.fixture(autouse=True)
def _needs_postgres_binaries() -> None:
    problem = pg_available()
    if problem is not None:  # same rule as tests/conftest.py: skip only locally
        if ON_CI:
            pytest.fail(f"{problem}; CI must provide it", pytrace=False)
        pytest.skip(problem)


def _pick(database_url: str) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["TOOLGUARD_TEST_DATABASE_URL"] = database_url
    done = subprocess.run(["bash", "-c", DRIVER], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240, check=False)
    found = dict(line.split("=", 1) for line in done.stdout.splitlines()
                 if line.split("=", 1)[0] in ("URL", "PID", "DIR"))
    return done, found


def _alive(pid: int) -> bool:
    """True while the process runs (a zombie no parent reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_a_cluster_with_debians_default_authentication_falls_back_to_a_private_one() -> None:
    with DebianDefaultCluster() as debian:
        configured = f"postgresql://postgres@127.0.0.1:{debian.port}/test"
        with pytest.raises(psycopg.OperationalError, match="password"):  # what stopped .ci/run
            psycopg.connect(configured, connect_timeout=10).close()

        done, found = _pick(configured)

        assert done.returncode == 0, done.stdout + done.stderr
        assert "starting a private cluster instead" in done.stdout
        url = found["URL"]
        assert url.startswith("postgresql://postgres@127.0.0.1:") and url.endswith("/test")
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert port not in (5432, debian.port)
        assert "test:7" in done.stdout.splitlines()  # it worked: a table in database test
        pid, data = int(found["PID"]), Path(found["DIR"])
        assert not _alive(pid), "the private cluster outlived the script"
        assert not data.exists()
        assert "stopping the private PostgreSQL cluster" in done.stdout
        assert debian.running()  # the configured server is left as it was


def test_a_reachable_database_is_used_as_it_is() -> None:
    with PgServer() as reachable:
        configured = f"postgresql://postgres@127.0.0.1:{reachable.port}/test"

        done, found = _pick(configured)

        assert done.returncode == 0, done.stdout + done.stderr
        assert found == {"URL": configured, "PID": "", "DIR": ""}  # no private cluster
        assert "created database test" in done.stdout
        assert "test:7" in done.stdout.splitlines()
        assert reachable.running()
