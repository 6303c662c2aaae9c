"""``toolguard audit seal / verify / export / check-export``: the tamper-evident log from the CLI."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from toolguard.cli import app
from toolguard.store import AuditEntry, open_store


def run(runner: CliRunner, *args: str):
    return runner.invoke(app, ["audit", *args])


@pytest.fixture
def demo_copy(demo_home: dict, tmp_path: Path) -> str:
    """A private copy of the demo's store (the demo run is shared by the CLI tests)."""
    source = sqlite3.connect(demo_home["home"] / "store.db")
    target = sqlite3.connect(tmp_path / "copy.db")
    source.backup(target)
    source.close()
    target.close()
    return f"sqlite:///{tmp_path}/copy.db"


@pytest.fixture
def pg_log(postgres_url: str, unique: str) -> Iterator[list[str]]:
    """A PostgreSQL store in a schema of its own with a few audit rows: ``--url``/``--schema``."""
    from store.envs import drop_schema

    schema = f"tg_cli_{unique}"
    store = open_store(postgres_url, install=True, schema=schema, autoseal=None)  # sealed by hand
    try:
        for i in range(5):
            store.audit(AuditEntry(decision="rejected", reason="not_authorized", tool="refund",
                                   agent=f"agent-{i}", policy_version="sha256:abc"))
    finally:
        store.close()
    try:
        yield ["--url", postgres_url, "--schema", schema]
    finally:
        drop_schema(postgres_url, schema)


def tamper_sqlite(url: str, statement: str) -> None:
    """What the file's owner can do: drop the append-only trigger, change a row, put it back."""
    conn = sqlite3.connect(url.removeprefix("sqlite:///"))
    (trigger,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = "
                              "'toolguard_audit_no_update'").fetchone()
    conn.execute("DROP TRIGGER toolguard_audit_no_update")
    conn.execute(statement)
    conn.execute(trigger)
    conn.commit()
    conn.close()


def anchor_of(output: str) -> str:
    match = re.search(r"anchor\s+([0-9a-f]{64})", output)
    assert match, output
    return match.group(1)


def test_verify_passes_on_the_untouched_demo_log(runner: CliRunner, demo_copy: str) -> None:
    """The demo's stores sealed what they wrote (at the latest when they closed)."""
    result = run(runner, "verify", "--url", demo_copy)
    assert result.exit_code == 0, result.output
    assert ": OK" in result.stdout and " 0 not sealed yet" in result.stdout
    sealed = run(runner, "seal", "--url", demo_copy)
    assert sealed.exit_code == 0 and "nothing new to seal" in sealed.stdout
    result = run(runner, "verify", "--url", demo_copy)
    assert result.exit_code == 0 and "every link checks" in result.stdout
    assert " 0 not sealed yet" in result.stdout
    anchor = anchor_of(result.stdout)
    assert anchor == anchor_of(sealed.stdout)
    assert run(runner, "verify", "--url", demo_copy, "--anchor", anchor).exit_code == 0
    data = json.loads(run(runner, "verify", "--url", demo_copy, "--json").stdout)
    assert data["ok"] and data["head"]["hash"] == anchor and data["unsealed"] == 0


def test_verify_pinpoints_a_row_changed_with_the_trigger_off(runner: CliRunner,
                                                             demo_copy: str) -> None:
    assert run(runner, "seal", "--url", demo_copy).exit_code == 0
    tamper_sqlite(demo_copy, "UPDATE toolguard_audit SET decision = 'accepted', "
                             "reason = 'applied' WHERE reason = 'stale_fencing_token'")
    result = run(runner, "verify", "--url", demo_copy)
    assert result.exit_code == 1, result.output
    assert "1 PROBLEM" in result.stdout
    assert re.search(r"row #\d+ in seal #\d+ \(ids \d+\.\.\d+\) was changed after it was sealed: "
                     r"its content no longer matches the hash the seal recorded", result.stdout)
    data = json.loads(run(runner, "verify", "--url", demo_copy, "--json").stdout)
    assert [p["kind"] for p in data["problems"]] == ["row_changed"]


