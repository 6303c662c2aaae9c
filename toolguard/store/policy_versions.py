"""The text of every policy version that decided, kept in the store by its digest.

Every audit row names the policy version that decided (``policy_version``: the
SHA-256 of the policy's canonical content, ``Policy.digest``). A guard writes that
content to ``toolguard_policy_version`` the first time it decides under a
version (one ``INSERT`` per version, store and guard; nothing when it is there
already), together with the YAML files the policy was loaded from, if they
still hash to the same version. The review page and ``toolguard audit show``
then show the rule of the version that decided, not whatever the files on disk
say now.

A stored version is checked when it is read: content that does not hash to its
digest (PostgreSQL also refuses it with a ``CHECK``), or sources that no longer
load to that version, are not shown as the deciding rule.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from toolguard.call.intent import canonical_json
from toolguard.errors import PolicyProblems, ToolGuardError
from toolguard.policies import Policy

__all__ = ["PolicyRecorder", "PolicyText", "arecord_policy_text", "policy_from_texts",
           "policy_text", "read_policy_text", "record_policy_text"]

log = logging.getLogger("toolguard.store")

#: A stored source file: at most this many characters (a policy is a few KB).
MAX_SOURCE_CHARS = 1_000_000
_INSERT = {"postgresql": "INSERT INTO toolguard_policy_version (digest, content, sources) "
                         "VALUES (%s, %s, %s::jsonb) ON CONFLICT (digest) DO NOTHING",
           "sqlite": "INSERT OR IGNORE INTO toolguard_policy_version (digest, content, sources) "
                     "VALUES (?, ?, ?)"}
_SELECT = {"postgresql": "SELECT digest, content, sources::text, first_at "
                         "FROM toolguard_policy_version WHERE digest = %s",
           "sqlite": "SELECT digest, content, sources, first_at FROM toolguard_policy_version "
                     "WHERE digest = ?"}


@dataclass(frozen=True, slots=True)
class PolicyText:
    """One policy version as the store keeps it: its canonical content and its YAML files."""

    digest: str
    content: str
    #: ``(file, text)`` of each YAML file it was loaded from; () when unknown.
    sources: tuple[tuple[str, str], ...] = ()
    first_at: datetime | None = None

    @property
    def intact(self) -> bool:
        """Whether the content hashes to the digest (else it is not that version)."""
        return hashlib.sha256(self.content.encode("utf-8", "surrogatepass")).hexdigest() == \
            self.digest

    def sources_json(self) -> str | None:
        if not self.sources:
            return None
        return json.dumps([{"file": f, "text": t} for f, t in self.sources], ensure_ascii=False)


def _content(policy: Policy) -> str:
    """The canonical JSON ``Policy.digest`` hashes."""
    return canonical_json(policy.model_dump(mode="json", exclude_defaults=True))


def _source_files(policy: Policy) -> list[str]:
    """The files the policy was loaded from, in the order their values were first located."""
    locations = policy._locations  # the loader's record of where each value was written
    return list(dict.fromkeys(loc.file for loc in locations.values() if loc.file))


def policy_text(policy: Policy) -> PolicyText:
    """``policy`` as the store keeps it. Its files are read again and kept only if they
    still load to this very version (a file edited since it was loaded is left out)."""
    digest, content = policy.digest, _content(policy)
    sources: tuple[tuple[str, str], ...] = ()
    files = _source_files(policy)
    if files:
        try:
            texts = tuple((file, Path(file).read_text(encoding="utf-8")) for file in files)
        except (OSError, UnicodeError):
            texts = ()
        if texts and all(len(t) <= MAX_SOURCE_CHARS for _, t in texts):
            try:
                same = policy_from_texts(texts).digest == digest
            except ToolGuardError:
                same = False
            sources = texts if same else ()
    return PolicyText(digest, content, sources)


def policy_from_texts(texts: Sequence[tuple[str, str]]) -> Policy:
    """The policy that YAML ``texts`` (``(file, text)`` each) load to, with each value's
    file:line, as ``load_policy`` would load those files; ``PolicyProblems`` if broken."""
    from toolguard.policies.loader import _merge, _parse, build_policy

    merged: dict[str, Any] = {}
    locations: dict[tuple[str | int, ...], Any] = {}
    problems: list[Any] = []
    for file, text in texts:
        data, where, found = _parse(text, file)
        problems.extend(found)
        problems.extend(_merge(merged, locations, data, where, file))
    if problems:
        raise PolicyProblems(problems)
    return build_policy(merged, locations)


def _row(row: Sequence[Any] | None) -> PolicyText | None:
    if row is None:
        return None
    sources: tuple[tuple[str, str], ...] = ()
    try:
        items = json.loads(row[2]) if row[2] else []
        sources = tuple((str(i["file"]), str(i["text"])) for i in items)
    except (ValueError, TypeError, KeyError):
        sources = ()
    first_at = row[3] if isinstance(row[3], datetime) else None
    if isinstance(row[3], str):
        try:
            first_at = datetime.fromisoformat(row[3].replace("Z", "+00:00"))
        except ValueError:
            first_at = None
    return PolicyText(str(row[0]), str(row[1]), sources, first_at)


def record_policy_text(store: Any, text: PolicyText) -> None:
    """Write ``text`` to ``store`` (a sync store) unless that version is there already."""
    with store.connection() as conn:
        conn.execute(_INSERT[store.dialect], (text.digest, text.content, text.sources_json()))


def read_policy_text(store: Any, digest: str) -> PolicyText | None:
    """The stored version ``digest`` of a sync store (None: not stored, or not a digest)."""
    if not isinstance(digest, str) or len(digest) != 64:
        return None
    with store.connection() as conn:
        return _row(conn.execute(_SELECT[store.dialect], (digest,)).fetchone())


async def arecord_policy_text(store: Any, text: PolicyText) -> None:
    """``record_policy_text`` for an asyncio store."""
    sync = getattr(store, "sync", None)
    if sync is not None:  # the async SQLite store: its sync twin, in a thread
        await asyncio.to_thread(record_policy_text, sync, text)
        return
    async with store.connection() as conn:
        await conn.execute(_INSERT[store.dialect], (text.digest, text.content,
                                                    text.sources_json()))


class PolicyRecorder:
    """Remembers which (store, version) pairs a guard has written, so each costs one
    ``INSERT`` once. A store that cannot be reached is tried again at the next call; the
    call itself goes on (it meets the store's state on its own)."""

    __slots__ = ("_done", "_texts")

    def __init__(self) -> None:
        self._done: set[tuple[int, str]] = set()
        self._texts: dict[str, PolicyText] = {}

    def _text(self, policy: Policy) -> PolicyText:
        found = self._texts.get(policy.digest)
        if found is None:
            found = self._texts[policy.digest] = policy_text(policy)
        return found

    def record(self, store: Any, policy: Policy) -> None:
        key = (id(store), policy.digest)
        if key in self._done:
            return
        if getattr(store, "dialect", None) not in _INSERT:  # a store of the user's own making
            self._done.add(key)
            return
        try:
            record_policy_text(store, self._text(policy))
        except Exception as error:  # the decision stands; the next call tries again
            log.debug("could not record policy version %s: %s", policy.digest[:12], error)
            return
        self._done.add(key)

    async def arecord(self, store: Any, policy: Policy) -> None:
        key = (id(store), policy.digest)
        if key in self._done:
            return
        if getattr(store, "dialect", None) not in _INSERT:
            self._done.add(key)
            return
        try:
            text = self._text(policy) if policy.digest in self._texts else \
                await asyncio.to_thread(policy_text, policy)  # reads the policy's files
            self._texts[policy.digest] = text
            await arecord_policy_text(store, text)
        except Exception as error:
            log.debug("could not record policy version %s: %s", policy.digest[:12], error)
            return
        self._done.add(key)
