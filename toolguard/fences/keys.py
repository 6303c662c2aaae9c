"""Keys that sign and verify fence claims: one line of text each, typed, with a key id.

A key is one line, so it fits a file or an environment variable::

    tgk1.ed25519-private.<key id>.<base64url of the 32-byte seed>     the guard's signing key
    tgk1.ed25519-public.<key id>.<base64url of the 32-byte public key>  what a service holds
    tgk1.hmac-sha256.<key id>.<base64url of a 32..64-byte secret>    shared by both sides

The kind is part of the text, so a public key can never be taken for an HMAC
secret (the classic "verify HS256 with the RSA public key" confusion), and the
key id is the name a claim carries: a service picks the key by that id from its
own ``Keyring``, never from anything the request says about the algorithm.

Where keys come from:

* ``load_signing_key(path)`` or, without a path, ``TOOLGUARD_FENCE_SIGNING_KEY``
  (the key text) or ``TOOLGUARD_FENCE_SIGNING_KEY_FILE`` (a path);
* ``load_keyring(path)`` or ``TOOLGUARD_FENCE_VERIFY_KEYS`` (key texts separated by
  spaces, commas or new lines) or ``TOOLGUARD_FENCE_VERIFY_KEYS_FILE`` (one per line,
  ``#`` comments). Two key ids at once is how a rotation runs without a refused call.

A file holding a secret (a private key, an HMAC secret) must not be readable by
group or others, as ssh insists for its keys. Every key that cannot be read
raises ``FenceKeyError`` naming the file or the variable and what is wrong.
Ed25519 needs the ``signing`` extra (``cryptography``); HMAC needs nothing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from toolguard.errors import ConfigurationError

__all__ = [
    "SIGNING_KEY_ENV",
    "SIGNING_KEY_FILE_ENV",
    "VERIFY_KEYS_ENV",
    "VERIFY_KEYS_FILE_ENV",
    "Algorithm",
    "FenceKeyError",
    "Keyring",
    "SigningKey",
    "VerifyingKey",
    "generate_signing_key",
    "load_keyring",
    "load_signing_key",
    "parse_signing_key",
    "parse_verifying_key",
    "write_signing_key",
]

SIGNING_KEY_ENV = "TOOLGUARD_FENCE_SIGNING_KEY"
SIGNING_KEY_FILE_ENV = "TOOLGUARD_FENCE_SIGNING_KEY_FILE"
VERIFY_KEYS_ENV = "TOOLGUARD_FENCE_VERIFY_KEYS"
VERIFY_KEYS_FILE_ENV = "TOOLGUARD_FENCE_VERIFY_KEYS_FILE"

Algorithm = Literal["ed25519", "hmac-sha256"]

_PREFIX = "tgk1"
_KEY_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MATERIAL = re.compile(r"[A-Za-z0-9_-]{1,128}")
_HMAC_BYTES = (32, 64)
_MAX_FILE_BYTES = 64 * 1024


class FenceKeyError(ConfigurationError):
    """A fence key that cannot be read: missing, unreadable, malformed, of the wrong kind or
    readable by others. The message names where it came from and what to do."""

    reason = "fence_key"


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    """Strict unpadded base64url (one spelling per byte string)."""
    if not _MATERIAL.fullmatch(text) or len(text) % 4 == 1:
        msg = "not unpadded base64url"
        raise ValueError(msg)
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64encode(data) != text:
        msg = "not the canonical base64url spelling"
        raise ValueError(msg)
    return data


def _ed25519() -> Any:
    from toolguard.runtime.extras import require

    require("signing", "Ed25519 fence keys")
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return ed25519


@dataclass(frozen=True, slots=True)
class VerifyingKey:
    """What a service checks a claim's signature with: an Ed25519 public key or an HMAC secret."""

    key_id: str
    algorithm: Algorithm
    material: bytes = field(repr=False)
    _public: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        public = _checked(self.key_id, self.algorithm, self.material, "public key",
                          lambda ed25519, raw: ed25519.Ed25519PublicKey.from_public_bytes(raw))
        object.__setattr__(self, "_public", public)

    def verify(self, data: bytes, signature: bytes) -> bool:
        """True if ``signature`` is this key's signature of ``data``."""
        if self.algorithm == "hmac-sha256":
            return hmac.compare_digest(hmac.digest(self.material, data, "sha256"), signature)
        from cryptography.exceptions import InvalidSignature

        try:
            self._public.verify(signature, data)
        except InvalidSignature:
            return False
        return True

    def text(self) -> str:
        """The key's one-line text (for an HMAC key, that is the secret: keep it so)."""
        return _key_text("ed25519-public", self.algorithm, self.key_id, self.material)

    @property
    def secret(self) -> bool:
        """True for an HMAC key: whoever can verify with it can also sign."""
        return self.algorithm == "hmac-sha256"


