"""The schema files themselves: install/upgrade, the SQL functions, the append-only audit log."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from importlib import resources
from typing import Any

import psycopg
import pytest
from psycopg import sql

from store.envs import StoreEnv, drop_schema, rows
from toolguard.errors import AuditAppendOnly, RecordNotFound, StaleFencingToken
from toolguard.store import AuditEntry, GuardedStore, Migration, latest_version, migrations, open_store
from toolguard.store.postgres_sql import APPLY, AUDIT_INSERT, FINISH, HAS_APPLIED
from toolguard.store.records import AUDIT_COLUMNS

SQL_DIR = resources.files("toolguard").joinpath("sql")


# --- install and upgrade (both stores) --------------------------------------------------------------


EXPECTED_MIGRATIONS = {"postgresql": [(1, "001_initial"), (2, "002_fast_path"),
                                      (3, "003_stale_blockers_exact_results"), (4, "004_controls"),
                                      (5, "005_tamper_evident_audit"), (6, "006_replay_keeps_intent"),
                                      (7, "007_policy_versions"), (8, "008_hot_path"),
                                      (9, "009_one_finish"), (10, "010_reads"),
                                      (11, "011_holds")],
                       "sqlite": [(1, "001_initial"), (2, "002_controls"), (3, "003_tamper_evident_audit"),
                                  (4, "004_policy_versions"), (5, "005_reads"),
                                  (6, "006_holds")]}


def test_install_is_idempotent_and_versioned(env: StoreEnv) -> None:
    store = env.open()
    expected = EXPECTED_MIGRATIONS[env.kind]
    latest = expected[-1][0]
    try:
        assert store.schema_version() == 0
        assert store.install() == latest_version(env.kind) == latest
        assert store.install() == latest
        assert store.schema_version() == latest
        assert rows(store, "SELECT version, name FROM toolguard_schema_version "
                           "ORDER BY version") == expected
    finally:
        store.close()


def test_upgrade_from_the_first_version(env: StoreEnv) -> None:
    """A store installed at version 1 (with data) upgrades in place to the latest."""
    store = env.open()
    try:
        shipped = migrations(env.kind)
        assert store.install(shipped[:1]) == 1
        # written as the toolguard of that version did (this one needs the latest schema)
        rows(store, "INSERT INTO toolguard_audit (decision, reason, tool) "
                    "VALUES ('accepted', 'applied', 'before-upgrade')")
        assert store.install() == latest_version(env.kind)
        assert store.query_audit()[0].tool == "before-upgrade"
    finally:
        store.close()


def test_upgrade_applies_only_newer_files(env: StoreEnv) -> None:
    store = env.open()
    try:
        shipped = migrations(env.kind)
        latest = shipped[-1].version
        assert store.install(shipped) == latest
        store.audit(AuditEntry(decision="accepted", reason="applied", tool="before-upgrade"))
        extra = Migration(latest + 1, f"{latest + 1:03d}_test_extra",
                          "CREATE TABLE toolguard_test_extra (x INTEGER);\n"
                          "INSERT INTO toolguard_test_extra (x) VALUES (42);\n")
        assert store.install([*shipped, extra]) == latest + 1
        # not applied twice (would duplicate the row)
        assert store.install([*shipped, extra]) == latest + 1
        assert store.install(shipped) == latest + 1  # never downgrades
        assert rows(store, "SELECT x FROM toolguard_test_extra") == [(42,)]
        assert [r[0] for r in rows(store, "SELECT version FROM toolguard_schema_version "
                                          "ORDER BY version")] == [
            *(m.version for m in shipped), latest + 1]
        assert store.query_audit()[0].tool == "before-upgrade"  # data kept
    finally:
        store.close()


def test_a_file_numbered_below_an_installed_one_is_still_applied(env: StoreEnv) -> None:
    """Numbers are taken by whoever adds a file: a store can get version N+2 before N+1 exists.

    N+1 must be applied when it arrives (not skipped because N+2 is "higher"), and until
    then the store counts as at version N (behind), so ``db status`` says to run init.
    """
    store = env.open()
    try:
        shipped = list(migrations(env.kind))
        latest = shipped[-1].version
        later = Migration(latest + 2, f"{latest + 2:03d}_test_later",
                          "CREATE TABLE toolguard_test_later (x INTEGER);\n")
        earlier = Migration(latest + 1, f"{latest + 1:03d}_test_earlier",
                            "CREATE TABLE toolguard_test_earlier (x INTEGER);\n"
                            "INSERT INTO toolguard_test_earlier (x) VALUES (7);\n")
        assert store.install([*shipped, later]) == latest + 2
        assert store.install([*shipped, earlier, later]) == latest + 2
        assert rows(store, "SELECT x FROM toolguard_test_earlier") == [(7,)]
        assert store.install([*shipped, earlier, later]) == latest + 2  # not applied twice
        assert rows(store, "SELECT x FROM toolguard_test_earlier") == [(7,)]
        assert [r[0] for r in rows(store, "SELECT version FROM toolguard_schema_version "
                                          "ORDER BY version")] == [
            *(m.version for m in shipped), latest + 1, latest + 2]
    finally:
        store.close()


def test_a_store_missing_a_shipped_file_counts_as_behind() -> None:
    from toolguard.store.base import effective_version, pending_migrations

    shipped = [Migration(v, f"{v:03d}_m", "") for v in (1, 2, 3, 5)]
    assert effective_version(set(), shipped) == 0
    assert effective_version({1, 2, 3}, shipped) == 3
    assert effective_version({1, 2, 3, 5}, shipped) == 5
    assert effective_version({1, 3, 5}, shipped) == 1  # 2 missing: behind, `db init` applies it
    assert effective_version({1, 2, 3, 5, 6}, shipped) == 6  # a newer toolguard's files
    assert effective_version({2, 3}, shipped) == 0
    assert [m.version for m in pending_migrations(shipped, {1, 3})] == [2, 5]
    assert [m.version for m in pending_migrations(reversed(shipped), set())] == [1, 2, 3, 5]


def test_failed_upgrade_changes_nothing(env: StoreEnv) -> None:
    store = env.open()
    try:
        shipped = migrations(env.kind)
        latest = shipped[-1].version
        store.install(shipped)
        broken = Migration(latest + 1, f"{latest + 1:03d}_broken",
                           "CREATE TABLE toolguard_half (x INTEGER);\n"
                           "THIS IS NOT SQL;\n")
        with pytest.raises(Exception, match=r"(?i)syntax"):
            store.install([*shipped, broken])
        assert store.schema_version() == latest
        with pytest.raises(Exception, match="toolguard_half"):
            rows(store, "SELECT * FROM toolguard_half")
    finally:
        store.close()


def test_concurrent_installers_do_not_race(env: StoreEnv) -> None:
    stores = [env.open() for _ in range(4)]
    barrier = threading.Barrier(len(stores))
    results: list[object] = []

    def install(store: GuardedStore) -> None:
        barrier.wait()
        try:
            results.append(store.install())
        except Exception as error:  # collected, asserted below
            results.append(error)

    threads = [threading.Thread(target=install, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    try:
        latest = latest_version(env.kind)
        assert results == [latest] * 4
        assert rows(stores[0], "SELECT count(*) FROM toolguard_schema_version") == [
            (len(migrations(env.kind)),)]
    finally:
        for store in stores:
            store.close()


# --- the raw SQL files, as another language would use them -------------------------------------------


@pytest.fixture
def pg(postgres_url: str, unique: str) -> Iterator[psycopg.Connection[Any]]:
    """A raw autocommit connection whose search_path is a fresh schema."""
    schema = f"tg_raw_{unique}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        try:
            yield conn
        finally:
            drop_schema(postgres_url, schema)


def _sql_file(*parts: str) -> str:
    return SQL_DIR.joinpath(*parts).read_text(encoding="utf-8")


def _raises(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...] = ()) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(query, params)
    return caught.value


def test_pg_file_installs_twice_with_psql_semantics(pg: psycopg.Connection[Any]) -> None:
    for _ in range(2):
        with pg.transaction():  # psql --single-transaction
            pg.execute(_sql_file("001_initial.sql"))
    assert pg.execute("SELECT version, name FROM toolguard_schema_version").fetchall() == [
        (1, "001_initial")]
    triggers = pg.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid = "
                          "'toolguard_audit'::regclass AND NOT tgisinternal").fetchone()
    assert triggers == (1,)


def _apply_twice(pg: psycopg.Connection[Any], name: str, version: int) -> None:
    """Apply one shipped file twice, each time as psql --single-transaction; it is then the
    highest version recorded."""
    for _ in range(2):
        with pg.transaction():
            pg.execute(_sql_file(name))
    assert pg.execute("SELECT max(version) FROM toolguard_schema_version").fetchone() == (version,)


def _install_files(pg: psycopg.Connection[Any], upto: int) -> None:
    """The shipped PostgreSQL files up to version ``upto``, each as psql --single-transaction."""
    for step in migrations("postgresql"):
        if step.version <= upto:
            with pg.transaction():
                pg.execute(step.sql)


@pytest.mark.parametrize("version", [1, 3])
def test_pg_fence_function(pg: psycopg.Connection[Any], version: int) -> None:
    _install_files(pg, version)
    assert pg.execute("SELECT toolguard_fence('k', 10)").fetchone() == (10,)
    assert pg.execute("SELECT toolguard_fence('k', 10)").fetchone() == (10,)  # equal: same lease
    assert pg.execute("SELECT toolguard_fence('k', 12)").fetchone() == (12,)
    stale = _raises(pg, "SELECT toolguard_fence('k', 11)")
    assert stale.sqlstate == "TG001"
    assert json.loads(stale.diag.message_detail or "") == {"key": "k", "token": 11, "current": 12}
    for bad in ("SELECT toolguard_fence('k', NULL)", "SELECT toolguard_fence(NULL, 5)",
                "SELECT toolguard_fence('', 5)", "SELECT toolguard_fence('k', 0)",
                "SELECT toolguard_fence('k', -1)",
                "SELECT toolguard_fence_all(ARRAY['a', 'b'], ARRAY[1]::bigint[])",
                "SELECT toolguard_fence_all(NULL, NULL)"):
        assert _raises(pg, bad).sqlstate == "TG002", bad
    assert pg.execute("SELECT key, token FROM toolguard_high_water").fetchall() == [("k", 12)]
    # all keys or none: b is stale, so a does not advance either
    pg.execute("SELECT toolguard_fence_all(ARRAY['b', 'a'], ARRAY[5, 5]::bigint[])")
    error = _raises(pg, "SELECT toolguard_fence_all(ARRAY['a', 'b'], ARRAY[9, 4]::bigint[])")
    assert error.sqlstate == "TG001"
    assert dict(pg.execute("SELECT key, token FROM toolguard_high_water").fetchall()) == {
        "k": 12, "a": 5, "b": 5}


@pytest.mark.parametrize("version", [1, 3])
def test_pg_intent_functions(pg: psycopg.Connection[Any], version: int) -> None:
    """As a version-1 client calls them (untyped literals, toolguard_apply), on 001 and on 003."""
    _install_files(pg, version)
    begin = ("SELECT * FROM toolguard_begin_intent('i1', 'deposit', 'agent', NULL, "
             "ARRAY['acct:1'], 'h')")
    assert pg.execute(begin).fetchone() == ("begun", None, 1, None)
    assert pg.execute(begin).fetchone() == ("begun", "pending", 2, None)
    other = _raises(pg, "SELECT * FROM toolguard_begin_intent('i1', 'deposit', 'agent', NULL, "
                        "ARRAY['acct:1'], 'other')")
    assert other.sqlstate == "TG004"
    with pg.transaction():
        assert pg.execute("SELECT * FROM toolguard_enter(ARRAY['acct:1'], ARRAY[3]::bigint[], "
                          "'i1', 'deposit', 'agent', NULL, 'h')").fetchone() == (False, None)
        assert pg.execute("SELECT * FROM toolguard_enter(ARRAY['acct:1'], ARRAY[3]::bigint[], "
                          "'i2', 'note', NULL, NULL, 'h', ARRAY['ticket:1'])").fetchone() == (
            False, None)
        pg.execute("SELECT toolguard_apply('i1', '{\"ok\": true}', '{\"acct:1\": 3}')")
    assert pg.execute(begin).fetchone() == ("replay", "applied", 2, {"ok": True})
    assert pg.execute("SELECT * FROM toolguard_enter(ARRAY['acct:1'], ARRAY[3]::bigint[], "
                      "'i1', 'deposit', 'agent', NULL, 'h')").fetchone() == (True, {"ok": True})
    assert _raises(pg, "SELECT toolguard_apply('i1', 'null', '{}')").sqlstate == "TG003"
    assert pg.execute("SELECT keys FROM toolguard_intent ORDER BY idempotency_key").fetchall() == [
        (["acct:1"],), (["ticket:1"],)]


def test_pg_002_installs_twice_on_001(pg: psycopg.Connection[Any]) -> None:
    for name in ("001_initial.sql", "002_fast_path.sql", "002_fast_path.sql"):
        with pg.transaction():  # psql --single-transaction
            pg.execute(_sql_file(name))
    assert pg.execute("SELECT version, name FROM toolguard_schema_version ORDER BY version"
                      ).fetchall() == [(1, "001_initial"), (2, "002_fast_path")]


def test_pg_002_enter_fences_one_key_like_fence_all(pg: psycopg.Connection[Any]) -> None:
    """The single-key path of toolguard_enter: same checks, same errors as toolguard_fence_all."""
    pg.execute(_sql_file("001_initial.sql"))
    pg.execute(_sql_file("002_fast_path.sql"))
    enter = "SELECT * FROM toolguard_enter(%s::text[], %s::bigint[], NULL, NULL, NULL, NULL, NULL)"
    assert pg.execute(enter, (["k"], [10])).fetchone() == (False, None)
    assert pg.execute(enter, (["k"], [10])).fetchone() == (False, None)  # equal: same lease
    stale = _raises(pg, enter, (["k"], [9]))
    assert stale.sqlstate == "TG001"
    assert json.loads(stale.diag.message_detail or "") == {"key": "k", "token": 9, "current": 10}
    for keys, tokens in ((["k"], [None]), ([None], [11]), ([""], [11]), (["k"], [0]),
                         (["k"], [-1]), (["k"], [11, 12]), (["k", "j"], [11]), (None, None),
                         (["k"], None), ([], [])):
        error = _raises(pg, enter, (keys, tokens))
        assert error.sqlstate == "TG002", (keys, tokens)
    # an array not indexed from 1 has no element 1: rejected, never skipped
    odd = _raises(pg, "SELECT * FROM toolguard_enter('[0:0]={k}'::text[], ARRAY[11]::bigint[], "
                      "NULL, NULL, NULL, NULL, NULL)")
    assert odd.sqlstate == "TG002"
    assert pg.execute(enter, (["k", "j"], [11, 11])).fetchone() == (False, None)  # several keys
    assert dict(pg.execute("SELECT key, token FROM toolguard_high_water").fetchall()) == {
        "k": 11, "j": 11}


def test_pg_002_enter_counts_reconciling_attempts(pg: psycopg.Connection[Any]) -> None:
    pg.execute(_sql_file("001_initial.sql"))
    pg.execute(_sql_file("002_fast_path.sql"))
    enter = ("SELECT * FROM toolguard_enter(ARRAY['acct:1'], ARRAY[%s]::bigint[], 'i1', "
             "'deposit', 'agent', NULL, %s)")
    with pg.transaction():
        assert pg.execute(enter, (1, "h")).fetchone() == (False, None)
    assert pg.execute("SELECT status, attempts FROM toolguard_intent").fetchone() == ("pending", 1)
    with pg.transaction():  # a 'pending' row was counted when it was created
        pg.execute(enter, (2, "h"))
    assert pg.execute("SELECT attempts FROM toolguard_intent").fetchone() == (1,)
    pg.execute("UPDATE toolguard_intent SET status = 'unknown'")
    with pg.transaction():  # reconciling an unknown attempt: this one counts
        pg.execute(enter, (3, "h"))
        pg.execute("SELECT toolguard_apply('i1', '7', '{}')")
    assert pg.execute("SELECT status, attempts FROM toolguard_intent").fetchone() == ("applied", 2)
    assert pg.execute(enter, (4, "h")).fetchone() == (True, 7)
    assert _raises(pg, enter, (5, "other")).sqlstate == "TG004"
    assert pg.execute("SELECT attempts FROM toolguard_intent").fetchone() == (2,)


def test_pg_003_installs_twice_on_002_and_keeps_results(pg: psycopg.Connection[Any]) -> None:
    _install_files(pg, 2)
    with pg.transaction():
        pg.execute("SELECT * FROM toolguard_enter(ARRAY['k'], ARRAY[1]::bigint[], 'old', 't', "
                   "NULL, NULL, 'h')")
        pg.execute("SELECT toolguard_apply('old', '{\"b\": 1, \"a\": [2]}', '{}')")
    _apply_twice(pg, "003_stale_blockers_exact_results.sql", 3)
    assert pg.execute("SELECT result FROM toolguard_intent").fetchone() == ({"a": [2], "b": 1},)
    assert pg.execute("SELECT pg_typeof(result)::text FROM toolguard_intent").fetchone() == ("json",)


def test_pg_003_records_results_exactly(pg: psycopg.Connection[Any]) -> None:
    _install_files(pg, 3)
    text = '{"b":1e16,"a":"\\u0000","b2":-0.0}'
    with pg.transaction():
        pg.execute("SELECT * FROM toolguard_enter(ARRAY['k'], ARRAY[1]::bigint[], 'i', 't', "
                   "NULL, NULL, 'h')")
        pg.execute("SELECT toolguard_record('i', %s::json, '{\"k\": 1}')", (text,))
    assert pg.execute("SELECT result::text FROM toolguard_intent").fetchone() == (text,)
    row = pg.execute("SELECT * FROM toolguard_enter(ARRAY['k'], ARRAY[1]::bigint[], 'i', 't', "
                     "NULL, NULL, 'h')").fetchone()
    assert row is not None and json.dumps(row[1]) == json.dumps(json.loads(text))
    begun = pg.execute("SELECT result::text FROM toolguard_begin_intent('i', 't', NULL, NULL, "
                       "ARRAY['k'], 'h')").fetchone()
    assert begun == (text,)
    # a jsonb result (an older client) cannot hold \u0000: refused as before
    with pg.transaction():
        pg.execute("SELECT * FROM toolguard_enter(ARRAY['k'], ARRAY[1]::bigint[], 'j', 't', "
                   "NULL, NULL, 'h')")
        assert _raises(pg, "SELECT toolguard_apply('j', %s::jsonb, '{}')",
                       (text,)).sqlstate == "22P05"


def test_pg_006_a_replay_leaves_the_applied_intent_row_alone(pg: psycopg.Connection[Any]) -> None:
    """Version 6: toolguard_enter finds an applied intent without writing its row, so a client
    may commit a replay's fence advance; everything else behaves as in version 3."""
    _install_files(pg, 3)
    _apply_twice(pg, "006_replay_keeps_intent.sql", 6)  # on top of 003 (it needs nothing newer)
    enter = ("SELECT * FROM toolguard_enter(ARRAY['k'], ARRAY[%s]::bigint[], 'i', 'deposit', "
             "'agent', NULL, %s)")
    with pg.transaction():
        assert pg.execute(enter, (1, "h")).fetchone() == (False, None)
        pg.execute("SELECT toolguard_record('i', '7', '{\"k\": 1}')")
    intent_row = "SELECT xmin::text, status, attempts, updated_at, result::text FROM toolguard_intent"
    applied = pg.execute(intent_row).fetchone()
    with pg.transaction():  # a replay, committed: only the fence moved
        assert pg.execute(enter, (5, "h")).fetchone() == (True, 7)
    assert pg.execute(intent_row).fetchone() == applied  # not even a new row version
    assert pg.execute("SELECT token FROM toolguard_high_water").fetchone() == (5,)
    assert _raises(pg, enter, (6, "other")).sqlstate == "TG004"  # a conflict still raises
    pg.execute("UPDATE toolguard_intent SET status = 'unknown'")
    with pg.transaction():  # reconciling an unknown attempt is still counted
        assert pg.execute(enter, (7, "h")).fetchone() == (False, 7)
    assert pg.execute("SELECT status, attempts FROM toolguard_intent").fetchone() == ("unknown", 2)


