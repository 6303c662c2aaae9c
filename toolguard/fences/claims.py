"""Signed fence claims: a service trusts a fencing token only when a guard signed it.

Beside ``Fencing-Token`` a signed request carries ``Fencing-Claim`` (MCP
``_meta["toolguard/fencing-claim"]``): one claim per lock key, comma-separated::

    claim     = "tgf1." alg "." key-id "." payload "." signature
    alg       = "ed25519" / "hs256"                 ; fixed by the key, never chosen by the claim
    key-id    = 1*64( ALPHA / DIGIT / "_" / "-" )
    payload   = base64url( JSON object )            ; no padding
    signature = base64url( sign( "tgf1." alg "." key-id "." payload ) )

The payload is a JSON object with exactly these members::

    aud  the service the claim is for (its audience)      string
    key  the lock key                                      string
    tok  its fencing token                                 integer 1 .. 2^63-1
    exp  when the lease expires, Unix milliseconds          integer
    iat  when the claim was signed, Unix milliseconds       integer
    agt  the agent                                         string
    idk  the request's Idempotency-Key, or null (a read)   string / null
    iid  the intent (tool-call) id, or null                string / null

What is signed is the exact text before the last dot, so the verifier needs no
canonical JSON; the algorithm and key id are inside it, so neither can be
swapped. The service picks the key by id from its own ``Keyring`` and refuses a
claim whose ``alg`` is not that key's. Verification order (first failure wins,
each with its reason, audited once, nothing touched):

``claim_missing`` (401) no claim, or a fenced key without one;
``claim_malformed`` (401) not this grammar, oversized, a key claimed twice;
``claim_unknown_key`` (401) a key id the service does not hold, or another algorithm;
``claim_bad_signature`` (401) the signature does not verify;
``claim_expired`` (401) ``exp`` passed, ``iat`` in the future, or longer-lived than allowed
(each with ``max_skew_s`` of leeway for the two clocks);
``claim_wrong_audience`` (403) signed for another service;
``claim_mismatch`` (403) its token, agent, idempotency key or intent id is not the
request's (``field`` names which), or a claim for a key the request does not fence.

A refusal carries the claims that held in themselves (``ClaimRefused.proven``: signed,
for this service, in time), so that its audit row names what they signed and marks the
request's other values unproven (``toolguard.fences.proof``).

Sizes: the whole field is at most ``MAX_FIELD_BYTES`` (8,192) bytes like every
fence field, each claim at most ``MAX_CLAIM_BYTES``; a lease whose claims do not
fit is refused by the client before anything is sent.

Client side, ``FenceSigner(key, audience=...).sign(fences, lease)`` adds the
claims to ``Fences`` from the lease in hand: a lost lease raises ``LockLost``
and is never signed. Server side, ``ClaimVerifier(audience=..., keys=...)`` is
given to ``FenceMiddleware`` / ``FenceToolMiddleware`` as ``claims=``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from toolguard.errors import GuardMisconfigured, LockLost, ToolGuardError
from toolguard.fences.keys import Keyring, SigningKey, VerifyingKey
from toolguard.fences.wire import (
    AGENT_HEADER,
    CLAIM_HEADER,
    FENCING_TOKEN_HEADER,
    IDEMPOTENCY_KEY_HEADER,
    INTENT_HEADER,
    MAX_FIELD_BYTES,
    Fences,
    WireError,
)

__all__ = [
    "CLAIM_REASONS",
    "DEFAULT_MAX_LIFETIME_S",
    "DEFAULT_MAX_SKEW_S",
    "MAX_CLAIM_BYTES",
    "VERSION",
    "Claim",
    "ClaimRefused",
    "ClaimVerifier",
    "FenceSigner",
    "HeldLease",
    "check_signer",
    "encode_claim",
    "parse_claims",
]

VERSION = "tgf1"
#: Each claim's bound; with ``MAX_FIELD_BYTES`` for the field, a lease of a few dozen keys fits.
MAX_CLAIM_BYTES = 2048
DEFAULT_MAX_SKEW_S = 5.0
DEFAULT_MAX_LIFETIME_S = 600.0
_MAX_TOKEN = 2**63 - 1
_MAX_MS = 2**53  # the integers every JSON reader keeps exactly
_MAX_TEXT = 1024

_ALG_OF = {"ed25519": "ed25519", "hmac-sha256": "hs256"}
_CLAIM = re.compile(r"tgf1\.(ed25519|hs256)\.([A-Za-z0-9_-]{1,64})\.([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]+)")
_MEMBERS = frozenset({"aud", "key", "tok", "exp", "iat", "agt", "idk", "iid"})
_SIGNATURE_BYTES = {"ed25519": 64, "hs256": 32}

#: Reason -> HTTP status of a refused claim (401: not proven; 403: proven, but not this request).
CLAIM_REASONS: Mapping[str, int] = {
    "claim_missing": 401,
    "claim_malformed": 401,
    "claim_unknown_key": 401,
    "claim_bad_signature": 401,
    "claim_expired": 401,
    "claim_wrong_audience": 403,
    "claim_mismatch": 403,
}


class ClaimRefused(ToolGuardError):
    """A fence claim the service does not accept; ``reason`` is one of ``CLAIM_REASONS``.

    ``lock_key`` names the fenced key whose claim failed, ``key_id`` the signing key the
    claim named, ``field`` the request field a ``claim_mismatch`` disagrees with.
    """

    reason = "claim_malformed"

    def __init__(self, message: str, *, reason: str, lock_key: str | None = None,
                 key_id: str | None = None, field: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.lock_key = lock_key
        self.key_id = key_id
        self.field = field
        #: The request's claims that held in themselves (``ClaimVerifier.proven``): what the
        #: refusal's audit row may name.
        self.proven: tuple[Claim, ...] = ()

    def extras(self) -> dict[str, str]:
        """What the problem object names beside the reason (never a signature or a secret)."""
        found = {"key": self.lock_key, "key_id": self.key_id, "field": self.field}
        return {name: value for name, value in found.items() if value is not None}


@dataclass(frozen=True, slots=True)
class Claim:
    """One fence as a guard signed it (see the module docstring for each member)."""

    audience: str
    key: str
    token: int
    expires_ms: int
    issued_ms: int
    agent: str
    idempotency_key: str | None
    intent_id: str | None
    key_id: str

    def payload(self) -> dict[str, Any]:
        return {"aud": self.audience, "key": self.key, "tok": self.token,
                "exp": self.expires_ms, "iat": self.issued_ms, "agt": self.agent,
                "idk": self.idempotency_key, "iid": self.intent_id}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    if len(text) % 4 == 1:
        msg = "bad base64url length"
        raise ValueError(msg)
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64(data) != text:  # one spelling only: no claim has two texts
        msg = "not the canonical base64url spelling"
        raise ValueError(msg)
    return data


def encode_claim(claim: Claim, key: SigningKey) -> str:
    """The claim's wire text, signed with ``key`` (its ``key_id`` must be the key's)."""
    if claim.key_id != key.key_id:
        msg = f"the claim names key id {claim.key_id!r}, signed with {key.key_id!r}"
        raise GuardMisconfigured(msg)
    payload = json.dumps(claim.payload(), separators=(",", ":"), ensure_ascii=False)
    head = f"{VERSION}.{_ALG_OF[key.algorithm]}.{key.key_id}.{_b64(payload.encode('utf-8'))}"
    text = f"{head}.{_b64(key.sign(head.encode('ascii')))}"
    if len(text) > MAX_CLAIM_BYTES:
        msg = (f"the claim for {claim.key!r} is {len(text)} bytes, more than {MAX_CLAIM_BYTES}: "
               f"shorten the lock key or the idempotency key")
        raise WireError(msg, field=CLAIM_HEADER)
    return text


def parse_claims(text: str, keys: Mapping[str, VerifyingKey]) -> list[Claim]:
    """Check every claim's grammar and signature against ``keys``; ``ClaimRefused`` otherwise."""
    claims, failure = _parse_prefix(text, keys)
    if failure is not None:
        raise failure
    return claims


