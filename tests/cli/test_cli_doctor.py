"""``toolguard doctor``: the operating checklist, pass/warn/fail, exit codes, --reseed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psycopg
import pytest
from store.envs import drop_schema
from typer.testing import CliRunner

from toolguard.cli import app
from toolguard.locks.postgres import SCHEMA_VERSION as LOCK_SCHEMA_VERSION
from toolguard.store import IntentRecord, open_store

DEMO_POLICY = Path(__file__).resolve().parents[2] / "toolguard" / "demo" / "policy.yml"
CHECKS = {"lock_server", "store", "redis_eviction", "persistence", "clock", "schema", "lock_schema",
          "ttl", "fences", "pg_signal", "fence_claims"}


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
    # lead:L-101 .. lead:L-106, and the decisions epilogue's two fenced accounts
    assert fences["data"]["keys_checked"] == 8
    assert all(c["why"] for c in data["checks"])


def test_text_output_explains_each_check(runner: CliRunner, demo_home: dict) -> None:
    result, _ = doctor(runner, "--lock-url", demo_home["locks"], "--url", demo_home["url"],
                       "--policy", str(DEMO_POLICY))
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "PASS  Lock server reachable" in text and "SKIP  Redis eviction policy" in text
    assert "WARN  TTL vs renewal interval" in text  # the demo's 800 ms TTL (under 1 s)
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


def check(data: dict, name: str) -> dict:
    return next(c for c in data["checks"] if c["name"] == name)


def fenced_ahead(store_url: str, key: str) -> None:
    """A high-water mark ~12 days ahead of any clock: the lock server's next token is behind."""
    ahead = (time.time_ns() // 1000) + 10**12
    with open_store(store_url, install=True) as store, \
            store.fenced({key: ahead}, IntentRecord(tool="doctor_test")) as tx:
        tx.record("ok")


# --- Redis Cluster and Sentinel ---------------------------------------------------------------


@pytest.mark.cluster
def test_a_redis_cluster_is_probed_on_every_primary(runner: CliRunner, redis_cluster_url: str,
                                                     tmp_path: Path, unique: str) -> None:
    store_url = f"sqlite:///{tmp_path}/store.db"
    key = f"doctor:{unique}"
    fenced_ahead(store_url, key)
    result, data = doctor(runner, "--lock-url", redis_cluster_url, "--url", store_url, "--json")
    assert result.exit_code == 1, result.output  # the fence is behind; nothing else fails
    found = statuses(data)
    assert set(found) == CHECKS
    assert found["lock_server"] == "pass" and check(data, "lock_server")["data"]["kind"] == \
        "redis-cluster"
    assert "3 primaries" in check(data, "lock_server")["summary"]
    for name in ("redis_eviction", "persistence"):
        nodes = check(data, name)["data"]["nodes"]
        assert len(nodes) == 3, nodes  # one entry per primary
        assert check(data, name)["summary"].startswith("all 3 nodes: ")  # alike: said once
    assert found["redis_eviction"] == "pass"  # the test cluster runs noeviction (redis default)
    assert found["persistence"] == "warn"  # no AOF, and one async replica per primary
    assert all(n["replicas"] == 1 for n in check(data, "persistence")["data"]["nodes"].values())
    clocks = check(data, "clock")["data"]
    assert len([label for label in clocks if label.startswith("lock server (redis-cluster ")]) == 3
    assert found["fences"] == "fail" and key in check(data, "fences")["data"]["behind"]
    _, data = doctor(runner, "--lock-url", redis_cluster_url, "--url", store_url, "--reseed",
                     "--json")
    assert statuses(data)["fences"] == "pass", data
    _, data = doctor(runner, "--lock-url", redis_cluster_url, "--url", store_url, "--json")
    assert statuses(data)["fences"] == "pass"


@pytest.mark.sentinel
def test_a_sentinel_url_is_probed_on_its_primary(runner: CliRunner, redis_sentinel_url: str,
                                                  tmp_path: Path) -> None:
    from toolguard.locks.redis_ha import sentinel_client

    primary = sentinel_client(redis_sentinel_url)
    host, port = primary.connection_pool.get_master_address()
    primary.close()
    result, data = doctor(runner, "--lock-url", redis_sentinel_url,
                          "--url", f"sqlite:///{tmp_path}/store.db", "--json")
    found = statuses(data)
    assert result.exit_code == 1 and found["schema"] == "fail"  # (an empty store)
    assert found["lock_server"] == "pass"
    assert f"{host}:{port}, the primary of" in check(data, "lock_server")["summary"]
    assert check(data, "lock_server")["data"]["kind"] == "redis-sentinel"
    assert found["redis_eviction"] == "pass"
    assert check(data, "persistence")["data"]["replicas"] == 2  # the group's two replicas
    assert found["persistence"] == "warn"
    assert "lock server (redis-sentinel)" in check(data, "clock")["data"]


def test_a_malformed_ha_url_is_a_usage_error(runner: CliRunner) -> None:
    result, _ = doctor(runner, "--lock-url", "redis+sentinel://127.0.0.1:26379")  # no service
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "monitored primary" in result.output


def test_an_unreachable_cluster_exits_3(runner: CliRunner, tmp_path: Path) -> None:
    from servers import free_port

    result, data = doctor(runner, "--lock-url", f"redis+cluster://127.0.0.1:{free_port()}",
                          "--url", f"sqlite:///{tmp_path}/store.db", "--timeout", "0.5", "--json")
    assert result.exit_code == 3, result.output
    assert statuses(data)["lock_server"] == "fail"


# --- the PostgreSQL lock schema ---------------------------------------------------------------


def test_the_postgres_lock_schema_is_checked(runner: CliRunner, postgres_url: str,
                                             tmp_path: Path, unique: str) -> None:
    lock_schema = f"tg_doctor_locks_{unique}"
    store_url = f"sqlite:///{tmp_path}/store.db"
    assert runner.invoke(app, ["db", "init", "--url", store_url]).exit_code == 0
    args = ("--lock-url", postgres_url, "--lock-schema", lock_schema, "--url", store_url, "--json")
    try:
        result, data = doctor(runner, *args)
        assert result.exit_code == 0, result.output  # a missing lock schema is installed on use
        lock = check(data, "lock_schema")
        assert lock["status"] == "warn" and "not installed" in lock["summary"]
        assert lock["fix"] == f"toolguard db init --lock-url {postgres_url} --lock-schema {lock_schema}"
        strict, _ = doctor(runner, *args, "--strict")
        assert strict.exit_code == 1
        assert runner.invoke(app, ["db", "init", "--url", store_url, "--lock-url", postgres_url,
                                   "--lock-schema", lock_schema]).exit_code == 0
        result, data = doctor(runner, *args, "--strict")
        lock = check(data, "lock_schema")
        assert lock["status"] == "pass" and lock["data"]["installed"] == LOCK_SCHEMA_VERSION
    finally:
        drop_schema(postgres_url, lock_schema)
    _, data = doctor(runner, "--lock-url", f"sqlite:///{tmp_path}/locks.db", "--url", store_url,
                     "--json")
    assert statuses(data)["lock_schema"] == "skip"
    result, _ = doctor(runner, "--lock-url", f"sqlite:///{tmp_path}/locks.db", "--url", store_url,
                       "--lock-schema", "s")
    assert result.exit_code == 2


# --- may the store's role end a paused holder's transaction? -------------------------------------


@pytest.fixture
def roles(postgres_url: str, unique: str):
    """Two login roles of the test's own (cluster-wide, so dropped afterwards)."""
    names = (f"tg_app_{unique}", f"tg_other_{unique}")
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        for name in names:
            conn.execute(f'CREATE ROLE "{name}" LOGIN NOSUPERUSER')
    try:
        yield names
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            for name in names:
                conn.execute(f'DROP OWNED BY "{name}" CASCADE')
                conn.execute(f'DROP ROLE "{name}"')


def _as(url: str, role: str) -> str:
    head, _, rest = url.partition("://")
    return f"{head}://{role}@{rest.rpartition('@')[2]}"


def test_the_store_role_may_end_a_paused_holder(runner: CliRunner, postgres_url: str,
                                                tmp_path: Path, unique: str,
                                                roles: tuple[str, str]) -> None:
    app_role, other = roles
    schema = f"tg_doctor_sig_{unique}"
    locks = ("--lock-url", f"sqlite:///{tmp_path}/locks.db")
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}" AUTHORIZATION "{app_role}"')
        (database,) = conn.execute("SELECT current_database()").fetchone()
        conn.execute(f'GRANT CREATE ON DATABASE "{database}" TO "{app_role}"')  # (the installer)
    try:
        as_app = _as(postgres_url, app_role)
        installed = runner.invoke(app, ["db", "init", "--url", as_app, "--schema", schema])
        assert installed.exit_code == 0, installed.output
        # the installing role, alone: it may end its own sessions
        result, data = doctor(runner, *locks, "--url", as_app, "--schema", schema, "--json")
        assert result.exit_code == 0, result.output
        signal = check(data, "pg_signal")
        assert signal["status"] == "pass" and "one role for every client" in signal["summary"]
        # another role may fence too: the app role may not end its sessions
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO "{other}"')
            conn.execute(f'GRANT SELECT, UPDATE ON "{schema}".toolguard_high_water TO "{other}"')
        _, data = doctor(runner, *locks, "--url", as_app, "--schema", schema, "--json")
        signal = check(data, "pg_signal")
        assert signal["status"] == "warn" and other in signal["summary"], signal
        assert signal["fix"] == f"GRANT pg_signal_backend TO {app_role} (or one role for every client)"
        assert signal["data"]["unsignalable_roles"] == [other]
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'GRANT pg_signal_backend TO "{app_role}"')
        _, data = doctor(runner, *locks, "--url", as_app, "--schema", schema, "--json")
        signal = check(data, "pg_signal")
        assert signal["status"] == "pass" and "pg_signal_backend" in signal["summary"]
        # the superuser that ran the other tests: may end anyone's
        _, data = doctor(runner, *locks, "--url", postgres_url, "--schema", schema, "--json")
        assert check(data, "pg_signal")["data"]["superuser"] is True
    finally:
        drop_schema(postgres_url, schema)
    _, data = doctor(runner, *locks, "--url", f"sqlite:///{tmp_path}/store.db", "--json")
    assert statuses(data)["pg_signal"] == "skip"


def test_nodes_that_differ_are_reported_apart_with_the_worst_status() -> None:
    from toolguard.cli.checks.lock_server import _eviction_of, _per_node

    safe = {"maxmemory-policy": "noeviction", "maxmemory": "0"}
    combined = _per_node({"a:1": safe, "b:2": safe,
                          "c:3": {"maxmemory-policy": "allkeys-lru", "maxmemory": "100"},
                          "d:4": "unknown command 'CONFIG'"}, _eviction_of)
    assert combined.status == "fail" and combined.fix and "noeviction" in combined.fix
    assert combined.summary.startswith("a:1, b:2: maxmemory-policy noeviction")
    assert "c:3: maxmemory-policy allkeys-lru with maxmemory 100" in combined.summary
    assert "d:4: cannot read the configuration: unknown command 'CONFIG'" in combined.summary
    assert set(combined.data["nodes"]) == {"a:1", "b:2", "c:3", "d:4"}
    assert _per_node({"a:1": safe}, _eviction_of) == _eviction_of(safe)  # one node: as it was
