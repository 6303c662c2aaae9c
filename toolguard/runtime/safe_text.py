"""Untrusted values in toolguard's own texts: bounded, and never raising.

A model (or anyone upstream of it) picks the call's id, name and arguments. Any
of them may be a value whose text cannot be built: a 5,000-digit integer
(``str()`` raises ``ValueError`` past Python's 4,300-digit limit), a list nested
1,000 deep (``RecursionError``), an object whose ``__str__`` raises, or text of
megabytes. Every message, log line or audit detail that shows such a value goes
through one of these two functions:

* ``safe_repr(value)``: the value as code shows it (strings quoted), for a
  message that names it (``got 'c1'``, ``got [[[...]]]``);
* ``safe_str(value)``: the value as text, where a field wants the text itself
  (a ``ToolMessage``'s ``tool_call_id`` and ``name``): a string as it is, a small
  number as its digits, anything else as ``safe_repr`` gives it.

Both are bounded (``limit`` characters, with ``...`` where cut) and catch every
exception the value's own methods raise; so does ``text_of(value)``, the
``str()`` of any object (an exception a tool raised, a tool's answer). ``storable_text`` makes text any store
can keep (bounded, NUL and lone surrogates escaped). Pure: no I/O.
"""

from __future__ import annotations

import reprlib
import uuid
from typing import Any

__all__ = ["REPR_LIMIT", "STORED_LIMIT", "TEXT_LIMIT", "safe_repr", "safe_str", "storable_text",
           "text_of"]

#: Characters a ``safe_repr`` keeps by default: enough to recognize a value in a message.
REPR_LIMIT = 80
#: Characters a ``safe_str`` keeps by default: the longest id or name the envelope accepts.
TEXT_LIMIT = 256
#: Bits of an integer shown in full (about 300 digits); a longer one is described by its size.
_MAX_BITS = 1_000


def _digits(value: int) -> str:
    """The decimal text of ``value``, or a description when it is long (never converts it)."""
    if int.bit_length(value) <= _MAX_BITS:  # far below the interpreter's 4,300-digit limit
        return int.__repr__(value)
    approx = int(int.bit_length(value) * 0.30103) + 1
    return f"<an integer of about {approx} digits>"


class _Bounded(reprlib.Repr):
    """``reprlib`` with its depth and size bounds, and integers shown without converting them."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = max(limit, 8)
        self.maxother = max(limit, 8)
        self.maxdict = self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = 6

    def repr_int(self, x: int, level: int) -> str:
        return _digits(x)

    def repr_instance(self, x: Any, level: int) -> str:
        try:
            if isinstance(x, int):  # a bool is repr_bool's; an int subclass lands here
                return _digits(int(x))
            text = repr(x)
        except Exception:
            return f"<{_type_name(x)} object>"
        return _cut(text, self.maxother)


def _type_name(value: Any) -> str:
    try:
        name = type(value).__name__
    except Exception:
        return "object"
    return name if isinstance(name, str) else "object"


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit - 3] + "..." if limit > 3 else text[:max(limit, 0)]


def safe_repr(value: Any, limit: int = REPR_LIMIT) -> str:
    """``repr(value)`` at most ``limit`` characters long, nested at most 3 levels; never raises."""
    try:
        text = _Bounded(limit).repr(value)
    except Exception:
        text = f"<{_type_name(value)} object>"
    return _cut(text, limit)


def safe_str(value: Any, limit: int = TEXT_LIMIT) -> str:
    """``str(value)`` for a string, a small number or a UUID (cut at ``limit``), else ``safe_repr``.

    ``None`` is ``""``. A ``str`` subclass is read as the text it holds, never
    through its own (maybe overridden) methods.
    """
    if value is None:
        return ""
    try:
        if isinstance(value, str):
            return _cut(str.__str__(value), limit)
        if isinstance(value, bool):
            return _cut("True" if value else "False", limit)
        if isinstance(value, int):
            return _cut(_digits(int.__int__(value)), limit)
        if isinstance(value, float):
            return _cut(float.__repr__(value), limit)
        if isinstance(value, uuid.UUID):
            return _cut(uuid.UUID.__str__(value), limit)
    except Exception:
        return f"<{_type_name(value)} object>"
    return safe_repr(value, min(limit, REPR_LIMIT))


#: Characters ``text_of`` keeps by default (the audit detail keeps 2,000).
EXCEPTION_LIMIT = 4_000


def text_of(value: Any, limit: int = EXCEPTION_LIMIT) -> str:
    """``str(value)`` of any object (an exception, a tool's answer), cut at ``limit``; never raises.

    Strings and numbers read as ``safe_str``; an object whose ``__str__``
    raises or recurses without end reads as its ``safe_repr``.
    """
    if value is None or isinstance(value, str | int | float | uuid.UUID):
        return safe_str(value, limit)
    try:
        text = str(value)
    except Exception:
        return safe_repr(value, min(limit, REPR_LIMIT))
    return safe_str(text, limit) if isinstance(text, str) else safe_repr(text, limit)


#: Characters of a name or an id a store keeps (at most 800 bytes: fits any index).
STORED_LIMIT = 200


def storable_text(value: str | None, limit: int = STORED_LIMIT) -> str | None:
    """Untrusted text as every store can keep it: bounded, NUL and lone surrogates escaped."""
    if value is None:
        return None
    text = value[:limit]
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii():
        text = "".join(f"\\u{ord(ch):04x}" if "\ud800" <= ch <= "\udfff" else ch for ch in text)
    return text
