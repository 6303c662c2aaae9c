"""Signed fence claims, pure: the documented test vectors, every refusal, keys and their files.

The server-side tests (real uvicorn and FastMCP servers) are in ``test_claims_rest.py``
and ``test_claims_mcp.py``.
"""

from __future__ import annotations

import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolguard.errors import GuardMisconfigured, LockLost, ToolGuardError
from toolguard.fences import (
    ClaimRefused,
    ClaimVerifier,
    FenceKeyError,
    Fences,
    FenceSigner,
    Keyring,
    SigningKey,
    generate_signing_key,
    load_keyring,
    load_signing_key,
)
from toolguard.fences.claims import MAX_CLAIM_BYTES, Claim, encode_claim, parse_claims
from toolguard.fences.keys import parse_signing_key, parse_verifying_key, write_signing_key
from toolguard.fences.problems import Problem, error_from_problem, problem_from_error
from toolguard.fences.scope import scoped_key
from toolguard.fences.wire import WireError, parse_headers, parse_meta

DOCS = Path(__file__).resolve().parents[2] / "docs" / "fences.md"

# --- the test vectors of docs/fences.md ("The signed claim, byte for byte") ------------------

SEED = bytes(range(32))
NOW = 1764000000.0
ED25519_PRIVATE = "tgk1.ed25519-private.k1.AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8"
ED25519_PUBLIC = "tgk1.ed25519-public.k1.A6EHv_POEL4dcN0Y50vAmWfk1jCbpQ1fHdyGZBJVMbg"
HMAC_SECRET = "tgk1.hmac-sha256.h1.AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8"
PAYLOAD = ("eyJhdWQiOiJjcm0iLCJrZXkiOiJsZWFkOkwtNyIsInRvayI6MTc2NDAwMDAwMDAwMDA0MiwiZXhwIjoxNzY0MDAw"
           "MDEwMDAwLCJpYXQiOjE3NjQwMDAwMDAwMDAsImFndCI6ImludGVudF9zY29yZXIiLCJpZGsiOiJ0aHJlYWQ6dC0x"
           "Ly9jYWxsLTEjMSIsImlpZCI6ImNhbGwtMSJ9")
ED25519_CLAIM = (f"tgf1.ed25519.k1.{PAYLOAD}.Fj0vindSqVrVW50ZYf9ssYxXfO-YXZeP6bYOVLLD8BUwhMxm574H"
                 f"72goEugtvB3iMSzyGyRb7E1RQVKLfnpmAQ")
HMAC_CLAIM = f"tgf1.hs256.h1.{PAYLOAD}.d81Wn4UzF2JJePmmtTNVu_wnIW0-CInXy0WTT-iQU7Y"
FENCES = Fences(tokens={"lead:L-7": 1764000000000042}, idempotency_key="thread:t-1//call-1#1",
                agent="intent_scorer", intent_id="call-1")


class HeldFor:
    """A lease in hand: its tokens, ``remaining`` seconds, lost when ``lost`` is set."""

    def __init__(self, tokens: dict[str, int], remaining: float = 10.0, lost: bool = False):
        self.tokens = tokens
        self.remaining = remaining
        self.lost = lost

    def check(self) -> None:
        if self.lost:
            raise LockLost("lease lost", keys=tuple(self.tokens))

    def remaining_s(self) -> float:
        return self.remaining


def signer(key: SigningKey | None = None, audience: str = "crm", at: float = NOW) -> FenceSigner:
    return FenceSigner(key or SigningKey("k1", "ed25519", SEED), audience=audience,
                       clock=lambda: at)


def verifier(*keys: SigningKey, audience: str = "crm", at: float = NOW + 1,
             **options: float) -> ClaimVerifier:
    return ClaimVerifier(audience=audience, keys=Keyring(keys or [SigningKey("k1", "ed25519", SEED)]),
                         clock=lambda: at, **options)


def signed(fences: Fences = FENCES, **options: object) -> Fences:
    return signer(**options).sign(fences, HeldFor(dict(fences.tokens)))  # type: ignore[arg-type]


def refusal(verify: ClaimVerifier, fences: Fences) -> ClaimRefused:
    with pytest.raises(ClaimRefused) as caught:
        verify.verify(fences)
    return caught.value


