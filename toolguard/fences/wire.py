"""The wire format of fences that travel: HTTP headers and MCP ``_meta``, one place.

A fenced request carries four values:

============================  ==============================  =====================================
HTTP header                   MCP ``_meta`` key               value
============================  ==============================  =====================================
``Idempotency-Key``           ``toolguard/idempotency-key``   the request's idempotency key
``Fencing-Token``             ``toolguard/fencing-token``     every lock key of the lease and its token
``Toolguard-Agent``           ``toolguard/agent``             the agent, for the service's audit log
``Toolguard-Intent``          ``toolguard/intent``            the intent (tool-call) id, for the audit log
============================  ==============================  =====================================

``Fencing-Token`` (the same text in ``_meta``) is a comma-separated list::

    Fencing-Token = fence *( OWS "," OWS fence )          ; at most MAX_FENCES, no key twice
    fence         = key "=" token
    key           = 1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "%" HEXUP HEXUP )
    token         = %x31-39 *18DIGIT                      ; 1 .. 2^63 - 1, no leading zero

``key`` is the lock key's UTF-8 bytes with every byte outside the RFC 3986
unreserved set percent-encoded in upper-case hex, and only those: each key has
exactly one spelling, so the encoding is injective and decoding gives back the
exact key (``lead:L-7`` travels as ``lead%3AL-7``). The parser refuses any other
spelling. Why not an RFC 8941 Dictionary: its keys allow only ``a-z 0-9 _ - . *``
(no upper case, no ``%``), so lock keys cannot be keys; and an sf-integer has at
most 15 digits, while toolguard's hybrid-clock tokens (microseconds) have 16.

The three text fields are RFC 8941 sf-strings (``"thread:t-1/%2F/call-1#1"``,
printable ASCII with ``\\"`` and ``\\\\`` escaped), as the IETF httpapi
idempotency-key draft defines ``Idempotency-Key``; text outside printable
ASCII travels as an RFC 9651 Display String (``%"caf%c3%a9"``). In ``_meta`` they
are plain JSON strings. Every field may appear once: a repeated header line is
refused rather than combined.

This module is pure (no I/O): the client, the ASGI middleware and the MCP
middleware share it, and the parser is fuzzed on its own.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from toolguard.errors import ToolGuardError

__all__ = [
    "AGENT_HEADER",
    "CLAIM_HEADER",
    "FENCING_TOKEN_HEADER",
    "IDEMPOTENCY_KEY_HEADER",
    "INTENT_HEADER",
    "MAX_FENCES",
    "MAX_FIELD_BYTES",
    "META_KEYS",
    "REPLAYED_HEADER",
    "SAFE_METHODS",
    "Fences",
    "WireError",
    "decode_fences",
    "decode_text",
    "encode_fences",
    "encode_key",
    "encode_text",
    "parse_headers",
    "parse_meta",
    "request_digest",
]

IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
FENCING_TOKEN_HEADER = "Fencing-Token"
AGENT_HEADER = "Toolguard-Agent"
INTENT_HEADER = "Toolguard-Intent"
#: The signed claims of the fences (``toolguard.fences.claims``): ASCII, parsed by the verifier.
CLAIM_HEADER = "Fencing-Claim"
#: Methods that change nothing: fenced when they carry fences, but never given an idempotency key.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
#: Response header on a replayed response (the recorded one, not a new run).
REPLAYED_HEADER = "Idempotent-Replayed"

#: MCP ``_meta`` key for each header (a ``toolguard/`` prefix, as the MCP spec asks of custom keys).
META_KEYS: Mapping[str, str] = {
    IDEMPOTENCY_KEY_HEADER: "toolguard/idempotency-key",
    FENCING_TOKEN_HEADER: "toolguard/fencing-token",
    AGENT_HEADER: "toolguard/agent",
    INTENT_HEADER: "toolguard/intent",
    CLAIM_HEADER: "toolguard/fencing-claim",
}
_META_PREFIX = "toolguard/"
_HEADER_NAMES = {name.lower().encode("ascii"): name for name in META_KEYS}

#: Bounds that keep a hostile header from costing memory or CPU (each field, encoded).
MAX_FIELD_BYTES = 8192
MAX_FENCES = 256
_MAX_TOKEN = 2**63 - 1

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_KEY = re.compile(r"(?:[A-Za-z0-9._~-]|%[0-9A-F]{2})+")
_TOKEN = re.compile(r"[1-9][0-9]{0,18}")
_OWS = " \t"
_HEX = "0123456789abcdef"


class WireError(ToolGuardError):
    """A fence header or ``_meta`` value that is malformed, oversized or repeated.

    ``field`` names the header; the message says what is wrong and where. The
    service answers 400 (HTTP) or an invalid-params error (MCP) and changes nothing.
    """

    reason = "invalid_fence_header"

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class Fences:
    """What a fenced request carries: its idempotency key, the lease's tokens, who and which call.

    ``tokens`` is empty and ``idempotency_key`` None when the request carried
    none; the service decides whether that is allowed.
    """

    tokens: Mapping[str, int] = field(default_factory=dict)
    idempotency_key: str | None = None
    agent: str | None = None
    intent_id: str | None = None
    #: The ``Fencing-Claim`` text as it came (checked by ``ClaimVerifier``), or None.
    claims: str | None = None

    @property
    def present(self) -> bool:
        """True if the request carried any fence field at all."""
        return bool(self.tokens) or any(v is not None for v in (self.idempotency_key, self.agent,
                                                               self.intent_id, self.claims))

    def headers(self) -> dict[str, str]:
        """The HTTP headers for these values (absent values are left out)."""
        out: dict[str, str] = {}
        if self.tokens:
            out[FENCING_TOKEN_HEADER] = encode_fences(self.tokens)
        for name, value in self._texts():
            if value is not None:
                out[name] = encode_text(value, field=name)
        if self.claims is not None:
            out[CLAIM_HEADER] = _claim_text(self.claims, CLAIM_HEADER)
        return out

    def meta(self) -> dict[str, str]:
        """The MCP ``_meta`` entries for these values (absent values are left out)."""
        out: dict[str, str] = {}
        if self.tokens:
            out[META_KEYS[FENCING_TOKEN_HEADER]] = encode_fences(self.tokens)
        for name, value in self._texts():
            if value is not None:
                _check_text(value, name)
                _check_size(value, name)  # what the server refuses is refused before it leaves
                out[META_KEYS[name]] = value
        if self.claims is not None:
            out[META_KEYS[CLAIM_HEADER]] = _claim_text(self.claims, META_KEYS[CLAIM_HEADER])
        return out

    def _texts(self) -> tuple[tuple[str, str | None], ...]:
        return ((IDEMPOTENCY_KEY_HEADER, self.idempotency_key), (AGENT_HEADER, self.agent),
                (INTENT_HEADER, self.intent_id))


# --- Fencing-Token --------------------------------------------------------------------------


def encode_key(key: str) -> str:
    """The one spelling of ``key`` on the wire: UTF-8, every non-unreserved byte as ``%XX``."""
    if not isinstance(key, str) or not key:
        msg = f"a lock key is a non-empty string, got {key!r}"
        raise WireError(msg, field=FENCING_TOKEN_HEADER)
    try:
        data = key.encode("utf-8")
    except UnicodeEncodeError:
        msg = f"lock key {key!r} is not valid Unicode (lone surrogate)"
        raise WireError(msg, field=FENCING_TOKEN_HEADER) from None
    if any(b < 0x20 or b == 0x7F for b in data):
        msg = f"lock key {key!r} has a control character"
        raise WireError(msg, field=FENCING_TOKEN_HEADER)
    return "".join(chr(b) if b in _UNRESERVED else f"%{b:02X}" for b in data)


def encode_fences(tokens: Mapping[str, int]) -> str:
    """``Fencing-Token`` text for ``tokens`` (sorted by key, so equal leases give equal text)."""
    if not tokens:
        msg = "a lease has at least one key"
        raise WireError(msg, field=FENCING_TOKEN_HEADER)
    if len(tokens) > MAX_FENCES:
        msg = f"more than {MAX_FENCES} lock keys"
        raise WireError(msg, field=FENCING_TOKEN_HEADER)
    parts = []
    for key in sorted(tokens):
        token = tokens[key]
        if not isinstance(token, int) or isinstance(token, bool) or not 0 < token <= _MAX_TOKEN:
            msg = f"the token of {key!r} must be an integer in 1..2^63-1, got {token!r}"
            raise WireError(msg, field=FENCING_TOKEN_HEADER)
        parts.append(f"{encode_key(key)}={token}")
    text = ", ".join(parts)
    if len(text) > MAX_FIELD_BYTES:
        msg = f"longer than {MAX_FIELD_BYTES} bytes: the lease has too many or too long keys"
        raise WireError(msg, field=FENCING_TOKEN_HEADER)
    return text


def decode_fences(text: str, *, field: str = FENCING_TOKEN_HEADER) -> dict[str, int]:
    """Parse ``Fencing-Token`` text strictly; raise ``WireError`` saying what and where."""
    _check_size(text, field)
    tokens: dict[str, int] = {}
    for position, raw in enumerate(text.split(","), start=1):
        member = raw.strip(_OWS)
        where = f"member {position}"
        if not member:
            msg = f"{where} is empty"
            raise WireError(msg, field=field)
        if len(tokens) >= MAX_FENCES:
            msg = f"more than {MAX_FENCES} lock keys"
            raise WireError(msg, field=field)
        wire_key, equals, wire_token = member.partition("=")
        if not equals:
            msg = f"{where}: expected key=token, got {_shown(member)}"
            raise WireError(msg, field=field)
        if not _KEY.fullmatch(wire_key):
            msg = f"{where}: the key {_shown(wire_key)} is not percent-encoded text"
            raise WireError(msg, field=field)
        key = _decode_key(wire_key, where, field)
        if not _TOKEN.fullmatch(wire_token) or int(wire_token) > _MAX_TOKEN:
            msg = f"{where}: the token {_shown(wire_token)} is not an integer in 1..2^63-1"
            raise WireError(msg, field=field)
        if key in tokens:
            msg = f"{where}: the key {_shown(wire_key)} appears twice"
            raise WireError(msg, field=field)
        tokens[key] = int(wire_token)
    return tokens


def _decode_key(wire_key: str, where: str, field: str) -> str:
    data = bytearray()
    index = 0
    while index < len(wire_key):
        char = wire_key[index]
        if char == "%":
            data.append(int(wire_key[index + 1:index + 3], 16))
            index += 3
        else:
            data.append(ord(char))
            index += 1
    try:
        key = data.decode("utf-8")
    except UnicodeDecodeError:
        msg = f"{where}: the key {_shown(wire_key)} is not UTF-8"
        raise WireError(msg, field=field) from None
    try:
        canonical = encode_key(key)
    except WireError as error:
        msg = f"{where}: {error.message.partition(': ')[2]}"
        raise WireError(msg, field=field) from None
    if canonical != wire_key:
        msg = (f"{where}: the key {_shown(wire_key)} is not in its one spelling "
               f"({canonical}): encode exactly the bytes outside A-Z a-z 0-9 - . _ ~")
        raise WireError(msg, field=field)
    return key


# --- text fields: sf-string / Display String ---------------------------------------------------


def _check_text(value: str, field: str) -> None:
    """Non-empty, valid Unicode, no control characters (no store could audit a NUL)."""
    if not isinstance(value, str) or not value:
        msg = f"expected a non-empty string, got {value!r}"
        raise WireError(msg, field=field)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        msg = "not valid Unicode (lone surrogate)"
        raise WireError(msg, field=field) from None
    bad = next((c for c in value if c < " " or c == "\x7f"), None)
    if bad is not None:
        msg = f"control character {bad!r} at position {value.index(bad) + 1}"
        raise WireError(msg, field=field)


def encode_text(value: str, *, field: str) -> str:
    """An sf-string for printable ASCII, else an RFC 9651 Display String."""
    _check_text(value, field)
    if all(" " <= c <= "~" for c in value):
        text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    else:
        text = '%"' + "".join(chr(b) if 0x20 <= b <= 0x7E and b not in (0x22, 0x25)
                              else f"%{b:02x}" for b in value.encode("utf-8")) + '"'
    if len(text) > MAX_FIELD_BYTES:
        msg = f"longer than {MAX_FIELD_BYTES} bytes once encoded"
        raise WireError(msg, field=field)
    return text


def decode_text(text: str, *, field: str) -> str:
    """Parse an sf-string or a Display String strictly (surrounding spaces allowed)."""
    _check_size(text, field)
    body = text.strip(" ")
    if body.startswith('"'):
        value = _sf_string(body, field)
    elif body.startswith('%"'):
        value = _display_string(body, field)
    else:
        msg = f"expected a quoted string (\"...\" or %\"...\"), got {_shown(body)}"
        raise WireError(msg, field=field)
    _check_text(value, field)
    return value


def _sf_string(body: str, field: str) -> str:
    out: list[str] = []
    index = 1
    while index < len(body):
        char = body[index]
        if char == "\\":
            following = body[index + 1:index + 2]
            if following not in ('"', "\\"):
                msg = f"character {index + 1}: a backslash escapes only \" or \\"
                raise WireError(msg, field=field)
            out.append(following)
            index += 2
            continue
        if char == '"':
            if index != len(body) - 1:
                msg = f"character {index + 2}: text after the closing quote"
                raise WireError(msg, field=field)
            return "".join(out)
        if not " " <= char <= "~":
            msg = f"character {index + 1}: {char!r} is not printable ASCII"
            raise WireError(msg, field=field)
        out.append(char)
        index += 1
    msg = "no closing quote"
    raise WireError(msg, field=field)


def _display_string(body: str, field: str) -> str:
    data = bytearray()
    index = 2
    while index < len(body):
        char = body[index]
        if char == "%":
            digits = body[index + 1:index + 3]
            if len(digits) != 2 or any(d not in _HEX for d in digits):
                msg = f"character {index + 1}: % must be followed by two lower-case hex digits"
                raise WireError(msg, field=field)
            data.append(int(digits, 16))
            index += 3
            continue
        if char == '"':
            if index != len(body) - 1:
                msg = f"character {index + 2}: text after the closing quote"
                raise WireError(msg, field=field)
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError:
                msg = "the display string is not UTF-8"
                raise WireError(msg, field=field) from None
        if not " " <= char <= "~":
            msg = f"character {index + 1}: {char!r} is not printable ASCII"
            raise WireError(msg, field=field)
        data.append(ord(char))
        index += 1
    msg = "no closing quote"
    raise WireError(msg, field=field)


# --- whole requests ------------------------------------------------------------------------------


def parse_headers(raw: Iterable[tuple[bytes, bytes]]) -> Fences:
    """The fence fields of an ASGI header list; ``WireError`` if one is malformed or repeated.

    Fence fields come from the header section only. Some servers (uvicorn with
    ``--http httptools``) append a chunked body's trailer fields to the same list, after
    the header section, which therefore holds ``Transfer-Encoding``: a fence field listed
    after the ``Transfer-Encoding`` line may be a trailer, and is refused (a proxy that
    filters fence headers may pass trailers through).
    """
    seen: dict[str, str] = {}
    framed = False  # a Transfer-Encoding line came first: what follows may be trailers
    for raw_name, raw_value in raw:
        lowered = raw_name.lower()
        if lowered == b"transfer-encoding":
            framed = True
            continue
        name = _HEADER_NAMES.get(lowered)
        if name is None:
            continue
        if framed:
            msg = ("listed after Transfer-Encoding, where a server may have put a chunked "
                   "trailer: fence fields are read from the header section only, so send "
                   "them before Transfer-Encoding (or with a Content-Length body)")
            raise WireError(msg, field=name)
        if name in seen:
            msg = "the header appears more than once"
            raise WireError(msg, field=name)
        if len(raw_value) > MAX_FIELD_BYTES:
            msg = f"longer than {MAX_FIELD_BYTES} bytes"
            raise WireError(msg, field=name)
        try:
            seen[name] = raw_value.decode("ascii")
        except UnicodeDecodeError:
            msg = "the value has bytes outside ASCII"
            raise WireError(msg, field=name) from None
    return _fences(seen, text=decode_text)


def parse_meta(meta: object) -> Fences:
    """The fence fields of an MCP request's ``_meta`` (keys outside ``toolguard/`` are ignored).

    A key in the ``toolguard/`` namespace that is not one of ``META_KEYS``, matched
    case-insensitively and after Unicode compatibility folding (``Toolguard/Fencing-Token``,
    a full-width letter, a trailing space), is refused: it is a fence the sender meant
    to send, and the exact key may carry another value beside it.
    """
    if meta is None:
        return Fences()
    if not isinstance(meta, Mapping):
        msg = f"expected an object, got {type(meta).__name__}"
        raise WireError(msg, field="_meta")
    known = set(META_KEYS.values())
    for name in meta:
        if not isinstance(name, str) or name in known:
            continue
        folded = unicodedata.normalize("NFKC", name).casefold().strip()
        if folded.startswith(_META_PREFIX):
            closest = next((k for k in known if k == folded), None)
            hint = f" (the key is {closest!r}, exactly)" if closest else ""
            msg = f"not a toolguard _meta key{hint}: toolguard sends only {sorted(known)}"
            raise WireError(msg, field=name if name.isprintable() and len(name) <= 100
                            else _shown(name))
    values: dict[str, str] = {}
    for name, key in META_KEYS.items():
        if key not in meta:
            continue
        value = meta[key]
        if not isinstance(value, str):
            msg = f"expected a string, got {type(value).__name__}"
            raise WireError(msg, field=key)
        _check_size(value, key)
        values[name] = value
    return _fences(values, text=_plain_text, meta=True)


def _plain_text(value: str, *, field: str) -> str:
    _check_text(value, field)
    return value


def _fences(values: Mapping[str, str], *, text: Any, meta: bool = False) -> Fences:
    def name_of(header: str) -> str:
        return META_KEYS[header] if meta else header

    tokens: dict[str, int] = {}
    if FENCING_TOKEN_HEADER in values:
        tokens = decode_fences(values[FENCING_TOKEN_HEADER], field=name_of(FENCING_TOKEN_HEADER))
    texts = {name: text(values[name], field=name_of(name))
             for name in (IDEMPOTENCY_KEY_HEADER, AGENT_HEADER, INTENT_HEADER) if name in values}
    claims = values.get(CLAIM_HEADER)
    return Fences(tokens=tokens, idempotency_key=texts.get(IDEMPOTENCY_KEY_HEADER),
                  agent=texts.get(AGENT_HEADER), intent_id=texts.get(INTENT_HEADER),
                  claims=None if claims is None else _claim_text(claims, name_of(CLAIM_HEADER)))


def _claim_text(value: str, field: str) -> str:
    """The claim field as it travels: printable ASCII within the bound (its grammar is the
    verifier's: ``toolguard.fences.claims``)."""
    if not isinstance(value, str) or not value.strip(_OWS):
        msg = f"expected the signed claims, got {value!r}"[:200]
        raise WireError(msg, field=field)
    _check_size(value, field)
    if not all(" " <= c <= "~" for c in value):
        msg = "the claims are printable ASCII"
        raise WireError(msg, field=field)
    return value.strip(_OWS)


def request_digest(*parts: bytes | str) -> str:
    """SHA-256 (hex) of ``parts``, each length-prefixed so no two part lists hash alike."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


def _check_size(text: str, field: str) -> None:
    """At most ``MAX_FIELD_BYTES`` UTF-8 bytes (a ``_meta`` string may hold any characters)."""
    if len(text) > MAX_FIELD_BYTES or (
            not text.isascii() and len(text.encode("utf-8", "surrogatepass")) > MAX_FIELD_BYTES):
        msg = f"longer than {MAX_FIELD_BYTES} bytes"
        raise WireError(msg, field=field)


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")