def test_pg_008_enter_fences_one_key_itself_exactly_as_toolguard_fence(
        pg: psycopg.Connection[Any]) -> None:
    """Version 8: toolguard_enter's own one-key fence agrees with toolguard_fence on every
    input (new key, equal token, advance, stale, invalid), on top of 007, installed twice."""
    _install_files(pg, 7)
    _apply_twice(pg, "008_hot_path.sql", 8)
    enter = ("SELECT * FROM toolguard_enter(%s::text[], %s::bigint[], %s, 'deposit', 'agent', "
             "NULL, 'h')")
    for key, token in (("new", 3), ("new", 3), ("new", 9)):  # created, equal, advanced
        with pg.transaction():
            assert pg.execute(enter, ([key], [token], f"i-{token}-{key}")).fetchone() == (
                False, None)
            published = pg.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = "
                "pg_backend_pid() AND ((classid::bigint << 32) | objid::bigint) = "
                "toolguard_token_lock(%s)", (token,)).fetchone()
            assert published == (1,)  # the token is published while the transaction lasts
    assert pg.execute("SELECT token FROM toolguard_high_water WHERE key = 'new'").fetchone() == (9,)
    stale = _raises(pg, enter, (["new"], [8], "i-stale"))
    assert stale.sqlstate == "TG001"
    assert json.loads(stale.diag.message_detail or "") == {"key": "new", "token": 8, "current": 9}
    for keys, tokens in (([""], [5]), (["k"], [0]), (["k"], [-1]), (["k"], [None]),
                         ([None], [5]), ([], []), (["a", "b"], [1])):
        assert _raises(pg, enter, (keys, tokens, "i-bad")).sqlstate == "TG002", (keys, tokens)
    assert pg.execute("SELECT count(*) FROM toolguard_intent WHERE idempotency_key IN "
                      "('i-stale', 'i-bad')").fetchone() == (0,)
    with pg.transaction():  # several keys still go through toolguard_fence_all
        assert pg.execute(enter, (["b", "a"], [4, 4], "i-two")).fetchone() == (False, None)
    other = enter.replace("'h'", "'other'")
    assert _raises(pg, other, (["new"], [10], "i-two")).sqlstate == "TG004"  # other arguments
    with pg.transaction():  # the replay of an applied intent on the fast path
        pg.execute("SELECT toolguard_record('i-9-new', '7', '{}')")
    assert pg.execute(enter, (["new"], [11], "i-9-new")).fetchone() == (True, 7)


