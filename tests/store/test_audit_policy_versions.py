"""The store keeps the text of every policy version that decided (``toolguard_policy_version``).

A guard writes the version before its first decision under it, sync and asyncio, on
both stores; the stored content hashes to the digest the audit rows name, the YAML
files load to that very version, and the table is append-only.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from store.envs import StoreEnv, rows
from toolguard import ToolGuard, guarded
from toolguard.policies import load_policy
from toolguard.review.rules import PolicySource
from toolguard.store import GuardedStore
from toolguard.store.policy_versions import PolicyText, read_policy_text, record_policy_text

POLICY = """\
version: 1
tools:
  set_tier:
    locks: ["lead:{lead_id}"]
    agents: [router]       # only the router sets a tier
"""


def policy_file(tmp_path: Path, text: str = POLICY) -> Path:
    path = tmp_path / "policy.yml"
    path.write_text(text, encoding="utf-8")
    return path


def refuse_once(env: StoreEnv, store: GuardedStore, path: Path, call: str) -> str:
    policy = load_policy(path)
    locks = env.locks()
    try:
        guard = ToolGuard(policy, locks=locks, store=store)

        @guarded(guard, agent="intent_scorer", name="set_tier")
        def set_tier(lead_id: str, tier: str) -> str:
            return tier

        decision = set_tier.run({"lead_id": "L-1", "tier": "A"}, call_id=call, thread_id="t")
        assert decision.reason == "not_authorized"
    finally:
        locks.close()
    return policy.digest


def test_a_guard_keeps_the_version_it_decided_under(env: StoreEnv, store: GuardedStore,
                                                    tmp_path: Path) -> None:
    path = policy_file(tmp_path)
    digest = refuse_once(env, store, path, "c1")
    refuse_once(env, store, path, "c2")  # a second guard, the same version: one row
    (entry,) = [e for e in store.query_audit() if e.intent_id == "c1"]
    assert entry.policy_version == digest
    kept = read_policy_text(store, digest)
    assert kept is not None and kept.intact and kept.first_at is not None
    assert kept.sources == ((str(path), POLICY),)
    assert rows(store, "SELECT count(*) FROM toolguard_policy_version") == [(1,)]
    source = PolicySource.stored(kept)
    assert source is not None and source.digest == digest
    rule = source.rule_for(entry)
    assert rule is not None and rule.field == "tools.set_tier.agents"
    assert rule.location is not None and rule.location.file == str(path)
    assert rule.location.line == 5
    # the file changes afterwards: what decided is still what the store shows
    path.write_text(POLICY.replace("[router]", "[router, intent_scorer]"), encoding="utf-8")
    assert PolicySource.stored(read_policy_text(store, digest)).digest == digest  # type: ignore[arg-type, union-attr]
    assert PolicySource(path).digest != digest


def test_an_edited_file_is_not_kept_as_the_source(env: StoreEnv, store: GuardedStore,
                                                  tmp_path: Path) -> None:
    """Edited between loading and the first decision: the canonical content only (no lines)."""
    path = policy_file(tmp_path)
    policy = load_policy(path)
    path.write_text(POLICY.replace("set_tier", "set_score"), encoding="utf-8")
    locks = env.locks()
    try:
        guard = ToolGuard(policy, locks=locks, store=store)

        @guarded(guard, agent="intent_scorer", name="set_tier")
        def set_tier(lead_id: str, tier: str) -> str:
            return tier

        set_tier.run({"lead_id": "L-1", "tier": "A"}, call_id="c1", thread_id="t")
    finally:
        locks.close()
    kept = read_policy_text(store, policy.digest)
    assert kept is not None and kept.intact and kept.sources == ()
    source = PolicySource.stored(kept)
    assert source is not None and source.digest == policy.digest
    (entry,) = store.query_audit()
    rule = source.rule_for(entry)
    assert rule is not None and rule.known and rule.lines == ()


def test_the_async_guard_keeps_it_too(env: StoreEnv, tmp_path: Path) -> None:
    path = policy_file(tmp_path)
    policy = load_policy(path)

    async def scenario() -> None:
        store = env.open_async(install=True)
        locks = env.alocks()
        try:
            guard = ToolGuard(policy, async_locks=locks, async_store=store)

            @guarded(guard, agent="intent_scorer", name="set_tier")
            async def set_tier(lead_id: str, tier: str) -> str:
                return tier

            decision = await set_tier.arun({"lead_id": "L-1", "tier": "A"}, call_id="c1",
                                           thread_id="t")
            assert decision.reason == "not_authorized"
        finally:
            await locks.aclose()
            await store.close()

    asyncio.run(scenario())
    store = env.open()
    try:
        kept = read_policy_text(store, policy.digest)
        assert kept is not None and kept.intact and kept.sources == ((str(path), POLICY),)
    finally:
        store.close()


def test_the_table_is_append_only_and_checked(store: GuardedStore) -> None:
    good = PolicyText("a" * 64, "{}")  # sha256("{}") is not a*64: refused or not intact
    if store.dialect == "postgresql":  # the CHECK: content that is not the digest's
        with pytest.raises(Exception, match="toolguard_policy_version_check"):
            record_policy_text(store, good)
    else:
        record_policy_text(store, good)
        kept = read_policy_text(store, "a" * 64)
        assert kept is not None and not kept.intact and PolicySource.stored(kept) is None
    import hashlib

    content = '{"version":1}'
    digest = hashlib.sha256(content.encode()).hexdigest()
    record_policy_text(store, PolicyText(digest, content))
    record_policy_text(store, PolicyText(digest, content))  # once is enough: no error
    for statement in ("UPDATE toolguard_policy_version SET content = 'x'",
                      "DELETE FROM toolguard_policy_version"):
        with pytest.raises(Exception, match="append-only"):
            rows(store, statement)
    assert read_policy_text(store, digest) == PolicyText(
        digest, content, (), read_policy_text(store, digest).first_at)  # type: ignore[union-attr]
    assert read_policy_text(store, "not-a-digest") is None
