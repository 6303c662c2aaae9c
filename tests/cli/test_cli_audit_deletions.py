"""Every deletion from the demo's log is found: `toolguard audit verify` names the row.

The demo's stores seal the rows they write (``toolguard.store.autoseal``), at the
latest when they close, so the whole log is sealed when the demo ends. Then one
row deleted anywhere, the first, one in the middle or the last, by someone who
switched the append-only trigger off and back on, fails verify with the row's id.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from toolguard.cli import app

WHERE = ("first", "middle", "last")


def verify(*args: str) -> Any:
    return CliRunner().invoke(app, ["audit", "verify", *args])


def pick(ids: list[int], where: str) -> int:
    return {"first": ids[0], "middle": ids[len(ids) // 2], "last": ids[-1]}[where]


def assert_named(result: Any, row_id: int) -> None:
    assert result.exit_code == 1, result.output
    assert re.search(rf"row #{row_id} (of|deleted)\b.*deleted", result.stdout) or \
        f"row #{row_id} deleted" in result.stdout, result.stdout


@pytest.fixture
def demo_copy(demo_home: dict, tmp_path: Path) -> str:
    source = sqlite3.connect(demo_home["home"] / "store.db")
    target = sqlite3.connect(tmp_path / "copy.db")
    source.backup(target)
    source.close()
    target.close()
    return str(tmp_path / "copy.db")


def test_the_demo_log_is_sealed_end_to_end(demo_home: dict) -> None:
    result = verify("--url", demo_home["url"], "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] and report["unsealed"] == 0 and report["rows"] > 40
    assert report["sealed_rows"] == report["rows"]


@pytest.mark.parametrize("where", WHERE)
def test_one_row_deleted_from_the_sqlite_demo_log_is_named(demo_copy: str, where: str) -> None:
    conn = sqlite3.connect(demo_copy)
    ids = [row_id for (row_id,) in conn.execute("SELECT id FROM toolguard_audit ORDER BY id")]
    victim = pick(ids, where)
    (trigger,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = "
                              "'toolguard_audit_no_delete'").fetchone()
    conn.execute("DROP TRIGGER toolguard_audit_no_delete")
    conn.execute("DELETE FROM toolguard_audit WHERE id = ?", (victim,))
    conn.execute(trigger)
    conn.commit()
    conn.close()
    result = verify("--url", f"sqlite:///{demo_copy}")
    assert_named(result, victim)
    problems = json.loads(verify("--url", f"sqlite:///{demo_copy}", "--json").stdout)["problems"]
    assert [(p["kind"], p["row_id"]) for p in problems] == [("row_deleted", victim)]


def test_an_unsealed_row_deleted_on_sqlite_is_named(tmp_path: Path) -> None:
    """Rows the sealer has not reached yet: SQLite's ids have no gaps, so a hole is a deletion
    (first, middle or last of them)."""
    from toolguard.store import AuditEntry, open_store

    path = tmp_path / "store.db"
    for where in WHERE:
        path.unlink(missing_ok=True)
        store = open_store(f"sqlite:///{path}", install=True, autoseal=None)
        for i in range(5):
            store.audit(AuditEntry(decision="rejected", reason="not_authorized", tool="t",
                                   agent=f"a{i}"))
        store.seal_audit()
        for i in range(5):
            store.audit(AuditEntry(decision="rejected", reason="not_authorized", tool="t",
                                   agent=f"b{i}"))
        store.close()
        victim = pick(list(range(6, 11)), where)
        conn = sqlite3.connect(path)
        (trigger,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = "
                                  "'toolguard_audit_no_delete'").fetchone()
        conn.execute("DROP TRIGGER toolguard_audit_no_delete")
        conn.execute("DELETE FROM toolguard_audit WHERE id = ?", (victim,))
        conn.execute(trigger)
        conn.commit()
        conn.close()
        result = verify("--url", f"sqlite:///{path}")
        assert_named(result, victim)
        assert "before a seal covered it" in result.stdout


@pytest.fixture(scope="module")
def pg_demo(postgres_url: str, redis_url: str) -> Iterator[list[str]]:
    """``toolguard demo`` on PostgreSQL (and Redis), its log in a schema of its own."""
    import os
    import uuid

    import psycopg
    from store.envs import demo_crm_schema, drop_schema

    schema = f"tg_deletions_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    names = ("TOOLGUARD_DATABASE_URL", "TOOLGUARD_REDIS_URL", "TOOLGUARD_LOCK_URL",
             "TOOLGUARD_HOME")
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    os.environ["TOOLGUARD_DATABASE_URL"] = f"{postgres_url}?options=-csearch_path%3D{schema}"
    os.environ["TOOLGUARD_REDIS_URL"] = redis_url
    with demo_crm_schema(postgres_url):
        try:
            result = CliRunner().invoke(app, ["demo", "--json"])
            assert result.exit_code == 0, result.output
        finally:
            for name in names:
                os.environ.pop(name, None)
            os.environ.update(saved)
        try:
            yield ["--url", postgres_url, "--schema", schema]
        finally:
            drop_schema(postgres_url, schema)


def test_one_row_deleted_from_the_postgresql_demo_log_is_named(pg_demo: list[str]) -> None:
    import psycopg

    url, schema = pg_demo[1], pg_demo[3]
    report = json.loads(verify(*pg_demo, "--json").stdout)
    assert report["ok"] and report["unsealed"] == 0 and report["rows"] > 40
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"SET search_path TO {schema}")
        ids = [row_id for (row_id,) in conn.execute("SELECT id FROM toolguard_audit ORDER BY id")]
    for where in WHERE:
        victim = pick(ids, where)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"SET search_path TO {schema}")
            with conn.transaction():
                conn.execute("ALTER TABLE toolguard_audit DISABLE TRIGGER USER")
                conn.execute("CREATE TEMP TABLE kept AS SELECT * FROM toolguard_audit "
                             "WHERE id = %s", (victim,))
                conn.execute("DELETE FROM toolguard_audit WHERE id = %s", (victim,))
                conn.execute("ALTER TABLE toolguard_audit ENABLE TRIGGER USER")
            result = verify(*pg_demo)
            assert_named(result, victim)
            with conn.transaction():  # put it back, as it was, for the next case
                conn.execute("ALTER TABLE toolguard_audit DISABLE TRIGGER USER")
                conn.execute("INSERT INTO toolguard_audit SELECT * FROM kept")
                conn.execute("ALTER TABLE toolguard_audit ENABLE TRIGGER USER")
                conn.execute("DROP TABLE kept")
        assert verify(*pg_demo).exit_code == 0, where