def test_pg_008_recording_a_result_is_a_hot_update(pg: psycopg.Connection[Any]) -> None:
    """The record changes no indexed column (the ordering index covers every intent), so its
    row version stays on the page the insert used; the ordering query still finds the row."""
    _install_files(pg, 8)
    indexes = pg.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = "
                         "'toolguard_intent' AND schemaname = current_schema() ORDER BY 1").fetchall()
    assert [name for name, _ in indexes] == ["toolguard_intent_keys", "toolguard_intent_pkey"]
    assert "WHERE" not in dict(indexes)["toolguard_intent_keys"]
    enter = ("SELECT * FROM toolguard_enter(ARRAY['lead:1'], ARRAY[%s]::bigint[], %s, 't', "
             "NULL, NULL, 'h')")
    for n in range(1, 4):
        with pg.transaction():  # the updates counted so far (not yet flushed): every one HOT
            pg.execute(enter, (n, f"i{n}"))
            pg.execute("SELECT toolguard_record(%s, '1', '{}')", (f"i{n}",))
            updates = pg.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables "
                                 "WHERE relid = 'toolguard_intent'::regclass").fetchone()
        assert updates is not None and updates[0] >= 1 and updates[1] == updates[0], (n, updates)
    applied = pg.execute(HAS_APPLIED, ("t", "lead:1", None, None)).fetchone()
    assert applied == (True,)
    assert pg.execute(HAS_APPLIED, ("other", "lead:1", None, None)).fetchone() == (False,)


