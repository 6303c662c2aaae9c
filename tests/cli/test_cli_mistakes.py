"""A newcomer's mistakes fail at once, on one line, with the documented exit code."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from typer.testing import CliRunner

from toolguard.cli import app


def _with(url: str, *, user: str | None = None, database: str | None = None,
          query: str | None = None) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc
    if user is not None:
        netloc = f"{user}@{netloc.rpartition('@')[2]}"
    path = f"/{database}" if database is not None else parts.path
    return urlunsplit((parts.scheme, netloc, path, query if query is not None else parts.query, ""))


@pytest.fixture
def no_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """A definitive error must be classified before any pool exists (a pool retries for seconds)."""
    import toolguard.store.postgres as postgres

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a pool was opened for a URL the server had already refused")

    monkeypatch.setattr(postgres.PostgresStore, "__init__", refuse)


MISTAKES = [
    pytest.param({"database": "toolguard_no_such_database"}, 4, 'database "toolguard_no_such_database"',
                 id="database"),
    pytest.param({"user": "toolguard_no_such_role"}, 4, 'role "toolguard_no_such_role"', id="role"),
    pytest.param({"query": "sslmode=bogus"}, 2, "invalid sslmode", id="sslmode-value"),
]


@pytest.mark.parametrize("command", [["db", "status"], ["db", "init"], ["audit"], ["audit", "stats"],
                                     ["doctor", "--lock-url", "sqlite:///locks.db"]])
@pytest.mark.parametrize(("change", "code", "said"), MISTAKES)
def test_a_wrong_postgres_url_fails_at_once(runner: CliRunner, postgres_url: str, no_pool: None,
                                            command: list[str], change: dict, code: int,
                                            said: str) -> None:
    url = _with(postgres_url, **change)
    result = runner.invoke(app, [*command, "--url", url, "--timeout", "30"])
    assert result.exit_code == code, result.output
    assert said in result.stdout + result.stderr
    assert "Traceback" not in result.output
    if command[0] != "doctor":
        assert result.stderr.count("\n") == 1, result.stderr  # one line
        assert result.stderr.count("://") == 1, result.stderr  # the URL, once


def test_sslmode_the_server_cannot_do_is_a_refusal(runner: CliRunner, postgres_url: str,
                                                   no_pool: None) -> None:
    import psycopg

    with psycopg.connect(postgres_url) as conn:
        ssl = conn.execute("SHOW ssl").fetchone()
    if ssl and ssl[0] == "on":
        pytest.skip("this server speaks SSL, so sslmode=require is accepted")
    result = runner.invoke(app, ["db", "status", "--url", _with(postgres_url, query="sslmode=require")])
    assert result.exit_code == 4, result.output
    assert "does not support SSL" in result.stderr and result.stderr.count("\n") == 1


def test_demo_with_a_wrong_database_fails_before_running(runner: CliRunner, postgres_url: str,
                                                         no_pool: None, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOOLGUARD_DATABASE_URL", _with(postgres_url, database="toolguard_nope_db"))
    result = runner.invoke(app, ["demo", "--dir", str(tmp_path)])
    assert result.exit_code == 4, result.output
    assert 'database "toolguard_nope_db" does not exist' in result.stderr
    assert "guard off" not in result.stdout  # nothing ran


@pytest.mark.parametrize("command", [["audit"], ["audit", "--rejected"], ["audit", "stats"],
                                     ["audit", "show", "1"], ["db", "status"], ["doctor"]])
def test_read_only_commands_create_nothing(runner: CliRunner, tmp_path: Path,
                                           command: list[str]) -> None:
    result = runner.invoke(app, command)  # cwd is tmp_path: the embedded default
    assert result.exit_code == 1, result.output
    assert not (tmp_path / ".toolguard").exists()
    assert "toolguard db init" in result.output


@pytest.mark.parametrize("text", ["abc", "0", "1.5", "²", "#"])
def test_audit_show_a_bad_id_is_said_plainly(runner: CliRunner, demo_home: dict, text: str) -> None:
    result = runner.invoke(app, ["audit", "show", text, "--url", demo_home["url"]])
    assert result.exit_code == 2, result.output
    assert "is not an audit entry id" in result.stderr
    assert "Input should be" not in result.output  # no pydantic wording


def test_audit_show_csv_and_hash_id(runner: CliRunner, demo_home: dict) -> None:
    stale = demo_home["report"]["guard_on"]["stale_rejections"][0]
    result = runner.invoke(app, ["audit", "show", f"#{stale}", "--csv", "--url", demo_home["url"]])
    assert result.exit_code == 0, result.output
    header, row = result.stdout.splitlines()
    assert header.startswith("id,at,decision,reason") and row.startswith(f"{stale},")


def test_piped_output_keeps_words_whole(runner: CliRunner, demo_home: dict) -> None:
    result = runner.invoke(app, ["audit", "--rejected", "--url", demo_home["url"]])
    assert result.exit_code == 0
    first = result.stdout.splitlines()[0]
    assert first.endswith(f"in {demo_home['url']}"), first  # not broken at 80 columns
    stats = runner.invoke(app, ["audit", "stats", "--url", demo_home["url"]])
    assert "already applied under this idempotency key: the recorded result was returned" in stats.stdout
