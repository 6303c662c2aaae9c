"""What a caller read, checked when it writes: the plan and the verdict (pure: no I/O).

A model reads in one tool call and writes what it decided in a later one. The
store keeps a version per key (advanced by every accepted fenced write) and,
per caller (agent + conversation), the version it last saw of each key. A
read records an observation (``Observe``); a write by the same caller runs a
``ReadCheck`` inside its fenced transaction: every written key the caller has
observed, and every key its decision rests on (``decides``), must still be at
the version it saw, else ``StaleRead``; a key that needs a current
observation and has none is ``Unread``. The dialects fetch the rows
(``Seen``); ``verdict`` decides, the same way for all of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from toolguard.call.intent import bounded_key
from toolguard.errors import ReadCheckFailed, StaleRead, Unread

__all__ = ["Observe", "ReadCheck", "Seen", "caller_of", "observed_detail", "verdict"]


def caller_of(agent: str | None, conversation: str | None) -> str | None:
    """The caller a read belongs to: the agent and its conversation (None without an agent).

    Written as JSON so that no two (agent, conversation) pairs share a caller;
    bounded like an idempotency key (a long one is hashed).
    """
    if not agent:
        return None
    return bounded_key(json.dumps([agent, conversation or ""], ensure_ascii=False,
                                  separators=(",", ":")))


@dataclass(frozen=True, slots=True)
class ReadCheck:
    """What a write's fenced transaction checks of its caller's reads.

    ``required``: every written key needs a current observation (``requires_read``).
    ``decides``: keys read but not written that the decision rests on: each needs a
    current observation, and is share-locked so that its writer cannot commit unseen.
    ``shadow``: a failed check is reported (``ReadCheck`` verdicts on ``tx.would_refuse``)
    and the write applies anyway. ``wait_s`` bounds the wait for a decided key's row.
    """

    caller: str
    decides: tuple[str, ...] = ()
    required: bool = False
    ttl_s: float = 600.0
    wait_s: float = 5.0
    shadow: bool = False

    @property
    def wait_ms(self) -> int:
        return max(1, int(self.wait_s * 1000))


@dataclass(frozen=True, slots=True)
class Observe:
    """A read's plan: record what ``caller`` saw of the keys, at the versions read first."""

    caller: str


@dataclass(frozen=True, slots=True)
class Seen:
    """One key as the check found it: the caller's observation (None: none current) and now."""

    key: str
    decided: bool
    observed: int | None
    current: int
    agent: str | None = None
    intent_id: str | None = None

    @classmethod
    def of(cls, row: Iterable[Any]) -> Seen:
        key, decided, observed, current, agent, intent_id = row
        return cls(str(key), bool(decided), None if observed is None else int(observed),
                   int(current or 0), agent, intent_id)


def verdict(check: ReadCheck, rows: Iterable[Seen]) -> ReadCheckFailed | None:
    """The refusal the rows call for (stale first: it says more), or None."""
    stale: list[Seen] = []
    unread: list[Seen] = []
    for seen in rows:
        if seen.observed is None:
            if seen.decided or check.required:
                unread.append(seen)
        elif seen.observed != seen.current:
            stale.append(seen)
    if stale:
        keys = tuple(s.key for s in stale)
        changes = "; ".join(
            f"{s.key}: read at version {s.observed}, now {s.current} (written by agent "
            f"{s.agent or '?'} in intent {s.intent_id or '?'})" for s in stale)
        return StaleRead(
            f"stale read: {changes}", keys=keys,
            model_words=(f"{_listed(keys)} changed since you read {_it(keys)}; nothing was "
                         f"written. Read {_it(keys)} again, decide again from what {_it_says(keys)}"
                         f" now, then send the new call."))
    if unread:
        keys = tuple(s.key for s in unread)
        why = "the decision rests on" if all(s.decided for s in unread) else "this call writes"
        return Unread(
            f"no current read of {', '.join(keys)} by this caller ({why} "
            f"{_it(keys)}; reads count for {check.ttl_s:g} s)", keys=keys,
            model_words=(f"this call needs a current read of {_listed(keys)}; nothing was "
                         f"written. Read {_it(keys)} first, decide from what {_it_says(keys)}, "
                         f"then send the call."))
    return None


def observed_detail(versions: dict[str, int]) -> str:
    """A read's audit detail: the version it saw of each key (for the operator)."""
    return "observed " + ", ".join(f"{key} at version {version}"
                                   for key, version in sorted(versions.items()))


def _listed(keys: tuple[str, ...]) -> str:
    return ", ".join(keys)


def _it(keys: tuple[str, ...]) -> str:
    return "it" if len(keys) == 1 else "them"


def _it_says(keys: tuple[str, ...]) -> str:
    return "it says" if len(keys) == 1 else "they say"
