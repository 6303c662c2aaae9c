"""Text and JSON every store can keep: strict JSON, and text without NUL or lone surrogates.

PostgreSQL and SQLite disagree on what text they accept (PostgreSQL refuses
NUL, neither can keep a lone surrogate); these helpers make both refuse, or
clean, the same way. Separate from the records because the transaction's
result (``dump_json``) and the fence plan's key check use them as well.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from toolguard.errors import StoreError

#: Built once: ``json.dumps`` with these options would build a new encoder on every call.
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
#: Values that come back from a JSON round trip unchanged (exact types, not subclasses).
_JSON_SCALARS = (str, int, bool, type(None))


def dump_json(value: Any, what: str = "result") -> str:
    """Strict JSON text (no NaN, no arbitrary objects), so both stores keep the same value.

    Strings must be valid Unicode: a lone surrogate cannot be UTF-8, which both
    stores keep their text in, so it is refused (``not_json``) and never escaped.
    """
    try:
        text = _JSON.encode(value)
    except (TypeError, ValueError) as error:
        msg = f"the {what} must be JSON-serializable: {error}"
        raise StoreError(msg, reason="not_json") from error
    if not text.isascii() and _SURROGATE.search(text):
        where = _surrogate_path(value, what.rsplit(" ", 1)[-1]) or what
        msg = (f"the {what} must be valid Unicode: {where} holds a lone surrogate, which "
               f"UTF-8 cannot encode")
        raise StoreError(msg, reason="not_json")
    return text


# --- text every store can keep ---------------------------------------------------------------

_SURROGATE = re.compile("[\ud800-\udfff]")


def text_problem(text: str) -> str | None:
    """Why a store cannot keep ``text`` as it is (None if it can).

    PostgreSQL refuses NUL in ``text`` (SQLite keeps it), and neither store can
    keep a lone surrogate (no UTF-8 form): refused the same way on both.
    """
    if "\x00" in text:
        return "contains NUL (U+0000)"
    if not text.isascii() and _SURROGATE.search(text):
        return "is not valid Unicode (a lone surrogate)"
    return None


def storable_text(text: str) -> str:
    """``text`` with NUL and lone surrogates replaced by U+FFFD.

    For the audit log only, which must be written whatever arrives (a tool's
    error message, redacted args): an identity (a key, an idempotency key) is
    refused instead (``text_problem``), never changed.
    """
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    if not text.isascii():
        text = _SURROGATE.sub("\ufffd", text)
    return text


def storable_json(value: Any) -> Any:
    """A JSON value with every string and object key passed through ``storable_text``."""
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, Mapping):
        return {storable_text(k) if isinstance(k, str) else k: storable_json(v)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable_json(v) for v in value]
    return value


def _storable_text(value: str | None) -> str | None:
    return None if value is None else storable_text(value)


def _audit_json(value: Any) -> str:
    """Audit args as JSON text, cleaned first only when they hold text a store refuses."""
    try:
        text = _JSON.encode(value)
    except (TypeError, ValueError) as error:
        msg = f"the audit args must be JSON-serializable: {error}"
        raise StoreError(msg, reason="not_json") from error
    # NUL is escaped as \u0000 in the text (a false alarm on a literal backslash is harmless).
    if "\\u0000" in text or (not text.isascii() and _SURROGATE.search(text)):
        text = _JSON.encode(storable_json(value))
    return text


def _surrogate_path(value: Any, path: str) -> str | None:
    """Where in ``value`` the first string (or object key) with a lone surrogate is."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and _SURROGATE.search(key):
                return f"the key {key!r} of {path}"
            found = _surrogate_path(item, f"{path}[{key!r}]")
            if found:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _surrogate_path(item, f"{path}[{index}]")
            if found:
                return found
    return None