@dataclass(frozen=True, slots=True)
class SigningKey:
    """What a guard signs claims with: an Ed25519 private key or an HMAC secret, and its id."""

    key_id: str
    algorithm: Algorithm
    material: bytes = field(repr=False)
    _private: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        private = _checked(self.key_id, self.algorithm, self.material, "private key (seed)",
                           lambda ed25519, raw: ed25519.Ed25519PrivateKey.from_private_bytes(raw))
        object.__setattr__(self, "_private", private)

    def sign(self, data: bytes) -> bytes:
        if self.algorithm == "hmac-sha256":
            return hmac.digest(self.material, data, "sha256")
        signature: bytes = self._private.sign(data)
        return signature

    def public(self) -> VerifyingKey:
        """The key a service verifies with (for HMAC, the same secret)."""
        if self.algorithm == "hmac-sha256":
            return VerifyingKey(self.key_id, "hmac-sha256", self.material)
        from cryptography.hazmat.primitives import serialization

        raw = self._private.public_key().public_bytes(serialization.Encoding.Raw,
                                                      serialization.PublicFormat.Raw)
        return VerifyingKey(self.key_id, "ed25519", raw)

    def text(self) -> str:
        """The private key's one-line text: write it only to a 0600 file or a secret store."""
        return _key_text("ed25519-private", self.algorithm, self.key_id, self.material)

    def __repr__(self) -> str:
        return f"SigningKey(key_id={self.key_id!r}, algorithm={self.algorithm!r})"


def _checked(key_id: str, algorithm: Algorithm, material: bytes, what: str,
             make: Callable[[Any, bytes], Any]) -> Any:
    """A key's id and material checked; ``make(ed25519, material)`` for an Ed25519 key
    (the ``cryptography`` object), None for an HMAC secret."""
    _check_key_id(key_id)
    if algorithm != "ed25519":
        _check_hmac(material)
        return None
    if len(material) != 32:
        msg = f"an Ed25519 {what} is 32 bytes, got {len(material)}"
        raise FenceKeyError(msg)
    return make(_ed25519(), material)


def _key_text(ed25519_kind: str, algorithm: Algorithm, key_id: str, material: bytes) -> str:
    kind = ed25519_kind if algorithm == "ed25519" else "hmac-sha256"
    return f"{_PREFIX}.{kind}.{key_id}.{_b64encode(material)}"


def _check_key_id(key_id: object) -> None:
    if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
        msg = f"a key id is 1 to 64 of A-Z a-z 0-9 _ -, got {key_id!r}"
        raise FenceKeyError(msg)


def _check_hmac(secret: bytes) -> None:
    if not _HMAC_BYTES[0] <= len(secret) <= _HMAC_BYTES[1]:
        msg = (f"an HMAC-SHA256 secret is {_HMAC_BYTES[0]} to {_HMAC_BYTES[1]} bytes, "
               f"got {len(secret)}")
        raise FenceKeyError(msg)


def generate_signing_key(key_id: str, algorithm: Algorithm = "ed25519") -> SigningKey:
    """A new random key (``secrets``: the operating system's CSPRNG)."""
    if algorithm not in ("ed25519", "hmac-sha256"):
        msg = f"algorithm is 'ed25519' or 'hmac-sha256', got {algorithm!r}"
        raise FenceKeyError(msg)
    return SigningKey(key_id, algorithm, secrets.token_bytes(32))


def _split(text: str, where: str) -> tuple[str, str, bytes]:
    parts = text.strip().split(".")
    if len(parts) != 4 or parts[0] != _PREFIX:
        msg = (f"{where}: not a toolguard fence key (expected "
               f"{_PREFIX}.<kind>.<key id>.<base64url>, as `toolguard keys new` writes)")
        raise FenceKeyError(msg)
    _, kind, key_id, material = parts
    if not _KEY_ID.fullmatch(key_id):
        msg = f"{where}: the key id {key_id[:70]!r} is not 1 to 64 of A-Z a-z 0-9 _ -"
        raise FenceKeyError(msg)
    try:
        data = _b64decode(material)
    except (ValueError, binascii.Error):
        msg = f"{where}: the key material of {key_id!r} is not unpadded base64url"
        raise FenceKeyError(msg) from None
    return kind, key_id, data


