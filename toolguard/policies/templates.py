"""Lock-key templates (``"lead:{lead_id}"``) and the escaping that keeps keys apart.

The promise: for one template, two different argument tuples never render to
the same key. Every value is escaped into a small alphabet (``A-Z a-z 0-9 _ -``
plus ``%`` and ``~``):

* a string keeps its safe characters and percent-encodes every other UTF-8
  byte, so ``:``, ``/``, ``.``, ``{``, ``}``, ``*``, ``%``, NUL and look-alike
  letters (Cyrillic ``\\u0430`` vs Latin ``a``) all stay distinct. Nothing is normalized:
  normalizing would merge inputs that the tool treats as different;
* a non-string scalar carries a type tag the escaped strings never contain:
  ``~i42`` (integer), ``~t`` / ``~f`` (booleans), ``~d1%2E5`` (float). So ``1``,
  ``"1"``, ``True`` and ``1.0`` are four keys. Keep the type of an id the same
  in every tool that locks it (``check_against`` warns when two tools disagree);
* ``null`` or a missing value is refused: a key needs a value;
* an escaped value longer than 256 characters becomes ``~h`` and the SHA-256
  of its escaped text, so every key fits a database index (PostgreSQL's
  b-tree rows hold about 2,700 bytes). ``~h`` is a tag like the others:
  still injective, as far as SHA-256 is collision-free.

Between two placeholders a template needs a separator whose first character is
outside that alphabet (``"{a}:{b}"``, not ``"{a}{b}"``); with it the key can be
parsed back unambiguously, which is what makes rendering injective. Literal text
is printable ASCII without ``{ } * % \\`` and without spaces, so keys stay safe
in Redis (no ``{`` to disturb cluster hash tags), SQL and etcd.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from toolguard.errors import InvalidArguments
from toolguard.policies.paths import MISSING, FieldPath

__all__ = ["ESCAPED_ALPHABET", "MAX_VALUE_CHARS", "KeyTemplate", "escape_text", "escape_value"]

_SAFE = frozenset(string.ascii_letters + string.digits + "_-")
#: Every character an escaped value can contain.
ESCAPED_ALPHABET = _SAFE | {"%", "~"}
_LITERAL = frozenset(chr(c) for c in range(0x21, 0x7F)) - set("{}*%\\")
_MAX_SHOWN = 60
#: Escaped values longer than this are hashed (``~h<sha256>``).
MAX_VALUE_CHARS = 256


_ALL_SAFE = re.compile(r"[A-Za-z0-9_-]*")


def escape_text(text: str) -> str:
    """Percent-encode every UTF-8 byte outside ``A-Z a-z 0-9 _ -``; injective."""
    if _ALL_SAFE.fullmatch(text):  # the usual id: nothing to encode
        return text
    out: list[str] = []
    for char in text:
        if char in _SAFE:
            out.append(char)
        else:
            out.extend(f"%{byte:02X}" for byte in char.encode("utf-8", "surrogatepass"))
    return "".join(out)


def escape_value(value: Any) -> str:
    """One JSON scalar as key text: strings escaped, other scalars type-tagged.

    Raise ``TypeError`` for ``null``, objects and lists, ``ValueError`` for NaN
    and infinities: none of them names one resource. Long values are hashed
    (``MAX_VALUE_CHARS``).
    """
    if isinstance(value, str):
        text = escape_text(value)
        if len(text) > MAX_VALUE_CHARS:
            return f"~h{hashlib.sha256(text.encode('ascii')).hexdigest()}"
        return text
    if isinstance(value, bool):
        return "~t" if value else "~f"
    if isinstance(value, int):
        digits = f"~i{value}"
        if len(digits) > MAX_VALUE_CHARS:
            return f"~h{hashlib.sha256(digits.encode('ascii')).hexdigest()}"
        return digits
    if isinstance(value, float):
        if not math.isfinite(value):
            msg = "a key cannot hold NaN or an infinity"
            raise ValueError(msg)
        return f"~d{escape_text(repr(value))}"
    kind = "null" if value is None else ("a list" if isinstance(value, (list, tuple))
                                         else ("an object" if isinstance(value, Mapping)
                                               else type(value).__name__))
    msg = f"a key needs a string, number or boolean, got {kind}"
    raise TypeError(msg)


@dataclass(frozen=True, slots=True)
class KeyTemplate:
    """A parsed template: literal text around ``{field.path}`` placeholders."""

    text: str
    literals: tuple[str, ...]
    fields: tuple[FieldPath, ...]

    @classmethod
    def parse(cls, text: str) -> KeyTemplate:
        """Parse and check a template; raise ``ValueError`` saying what is wrong."""
        given: object = text  # a policy file may hold anything here
        if not isinstance(given, str):
            msg = f"a key template is a string, got {type(given).__name__}"
            raise ValueError(msg)
        if not text:
            msg = "a key template cannot be empty"
            raise ValueError(msg)
        literals: list[str] = []
        fields: list[FieldPath] = []
        literal = ""
        index = 0
        while index < len(text):
            char = text[index]
            if char == "{":
                end = text.find("}", index + 1)
                inner = text[index + 1:end] if end != -1 else ""
                if end == -1 or "{" in inner:
                    msg = f"unclosed '{{' at column {index + 1} in template {text!r}"
                    raise ValueError(msg)
                try:
                    fields.append(FieldPath.parse(inner.strip()))
                except ValueError as error:
                    msg = f"in template {text!r}: {error}"
                    raise ValueError(msg) from None
                literals.append(literal)
                literal = ""
                index = end + 1
                continue
            if char == "}":
                msg = f"unmatched '}}' at column {index + 1} in template {text!r}"
                raise ValueError(msg)
            if char not in _LITERAL:
                msg = (f"character {char!r} at column {index + 1} is not allowed in the literal "
                       f"text of template {text!r} (printable ASCII without spaces or {{}}*%\\)")
                raise ValueError(msg)
            literal += char
            index += 1
        literals.append(literal)
        for position, between in enumerate(literals[1:-1], start=1):
            if not between or between[0] in ESCAPED_ALPHABET:
                msg = (f"template {text!r}: placeholders {{{fields[position - 1]}}} and "
                       f"{{{fields[position]}}} need a separator such as ':' between them "
                       f"(starting with a character other than letters, digits, _ - % ~), "
                       f"or two argument tuples could render the same key")
                raise ValueError(msg)
        stars = sum(path.stars for path in fields)
        if stars > 1:
            msg = f"template {text!r}: only one [*] per template (it expands to one key per element)"
            raise ValueError(msg)
        return cls(text, tuple(literals), tuple(fields))

    def __str__(self) -> str:
        return self.text

    @property
    def skeleton(self) -> str:
        """The template with placeholders blanked: ``lead:{}``; equal skeletons = same resource kind."""
        return "{}".join(self.literals)

    @property
    def expands(self) -> bool:
        """True when a ``[*]`` makes this template render one key per list element."""
        return any(path.stars for path in self.fields)

    def render(self, args: Mapping[str, Any], *, what: str = "lock key") -> tuple[str, ...]:
        """Keys from JSON-form *validated* args, deduplicated and sorted.

        Raise ``InvalidArguments`` naming the argument when a value is missing,
        ``null``, or not a scalar. A ``[*]`` over an empty list renders no key.
        """
        plain = self._render_plain(args)
        if plain is not None:
            return plain
        choices: list[list[str]] = []
        for path in self.fields:
            values: list[str] = []
            for where, value in path.resolve(args):
                if value is MISSING or value is None:
                    msg = f"{where}: the {what} {_shown(self.text)} needs a value, got " + (
                        "nothing" if value is MISSING else "null")
                    raise InvalidArguments(msg)
                try:
                    values.append(escape_value(value))
                except (TypeError, ValueError) as error:
                    msg = f"{where}: {what} {_shown(self.text)}: {error}"
                    raise InvalidArguments(msg) from None
            choices.append(values)
        keys = {
            "".join(part for pair in itertools.zip_longest(self.literals, combo, fillvalue="")
                    for part in pair)
            for combo in itertools.product(*choices)
        }
        return tuple(sorted(keys))

    def _render_plain(self, args: Mapping[str, Any]) -> tuple[str, ...] | None:
        """The one key of a template without ``[*]`` whose values are all there and
        scalar (the usual call), without the general path; None otherwise (``render``
        then takes the general path, which also names any problem)."""
        values: list[str] = []
        for path in self.fields:
            if path.stars:
                return None
            data: Any = args
            for part in path.parts:
                if type(data) is not dict:
                    return None
                data = data.get(part, MISSING)
            if data is MISSING or data is None:
                return None
            try:
                values.append(escape_value(data))
            except (TypeError, ValueError):
                return None
        pieces = [self.literals[0]]
        for value, literal in zip(values, self.literals[1:], strict=False):
            pieces.append(value)
            pieces.append(literal)
        if len(self.literals) != len(values) + 1:
            return None  # not the shape ``render`` assembles below: let it do the work
        return ("".join(pieces),)

    # pydantic: accept the text or a KeyTemplate, serialize back to the text.
    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler
                                     ) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            _coerce_template, serialization=core_schema.plain_serializer_function_ser_schema(str))

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {"type": "string"}


def _coerce_template(value: Any) -> KeyTemplate:
    return value if isinstance(value, KeyTemplate) else KeyTemplate.parse(value)


def _shown(text: str) -> str:
    return repr(text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN - 3] + "...")