def test_pg_009_finish_writes_what_record_and_insert_write(pg: psycopg.Connection[Any]) -> None:
    """Version 9: toolguard_finish leaves the same intent and audit rows as toolguard_record
    followed by the audit INSERT (the row hash verifies), and raises TG003 writing nothing when
    there is no unapplied intent; installed twice on top of 008."""
    _install_files(pg, 8)
    _apply_twice(pg, "009_one_finish.sql", 9)
    enter = ("SELECT * FROM toolguard_enter(ARRAY['lead:1'], ARRAY[%s]::bigint[], %s, 't', "
             "'agent', NULL, 'h')")
    audit = ("agent", "t", "call-1", "k", None, "applied", "ok", ["lead:1"], '{"lead:1": 1}',
             '{"a": [1, "\\u00e9"]}', "done", 1.5, 2, "sha256:abc")
    columns = ", ".join(AUDIT_COLUMNS)
    with pg.transaction():  # the two statements the client sent up to version 8
        pg.execute(enter, (1, "k8"))
        pg.execute(APPLY, ("k8", '{"n": 1e16}', '{"lead:1": 1}'))
        pg.execute(AUDIT_INSERT, audit)
    with pg.transaction():  # the one it sends now
        pg.execute(enter, (2, "k9"))
        pg.execute(FINISH, ("k9", '{"n": 1e16}', '{"lead:1": 1}', *audit))
    intents = pg.execute("SELECT status, result::text, tokens, last_error, applied_at IS NOT NULL "
                         "FROM toolguard_intent ORDER BY idempotency_key").fetchall()
    assert intents[0] == intents[1] == ("applied", '{"n": 1e16}', {"lead:1": 1}, None, True)
    rows = pg.execute(f"SELECT {columns} FROM toolguard_audit ORDER BY id").fetchall()
    assert len(rows) == 2 and rows[0] == rows[1]
    hashes = pg.execute("SELECT row_hash = sha256(convert_to(toolguard_audit_canonical(a), 'UTF8')) "
                        "FROM toolguard_audit a").fetchall()
    assert hashes == [(True,), (True,)]
    for key in ("k9", "missing"):  # applied already / never entered: nothing written
        error = _raises(pg, FINISH, (key, "2", "{}", *audit))
        assert error.sqlstate == "TG003" and key in str(error)
    assert pg.execute("SELECT count(*) FROM toolguard_audit").fetchone() == (2,)
    assert pg.execute("SELECT result::text FROM toolguard_intent WHERE idempotency_key = 'k9'"
                      ).fetchone() == ('{"n": 1e16}',)