def test_verify_on_postgresql_pinpoints_a_row_changed_with_the_trigger_disabled(
        runner: CliRunner, pg_log: list[str]) -> None:
    import psycopg

    assert run(runner, "verify", *pg_log).exit_code == 0
    assert run(runner, "seal", *pg_log).exit_code == 0
    result = run(runner, "verify", *pg_log)
    assert result.exit_code == 0 and "every link checks" in result.stdout
    anchor = anchor_of(result.stdout)
    url, schema = pg_log[1], pg_log[3]
    with psycopg.connect(url, autocommit=True) as conn, conn.transaction():
        conn.execute(f"SET LOCAL search_path TO {schema}")
        conn.execute("ALTER TABLE toolguard_audit DISABLE TRIGGER toolguard_audit_append_only")
        conn.execute("UPDATE toolguard_audit SET agent = 'someone else' WHERE id = 3")
        conn.execute("ALTER TABLE toolguard_audit ENABLE TRIGGER toolguard_audit_append_only")
    result = run(runner, "verify", *pg_log, "--anchor", anchor)
    assert result.exit_code == 1
    assert ("row #3 in seal #1 (ids 1..5) was changed after it was sealed: its content no "
            "longer matches the hash the seal recorded") in result.stdout


def test_a_rewritten_chain_fails_against_the_anchor(runner: CliRunner, demo_copy: str) -> None:
    anchor = anchor_of(run(runner, "seal", "--url", demo_copy).stdout)
    conn = sqlite3.connect(demo_copy.removeprefix("sqlite:///"))
    (trigger,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = "
                              "'toolguard_audit_seal_no_delete'").fetchone()
    conn.execute("DROP TRIGGER toolguard_audit_seal_no_delete")
    conn.execute("DELETE FROM toolguard_audit_seal")
    conn.execute(trigger)
    conn.commit()
    conn.close()
    assert run(runner, "seal", "--url", demo_copy).exit_code == 0  # a new, consistent chain
    assert run(runner, "verify", "--url", demo_copy).exit_code == 0
    result = run(runner, "verify", "--url", demo_copy, "--anchor", anchor)
    assert result.exit_code == 1 and "is not a seal of this log" in result.stdout


def test_export_drop_and_check_the_file(runner: CliRunner, demo_copy: str,
                                        tmp_path: Path) -> None:
    assert run(runner, "seal", "--url", demo_copy).exit_code == 0
    out = tmp_path / "audit-old.jsonl"
    result = run(runner, "export", "--url", demo_copy, "--before", "now", "--out", str(out),
                 "--drop")
    assert result.exit_code == 0, result.output
    assert re.search(r"exported \d+ rows in \d+ seals", result.stdout)
    assert "dropped from the store" in result.stdout
    assert run(runner, "list", "--url", demo_copy, "--json").stdout.strip() == "[]"
    result = run(runner, "verify", "--url", demo_copy, "--export", str(out))
    assert result.exit_code == 0, result.output
    assert "verifies" in result.stdout
    checked = run(runner, "check-export", str(out))
    assert checked.exit_code == 0 and "verifies" in checked.stdout
    lines = out.read_text(encoding="utf-8").splitlines()
    lines[2] = lines[2].replace("lead", "LEAD", 1)
    forged = tmp_path / "forged.jsonl"
    forged.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = run(runner, "check-export", str(forged))
    assert result.exit_code == 1 and "does NOT verify" in result.stdout
    assert run(runner, "verify", "--url", demo_copy, "--export", str(forged)).exit_code == 1


@pytest.mark.parametrize("args", [
    ["verify", "--anchor", "not-a-hash"], ["verify", "--export", "/no/such/file.jsonl"],
    ["export", "--out", "x.jsonl"], ["export", "--out", "x.jsonl", "--before", "1h",
                                     "--through-seal", "1"],
    ["export", "--out", "x.jsonl", "--before", "last tuesday"],
    ["check-export", "/no/such/file.jsonl"],
])
def test_bad_input_is_a_usage_error(runner: CliRunner, demo_copy: str, args: list[str]) -> None:
    result = run(runner, *args, *(["--url", demo_copy] if args[0] != "check-export" else []))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


def test_export_refuses_an_existing_file_and_an_empty_range(runner: CliRunner, demo_copy: str,
                                                            tmp_path: Path) -> None:
    existing = tmp_path / "there.jsonl"
    existing.write_text("keep me\n", encoding="utf-8")
    result = run(runner, "export", "--url", demo_copy, "--before", "now", "--out", str(existing))
    assert result.exit_code == 2 and existing.read_text(encoding="utf-8") == "keep me\n"
    result = run(runner, "export", "--url", demo_copy, "--before", "2001-01-01", "--out",
                 str(tmp_path / "new.jsonl"))  # nothing that old
    assert result.exit_code == 2 and "nothing to export" in result.stderr
