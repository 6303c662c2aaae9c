"""``toolguard doctor``: the operating checklist, pass/warn/fail, exit codes, --reseed."""

from __future__ import annotations

import json
import time
from pathlib import Path

from typer.testing import CliRunner

from toolguard.cli import app
from toolguard.store import IntentRecord, open_store

DEMO_POLICY = Path(__file__).resolve().parents[2] / "toolguard" / "demo" / "policy.yml"
CHECKS = {"lock_server", "store", "redis_eviction", "persistence", "clock", "schema", "ttl", "fences"}


def doctor(runner: CliRunner, *args: str):
    result = runner.invoke(app, ["doctor", *args])
    return result, (json.loads(result.stdout) if "--json" in args else None)


def statuses(data: dict) -> dict[str, str]:
    return {check["name"]: check["status"] for check in data["checks"]}


def test_embedded_default_passes(runner: CliRunner, demo_home: dict) -> None:
    result, data = doctor(runner, "--lock-url", demo_home["locks"], "--url", demo_home["url"],
                          "--json")
    assert result.exit_code == 0, result.output
    found = statuses(data)
    assert set(found) == CHECKS
    assert found["lock_server"] == found["store"] == found["schema"] == found["fences"] == "pass"
    assert found["redis_eviction"] == "skip"
    fences = next(c for c in data["checks"] if c["name"] == "fences")
    assert fences["data"]["keys_checked"] == 6  # lead:L-101 .. lead:L-106
    assert all(c["why"] for c in data["checks"])


def test_text_output_explains_each_check(runner: CliRunner, demo_home: dict) -> None:
    result, _ = doctor(runner, "--lock-url", demo_home["locks"], "--url", demo_home["url"],
                       "--policy", str(DEMO_POLICY))
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "PASS  Lock server reachable" in text and "SKIP  Redis eviction policy" in text
    assert "WARN  TTL vs renewal interval" in text  # the demo's 500 ms TTL
    assert "why:" in text and "fix:" in text
    strict, _ = doctor(runner, "--lock-url", demo_home["locks"], "--url", demo_home["url"],
                       "--policy", str(DEMO_POLICY), "--strict")
    assert strict.exit_code == 1


def test_schema_not_installed_fails(runner: CliRunner, tmp_path: Path) -> None:
    result, data = doctor(runner, "--lock-url", f"sqlite:///{tmp_path}/locks.db",
                          "--url", f"sqlite:///{tmp_path}/store.db", "--json")
    assert result.exit_code == 1
    schema = next(c for c in data["checks"] if c["name"] == "schema")
    assert schema["status"] == "fail" and schema["fix"] == "toolguard db init"


def test_unreachable_lock_server_exits_3(runner: CliRunner, tmp_path: Path) -> None:
    result, data = doctor(runner, "--lock-url", "redis://127.0.0.1:1/0", "--url",
                          f"sqlite:///{tmp_path}/store.db", "--timeout", "0.5", "--json")
    assert result.exit_code == 3
    found = statuses(data)
    assert found["lock_server"] == "fail" and found["fences"] == "skip"


def test_bad_url_is_a_usage_error(runner: CliRunner) -> None:
    result, _ = doctor(runner, "--lock-url", "mysql://x/y")
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_redis_checks_and_reseed(runner: CliRunner, redis_url: str, tmp_path: Path,
                                 unique: str) -> None:
    store_url = f"sqlite:///{tmp_path}/store.db"
    key = f"doctor:{unique}"
    ahead = (time.time_ns() // 1000) + 10**12  # a high-water mark ~12 days ahead of any clock
    with open_store(store_url, install=True) as store, \
            store.fenced({key: ahead}, IntentRecord(tool="doctor_test")) as tx:
        tx.record("ok")
    result, data = doctor(runner, "--lock-url", redis_url, "--url", store_url, "--json")
    found = statuses(data)
    assert found["lock_server"] == "pass"
    assert found["redis_eviction"] in ("pass", "warn", "fail")
    assert found["persistence"] in ("pass", "warn")
    assert found["clock"] in ("pass", "warn")
    assert found["fences"] == "fail" and result.exit_code == 1  # (eviction may fail too: also 1)
    fences = next(c for c in data["checks"] if c["name"] == "fences")
    assert key in fences["data"]["behind"] and "--reseed" in fences["fix"]
    _, data = doctor(runner, "--lock-url", redis_url, "--url", store_url, "--reseed", "--json")
    assert statuses(data)["fences"] == "pass", data
    _, data = doctor(runner, "--lock-url", redis_url, "--url", store_url, "--json")
    assert statuses(data)["fences"] == "pass"


def test_postgres_store_clock(runner: CliRunner, postgres_url: str, tmp_path: Path,
                              unique: str) -> None:
    from store.envs import drop_schema

    schema = f"tg_doctor_{unique}"
    try:
        assert runner.invoke(app, ["db", "init", "--url", postgres_url, "--schema", schema]
                             ).exit_code == 0
        result, data = doctor(runner, "--lock-url", f"sqlite:///{tmp_path}/locks.db",
                              "--url", postgres_url, "--schema", schema, "--json")
        assert result.exit_code == 0, result.output
        clock = next(c for c in data["checks"] if c["name"] == "clock")
        assert "store (postgresql)" in clock["data"]
    finally:
        drop_schema(postgres_url, schema)