def _parse_prefix(text: str, keys: Mapping[str, VerifyingKey]
                  ) -> tuple[list[Claim], ClaimRefused | None]:
    """The claims parsed in order up to the first that fails, and that failure (or None)."""
    if len(text) > MAX_FIELD_BYTES:
        msg = f"{CLAIM_HEADER} is longer than {MAX_FIELD_BYTES} bytes"
        return [], ClaimRefused(msg, reason="claim_malformed")
    claims = []
    for position, raw in enumerate(text.split(","), start=1):
        try:
            claims.append(_parse_one(raw.strip(" \t"), position, keys))
        except ClaimRefused as failure:
            return claims, failure
    return claims, None


def _parse_one(raw: str, position: int, keys: Mapping[str, VerifyingKey]) -> Claim:
    where = f"{CLAIM_HEADER} claim {position}"
    if len(raw) > MAX_CLAIM_BYTES:
        msg = f"{where} is longer than {MAX_CLAIM_BYTES} bytes"
        raise ClaimRefused(msg, reason="claim_malformed")
    match = _CLAIM.fullmatch(raw)
    if match is None:
        msg = f"{where} is not {VERSION}.<alg>.<key id>.<payload>.<signature>"
        raise ClaimRefused(msg, reason="claim_malformed")
    alg, key_id, payload_text, signature_text = match.groups()
    key = keys.get(key_id)
    if key is None:
        msg = f"{where} is signed with key id {key_id!r}, which this service does not hold"
        raise ClaimRefused(msg, reason="claim_unknown_key", key_id=key_id)
    if _ALG_OF[key.algorithm] != alg:
        msg = f"{where} says {alg}, and this service's key {key_id!r} is {key.algorithm}"
        raise ClaimRefused(msg, reason="claim_unknown_key", key_id=key_id)
    try:
        signature = _unb64(signature_text)
    except (ValueError, binascii.Error):
        signature = b""
    head = raw[:-len(signature_text) - 1]
    if len(signature) != _SIGNATURE_BYTES[alg] or not key.verify(head.encode("ascii"), signature):
        msg = f"{where}: the signature does not verify with key {key_id!r}"
        raise ClaimRefused(msg, reason="claim_bad_signature", key_id=key_id)
    try:  # signed by a key the service trusts: only now is the payload read
        payload = json.loads(_unb64(payload_text).decode("utf-8"))
    except (ValueError, binascii.Error, UnicodeDecodeError):
        msg = f"{where}: the payload is not base64url JSON"
        raise ClaimRefused(msg, reason="claim_malformed", key_id=key_id) from None
    return _claim(payload, key_id, where)