def test_pg_003_token_locks_are_tagged(pg: psycopg.Connection[Any]) -> None:
    _install_files(pg, 3)
    lock = "SELECT toolguard_token_lock(%s)"
    assert pg.execute(lock, (5,)).fetchone() == ((679 << 53) | 5,)
    assert pg.execute(lock, (2**60,)).fetchone() == ((679 << 53) | (2**53 - 1),)  # saturated
    assert pg.execute(lock, (2**53 - 2,)).fetchone()[0] >> 53 == 679
    mine = ("SELECT ((classid::bigint << 32) | objid::bigint) >> 53, "
            "((classid::bigint << 32) | objid::bigint) & (2^53 - 1)::bigint FROM pg_locks "
            "WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND mode = 'ShareLock' "
            "ORDER BY 1")
    announce = pg.execute("SELECT toolguard_key_lock('k', 1) & (2^53 - 1)::bigint, "
                          "toolguard_key_lock('k', 2) & (2^53 - 1)::bigint").fetchone()
    assert announce is not None
    with pg.transaction():  # a new key: its token, and the announcement of its first row
        pg.execute("SELECT toolguard_fence('k', 42)")
        assert pg.execute(mine).fetchall() == [(679, 42), (680, announce[0]), (681, announce[1])]
    with pg.transaction():  # an existing key: its token only
        pg.execute("SELECT toolguard_fence('k', 43)")
        assert pg.execute(mine).fetchall() == [(679, 43)]
    assert pg.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                      "AND pid = pg_backend_pid()").fetchone() == (0,)  # released with the tx