def parse_signing_key(text: str, *, where: str = "signing key") -> SigningKey:
    """A ``SigningKey`` from its text; ``FenceKeyError`` naming ``where`` otherwise."""
    kind, key_id, data = _split(text, where)
    if kind == "ed25519-public":
        msg = (f"{where}: {key_id!r} is a public key, which verifies but cannot sign: give "
               f"the guard the private key file `toolguard keys new` wrote")
        raise FenceKeyError(msg)
    if kind not in ("ed25519-private", "hmac-sha256"):
        msg = f"{where}: unknown key kind {kind[:40]!r} (ed25519-private or hmac-sha256)"
        raise FenceKeyError(msg)
    try:
        return SigningKey(key_id, "ed25519" if kind == "ed25519-private" else "hmac-sha256", data)
    except FenceKeyError as error:
        raise FenceKeyError(f"{where}: {error}") from None


def parse_verifying_key(text: str, *, where: str = "verifying key") -> VerifyingKey:
    """A ``VerifyingKey`` from its text. A private Ed25519 key is refused: a service holds
    only public keys (``toolguard keys public FILE`` prints one)."""
    kind, key_id, data = _split(text, where)
    if kind == "ed25519-private":
        msg = (f"{where}: {key_id!r} is a private key; a service holds only the public key "
               f"(`toolguard keys public FILE` prints it)")
        raise FenceKeyError(msg)
    if kind not in ("ed25519-public", "hmac-sha256"):
        msg = f"{where}: unknown key kind {kind[:40]!r} (ed25519-public or hmac-sha256)"
        raise FenceKeyError(msg)
    try:
        return VerifyingKey(key_id, "ed25519" if kind == "ed25519-public" else "hmac-sha256", data)
    except FenceKeyError as error:
        raise FenceKeyError(f"{where}: {error}") from None


