"""The controls' migrations (PostgreSQL 004, SQLite 002) stand on 001 alone and install twice."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from toolguard.store import migrations, open_store

SQL = resources.files("toolguard").joinpath("sql")


@pytest.fixture
def pg(postgres_url: str) -> Iterator[psycopg.Connection[Any]]:
    schema = f"tg_mig_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        try:
            yield conn
        finally:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def test_pg_004_installs_twice_on_001_alone(pg: psycopg.Connection[Any]) -> None:
    for name in ("001_initial.sql", "004_controls.sql", "004_controls.sql"):
        with pg.transaction():  # psql --single-transaction
            pg.execute(SQL.joinpath(name).read_text(encoding="utf-8"))
    assert pg.execute("SELECT version FROM toolguard_schema_version ORDER BY version").fetchall() == [
        (1,), (4,)]
    admit = ("SELECT refused, retry_ms, fresh FROM toolguard_quota_admit(%s::text[], %s::numeric[], "
             "%s::numeric[], %s::bigint[], %s::text[])")
    assert pg.execute(admit, (["s"], [1], [1], [60000], ["e1"])).fetchone() == (0, 0, [True])
    assert pg.execute(admit, (["s"], [1], [1], [60000], ["e1"])).fetchone() == (0, 0, [False])
    refused, retry_ms, _ = pg.execute(admit, (["s"], [1], [1], [60000], ["e2"])).fetchone()
    assert refused == 1 and 0 < retry_ms <= 60000
    assert pg.execute(admit, (["t"], [1], [2], [60000], ["e3"])).fetchone() == (1, -1, None)
    for bad in ((["s", "s"], [1, 1], [1, 1], [1, 1], ["a", "b"]), ([""], [1], [1], [1], ["a"]),
                (["s"], [0], [1], [1], ["a"]), (["s"], [1], [-1], [1], ["a"]),
                (["s"], [1], [1], [0], ["a"]), (["s"], [1], [1], [1], [None]), ([], [], [], [], [])):
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            pg.execute(admit, bad)
    assert pg.execute("SELECT toolguard_quota_release(%s::text[], %s::text[])",
                      (["s", "s"], ["e1", "nope"])).fetchone() == (1,)
    assert pg.execute("SELECT used FROM toolguard_quota WHERE scope = 's'").fetchone() == (0,)
    columns = {row[0] for row in pg.execute("SELECT column_name FROM information_schema.columns "
                                            "WHERE table_name = 'toolguard_audit'")}
    assert "policy_version" in columns


def test_sqlite_002_installs_on_001_alone(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/store.db")
    try:
        shipped = {m.version: m for m in migrations("sqlite")}
        assert store.install([shipped[1], shipped[2]]) == 2
        assert store.install([shipped[1], shipped[2]]) == 2  # applied once
    finally:
        store.close()
    with sqlite3.connect(tmp_path / "store.db") as conn:
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        columns = {row[1] for row in conn.execute("PRAGMA table_info(toolguard_audit)")}
    assert {"toolguard_quota", "toolguard_quota_entry", "toolguard_pause",
            "toolguard_approval"} <= tables
    assert "policy_version" in columns