def test_the_documented_vectors_are_what_the_code_signs_and_verifies():
    key = SigningKey("k1", "ed25519", SEED)
    assert key.text() == ED25519_PRIVATE and key.public().text() == ED25519_PUBLIC
    assert parse_signing_key(ED25519_PRIVATE) == key
    assert parse_verifying_key(ED25519_PUBLIC) == key.public()
    assert signed().claims == ED25519_CLAIM
    secret = parse_signing_key(HMAC_SECRET)
    assert signer(secret).sign(FENCES, HeldFor(dict(FENCES.tokens))).claims == HMAC_CLAIM
    claims = verifier(key).verify(replace(FENCES, claims=ED25519_CLAIM))
    assert claims == (Claim(audience="crm", key="lead:L-7", token=1764000000000042,
                            expires_ms=1764000010000, issued_ms=1764000000000,
                            agent="intent_scorer", idempotency_key="thread:t-1//call-1#1",
                            intent_id="call-1", key_id="k1"),)
    assert verifier(secret).verify(replace(FENCES, claims=HMAC_CLAIM))[0].key_id == "h1"
    docs = DOCS.read_text()
    for vector in (ED25519_PRIVATE, ED25519_PUBLIC, HMAC_SECRET, PAYLOAD, ED25519_CLAIM,
                   HMAC_CLAIM):
        assert vector in docs.replace("\n", ""), vector[:40]


def test_claims_travel_in_the_headers_and_in_meta_unchanged():
    fences = signed()
    headers = [(name.lower().encode(), value.encode()) for name, value in fences.headers().items()]
    assert parse_headers(headers) == fences
    assert parse_meta(fences.meta()) == fences
    assert fences.meta()["toolguard/fencing-claim"] == ED25519_CLAIM


@pytest.mark.parametrize(("change", "reason"), [
    ({"claims": None}, "claim_missing"),
    ({"claims": "tgf1.ed25519.k1.x"}, "claim_malformed"),
    ({"claims": "tgf2" + ED25519_CLAIM[4:]}, "claim_malformed"),
    ({"claims": ED25519_CLAIM + ", " + ED25519_CLAIM}, "claim_malformed"),
    ({"claims": ED25519_CLAIM.replace(".k1.", ".k9.")}, "claim_unknown_key"),
    ({"claims": ED25519_CLAIM.replace("tgf1.ed25519", "tgf1.hs256")}, "claim_unknown_key"),
    ({"claims": ED25519_CLAIM[:-2] + "AB"}, "claim_bad_signature"),
    ({"claims": ED25519_CLAIM[:-1]}, "claim_bad_signature"),
    ({"claims": ED25519_CLAIM.replace(PAYLOAD, PAYLOAD[:-4] + "fQ")}, "claim_bad_signature"),
    ({"tokens": {"lead:L-7": 2**63 - 1}}, "claim_mismatch"),
    ({"tokens": {"lead:L-7": 1764000000000042, "lead:L-8": 5}}, "claim_missing"),
    ({"agent": "other_agent"}, "claim_mismatch"),
    ({"agent": None}, "claim_mismatch"),
    ({"idempotency_key": "thread:t-1//call-1#2"}, "claim_mismatch"),
    ({"intent_id": "call-2"}, "claim_mismatch"),
])
def test_every_claim_that_does_not_prove_the_request_is_refused(change, reason):
    fences = replace(signed(), **change)
    assert refusal(verifier(), fences).reason == reason


def test_the_token_inflation_request_without_a_claim_is_refused():
    forged = parse_headers([(b"fencing-token", b"lead%3AL-7=9223372036854775807"),
                            (b"idempotency-key", b'"x#1"')])
    error = refusal(verifier(), forged)
    assert error.reason == "claim_missing"
    assert problem_from_error(error).status == 401


def test_a_claim_for_another_service_expired_or_from_the_future_is_refused():
    assert refusal(verifier(), signed(audience="billing")).reason == "claim_wrong_audience"
    assert problem_from_error(refusal(verifier(), signed(audience="billing"))).status == 403
    expired = refusal(verifier(at=NOW + 10 + 5.5), signed())  # exp + skew passed
    assert (expired.reason, expired.lock_key) == ("claim_expired", "lead:L-7")
    assert verifier(at=NOW + 10 + 4.5).verify(signed())  # within the skew
    assert refusal(verifier(at=NOW - 6), signed()).reason == "claim_expired"  # iat ahead
    assert verifier(at=NOW - 4).verify(signed())
    long_lived = signer().sign(FENCES, HeldFor(dict(FENCES.tokens), remaining=3600))
    assert refusal(verifier(), long_lived).reason == "claim_expired"
    assert verifier(max_lifetime_s=7200).verify(long_lived)


