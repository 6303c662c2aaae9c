"""What the etcd backend writes and reads: its key layout and the gateway's JSON.

The keys of one lock under the prefix (``_Names``, ``etcd_keys``), the request
bodies of etcd's HTTP/JSON gateway (base64 keys, ranges, puts that only touch an
entry or mark it held), and what a reply, an entry's value or an owner id says
(``_Seen``, the offset, the epoch, an owner's TTL and presence window). Pure
functions and frozen records, no I/O: separate from ``toolguard.locks.etcd`` so
that the backend's protocol steps there read as steps, and so that tools and
tests can name a lock's keys without a client.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

DEFAULT_PREFIX = "toolguard/lock/"
#: The value of a holder's entry; a waiter's is empty.
HELD = b"h"


def etcd_keys(key: str, prefix: str = DEFAULT_PREFIX) -> tuple[bytes, bytes]:
    """The queue prefix and the floor key of lock ``key`` (for tools and tests)."""
    names = _Names.of(prefix.encode(), key)
    return names.queue, names.floor


# --- the gateway's JSON, built and read by small pure helpers ------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _prefix_end(prefix: bytes) -> bytes:
    """The range end covering every key that starts with ``prefix`` (which ends in '/')."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _range(key: bytes, end: bytes | None = None, *, limit: int = 0, newest_first: bool = False,
           by_creation: bool = False, max_create_revision: int = 0,
           values: bool = False) -> dict[str, Any]:
    request: dict[str, Any] = {"key": _b64(key), "keys_only": end is not None and not values}
    if end is not None:
        request["range_end"] = _b64(end)
    if limit:
        request["limit"] = limit
    if by_creation:
        request["sort_target"] = "CREATE"
        request["sort_order"] = "DESCEND" if newest_first else "ASCEND"
    if max_create_revision:
        request["max_create_revision"] = max_create_revision
    return {"request_range": request}


def _kvs(response: dict[str, Any]) -> list[dict[str, Any]]:
    return list(response.get("response_range", {}).get("kvs", []))


def _touch(key: bytes) -> dict[str, Any]:
    """A put that keeps value and lease: it only moves the entry's mod_revision."""
    return {"request_put": {"key": _b64(key), "ignore_value": True, "ignore_lease": True}}


def _mark_held(key: bytes) -> dict[str, Any]:
    """The grant: a put that keeps the lease and marks the entry as the holder's."""
    return {"request_put": {"key": _b64(key), "value": _b64(HELD), "ignore_lease": True}}


def _owner_of(entry: bytes) -> str:
    return unquote(entry.rsplit(b"/", 1)[-1].decode("ascii", "replace"))


def _owner_ttl_ms(entry: bytes) -> int | None:
    """The TTL carried in an entry's owner id (``base.new_owner``); None if it has none."""
    owner = _owner_of(entry)
    ttl = owner.rsplit(":", 1)[-1]
    return int(ttl) if ttl.isdigit() and ":" in owner else None


def _owner_presence_ms(entry: bytes) -> int | None:
    """How long a waiter's entry may stay untouched: its hand-off TTL (its presence
    window, at most its TTL); an owner id of an older version carries only its TTL."""
    ttl = _owner_ttl_ms(entry)
    if ttl is None:
        return None
    parts = _owner_of(entry).rsplit(":", 2)
    if len(parts) == 3 and parts[1].isdigit():
        return min(int(parts[1]), ttl)
    return ttl


@dataclass(frozen=True, slots=True)
class _Seen:
    """An entry ahead of a contender, as one reply showed it."""

    key: bytes
    mod_revision: int
    held: bool

    @classmethod
    def of(cls, kv: dict[str, Any]) -> _Seen:
        return cls(_unb64(kv["key"]), int(kv["mod_revision"]),
                   _unb64(kv.get("value", "")) == HELD)

    def silence_ms(self) -> int | None:
        """How long this entry may go untouched before a contender removes it."""
        return _owner_ttl_ms(self.key) if self.held else _owner_presence_ms(self.key)


def _offset(response: dict[str, Any]) -> int:
    kvs = _kvs(response)
    return int(_unb64(kvs[0].get("value", "")) or b"0") if kvs else 0


def _epoch(response: dict[str, Any]) -> int | None:
    """The cluster's epoch from a range of the epoch key; None when it is not written yet."""
    kvs = _kvs(response)
    return int(_unb64(kvs[0].get("value", "")) or b"0") if kvs else None


@dataclass(frozen=True, slots=True)
class _Names:
    """The etcd keys of one lock key and one contender."""

    queue: bytes
    entry: bytes
    floor: bytes

    @classmethod
    def of(cls, prefix: bytes, key: str, owner: str = "") -> _Names:
        escaped = quote(key, safe="").encode("ascii")
        queue = prefix + b"q/" + escaped + b"/"
        return cls(queue=queue, entry=queue + quote(owner, safe="").encode("ascii"),
                   floor=prefix + b"floor/" + escaped)

    @property
    def queue_end(self) -> bytes:
        return _prefix_end(self.queue)
