"""Field paths into tool arguments: ``email``, ``contact.email``, ``items[*].sku``.

One small syntax shared by key templates, constraints and redaction, so a
policy author learns it once. ``[*]`` means every element of a list (or every
value of an object).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

__all__ = ["MISSING", "STAR", "FieldPath"]

#: The path part that stands for every element.
STAR = "*"

_NAME = r"[A-Za-z_][A-Za-z0-9_-]*"
_PATH = re.compile(rf"{_NAME}(?:\.{_NAME}|\[\*\])*")
_PART = re.compile(rf"\.?({_NAME})|\[(\*)\]")


class _Missing:
    """The value at a path that does not exist (distinct from JSON ``null``)."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MISSING"

    def __bool__(self) -> bool:
        return False


MISSING: Any = _Missing()


@dataclass(frozen=True, slots=True)
class FieldPath:
    """A parsed path; ``str(path)`` gives back the text it was parsed from."""

    parts: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> FieldPath:
        """Parse ``a.b[*].c``; raise ``ValueError`` saying what is wrong."""
        given: object = text  # a policy file may hold anything here
        if not isinstance(given, str):
            msg = f"a field path is a string, got {type(given).__name__}"
            raise ValueError(msg)
        if not _PATH.fullmatch(text):
            msg = (f"invalid field path {text!r}: expected names joined by '.', with '[*]' "
                   f"for every element of a list (e.g. contact.email, items[*].sku)")
            raise ValueError(msg)
        parts = tuple(name or STAR for name, star in _PART.findall(text))
        return cls(parts)

    def __str__(self) -> str:
        out = ""
        for part in self.parts:
            out += "[*]" if part == STAR else (f".{part}" if out else part)
        return out

    @property
    def stars(self) -> int:
        """How many ``[*]`` the path holds (templates allow one)."""
        return self.parts.count(STAR)

    @property
    def head(self) -> str:
        """The top-level argument the path starts from."""
        return self.parts[0]

    def resolve(self, data: Any, prefix: str = "args") -> Iterator[tuple[str, Any]]:
        """Yield ``(concrete path, value)``; a part that does not exist yields ``MISSING``.

        ``[*]`` over an empty list yields nothing; over a value that is neither
        a list nor an object it yields that value as ``MISSING``.
        """
        yield from _walk(data, self.parts, prefix)

    # pydantic: accept "a.b" or a FieldPath, serialize back to the text.
    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler
                                     ) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            _coerce_path, serialization=core_schema.plain_serializer_function_ser_schema(str))

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {"type": "string", "pattern": _PATH.pattern}


def _coerce_path(value: Any) -> FieldPath:
    return value if isinstance(value, FieldPath) else FieldPath.parse(value)


def _walk(data: Any, parts: tuple[str, ...], where: str) -> Iterator[tuple[str, Any]]:
    if not parts:
        yield where, data
        return
    part, rest = parts[0], parts[1:]
    if part == STAR:
        if isinstance(data, (list, tuple)):
            for index, item in enumerate(data):
                yield from _walk(item, rest, f"{where}[{index}]")
        elif isinstance(data, Mapping):
            for key, item in data.items():
                yield from _walk(item, rest, f"{where}.{key}")
        else:
            yield f"{where}[*]", MISSING
        return
    child = data.get(part, MISSING) if isinstance(data, Mapping) else MISSING
    if child is MISSING:
        yield f"{where}.{part}", MISSING
        return
    yield from _walk(child, rest, f"{where}.{part}")