def test_a_rotation_accepts_both_key_ids_and_then_refuses_the_old_one():
    old, new = SigningKey("k1", "ed25519", SEED), generate_signing_key("k2")
    both = verifier(old, new)
    assert both.verify(signed())[0].key_id == "k1"
    assert both.verify(signer(new).sign(FENCES, HeldFor(dict(FENCES.tokens))))[0].key_id == "k2"
    error = refusal(verifier(new), signed())
    assert (error.reason, error.key_id) == ("claim_unknown_key", "k1")
    same_id = SigningKey("k1", "ed25519", bytes(32))  # another key under the old id
    assert refusal(verifier(same_id), signed()).reason == "claim_bad_signature"


def test_a_lost_lease_or_a_token_it_does_not_hold_is_never_signed():
    with pytest.raises(LockLost):
        signer().sign(FENCES, HeldFor(dict(FENCES.tokens), lost=True))
    with pytest.raises(LockLost):
        signer().sign(FENCES, HeldFor(dict(FENCES.tokens), remaining=0.0))
    with pytest.raises(ToolGuardError) as caught:
        signer().sign(replace(FENCES, tokens={"lead:L-7": 2**63 - 1}),
                      HeldFor(dict(FENCES.tokens)))
    assert caught.value.reason == "claim_not_held"
    with pytest.raises(ToolGuardError):
        signer().sign(replace(FENCES, agent=None), HeldFor(dict(FENCES.tokens)))


def test_sizes_are_bounded_on_both_sides():
    long_key = Fences(tokens={"k" * 1500: 1}, idempotency_key="x", agent="a")
    with pytest.raises(WireError):
        signer().sign(long_key, HeldFor(dict(long_key.tokens)))
    many = {f"lead:{n}": n + 1 for n in range(40)}
    with pytest.raises(WireError):
        signer().sign(replace(FENCES, tokens=many), HeldFor(many))
    assert len(ED25519_CLAIM) < MAX_CLAIM_BYTES
    keys = Keyring([SigningKey("k1", "ed25519", SEED)])
    with pytest.raises(ClaimRefused):
        parse_claims("x" * 9000, keys)
    with pytest.raises(ClaimRefused):
        parse_claims("tgf1.ed25519.k1." + "A" * 3000 + ".AA", keys)


def test_a_signed_but_odd_payload_is_malformed_not_trusted():
    key = SigningKey("k1", "ed25519", SEED)
    good = Claim("crm", "lead:L-7", 1764000000000042, 1764000010000, 1764000000000,
                 "intent_scorer", "thread:t-1//call-1#1", "call-1", "k1")
    for bad in (replace(good, token=0), replace(good, agent=""), replace(good, issued_ms=True)):
        text = encode_claim(bad, key)
        assert refusal(verifier(), replace(FENCES, claims=text)).reason == "claim_malformed"


def test_refusals_are_problems_and_typed_errors_again_on_the_client():
    error = refusal(verifier(), replace(signed(), agent="other_agent"))
    problem = problem_from_error(error)
    assert (problem.status, problem.mcp_code) == (403, -32079)
    assert problem.body()["field"] == "Toolguard-Agent" and problem.body()["key"] == "lead:L-7"
    again = error_from_problem(problem.body())
    assert isinstance(again, ClaimRefused) and again.reason == "claim_mismatch"
    assert Problem("claim_missing", "x").mcp_code == -32078


def test_the_scope_of_an_answer_is_injective():
    assert scoped_key("k#1", audience="crm", agent="a") == "crm/a/k#1"
    assert scoped_key("k#1", audience=None, agent=None) == "//k#1"
    pairs = [("a/b", "c"), ("a", "b/c"), ("a%2Fb", "c")]
    assert len({scoped_key("k", audience=a, agent=b) for a, b in pairs}) == 3


