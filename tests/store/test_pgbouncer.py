"""The PostgreSQL store through a real PgBouncer in transaction mode.

In transaction mode each transaction may run on another server connection, so
anything kept on a session between transactions (a prepared statement, a
``SET``) is gone or elsewhere the next time. A guarded call's statements (the
store's own and the tool's, run many times so psycopg would prepare them) must
all work there, on the sync and the asyncio store. PgBouncer runs with two
server connections for a client pool of six, so transactions move between them.

psycopg prepares a statement a connection ran five times; behind this PgBouncer
that fails (``prepared statement "_pg3_0" already exists``) as soon as the next
transaction lands on another server connection, so the store is opened with
``prepare_threshold=None`` (the store's own statements are never prepared).

The store is in its own database, in its default ``search_path`` (``schema=``
sets a session's ``search_path``; under PgBouncer give it to the role or the
database instead, see docs/deployment.md).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from servers import ON_CI, free_port

from toolguard.adapters import guarded
from toolguard.call.context import current
from toolguard.guard import ToolGuard
from toolguard.locks import connect, connect_async
from toolguard.policies import Policy
from toolguard.store import open_async_store, open_store

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
CALLS = 40
POLICY = Policy.from_dict({"version": 1, "tools": {"add_score": {
    "locks": ["lead:{lead_id}"], "agents": ["scorer"]}}})
UPDATE = "UPDATE lead SET score = score + %s WHERE id = %s RETURNING score"


@pytest.fixture
def bouncer(postgres_url: str, unique: str) -> Iterator[str]:
    """A database of the test's own behind a PgBouncer (transaction mode); its URL."""
    if not os.path.exists(PGBOUNCER):
        if ON_CI:
            pytest.fail("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
        pytest.skip("pgbouncer is not installed")
    database = f"pgb_{unique}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    info = psycopg.conninfo.conninfo_to_dict(postgres_url)
    host, pg_port, user = info.get("host", "127.0.0.1"), info.get("port", 5432), info.get("user", "postgres")
    direct = f"postgresql://{user}@{host}:{pg_port}/{database}"
    with psycopg.connect(direct, autocommit=True) as conn:
        conn.execute("CREATE TABLE lead (id text PRIMARY KEY, score bigint NOT NULL)")
        conn.execute("INSERT INTO lead VALUES ('a', 0), ('b', 0)")
    with open_store(direct, install=True):  # installed directly, as an operator would
        pass
    # pgbouncer drops root for the postgres user, who cannot enter pytest's (0700) tmp_path
    home = Path(tempfile.mkdtemp(prefix="toolguard-pgbouncer-"))
    home.chmod(0o755)
    (home / "users.txt").write_text(f'"{user}" ""\n')
    port = free_port()
    ini = home / "pgbouncer.ini"
    ini.write_text(f"""[databases]
{database} = host={host} port={pg_port} dbname={database}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {home}/users.txt
pool_mode = transaction
default_pool_size = 2
max_client_conn = 100
ignore_startup_parameters = extra_float_digits,application_name
logfile = {home}/pgbouncer.log
""")
    as_user = ["-u", "postgres"] if os.geteuid() == 0 else []
    if as_user:
        subprocess.run(["chown", "-R", "postgres", str(home)], check=True)
    process = subprocess.Popen([PGBOUNCER, *as_user, str(ini)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    url = f"postgresql://{user}@127.0.0.1:{port}/{database}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with psycopg.connect(url, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                break
            except psycopg.OperationalError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log = (home / "pgbouncer.log")
                    pytest.fail(f"pgbouncer did not start: "
                                f"{log.read_text()[-2000:] if log.exists() else ''}")
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(10)
        shutil.rmtree(home, ignore_errors=True)
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(database)))


def scores(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        return dict(conn.execute("SELECT id, score FROM lead ORDER BY id").fetchall())


def test_guarded_calls_through_pgbouncer_transaction_mode(bouncer: str, tmp_path: Path) -> None:
    store = open_store(bouncer, min_size=6, max_size=6, prepare_threshold=None)
    locks = connect(f"sqlite:///{tmp_path}/locks.db")
    guard = ToolGuard(POLICY, locks=locks, store=store)

    @guarded(guard, agent="scorer")
    def add_score(lead_id: str, delta: int) -> int:
        (score,) = current().tx.execute(UPDATE, (delta, lead_id)).fetchone()
        return int(score)

    try:
        decisions = [add_score.run({"lead_id": "ab"[n % 2], "delta": 1}, call_id=f"s{n}",
                                   thread_id="t") for n in range(CALLS)]
        assert [(d.reason, d.message) for d in decisions if not d.ok] == []
        replay = add_score.run({"lead_id": "a", "delta": 1}, call_id="s0", thread_id="t")
        assert replay.kind == "replayed", replay
        rows = store.query_audit(limit=None)
        assert len(rows) == CALLS + 1
        assert store.verify_audit().ok
    finally:
        locks.close()
        store.close()
    assert scores(bouncer) == {"a": CALLS // 2, "b": CALLS // 2}


def test_asyncio_guarded_calls_through_pgbouncer_transaction_mode(bouncer: str,
                                                                  tmp_path: Path) -> None:
    async def main() -> list[Any]:
        store = open_async_store(bouncer, min_size=6, max_size=6, prepare_threshold=None)
        locks = connect_async(f"sqlite:///{tmp_path}/alocks.db")
        guard = ToolGuard(POLICY, async_locks=locks, async_store=store)

        @guarded(guard, agent="scorer")
        async def add_score(lead_id: str, delta: int) -> int:
            row = await (await current().atx.execute(UPDATE, (delta, lead_id))).fetchone()
            return int(row[0])

        try:
            return list(await asyncio.gather(*(
                add_score.arun({"lead_id": "ab"[n % 2], "delta": 1}, call_id=f"a{n}",
                               thread_id="t") for n in range(CALLS))))
        finally:
            await locks.aclose()
            await store.close()

    decisions = asyncio.run(main())
    assert [d.reason for d in decisions if not d.ok] == []
    assert scores(bouncer) == {"a": CALLS // 2, "b": CALLS // 2}


def test_a_prepare_threshold_that_is_not_a_count_is_a_configuration_error() -> None:
    from toolguard.errors import ConfigurationError

    for wrong in (-1, 1.5, True, "5"):
        with pytest.raises(ConfigurationError, match="prepare_threshold"):
            open_store("postgresql://postgres@127.0.0.1:1/none", prepare_threshold=wrong)
