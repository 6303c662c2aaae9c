"""Keeping what a policy redacts out of everything toolguard writes.

``redact:`` names argument paths. Their values are masked in the audit log's
copy of the arguments (``redacted_args``). A tool may echo them, though (a
verified e-mail address in its result, an account number in an error message),
so ``Secrets`` collects the redacted values of one call and ``scrub`` masks
every occurrence of them in what toolguard records about that call: the result
kept for replays (``toolguard_intent.result``), the audit detail and the error
text of a failed intent.

The rule: a redacted text of at least ``MIN_SCRUBBED`` characters is masked
wherever it occurs inside a string (or an object key); a shorter one, and a
redacted number, only where a whole value equals it (so redacting ``pin: 7``
does not mangle every ``7``). Booleans and ``null`` are never masked. The
caller that made the call still gets the tool's result in clear; a replay
returns the recorded, masked result.

Pure: no I/O. Costs nothing for a tool without ``redact:``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from toolguard.policies.decisions import REDACTED
from toolguard.policies.model import ToolPolicy
from toolguard.policies.paths import MISSING

__all__ = ["MIN_SCRUBBED", "Secrets", "scrub", "scrub_text", "secrets_of"]

#: Redacted texts at least this long are masked inside other strings too.
MIN_SCRUBBED = 3


@dataclass(frozen=True, slots=True)
class Secrets:
    """The redacted values of one call, ready to be masked wherever they appear."""

    texts: frozenset[str] = frozenset()
    numbers: frozenset[int | float] = frozenset()
    pattern: re.Pattern[str] | None = None

    def __bool__(self) -> bool:
        return bool(self.texts or self.numbers)

    @classmethod
    def of(cls, values: Iterable[Any]) -> Secrets:
        texts: set[str] = set()
        numbers: set[int | float] = set()
        for value in values:
            if isinstance(value, bool) or value is None:
                continue
            if isinstance(value, int | float):
                numbers.add(value)
                texts.add(json.dumps(value))
            elif isinstance(value, str) and value:
                texts.add(value)
        inside = sorted((t for t in texts if len(t) >= MIN_SCRUBBED), key=len, reverse=True)
        pattern = re.compile("|".join(map(re.escape, inside))) if inside else None
        return cls(frozenset(texts), frozenset(numbers), pattern)


NO_SECRETS = Secrets()


def secrets_of(tool: ToolPolicy, args: Mapping[str, Any]) -> Secrets:
    """The values at ``tool``'s ``redact`` paths in validated JSON ``args`` (every leaf below)."""
    if not tool.redact:
        return NO_SECRETS
    found: list[Any] = []
    for path in tool.redact:
        for _, value in path.resolve(args):
            if value is not MISSING:
                found.extend(_leaves(value))
    return Secrets.of(found)


def scrub(value: Any, secrets: Secrets) -> Any:
    """A copy of the JSON ``value`` with every redacted value masked (see the module doc)."""
    if not secrets:
        return value
    return _scrub(value, secrets)


def scrub_text(text: str, secrets: Secrets) -> str:
    """``text`` with every redacted text of ``MIN_SCRUBBED`` or more characters masked."""
    if secrets.pattern is None or not text:
        return REDACTED if text in secrets.texts else text
    masked = secrets.pattern.sub(REDACTED, text)
    return REDACTED if masked in secrets.texts else masked


def _scrub(value: Any, secrets: Secrets) -> Any:
    if isinstance(value, str):
        return scrub_text(value, secrets)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return REDACTED if value in secrets.numbers else value
    if isinstance(value, Mapping):
        return {scrub_text(str(k), secrets): _scrub(v, secrets) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(item, secrets) for item in value]
    return value


def _leaves(value: Any) -> Iterable[Any]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        else:
            yield item
