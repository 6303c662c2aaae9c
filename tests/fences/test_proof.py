"""What a signed request proved: the claims' word for the audit row's columns, the rest unproven.

Pure unit tests of ``ClaimVerifier.proven``, ``ClaimRefused.proven`` and
``toolguard.fences.proof.attest``; the services' rows are checked end to end in
``test_claims_unproven.py``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolguard.fences import ClaimRefused, Fences
from toolguard.fences.proof import attest
from toolguard.store import AuditEntry
from toolguard.store.audit_view import arguments, unproven

from .test_claims import ED25519_CLAIM, FENCES, NOW, HeldFor, refusal, signed, signer, verifier

KEY = "lead:L-7"
TOKEN = FENCES.tokens[KEY]


def test_a_genuine_claim_resent_by_another_agent_proves_the_claims_agent():
    forged = replace(signed(), agent="other_writer")
    error = refusal(verifier(), forged)
    assert error.reason == "claim_mismatch"
    assert [c.agent for c in error.proven] == ["intent_scorer"]
    attested = attest(forged, error.proven)
    assert attested.fences == replace(FENCES, claims=forged.claims)
    assert attested.args() == {"unproven": {"agent": "other_writer"}}


@pytest.mark.parametrize("change", [
    {"claims": None},
    {"claims": ED25519_CLAIM[:-2] + "AB"},
    {"claims": ED25519_CLAIM.replace(".k1.", ".k9.")},
    {"claims": "tgf1.ed25519.k1.x"},
])
def test_claims_that_prove_nothing_leave_every_column_empty(change):
    sent = replace(signed(), **change)
    error = refusal(verifier(), sent)
    assert error.proven == () == verifier().proven(sent)
    attested = attest(sent, error.proven)
    assert (attested.fences.agent, attested.fences.idempotency_key, attested.fences.intent_id,
            dict(attested.fences.tokens)) == (None, None, None, {})
    assert attested.unproven == {"agent": "intent_scorer", "idempotency_key": FENCES.idempotency_key,
                                 "intent_id": "call-1", "tokens": {KEY: TOKEN}}


def test_an_expired_claim_or_one_for_another_service_proves_nothing():
    for verify, sent in ((verifier(at=NOW + 60), signed()),
                         (verifier(), signed(audience="billing"))):
        assert refusal(verify, sent).proven == () == verify.proven(sent)


@pytest.mark.parametrize(("change", "unproven"), [
    ({"idempotency_key": "other#1"}, {"idempotency_key": "other#1"}),
    ({"intent_id": "call-2"}, {"intent_id": "call-2"}),
    ({"tokens": {KEY: TOKEN + 1}}, {"tokens": {KEY: TOKEN + 1}}),
    ({"tokens": {KEY: TOKEN, "lead:L-8": 5}}, {"tokens": {"lead:L-8": 5}}),
    ({"agent": None}, {}),  # nothing said, nothing unproven: the claim names the agent
])
def test_a_mismatch_keeps_the_claims_word_and_marks_the_requests(change, unproven):
    sent = replace(signed(), **change)
    error = refusal(verifier(), sent)
    attested = attest(sent, error.proven)
    assert (attested.fences.agent, attested.fences.idempotency_key, attested.fences.intent_id,
            dict(attested.fences.tokens)) == ("intent_scorer", FENCES.idempotency_key, "call-1",
                                              {KEY: TOKEN})
    assert attested.unproven == unproven


def test_claims_that_disagree_prove_only_what_they_share():
    one = signed()
    other = signer().sign(replace(FENCES, tokens={"lead:L-8": 9}, agent="lead_enricher"),
                          HeldFor({"lead:L-8": 9}))
    both = replace(one, tokens={KEY: TOKEN, "lead:L-8": 9},
                   claims=f"{one.claims}, {other.claims}")
    held = verifier().proven(both)
    assert len(held) == 2
    attested = attest(both, held)
    assert attested.fences.agent is None  # two agents: neither is proven
    assert attested.fences.idempotency_key == FENCES.idempotency_key  # both signed this one
    assert dict(attested.fences.tokens) == {KEY: TOKEN, "lead:L-8": 9}
    assert attested.unproven == {"agent": "intent_scorer"}
    twice = replace(one, claims=f"{one.claims}, {signed(at=NOW + 1).claims}")
    assert refusal(verifier(at=NOW + 2), twice).reason == "claim_malformed"
    assert attest(twice, verifier(at=NOW + 2).proven(twice)).unproven == {}


def test_a_verified_request_has_nothing_unproven():
    sent = signed()
    attested = attest(sent, verifier().verify(sent))
    assert attested.fences == sent and attested.args() is None


def test_the_views_read_the_marker_and_only_the_marker():
    marked = AuditEntry(decision="rejected", reason="claim_mismatch", agent="intent_scorer",
                        args={"unproven": {"agent": "other_writer", "tokens": {KEY: 5}}})
    assert unproven(marked) == {"agent": "other_writer", "tokens": f"{KEY}=5"}
    assert arguments(marked) is None
    call = AuditEntry(decision="accepted", reason="applied", args={"unproven": {"agent": "x"},
                                                                   "lead_id": "L-7"})
    assert unproven(call) == {} and arguments(call) == call.args  # a call's own arguments


@settings(max_examples=200, deadline=None)
@given(agent=st.sampled_from([None, "intent_scorer", "other_writer"]),
       key=st.sampled_from([None, FENCES.idempotency_key, "other#1"]),
       intent=st.sampled_from([None, "call-1", "call-2"]),
       token=st.sampled_from([TOKEN, TOKEN + 1]),
       claims=st.sampled_from([None, ED25519_CLAIM, ED25519_CLAIM[:-2] + "AB", "junk"]))
def test_every_column_is_a_claims_word_and_every_other_value_is_unproven(agent, key, intent,
                                                                       token, claims):
    sent = Fences(tokens={KEY: token}, idempotency_key=key, agent=agent, intent_id=intent,
                  claims=claims)
    held = verifier().proven(sent)
    attested = attest(sent, held)
    shown = attested.fences
    for name in ("agent", "idempotency_key", "intent_id"):
        column, said = getattr(shown, name), getattr(sent, name)
        assert column is None or column in {getattr(c, name) for c in held}
        assert said is None or said == column or attested.unproven[name] == said
    for lock_key, value in sent.tokens.items():
        assert shown.tokens.get(lock_key) == value or attested.unproven["tokens"][lock_key] == value
    assert all(any(c.key == k and c.token == v for c in held) for k, v in shown.tokens.items())
    try:
        verifier().verify(sent)
    except ClaimRefused:
        pass
    else:
        assert attested.unproven == {}
