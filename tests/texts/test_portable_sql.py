"""A tool's SQL written once runs on both stores (issue 23, point 7).

``tx.execute`` takes psycopg's ``%s`` on SQLite and PostgreSQL alike, and
refuses on both what one of them would refuse or misread: a lone ``%`` (a
``LIKE 'Ada%'`` that SQLite ran and PostgreSQL refused) and a placeholder
inside a quoted string (psycopg fills ``'%s'`` with a parameter). The same
tool bodies, sync and asyncio, on the embedded store and on PostgreSQL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from toolguard import ToolGuard, current, guarded
from toolguard.errors import ConfigurationError
from toolguard.locks import connect, connect_async
from toolguard.policies import Policy
from toolguard.store import open_async_store, open_store
from toolguard.store.placeholders import check_placeholders

POLICY = Policy.from_dict({"version": 1, "tools": {
    "rename": {"locks": ["customer:{customer_id}"], "agents": ["crm"]},
    "tag": {"locks": ["customer:{customer_id}"], "agents": ["crm"]},
    "bad_like": {"locks": ["customer:{customer_id}"], "agents": ["crm"]},
    "bad_literal": {"locks": ["customer:{customer_id}"], "agents": ["crm"]},
}})

#: The setup both stores run as written (no parameters: the driver sees it unchanged).
SETUP = ("CREATE TABLE IF NOT EXISTS customers (id TEXT PRIMARY KEY, name TEXT NOT NULL, "
         "tags TEXT NOT NULL DEFAULT '')",
         "INSERT INTO customers (id, name) VALUES ('c-1', 'Ada Lovelace') "
         "ON CONFLICT (id) DO NOTHING")


@pytest.fixture(params=["sqlite", "postgresql"])
def guard(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> Iterator[ToolGuard]:
    if request.param == "sqlite":
        url, options = f"sqlite:///{tmp_path / 'store.db'}", {}
    else:
        url, options = request.getfixturevalue("postgres_url"), {"schema": f"tg_texts_{unique}"}
    store = open_store(url, install=True, **options)
    lock_url = f"sqlite:///{tmp_path / 'locks.db'}"
    built = ToolGuard(POLICY, locks=connect(lock_url), store=store,
                      async_locks=connect_async(lock_url),
                      async_store=open_async_store(url, **options))
    for _ in range(2):  # twice: the setup is idempotent on both
        with store.connection() as conn:
            for statement in SETUP:
                conn.execute(statement)
            if store.dialect == "sqlite":
                conn.commit()
    try:
        yield built
    finally:
        store.close()
        if request.param == "postgresql":
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    sql.Identifier(options["schema"])))


def tools(guard: ToolGuard) -> dict[str, Any]:
    @guarded(guard, agent="crm")
    def rename(customer_id: str, name: str) -> dict[str, Any]:
        tx = current().tx
        (old,) = tx.execute("SELECT name FROM customers WHERE id = %s", (customer_id,)).fetchone()
        tx.execute("UPDATE customers SET name = %(name)s WHERE id = %(id)s",
                   {"name": name, "id": customer_id}, expect_rows=1)
        (like,) = tx.execute("SELECT count(*) FROM customers WHERE name LIKE 'Ada%%' "
                             "AND id = %s", (customer_id,)).fetchone()
        (text,) = tx.execute("SELECT 'it''s 100%% ' || %s", (name,)).fetchone()
        return {"old": old, "ada": int(like), "text": text}

    @guarded(guard, agent="crm")
    def tag(customer_id: str, tag: str) -> str:
        tx = current().tx
        tx.execute("INSERT INTO customers (id, name, tags) VALUES (%s, %s, %s) "
                   "ON CONFLICT (id) DO UPDATE SET tags = excluded.tags",
                   (customer_id, "new", tag))
        (tags,) = tx.execute("SELECT tags FROM customers WHERE id = %s", (customer_id,)).fetchone()
        return str(tags)

    @guarded(guard, agent="crm")
    def bad_like(customer_id: str) -> int:
        return int(current().tx.execute("SELECT count(*) FROM customers WHERE name LIKE 'Ada%' "
                                        "AND id = %s", (customer_id,)).fetchone()[0])

    @guarded(guard, agent="crm")
    def bad_literal(customer_id: str) -> Any:
        return current().tx.execute("SELECT 'id %s', %s", (customer_id, 1)).fetchone()

    return {"rename": rename, "tag": tag, "bad_like": bad_like, "bad_literal": bad_literal}


def test_the_same_tool_sql_runs_on_both_stores(guard: ToolGuard) -> None:
    run = tools(guard)
    assert run["rename"](customer_id="c-1", name="Ada King") == {
        "old": "Ada Lovelace", "ada": 1, "text": "it's 100% Ada King"}
    assert run["tag"](customer_id="c-1", tag="vip") == "vip"
    assert run["tag"](customer_id="c-2", tag="lead") == "lead"


def test_the_same_async_tool_sql_runs_on_both_stores(guard: ToolGuard) -> None:
    @guarded(guard, agent="crm", name="rename")
    async def rename(customer_id: str, name: str) -> str:
        tx = current().atx
        await tx.execute("UPDATE customers SET name = %s WHERE id = %s", (name, customer_id),
                         expect_rows=1)
        cursor = await tx.execute("SELECT name FROM customers WHERE name LIKE 'Ada%%' "
                                  "AND id = %(id)s", {"id": customer_id})
        (found,) = await cursor.fetchone()
        return str(found)

    assert asyncio.run(rename(customer_id="c-1", name="Ada B.")) == "Ada B."


@pytest.mark.parametrize(("tool", "why"), [("bad_like", "a lone %"),
                                           ("bad_literal", "inside a quoted string")])
def test_sql_one_store_would_refuse_is_refused_on_both(guard: ToolGuard, tool: str,
                                                       why: str) -> None:
    """SQLite ran ``LIKE 'Ada%'`` and PostgreSQL refused it; ``'id %s'`` took a parameter."""
    with pytest.raises(ConfigurationError, match=why):
        tools(guard)[tool](customer_id="c-1")


@pytest.mark.parametrize("statement", [
    "SELECT %s", "SELECT %(a)s, %b, %t", "SELECT 'Ada%%' LIKE %s",
    "SELECT 'it''s %%', \"odd%%name\" FROM t -- 100%%", "SELECT $$ 5 %% 3 $$, %s",
    "SELECT E'it\\'s %%', %s", "SELECT json_extract(a, '$.x') - 1 / 2, %s"])
def test_portable_statements(statement: str) -> None:
    check_placeholders(statement)


@pytest.mark.parametrize("statement", [
    "SELECT 'Ada%' LIKE %s", "SELECT 5 % 3, %s", "SELECT 'a%s', %s", "SELECT 1 -- %s",
    "/* %(x)s */ SELECT %s", "SELECT strftime('%Y', 'now'), %s", "SELECT \"col%s\", %s"])
def test_statements_one_store_would_refuse_or_misread(statement: str) -> None:
    with pytest.raises(ConfigurationError, match="at character"):
        check_placeholders(statement)