def _claim(payload: object, key_id: str, where: str) -> Claim:
    def fail(what: str) -> ClaimRefused:
        return ClaimRefused(f"{where}: {what}", reason="claim_malformed", key_id=key_id)

    if not isinstance(payload, dict) or set(payload) != _MEMBERS:
        raise fail(f"the payload is an object with exactly {sorted(_MEMBERS)}")

    def text(name: str, *, optional: bool = False) -> Any:
        value = payload[name]
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value or len(value) > MAX_FIELD_BYTES:
            raise fail(f"{name!r} is a non-empty string")
        return value

    def integer(name: str, top: int) -> int:
        value = payload[name]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= top:
            raise fail(f"{name!r} is an integer in 1..{top}")
        return value

    return Claim(audience=text("aud"), key=text("key"), token=integer("tok", _MAX_TOKEN),
                 expires_ms=integer("exp", _MAX_MS), issued_ms=integer("iat", _MAX_MS),
                 agent=text("agt"), idempotency_key=text("idk", optional=True),
                 intent_id=text("iid", optional=True), key_id=key_id)


class HeldLease(Protocol):
    """What signing needs of a lease: its tokens, and whether (and how long) it still holds."""

    @property
    def tokens(self) -> Mapping[str, int]: ...

    def check(self) -> None: ...

    def remaining_s(self) -> float: ...


def _check_audience(audience: object, where: str) -> str:
    if not isinstance(audience, str) or not audience or len(audience) > _MAX_TEXT or any(
            c < " " or c == "\x7f" for c in audience):
        msg = f"{where}: audience must be the service's name (a non-empty line of text), got {audience!r}"
        raise GuardMisconfigured(msg)
    return audience


