"""The store's schema is this toolguard's, checked once per store before its first call.

A store installed by an older toolguard (or never installed) lacks tables and
columns the call flow writes: the kill switch's pause set, the audit row's
policy version, the quota and approval tables. Every call would then be refused
(``backend_unavailable``, ``store_error``) and reach the model as if the data
were at fault. It is a setup mistake, so it raises ``GuardMisconfigured`` to the
developer (audited where the store still can), naming the fix.

The check costs one query per store and guard; a server that cannot be reached
is not a verdict: the call goes on (and fails as it would), and the next call
checks again.
"""

from __future__ import annotations

from toolguard.errors import GuardMisconfigured
from toolguard.store import AsyncGuardedStore, GuardedStore
from toolguard.store.base import latest_version

__all__ = ["SchemaCheck"]


def _wanted(store: GuardedStore | AsyncGuardedStore) -> int:
    return latest_version("sqlite" if store.dialect == "sqlite" else "postgresql")


def _behind(store: GuardedStore | AsyncGuardedStore, version: int, wanted: int
            ) -> GuardMisconfigured:
    found = "not installed" if version == 0 else f"at version {version}"
    msg = (f"the guard's store ({store!r}) has the toolguard schema {found}, and this toolguard "
           f"needs version {wanted}: run `toolguard db init` (or open the store with "
           f"install=True) before guarding calls")
    return GuardMisconfigured(msg)


class SchemaCheck:
    """Remembers the stores whose schema was found current (a store is checked once)."""

    __slots__ = ("_current",)

    def __init__(self) -> None:
        self._current: set[int] = set()

    def check(self, store: GuardedStore) -> None:
        """Raise ``GuardMisconfigured`` if ``store``'s schema is behind this toolguard."""
        if id(store) in self._current:
            return
        try:
            version = store.schema_version()
        except Exception:  # unreachable now: the call finds out on its own; checked again next time
            return
        wanted = _wanted(store)
        if version < wanted:
            raise _behind(store, version, wanted)
        self._current.add(id(store))

    async def acheck(self, store: AsyncGuardedStore) -> None:
        """The asyncio twin of ``check``."""
        if id(store) in self._current:
            return
        try:
            version = await store.schema_version()
        except Exception:
            return
        wanted = _wanted(store)
        if version < wanted:
            raise _behind(store, version, wanted)
        self._current.add(id(store))
