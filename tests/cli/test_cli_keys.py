"""``toolguard keys new|public`` and ``toolguard fence reset`` (a poisoned key, recovered)."""

from __future__ import annotations

import stat
from pathlib import Path

from typer.testing import CliRunner

from toolguard.cli import app
from toolguard.fences import Keyring, load_signing_key
from toolguard.fences.keys import parse_verifying_key
from toolguard.locks import connect
from toolguard.store import AuditEntry, IntentRecord, open_store


def test_keys_new_writes_a_private_file_and_prints_the_public_key(runner: CliRunner,
                                                                  tmp_path: Path) -> None:
    out = tmp_path / "fence-k2.key"
    result = runner.invoke(app, ["keys", "new", "--id", "k2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    public = parse_verifying_key(result.stdout.strip())
    key = load_signing_key(out)
    assert public == key.public() and public.key_id == "k2"
    assert key.text() not in result.output  # the secret never reaches the terminal
    again = runner.invoke(app, ["keys", "public", str(out)])
    assert (again.exit_code, again.stdout.strip()) == (0, public.text())
    refused = runner.invoke(app, ["keys", "new", "--id", "k2", "--out", str(out)])
    assert refused.exit_code == 2 and "exists" in refused.output
    hmac = runner.invoke(app, ["keys", "new", "--id", "h1", "--out", str(tmp_path / "h1.key"),
                               "--hmac"])
    assert hmac.exit_code == 0 and hmac.stdout == ""
    assert Keyring([load_signing_key(tmp_path / "h1.key")])


def test_a_key_that_cannot_be_read_is_one_clear_line(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(app, ["keys", "public", str(tmp_path / "missing.key")])
    assert result.exit_code == 2
    assert "no such file" in result.output and "Traceback" not in result.output
    loose = tmp_path / "loose.key"
    runner.invoke(app, ["keys", "new", "--id", "k1", "--out", str(loose)])
    loose.chmod(0o644)
    result = runner.invoke(app, ["keys", "public", str(loose)])
    assert result.exit_code == 2 and "chmod 600" in result.output
    bad = runner.invoke(app, ["keys", "new", "--id", "no dots.here", "--out",
                              str(tmp_path / "x.key")])
    assert bad.exit_code == 2 and "key id" in bad.output


def test_fence_reset_recovers_a_poisoned_key_audited_and_refused_under_a_live_lease(
        runner: CliRunner, tmp_path: Path, redis_url: str, unique: str) -> None:
    store_url = f"sqlite:///{tmp_path}/service.db"
    key = f"lead:{unique}"
    locks = connect(redis_url)
    with open_store(store_url, install=True) as store:
        with store.fenced({key: 2**63 - 1}, IntentRecord(tool="POST /x")):
            pass  # the token-inflation request of an unsigned deployment landed
        assert store.high_water(key) == 2**63 - 1

        lease = locks.acquire(key, ttl_ms=30_000)
        try:
            refused = runner.invoke(app, ["fence", "reset", key, "--to", "5", "--url", store_url,
                                          "--lock-url", redis_url, "--by", "alice"])
            assert refused.exit_code == 1, refused.output
            assert "lease on the key is live" in refused.output
            assert store.high_water(key) == 2**63 - 1
        finally:
            lease.release()

        done = runner.invoke(app, ["fence", "reset", key, "--to", str(lease.token),
                                   "--url", store_url, "--lock-url", redis_url, "--by", "alice"])
        assert done.exit_code == 0, done.output
        assert f"{2**63 - 1} -> {lease.token}" in done.output
        assert store.high_water(key) == lease.token
        rows: list[AuditEntry] = store.query_audit(decision="operator", newest_first=False,
                                                   limit=None)
        assert [r.reason for r in rows] == ["fence_reset_refused", "fence_reset"]
        assert rows[1].args["by"] == "alice" and rows[1].args["from"] == 2**63 - 1
        assert "by alice" in (rows[1].detail or "")

        # a genuine holder writes again
        with (locks.acquire(key, ttl_ms=30_000) as next_holder,
              store.fenced(next_holder, IntentRecord(tool="POST /x"))):
            pass
        assert store.high_water(key) == next_holder.token
    locks.close()


def test_doctor_says_what_unsigned_mode_allows_and_checks_the_keys(
        runner: CliRunner, tmp_path: Path, monkeypatch) -> None:
    import json

    args = ["doctor", "--lock-url", f"sqlite:///{tmp_path}/locks.db", "--url",
            f"sqlite:///{tmp_path}/store.db", "--json"]

    def claims_check() -> dict:
        result = runner.invoke(app, args)
        return next(c for c in json.loads(result.stdout)["checks"] if c["name"] == "fence_claims")

    unsigned = claims_check()
    assert unsigned["status"] == "skip" and "unsigned mode" in unsigned["summary"]
    assert "fence reset" in unsigned["summary"] and "any agent" in unsigned["summary"]
    key_file = tmp_path / "k1.key"
    public = runner.invoke(app, ["keys", "new", "--id", "k1", "--out", str(key_file)]).stdout
    monkeypatch.setenv("TOOLGUARD_FENCE_SIGNING_KEY_FILE", str(key_file))
    monkeypatch.setenv("TOOLGUARD_FENCE_VERIFY_KEYS", public.strip())
    signed = claims_check()
    assert signed["status"] == "pass" and "'k1'" in signed["summary"]
    key_file.chmod(0o640)
    broken = claims_check()
    assert broken["status"] == "fail" and "chmod 600" in broken["summary"]
