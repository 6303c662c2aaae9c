"""The production controls work on the embedded default with no extra installed."""

from __future__ import annotations

from pathlib import Path

from test_core_without_extras import run_without_extras


def test_controls_without_extras(tmp_path: Path) -> None:
    (tmp_path / "policy.yml").write_text(
        "version: 1\ntools:\n  pay:\n    locks: ['a:{id}']\n    approval: true\n"
        "    quotas: [{calls: 1, window: 1h}]\n")
    result = run_without_extras("""
        import uuid
        from toolguard.controls.approvals import ApprovalBook
        from toolguard.errors import ApprovalRequired, RateLimited
        from toolguard.call.facts import CallFacts
        from toolguard.controls.pause import PauseBoard
        from toolguard.policies.diff import diff
        from toolguard.policies.reload import PolicyWatcher
        from toolguard.controls.quotas import Quotas, quota_backend
        from toolguard.controls.shadow import Enforcement
        from toolguard.store import open_store

        store = open_store(install=True)
        policy = PolicyWatcher("policy.yml").current
        rule = policy.tools["pay"]
        facts = lambda: CallFacts(tool="pay", agent="a", args={"id": 1}, args_hash="h",
                                  idempotency_key=uuid.uuid4().hex, attempt="x",
                                  policy_digest=policy.digest, keys=("a:~i1",))
        quotas = Quotas(quota_backend(store))
        quotas.admit(rule, facts())
        try:
            quotas.admit(rule, facts())
        except RateLimited:
            print("rate_limited")
        try:
            ApprovalBook(store).check(rule, facts())
        except ApprovalRequired:
            print("approval_required")
        PauseBoard(store).pause("tool", "pay")
        print(len(PauseBoard(store).records()), Enforcement("shadow").shadow)
        try:
            quota_backend("redis://127.0.0.1:6379/0")
        except Exception as error:
            print(type(error).__name__)
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["rate_limited", "approval_required", "1", "True", "MissingExtra"]
