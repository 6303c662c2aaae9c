"""Exactly-once effects inside DBOS: a step killed after its guarded call committed.

A workflow's step makes a guarded call (a payment row, written through the
fenced transaction); the process dies right after the call returned, before
DBOS recorded the step. DBOS recovers the workflow in a new process and runs
the step again; the guarded call takes the step's durable identity (workflow
id + step id) as its idempotency key, so the second run gets the recorded
result: one payment, and the audit log shows the call applied, then replayed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from toolguard import open_store

APP = Path(__file__).with_name("dbos_app.py")
PAI_APP = Path(__file__).with_name("pai_dbos_app.py")
ROOT = Path(__file__).resolve().parents[2]
#: DBOS's system database, a database of its own on the test server.
DBOS_DATABASE = "toolguard_dbos_test"
#: The issue's bar: every one of these kill-and-recover rounds leaves one effect.
ROUNDS = int(os.environ.get("TG_DBOS_ROUNDS", "3"))


@pytest.fixture
def setup(postgres_url: str, redis_url: str, unique: str) -> Iterator[dict[str, str]]:
    server = psycopg.conninfo.conninfo_to_dict(postgres_url)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                              (DBOS_DATABASE,)).fetchone()
        if not exists:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DBOS_DATABASE)))
    schema = f"tg_dbos_{unique}"
    store = open_store(postgres_url, schema=schema)
    store.install()
    with store.connection() as conn:
        conn.execute("CREATE TABLE payment (order_id TEXT NOT NULL, amount INT NOT NULL)")
        conn.commit()
    store.close()
    user = server.get("user", "postgres")
    host, port = server.get("host", "127.0.0.1"), server.get("port", "5432")
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "TG_DBOS_DB": f"postgresql://{user}@{host}:{port}/{DBOS_DATABASE}",
           "TG_STORE_URL": postgres_url, "TG_STORE_SCHEMA": schema,
           "TG_LOCK_URL": redis_url, "TG_LOCK_PREFIX": f"tgdbos:{unique}"}
    try:
        yield env
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def app(env: dict[str, str], mode: str, workflow_id: str,
        script: Path = APP) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(script), mode, workflow_id], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_a_step_killed_after_its_commit_is_replayed_on_recovery(setup: dict[str, str],
                                                                 unique: str) -> None:
    store = open_store(setup["TG_STORE_URL"], schema=setup["TG_STORE_SCHEMA"])
    try:
        for round_ in range(ROUNDS):
            workflow_id = f"order-{unique}-{round_}"
            crashed = app(setup, "crash", workflow_id)
            assert crashed.returncode == 17, crashed.stderr[-2000:]
            with store.connection() as conn:  # the effect committed before the process died
                assert conn.execute("SELECT count(*) FROM payment WHERE order_id = %s",
                                    (workflow_id,)).fetchone()[0] == 1

            recovered = app(setup, "recover", workflow_id)

            assert recovered.returncode == 0, recovered.stderr[-2000:]
            assert recovered.stdout.strip().splitlines()[-1] == f"charged 42 for {workflow_id}"
            with store.connection() as conn:
                assert conn.execute("SELECT count(*) FROM payment WHERE order_id = %s",
                                    (workflow_id,)).fetchone()[0] == 1
            rows = [row for row in store.query_audit(limit=None, newest_first=False, tool="charge")
                    if row.idempotency_key and workflow_id in row.idempotency_key]
            assert [(row.decision, row.reason) for row in rows] == [("accepted", "applied"),
                                                                   ("replayed", "duplicate")]
            assert rows[0].idempotency_key == rows[1].idempotency_key
            assert rows[0].idempotency_key == f"run:dbos%3A{workflow_id}//step-1"
    finally:
        store.close()


def test_a_pydantic_ai_run_under_dbos_replays_its_guarded_tool(setup: dict[str, str],
                                                               unique: str) -> None:
    """PydanticAI's DBOS durability: the run's ids come from the workflow, the model's answers
    from recorded steps, so the re-executed tool call has the same key and replays."""
    store = open_store(setup["TG_STORE_URL"], schema=setup["TG_STORE_SCHEMA"])
    try:
        for round_ in range(ROUNDS):
            workflow_id = f"pai-{unique}-{round_}"
            crashed = app(setup, "crash", workflow_id, PAI_APP)
            assert crashed.returncode == 17, crashed.stderr[-2000:]

            recovered = app(setup, "recover", workflow_id, PAI_APP)

            assert recovered.returncode == 0, recovered.stderr[-2000:]
            assert recovered.stdout.strip().splitlines()[-1] == "paid"
            with store.connection() as conn:
                assert conn.execute("SELECT count(*) FROM payment WHERE order_id = %s",
                                    (workflow_id,)).fetchone()[0] == 1
            rows = [row for row in store.query_audit(limit=None, newest_first=False, tool="charge")
                    if row.args and row.args.get("order_id") == workflow_id]
            assert [(row.decision, row.reason) for row in rows] == [("accepted", "applied"),
                                                                   ("replayed", "duplicate")]
            assert rows[0].idempotency_key == rows[1].idempotency_key
    finally:
        store.close()
