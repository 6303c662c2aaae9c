"""``toolguard db init|status``: exit codes and one-line errors, never a traceback."""

from __future__ import annotations

import pytest
from servers import free_port
from typer.testing import CliRunner

from store.envs import drop_schema
from toolguard.store import latest_version
from toolguard.store.cli import EXIT_BEHIND, EXIT_CONFIG, EXIT_UNREACHABLE, db_app

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