class Keyring(Mapping[str, VerifyingKey]):
    """The keys a service accepts claims from, by key id (at least one; ids unique).

    Rotation: add the new key id beside the old one, move the guards to the new
    private key, then drop the old id. Claims signed with a key id not here are
    refused ``claim_unknown_key``.
    """

    def __init__(self, keys: Iterable[VerifyingKey | SigningKey]) -> None:
        found: dict[str, VerifyingKey] = {}
        given: Iterable[object] = keys  # untyped callers may pass anything
        for key in given:
            if isinstance(key, SigningKey):
                key = key.public()
            if not isinstance(key, VerifyingKey):
                msg = f"a Keyring holds VerifyingKey objects, got {key!r}"
                raise FenceKeyError(msg)
            if key.key_id in found:
                msg = f"the key id {key.key_id!r} appears twice: each key needs an id of its own"
                raise FenceKeyError(msg)
            found[key.key_id] = key
        if not found:
            msg = "a Keyring needs at least one key (a service with no key can verify nothing)"
            raise FenceKeyError(msg)
        self._keys = found

    def __getitem__(self, key_id: str) -> VerifyingKey:
        return self._keys[key_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"Keyring({sorted(self._keys)})"


def _read_secret_file(path: Path, *, must_be_private: bool) -> str:
    where = f"key file {str(path)!r}"
    try:
        info = path.stat()
        if info.st_size > _MAX_FILE_BYTES:
            msg = f"{where}: larger than {_MAX_FILE_BYTES} bytes, not a key file"
            raise FenceKeyError(msg)
        if (must_be_private and os.name == "posix"
                and info.st_mode & (stat.S_IRWXG | stat.S_IRWXO)):
            msg = (f"{where}: readable by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
                   f"a secret key must be private: chmod 600 {path}")
            raise FenceKeyError(msg)
        return path.read_text(encoding="utf-8")
    except FenceKeyError:
        raise
    except FileNotFoundError:
        msg = f"{where}: no such file (create one with `toolguard keys new`)"
        raise FenceKeyError(msg) from None
    except (OSError, UnicodeDecodeError) as error:
        msg = f"{where}: cannot be read: {error}"
        raise FenceKeyError(msg) from None


def _key_lines(text: str) -> list[str]:
    lines: list[str] = []
    for line in text.splitlines():
        stripped = line.split("#", 1)[0].strip()
        lines.extend(part for part in re.split(r"[\s,]+", stripped) if part)
    return lines


def load_signing_key(path: str | os.PathLike[str] | None = None, *,
                     environ: Mapping[str, str] | None = None) -> SigningKey:
    """The guard's signing key from ``path``, else ``TOOLGUARD_FENCE_SIGNING_KEY`` (the text)
    or ``TOOLGUARD_FENCE_SIGNING_KEY_FILE`` (a path)."""
    env = os.environ if environ is None else environ
    if path is None and env.get(SIGNING_KEY_ENV):
        if env.get(SIGNING_KEY_FILE_ENV):
            msg = f"set {SIGNING_KEY_ENV} or {SIGNING_KEY_FILE_ENV}, not both"
            raise FenceKeyError(msg)
        return parse_signing_key(env[SIGNING_KEY_ENV], where=SIGNING_KEY_ENV)
    if path is None:
        path = env.get(SIGNING_KEY_FILE_ENV) or None
    if path is None:
        msg = (f"no fence signing key: pass a path, or set {SIGNING_KEY_ENV} (the key) or "
               f"{SIGNING_KEY_FILE_ENV} (its file); `toolguard keys new` makes one")
        raise FenceKeyError(msg)
    file = Path(path)
    lines = _key_lines(_read_secret_file(file, must_be_private=True))
    if len(lines) != 1:
        msg = f"key file {str(file)!r}: expected one key, found {len(lines)}"
        raise FenceKeyError(msg)
    return parse_signing_key(lines[0], where=f"key file {str(file)!r}")


def load_keyring(path: str | os.PathLike[str] | None = None, *,
                 environ: Mapping[str, str] | None = None) -> Keyring:
    """The keys a service verifies with, from ``path`` (one per line) or
    ``TOOLGUARD_FENCE_VERIFY_KEYS`` / ``TOOLGUARD_FENCE_VERIFY_KEYS_FILE``."""
    env = os.environ if environ is None else environ
    if path is None and env.get(VERIFY_KEYS_ENV):
        if env.get(VERIFY_KEYS_FILE_ENV):
            msg = f"set {VERIFY_KEYS_ENV} or {VERIFY_KEYS_FILE_ENV}, not both"
            raise FenceKeyError(msg)
        texts = _key_lines(env[VERIFY_KEYS_ENV])
        return Keyring(parse_verifying_key(text, where=f"{VERIFY_KEYS_ENV} (key {n})")
                       for n, text in enumerate(texts, start=1))
    if path is None:
        path = env.get(VERIFY_KEYS_FILE_ENV) or None
    if path is None:
        msg = (f"no fence verifying keys: pass a path, or set {VERIFY_KEYS_ENV} (the public "
               f"keys) or {VERIFY_KEYS_FILE_ENV} (their file)")
        raise FenceKeyError(msg)
    file = Path(path)
    text = _read_secret_file(file, must_be_private=False)
    keys = [parse_verifying_key(line, where=f"key file {str(file)!r} (key {n})")
            for n, line in enumerate(_key_lines(text), start=1)]
    if any(key.secret for key in keys):  # an HMAC secret signs too: keep its file private
        _read_secret_file(file, must_be_private=True)
    return Keyring(keys)


def write_signing_key(key: SigningKey, path: str | os.PathLike[str]) -> Path:
    """Write ``key`` to a new file with mode 0600 (never over an existing file)."""
    file = Path(path)
    try:
        descriptor = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        msg = f"key file {str(file)!r} exists already: choose another path (keys are never overwritten)"
        raise FenceKeyError(msg) from None
    except OSError as error:
        msg = f"key file {str(file)!r}: cannot be created: {error}"
        raise FenceKeyError(msg) from None
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        os.fchmod(handle.fileno(), 0o600)  # whatever the umask said
        handle.write(key.text() + "\n")
    return file


def fingerprint(key: VerifyingKey | SigningKey) -> str:
    """A short, non-secret name for a key's material (the first 12 hex of its public SHA-256)."""
    public = key.public() if isinstance(key, SigningKey) else key
    digest = hashlib.sha256(public.algorithm.encode() + b"\0" + public.material).hexdigest()
    return digest[:12]
