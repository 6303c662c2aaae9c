"""``toolguard db init|status``: exit codes and one-line errors, never a traceback."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from servers import free_port
from typer.testing import CliRunner

from store.envs import drop_schema
from toolguard.cli.db import EXIT_BEHIND, EXIT_CONFIG, EXIT_UNREACHABLE, db_app
from toolguard.locks.postgres import SCHEMA_VERSION as LOCK_SCHEMA_VERSION
from toolguard.locks.postgres import lock_schema_version
from toolguard.store import latest_version

runner = CliRunner()


def invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(db_app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def test_sqlite_init_and_status(tmp_path) -> None:
    url = f"sqlite:///{tmp_path}/cli.db"
    assert invoke("status", "--url", url) == (EXIT_BEHIND, f"not installed in {url}; run "
                                                          f"`toolguard db init`\n")
    assert not (tmp_path / "cli.db").exists()  # status does not create the file
    latest = latest_version("sqlite")
    code, out = invoke("init", "--url", url)
    assert code == 0 and f"upgraded from version 0 to {latest}" in out
    code, out = invoke("init", "--url", url)
    assert code == 0 and f"already at version {latest}" in out
    assert invoke("status", "--url", url) == (0, f"schema version {latest} in {url}\n")


def test_default_url_comes_from_settings(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOOLGUARD_DATABASE_URL", raising=False)
    monkeypatch.setenv("TOOLGUARD_HOME", str(tmp_path / "embedded"))
    code, out = invoke("init")
    assert code == 0 and str(tmp_path / "embedded" / "store.db") in out
    assert (tmp_path / "embedded" / "store.db").exists()


def test_postgres_init_and_status(postgres_url: str, unique: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    schema = f"tg_cli_{unique}"
    monkeypatch.setenv("TOOLGUARD_DATABASE_URL", postgres_url)
    try:
        assert invoke("status", "--schema", schema)[0] == EXIT_BEHIND
        code, out = invoke("init", "--schema", schema)
        latest = latest_version("postgresql")
        assert code == 0 and f"(schema {schema})" in out and f"to {latest}" in out
        code, out = invoke("status", "--url", postgres_url, "--schema", schema)
        assert code == 0 and f"schema version {latest}" in out
    finally:
        drop_schema(postgres_url, schema)


@pytest.mark.parametrize("url", ["mysql://db/x", "sqlite:///", "postgresql://u@h/db?bogus=1",
                                 "not a url"])
def test_bad_url_is_a_configuration_error(url: str) -> None:
    for command in ("init", "status"):
        code, out = invoke(command, "--url", url)
        assert code == EXIT_CONFIG and out.startswith("error: "), out


def test_schema_option_needs_postgres(tmp_path) -> None:
    code, out = invoke("init", "--url", f"sqlite:///{tmp_path}/x.db", "--schema", "s")
    assert code == EXIT_CONFIG and "PostgreSQL" in out


def test_unreachable_server(tmp_path) -> None:
    url = f"postgresql://postgres:secret@127.0.0.1:{free_port()}/nowhere"
    code, out = invoke("status", "--url", url, "--timeout", "1")
    assert code == EXIT_UNREACHABLE
    assert "cannot connect" in out and "refused" in out.lower()
    assert "secret" not in out  # the password is never printed


# --- the PostgreSQL lock schema, beside the store's ---------------------------------------------

V2_LOCK_SQL = (Path(__file__).parents[1] / "locks" / "data" / "lock_schema_v2.sql").read_text()


@pytest.fixture
def lock_env(postgres_url: str, unique: str, monkeypatch: pytest.MonkeyPatch):
    """A PostgreSQL store schema and a lock schema of the test's own; no lock URL set yet."""
    for name in ("TOOLGUARD_LOCK_URL", "TOOLGUARD_REDIS_URL", "TOOLGUARD_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    store_schema, lock_schema = f"tg_cli_{unique}", f"tg_cli_locks_{unique}"
    try:
        yield postgres_url, store_schema, lock_schema
    finally:
        drop_schema(postgres_url, store_schema)
        drop_schema(postgres_url, lock_schema)


def test_init_installs_the_postgres_lock_schema_from_the_settings(
        lock_env: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    url, store_schema, lock_schema = lock_env
    monkeypatch.setenv("TOOLGUARD_LOCK_URL", url)
    where = ("--url", url, "--schema", store_schema, "--lock-schema", lock_schema)
    code, out = invoke("status", *where)
    assert code == EXIT_BEHIND and "not installed" in out
    code, out = invoke("init", *where)
    assert code == 0, out
    assert f"lock schema upgraded from version 0 to {LOCK_SCHEMA_VERSION} in {url} " \
           f"(schema {lock_schema})" in out
    assert lock_schema_version(url, schema=lock_schema) == LOCK_SCHEMA_VERSION
    code, out = invoke("init", *where)
    assert code == 0 and f"lock schema already at version {LOCK_SCHEMA_VERSION}" in out
    code, out = invoke("status", *where)
    assert code == 0, out
    assert out.splitlines() == [
        f"schema version {latest_version('postgresql')} in {url} (schema {store_schema})",
        f"lock schema version {LOCK_SCHEMA_VERSION} in {url} (schema {lock_schema})"]


def test_status_names_a_missing_or_old_lock_schema_and_init_upgrades_it(
        lock_env: tuple[str, str, str]) -> None:
    url, store_schema, lock_schema = lock_env
    where = ("--url", url, "--schema", store_schema, "--lock-url", url, "--lock-schema", lock_schema)
    assert invoke("init", "--url", url, "--schema", store_schema)[0] == 0  # the store only
    assert lock_schema_version(url, schema=lock_schema) == 0  # (the lock URL is SQLite here)
    code, out = invoke("status", *where)
    assert code == EXIT_BEHIND
    assert f"lock schema not installed in {url} (schema {lock_schema}); run `toolguard db init`" in out
    with psycopg.connect(url, autocommit=True) as conn, conn.transaction():
        conn.execute(f'CREATE SCHEMA "{lock_schema}"')
        conn.execute(f'SET LOCAL search_path TO "{lock_schema}"')
        conn.execute(V2_LOCK_SQL)
    code, out = invoke("status", *where)
    assert code == EXIT_BEHIND
    assert f"lock schema version 2 in {url} (schema {lock_schema}), {LOCK_SCHEMA_VERSION} " \
           f"available" in out
    code, out = invoke("init", *where)
    assert code == 0 and f"lock schema upgraded from version 2 to {LOCK_SCHEMA_VERSION}" in out
    assert invoke("status", *where)[0] == 0


def test_other_lock_backends_have_no_schema_to_install(tmp_path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path}/cli.db"
    for lock_url in ("redis://127.0.0.1:1/0", f"sqlite:///{tmp_path}/locks.db",
                     "etcd://127.0.0.1:1"):
        monkeypatch.setenv("TOOLGUARD_LOCK_URL", lock_url)
        code, out = invoke("init", "--url", url)
        assert code == 0 and "lock schema" not in out, out  # nothing contacted, nothing said
    code, out = invoke("init", "--url", url, "--lock-url", "redis://127.0.0.1:1/0",
                       "--lock-schema", "s")
    assert code == EXIT_CONFIG and "--lock-schema" in out and "PostgreSQL" in out


def test_redis_url_comes_before_the_store_database(lock_env: tuple[str, str, str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """As at run time: TOOLGUARD_LOCK_URL, else TOOLGUARD_REDIS_URL, else the embedded file."""
    url, store_schema, _ = lock_env
    monkeypatch.setenv("TOOLGUARD_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("TOOLGUARD_DATABASE_URL", url)
    code, out = invoke("init", "--schema", store_schema)
    assert code == 0 and "lock schema" not in out, out


def test_unreachable_lock_server(tmp_path) -> None:
    lock_url = f"postgresql://postgres:secret@127.0.0.1:{free_port()}/nowhere"
    code, out = invoke("init", "--url", f"sqlite:///{tmp_path}/cli.db", "--lock-url", lock_url,
                       "--timeout", "1")
    assert code == EXIT_UNREACHABLE, out
    assert "cannot connect to the lock server at" in out and "secret" not in out