def test_audit_is_append_only_in_postgresql(pg: psycopg.Connection[Any]) -> None:
    pg.execute(_sql_file("001_initial.sql"))
    pg.execute("INSERT INTO toolguard_audit (decision, reason) VALUES ('accepted', 'applied')")
    for statement in ("UPDATE toolguard_audit SET reason = 'forged'",
                      "DELETE FROM toolguard_audit",
                      "UPDATE toolguard_audit SET reason = 'x' WHERE false",
                      "TRUNCATE toolguard_audit"):
        error = _raises(pg, statement)
        assert error.sqlstate == "TG005", statement
        assert "append-only" in str(error)
    assert pg.execute("SELECT decision, reason FROM toolguard_audit").fetchall() == [
        ("accepted", "applied")]


def test_audit_is_append_only_through_the_store(store: GuardedStore) -> None:
    store.audit(AuditEntry(decision="rejected", reason="not_authorized", tool="t"))
    for statement in ("UPDATE toolguard_audit SET reason = 'forged'", "DELETE FROM toolguard_audit"):
        with pytest.raises(AuditAppendOnly, match="append-only"):
            rows(store, statement)
    assert [(e.decision, e.reason) for e in store.query_audit()] == [("rejected", "not_authorized")]


def test_sqlite_file_installs_twice(tmp_path) -> None:
    db = sqlite3.connect(tmp_path / "raw.db")
    for _ in range(2):
        db.executescript(_sql_file("sqlite", "001_initial.sql"))
    assert db.execute("SELECT version FROM toolguard_schema_version").fetchall() == [(1,)]
    # the documented fence upsert: a stale token returns no row
    fence = ("INSERT INTO toolguard_high_water (key, token) VALUES (?, ?) ON CONFLICT (key) "
             "DO UPDATE SET token = excluded.token WHERE toolguard_high_water.token <= excluded.token "
             "RETURNING token")
    assert db.execute(fence, ("k", 5)).fetchall() == [(5,)]
    assert db.execute(fence, ("k", 5)).fetchall() == [(5,)]
    assert db.execute(fence, ("k", 4)).fetchall() == []
    with pytest.raises(sqlite3.IntegrityError):
        db.execute("INSERT INTO toolguard_high_water (key, token) VALUES ('n', NULL)")
    db.close()