class FenceSigner:
    """Signs a request's fences for one service (its ``audience``) with the guard's key.

    ``sign(fences, lease)`` is the one way in: it checks the lease first (a lost
    lease raises ``LockLost``), refuses a token the lease does not hold, and sets
    each claim's expiry to the lease's. A gateway that forwards calls holds a
    lease of its own and signs with it in the same way.
    """

    def __init__(self, key: SigningKey, *, audience: str,
                 clock: Callable[[], float] = time.time) -> None:
        given: object = key  # untyped callers may pass anything
        if not isinstance(given, SigningKey):
            msg = f"FenceSigner needs a SigningKey (load_signing_key(...)), got {key!r}"
            raise GuardMisconfigured(msg)
        self.key = given
        self.audience = _check_audience(audience, "FenceSigner")
        self._clock = clock

    def sign(self, fences: Fences, lease: HeldLease) -> Fences:
        """``fences`` with ``claims`` set: one claim per key, from the lease in hand."""
        lease.check()
        remaining = lease.remaining_s()
        if remaining <= 0:  # a lease at its deadline is lost, whatever its flag says yet
            msg = f"the lease on {', '.join(sorted(fences.tokens))} is at its deadline: not signed"
            raise LockLost(msg, keys=tuple(sorted(fences.tokens)))
        if not fences.tokens:
            msg = "nothing to sign: the request carries no fencing token"
            raise ToolGuardError(msg, reason="no_fences")
        if not fences.agent:
            msg = "a signed claim names its agent: the call has none"
            raise ToolGuardError(msg, reason="no_identity")
        held = lease.tokens
        now = self._clock()
        issued = int(now * 1000)
        expires = max(issued + 1, math.floor((now + remaining) * 1000))
        parts = []
        for lock_key in sorted(fences.tokens):
            token = fences.tokens[lock_key]
            if held.get(lock_key) != token:
                msg = (f"the lease in hand holds {lock_key!r} at {held.get(lock_key)!r}, not "
                       f"{token}: only the lease's own tokens are signed")
                raise ToolGuardError(msg, reason="claim_not_held")
            claim = Claim(audience=self.audience, key=lock_key, token=token, expires_ms=expires,
                          issued_ms=issued, agent=fences.agent,
                          idempotency_key=fences.idempotency_key, intent_id=fences.intent_id,
                          key_id=self.key.key_id)
            parts.append(encode_claim(claim, self.key))
        text = ", ".join(parts)
        if len(text) > MAX_FIELD_BYTES:
            msg = (f"the lease's {len(parts)} claims take {len(text)} bytes, more than "
                   f"{MAX_FIELD_BYTES}: a signed call holds fewer or shorter keys")
            raise WireError(msg, field=CLAIM_HEADER)
        return replace(fences, claims=text)

    def __repr__(self) -> str:
        return f"FenceSigner(audience={self.audience!r}, key_id={self.key.key_id!r})"


def check_signer(signer: object, where: str) -> FenceSigner | None:
    """``signer`` if it is a ``FenceSigner`` or None; ``GuardMisconfigured`` otherwise."""
    if signer is not None and not isinstance(signer, FenceSigner):
        msg = f"{where}: signer must be a FenceSigner(key, audience=...) or None, got {signer!r}"
        raise GuardMisconfigured(msg)
    return signer