def test_wiring_mistakes_raise_to_the_developer():
    with pytest.raises(GuardMisconfigured):
        FenceSigner("not a key", audience="crm")  # type: ignore[arg-type]
    with pytest.raises(GuardMisconfigured):
        FenceSigner(SigningKey("k1", "ed25519", SEED), audience="")
    with pytest.raises(GuardMisconfigured):
        ClaimVerifier(audience="crm", keys={"k1": "secret"})  # type: ignore[dict-item]
    with pytest.raises(GuardMisconfigured):
        ClaimVerifier(audience="crm", keys=Keyring([SigningKey("k1", "ed25519", SEED)]),
                      max_skew_s=float("nan"))
    with pytest.raises(FenceKeyError):
        Keyring([])


# --- keys: texts, files, environment -----------------------------------------------------------


def test_a_key_that_cannot_be_read_says_where_and_why(tmp_path):
    missing = tmp_path / "nope.key"
    with pytest.raises(FenceKeyError, match="no such file"):
        load_signing_key(missing)
    garbage = tmp_path / "garbage.key"
    garbage.write_text("hello\n")
    garbage.chmod(0o600)
    with pytest.raises(FenceKeyError, match="not a toolguard fence key"):
        load_signing_key(garbage)
    public = tmp_path / "public.key"
    public.write_text(ED25519_PUBLIC + "\n")
    public.chmod(0o600)
    with pytest.raises(FenceKeyError, match="public key"):
        load_signing_key(public)
    private = tmp_path / "private.key"
    private.write_text(ED25519_PRIVATE + "\n")
    private.chmod(0o644)
    with pytest.raises(FenceKeyError, match="chmod 600"):
        load_signing_key(private)
    with pytest.raises(FenceKeyError, match="private key"):
        load_keyring(environ={"TOOLGUARD_FENCE_VERIFY_KEYS": ED25519_PRIVATE})
    with pytest.raises(FenceKeyError, match="twice"):
        load_keyring(environ={"TOOLGUARD_FENCE_VERIFY_KEYS": f"{ED25519_PUBLIC} {ED25519_PUBLIC}"})
    with pytest.raises(FenceKeyError, match="TOOLGUARD_FENCE_SIGNING_KEY"):
        load_signing_key(environ={})
    with pytest.raises(FenceKeyError, match="base64url"):
        parse_signing_key("tgk1.ed25519-private.k1.AAE=")


def test_keys_load_from_files_and_from_the_environment(tmp_path):
    key = generate_signing_key("k2")
    path = write_signing_key(key, tmp_path / "k2.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(FenceKeyError, match="exists"):
        write_signing_key(key, path)
    assert load_signing_key(path) == key
    assert load_signing_key(environ={"TOOLGUARD_FENCE_SIGNING_KEY_FILE": str(path)}) == key
    assert load_signing_key(environ={"TOOLGUARD_FENCE_SIGNING_KEY": key.text()}) == key
    ring_file = tmp_path / "service.keys"
    ring_file.write_text(f"# rotation: k1 until Friday\n{ED25519_PUBLIC}\n{key.public().text()}\n")
    assert sorted(load_keyring(ring_file)) == ["k1", "k2"]
    env = {"TOOLGUARD_FENCE_VERIFY_KEYS": f"{ED25519_PUBLIC},{key.public().text()}"}
    assert sorted(load_keyring(environ=env)) == ["k1", "k2"]
    secret_ring = tmp_path / "secret.keys"
    secret_ring.write_text(HMAC_SECRET + "\n")
    os.chmod(secret_ring, 0o644)
    with pytest.raises(FenceKeyError, match="chmod 600"):
        load_keyring(secret_ring)
    assert "material" not in repr(key) and key.text() not in repr(key)


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(
    st.text(max_size=300),
    st.builds(lambda head, tail: head + tail, st.sampled_from(
        ["tgf1.ed25519.k1.", "tgf1.hs256.k1.", ED25519_CLAIM[:-10], ED25519_CLAIM + ","]),
        st.text(alphabet="AZaz09-_.,= ", max_size=200))))
def test_whatever_the_claim_field_holds_the_answer_is_a_refusal_or_a_proof(text):
    fences = replace(FENCES, claims=text)
    try:
        claims = verifier().verify(fences)
    except ClaimRefused as error:
        assert error.reason in ("claim_missing", "claim_malformed", "claim_unknown_key",
                                "claim_bad_signature", "claim_mismatch", "claim_expired")
    else:
        assert [c.token for c in claims] == [1764000000000042]