# --- the seed's example, done right ---------------------------------------------------------------


@pytest.fixture
def accounts(pg: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    pg.execute(_sql_file("examples", "customer_account.sql"))
    pg.execute(_sql_file("examples", "customer_account.sql"))  # twice is harmless
    return pg


def test_example_missing_account_is_an_error(accounts: psycopg.Connection[Any]) -> None:
    error = _raises(accounts, "SELECT mutate_account_balance(%s, 10, 5)", (uuid.uuid4(),))
    assert error.sqlstate == "TG003" and "does not exist" in str(error)
    assert accounts.execute("SELECT count(*) FROM customer_account").fetchone() == (0,)


def test_example_equal_token_accepted_stale_rejected(accounts: psycopg.Connection[Any]) -> None:
    account = uuid.uuid4()
    accounts.execute("INSERT INTO customer_account (account_id, balance) VALUES (%s, 100)", (account,))
    mutate = "SELECT mutate_account_balance(%s, %s, %s)"
    assert accounts.execute(mutate, (account, -60, 42)).fetchone()[0] == 40
    assert accounts.execute(mutate, (account, 5, 42)).fetchone()[0] == 45  # same lease again
    assert accounts.execute(mutate, (account, 1, 43)).fetchone()[0] == 46
    stale = _raises(accounts, mutate, (account, -50, 42))
    assert stale.sqlstate == "TG001"
    assert json.loads(stale.diag.message_detail or "")["current"] == 43
    assert _raises(accounts, mutate, (account, 5, None)).sqlstate == "TG002"
    assert _raises(accounts, mutate, (account, None, 44)).sqlstate == "TG002"
    assert accounts.execute("SELECT balance, last_fencing_token FROM customer_account").fetchone() == (
        46, 43)


def test_example_errors_map_to_typed_exceptions_in_fenced(postgres_url: str, unique: str) -> None:
    schema = f"tg_ex_{unique}"
    store = open_store(postgres_url, schema=schema, install=True)
    try:
        with store.connection() as conn:
            conn.execute(_sql_file("examples", "customer_account.sql"))
        account = uuid.uuid4()
        rows(store, "INSERT INTO customer_account (account_id, balance) VALUES (%s, 0)", (account,))
        key = f"account:{account}"
        with store.fenced({key: 5}) as tx:
            tx.execute("SELECT mutate_account_balance(%s, 10, %s)", (account, tx.tokens[key]))
        with pytest.raises(StaleFencingToken) as caught, store.fenced({"other:key": 1}) as tx:
            tx.execute("SELECT mutate_account_balance(%s, 10, 4)", (account,))
        assert (caught.value.key, caught.value.token, caught.value.current) == (key, 4, 5)
        with pytest.raises(RecordNotFound), store.fenced({key: 5}) as tx:
            tx.execute("SELECT mutate_account_balance(%s, 10, 5)", (uuid.uuid4(),))
        # a tool that swallows the error still cannot commit
        with pytest.raises(StaleFencingToken), store.fenced({"other:key": 2}) as tx, \
                contextlib.suppress(StaleFencingToken):
            tx.execute("SELECT mutate_account_balance(%s, 10, 1)", (account,))
        assert rows(store, "SELECT balance FROM customer_account") == [(10,)]
        reasons = [e.reason for e in store.query_audit(newest_first=False)]
        assert reasons == ["applied", "stale_fencing_token", "not_found", "stale_fencing_token"]
        stale_row = store.query_audit(reason="stale_fencing_token", limit=1, newest_first=False)[0]
        assert stale_row.decision == "rejected"
    finally:
        store.close()
        drop_schema(postgres_url, schema)


def test_pg_010_versions_and_reads(pg: psycopg.Connection[Any]) -> None:
    """Version 10: an accepted write advances its keys' versions (toolguard_finish), the read
    check locks and reports them, and an observation records what a caller saw; installed
    twice on top of 009."""
    _install_files(pg, 9)
    _apply_twice(pg, "010_reads.sql", 10)
    enter = ("SELECT * FROM toolguard_enter(ARRAY['lead:1'], ARRAY[%s]::bigint[], %s, 't', "
             "'agent', NULL, 'h')")
    audit = ("agent", "t", "call-1", "k", None, "accepted", "applied", ["lead:1"],
             '{"lead:1": 1}', None, None, 1.5, 1, None)
    pg.execute("SELECT toolguard_observe('c', ARRAY['lead:1'], ARRAY[0]::bigint[])")
    for n in (1, 2):
        with pg.transaction():
            pg.execute(enter, (1, f"k{n}"))
            pg.execute(FINISH, (f"k{n}", "1", '{"lead:1": 1}', *audit))
    assert pg.execute("SELECT version, agent, intent_id FROM toolguard_version "
                      "WHERE key = 'lead:1'").fetchone() == (2, "agent", "call-1")
    with pg.transaction():
        found = pg.execute("SELECT key, decided, observed, current FROM toolguard_read_check("
                           "'c', ARRAY['lead:1'], ARRAY['lead:2'], 600, 1000)").fetchall()
    assert found == [("lead:1", False, 0, 2), ("lead:2", True, None, 0)]