class ClaimVerifier:
    """A service's check of a request's claims: its ``audience``, the ``keys`` it trusts.

    ``max_skew_s`` is the leeway for the signer's clock against this host's (an
    expiry that passed less than that long ago still counts, an ``iat`` up to
    that far ahead too); ``max_lifetime_s`` bounds ``exp - iat``, and so how
    long a captured claim could be sent again.
    """

    def __init__(self, *, audience: str, keys: Keyring | Mapping[str, VerifyingKey],
                 max_skew_s: float = DEFAULT_MAX_SKEW_S,
                 max_lifetime_s: float = DEFAULT_MAX_LIFETIME_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.audience = _check_audience(audience, "ClaimVerifier")
        if not isinstance(keys, Keyring):
            if not isinstance(keys, Mapping) or not all(
                    isinstance(k, VerifyingKey) and k.key_id == i for i, k in keys.items()):
                msg = f"ClaimVerifier: keys is a Keyring (load_keyring(...)), got {keys!r}"
                raise GuardMisconfigured(msg)
            keys = Keyring(keys.values())
        self.keys = keys
        for name, value in (("max_skew_s", max_skew_s), ("max_lifetime_s", max_lifetime_s)):
            if (not isinstance(value, int | float) or isinstance(value, bool)
                    or not math.isfinite(value) or value < 0):
                msg = f"ClaimVerifier: {name} must be a finite number >= 0, got {value!r}"
                raise GuardMisconfigured(msg)
        if max_lifetime_s <= 0:
            msg = "ClaimVerifier: max_lifetime_s must be above 0"
            raise GuardMisconfigured(msg)
        self.max_skew_s = float(max_skew_s)
        self.max_lifetime_s = float(max_lifetime_s)
        self._clock = clock

    def verify(self, fences: Fences) -> tuple[Claim, ...]:
        """The request's claims, each checked; ``ClaimRefused`` at the first that fails.

        A refusal carries the claims that held in themselves (``proven``), so that its
        audit row names what they signed, not what the request's other fields say.
        """
        if fences.claims is None:
            msg = (f"this service accepts only signed fences: the request carries "
                   f"{FENCING_TOKEN_HEADER} without {CLAIM_HEADER}")
            raise ClaimRefused(msg, reason="claim_missing")
        claims, failure = _parse_prefix(fences.claims, self.keys)
        now_ms = self._clock() * 1000
        try:
            if failure is not None:
                raise failure
            seen: set[str] = set()
            for claim in claims:
                self._check_claim(claim, now_ms)
                self._check_request(claim, fences)
                if claim.key in seen:
                    msg = f"{CLAIM_HEADER} claims {claim.key!r} twice"
                    raise ClaimRefused(msg, reason="claim_malformed", lock_key=claim.key)
                seen.add(claim.key)
            unclaimed = sorted(set(fences.tokens) - seen)
            if unclaimed:
                msg = f"the fence on {unclaimed[0]!r} has no claim: every fenced key needs its own"
                raise ClaimRefused(msg, reason="claim_missing", lock_key=unclaimed[0])
        except ClaimRefused as refused:
            refused.proven = self._holding(claims, now_ms)
            raise
        return tuple(claims)

    def proven(self, fences: Fences) -> tuple[Claim, ...]:
        """The request's claims that hold in themselves, whatever else it carries; never raises.

        Each is signed by a trusted key, for this service, and in time: what it names
        (agent, idempotency key, intent, fences) is the guard's word. Claims after the
        first that does not parse are not read (as ``verify`` reads none of them).
        """
        if fences.claims is None:
            return ()
        claims, _ = _parse_prefix(fences.claims, self.keys)
        return self._holding(claims, self._clock() * 1000)

    def _holding(self, claims: list[Claim], now_ms: float) -> tuple[Claim, ...]:
        held = []
        for claim in claims:
            try:
                self._check_claim(claim, now_ms)
            except ClaimRefused:
                continue
            held.append(claim)
        return tuple(held)

    def _check_claim(self, claim: Claim, now_ms: float) -> None:
        """The claim in itself: for this service, not expired, not issued ahead, not too long."""
        skew_ms = self.max_skew_s * 1000
        if claim.audience != self.audience:
            raise _refuse(claim, "claim_wrong_audience",
                          f"signed for {claim.audience!r}, and this service is {self.audience!r}")
        if claim.expires_ms + skew_ms < now_ms:
            ago = (now_ms - claim.expires_ms) / 1000
            raise _refuse(claim, "claim_expired", f"its lease expired {ago:.1f} s ago")
        if claim.issued_ms - skew_ms > now_ms:
            ahead = (claim.issued_ms - now_ms) / 1000
            raise _refuse(claim, "claim_expired", f"issued {ahead:.1f} s in the future (clock "
                                                  f"skew over {self.max_skew_s:g} s)")
        if claim.expires_ms - claim.issued_ms > self.max_lifetime_s * 1000:
            raise _refuse(claim, "claim_expired",
                          f"valid for longer than {self.max_lifetime_s:g} s")

    @staticmethod
    def _check_request(claim: Claim, fences: Fences) -> None:
        """The request against the claim: its token, agent, idempotency key and intent."""
        token = fences.tokens.get(claim.key)
        if token is None:
            raise _refuse(claim, "claim_mismatch", "the request carries no fence for this key",
                          FENCING_TOKEN_HEADER)
        if token != claim.token:
            raise _refuse(claim, "claim_mismatch", f"signed for token {claim.token}, and "
                                                   f"{FENCING_TOKEN_HEADER} says {token}",
                          FENCING_TOKEN_HEADER)
        for field, signed, sent in ((AGENT_HEADER, claim.agent, fences.agent),
                                    (IDEMPOTENCY_KEY_HEADER, claim.idempotency_key,
                                     fences.idempotency_key),
                                    (INTENT_HEADER, claim.intent_id, fences.intent_id)):
            if signed != sent:
                raise _refuse(claim, "claim_mismatch",
                              f"signed for another {field} than the request's", field)

    def __repr__(self) -> str:
        return f"ClaimVerifier(audience={self.audience!r}, keys={sorted(self.keys)})"


def _refuse(claim: Claim, reason: str, what: str, field: str | None = None) -> ClaimRefused:
    return ClaimRefused(f"the claim for {claim.key!r}: {what}", reason=reason,
                        lock_key=claim.key, key_id=claim.key_id, field=field)
