"""Results are stored losslessly, and identically on PostgreSQL and SQLite.

"JSON-able" here means: a value that ``json.dumps(..., allow_nan=False)``
accepts and whose strings are valid Unicode. It is stored as that JSON text
and replayed as ``json.loads`` of it (tuples come back as lists, as on the
first run: ``tx.result`` is already the replayed form), on both stores: NUL
and other control characters, object key order, ``1e16`` vs
``10000000000000000``, ``-0.0``, big integers. A string with a lone surrogate
cannot be UTF-8 (both stores keep UTF-8 text) and is refused with a clear
error, audited, never applied. The audit log, which must be written whatever
arrives, keeps such text with U+FFFD in place of NUL and lone surrogates.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store.envs import StoreEnv, rows
from toolguard.errors import DuplicateIntent, InvalidFencingToken, StoreError
from toolguard.store import AuditEntry, GuardedStore, IntentRecord, Replay

NASTY = ["\x00", "a\x00b", "\x01\x1f\x7f", "\u2028\u2029", "\ufeff", "\U0001f600", "\\u0000",
         '"', "\\", "\ud7ff\ue000\uffff", "é", "\u0000\u0000"]
texts = st.one_of(st.text(), st.sampled_from(NASTY),
                  st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8))
floats = st.floats(allow_nan=False, allow_infinity=False)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2**63),
                    floats, st.sampled_from([1e16, -0.0, 5e-324, 1.7976931348623157e308, 0.1]),
                    texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.tuples(inner, inner),
    st.dictionaries(texts, inner, max_size=4)), max_leaves=16)


def exact(value: Any) -> str:
    """A value's JSON text: equal only if types (1 vs 1.0), key order and every char agree."""
    return json.dumps(value, ensure_ascii=True, allow_nan=False)


def record(key: str) -> IntentRecord:
    return IntentRecord(tool="emit", idempotency_key=key, args_hash="h", intent_id=key)


def round_trip(store: GuardedStore, value: Any) -> tuple[Any, Any, Any]:
    """Record ``value``, then replay it through the fenced re-check and through begin_intent."""
    key = uuid.uuid4().hex
    with store.fenced({"emit": 1}, record(key)) as tx:
        tx.record(value)
        first = tx.result
    with pytest.raises(DuplicateIntent) as caught, store.fenced({"emit": 1}, record(key)):
        pytest.fail("a replay must not run")
    replay = store.begin_intent(record(key))
    assert isinstance(replay, Replay)
    return first, caught.value.result, replay.result


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(value=json_values)
def test_any_json_value_replays_exactly(store: GuardedStore, value: Any) -> None:
    expected = json.loads(json.dumps(value, allow_nan=False))
    first, replayed, begun = round_trip(store, value)
    assert exact(first) == exact(replayed) == exact(begun) == exact(expected)


@pytest.mark.parametrize("value", [
    {"bb": 1, "a": 2, "": 3},            # jsonb would sort the keys: a, bb
    {"big": 1e16, "zero": -0.0},         # jsonb would give 10000000000000000 and 0
    {"note": "a\x00b", "a\x00": ["\x00"]},  # jsonb refuses \u0000
    {"$toolguard": "not special"},
    [1, 1.0, 10**30, -(2**70)],
])
def test_known_jsonb_losses_do_not_happen(store: GuardedStore, value: Any) -> None:
    _, replayed, begun = round_trip(store, value)
    assert exact(replayed) == exact(begun) == exact(value)


@pytest.mark.parametrize("value", ["\ud800", {"a": ["ok", "x\udfffy"]}, {"\udc00": 1}])
def test_lone_surrogates_are_refused_clearly_and_audited(store: GuardedStore, value: Any) -> None:
    with pytest.raises(StoreError) as caught, store.fenced({"emit": 1}, record("surrogate")) as tx:
        tx.record(value)
    error = caught.value
    assert error.reason == "not_json" and "lone surrogate" in str(error)
    (entry,) = store.query_audit(limit=None)
    assert (entry.decision, entry.reason) == ("failed", "not_json")
    assert rows(store, "SELECT status FROM toolguard_intent WHERE idempotency_key = %s",
                ("surrogate",)) == [("failed",)]
    assert store.high_water("emit") == 0


def test_the_error_names_where_the_surrogate_is(store: GuardedStore) -> None:
    with pytest.raises(StoreError) as caught, store.fenced({"emit": 1}) as tx:
        tx.record({"a": ["ok", "x\udfffy"]})
    assert "result['a'][1]" in str(caught.value)


def test_async_results_replay_exactly(env: StoreEnv, store: GuardedStore) -> None:
    value = {"z": "\x00", "a": [1e16, -0.0, "\U0001f600"]}

    async def scenario() -> tuple[Any, Any]:
        astore = env.open_async()
        try:
            async with astore.fenced({"emit": 1}, record("async")) as tx:
                tx.record(value)
            with pytest.raises(DuplicateIntent) as caught:
                async with astore.fenced({"emit": 1}, record("async")):
                    pytest.fail("a replay must not run")
            replay = await astore.begin_intent(record("async"))
            assert isinstance(replay, Replay)
            return caught.value.result, replay.result
        finally:
            await astore.close()

    replayed, begun = asyncio.run(scenario())
    assert exact(replayed) == exact(begun) == exact(value)


# --- the same class of bug elsewhere: text PostgreSQL or UTF-8 cannot hold -----------------------------


def test_audit_text_is_kept_with_replacement_characters(store: GuardedStore) -> None:
    """A tool's error message, redacted args or names with NUL or a lone surrogate: the audit row
    is still written (on PostgreSQL a NUL made the insert fail, and the decision went unaudited)."""
    args = {"note": "a\x00b", "s\x00": ["\ud800"], "n": 1}
    intent = IntentRecord(tool="emit", idempotency_key="texty", args_hash="h", args=args)
    with store.fenced({"emit": 1}, intent) as tx:
        tx.record("ok")
    with pytest.raises(ValueError), store.fenced({"emit": 1}):
        raise ValueError("bad byte \x00 and \udc80 here")
    store.audit(AuditEntry(decision="rejected", reason="unknown_tool", tool="rm\x00rf",
                           agent="a\ud800", detail="\x00"))
    accepted, failed, direct = store.query_audit(limit=None, newest_first=False)
    assert accepted.args == {"note": "a\ufffdb", "s\ufffd": ["\ufffd"], "n": 1}
    assert (failed.decision, failed.detail) == ("failed", "bad byte \ufffd and \ufffd here")
    assert (direct.tool, direct.agent, direct.detail) == ("rm\ufffdrf", "a\ufffd", "\ufffd")


@pytest.mark.parametrize("field", ["tool", "idempotency_key", "agent", "workflow", "intent_id",
                                   "keys"])
@pytest.mark.parametrize("bad", ["a\x00b", "a\ud800b"])
def test_intent_identity_text_must_be_storable(field: str, bad: str) -> None:
    values: dict[str, Any] = {"tool": "emit", "idempotency_key": "k", "args_hash": "h"}
    values[field] = (bad,) if field == "keys" else bad
    with pytest.raises(StoreError) as caught:
        IntentRecord(**values)
    assert caught.value.reason == "invalid_intent" and field in str(caught.value)


@pytest.mark.parametrize("key", ["a\x00b", "\udfff"])
def test_fence_keys_must_be_storable_text(store: GuardedStore, key: str) -> None:
    with pytest.raises(InvalidFencingToken), store.fenced({key: 1}):
        pytest.fail("must not run")
    (entry,) = store.query_audit(limit=None)
    assert entry.reason == "invalid_fencing_token"
