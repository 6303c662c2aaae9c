"""One call to start: ``open_guard`` builds a ``ToolGuard`` and the connections it owns.

>>> guard = toolguard.open_guard("policy.yml")          # the embedded SQLite default
>>> guard = toolguard.open_guard("policy.yml", locks="redis://127.0.0.1:6379/0",
...                              store="postgresql://app@db/crm")
>>> with guard: ...                                      # or guard.close() / await guard.aclose()

Without URLs it reads the ``TOOLGUARD_*`` settings (``toolguard.config``), else
the embedded SQLite files under ``./.toolguard/``. The guard it returns serves
both faces: ``run`` (and ``invoke``) on a sync lock manager and store opened at
once, so a wrong URL, database or role is a ``ConfigurationError`` here, not at
the first call; ``arun`` (and ``ainvoke``) on an asyncio pair opened in the
event loop that first needs it. An asyncio pool belongs to the loop it first ran
in: a pair opened at import time would fail in the second ``asyncio.run``. So
each loop gets a pair of its own, closed when ``asyncio.run`` ends that loop
(it cancels the tasks left over, the pair's closer among them), or by
``await guard.aclose()``; a loop you run and stop yourself needs the latter.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

from toolguard.config import Settings
from toolguard.errors import ConfigurationError, GuardMisconfigured
from toolguard.guard import ToolGuard
from toolguard.locks import AsyncLockManager, LockManager, connect, connect_async, sqlite_path
from toolguard.policies import Policy, load_policy
from toolguard.policies.reload import PolicyWatcher
from toolguard.runtime.cancellation import finish
from toolguard.runtime.connection_errors import redacted_url
from toolguard.steps.controls import Controls
from toolguard.store import AsyncGuardedStore, GuardedStore, open_async_store, open_store

__all__ = ["OpenedGuard", "open_guard"]

T = TypeVar("T")

PolicySource = str | os.PathLike[str] | Iterable[str | os.PathLike[str]] | Policy | PolicyWatcher

_CLOSED = ("this guard was closed (guard.close() / await guard.aclose()); open another with "
           "toolguard.open_guard(...)")


def open_guard(policy: PolicySource, *, locks: str | None = None, store: str | None = None,
               install: bool = True, lock_options: Mapping[str, Any] | None = None,
               store_options: Mapping[str, Any] | None = None,
               **options: Any) -> OpenedGuard:
    """A ``ToolGuard`` for ``policy`` (a path, paths, a ``Policy`` or a ``PolicyWatcher``)
    whose locks live at ``locks`` and whose store at ``store`` (URLs; ``None``: the
    settings, else the embedded SQLite files).

    ``install=True`` installs or upgrades the store's schema now (False: leave it to
    ``toolguard db init``; a store that is behind is then refused at the first call).
    ``lock_options`` go to ``connect``/``connect_async``, ``store_options`` to
    ``open_store``/``open_async_store``, the rest to ``ToolGuard`` (``schemas=``,
    ``quotas=``, ``pauses=``...). It does its I/O at once (the policy files, the
    store): call it at startup, outside the event loop, or in a thread.
    """
    rules = policy if isinstance(policy, Policy | PolicyWatcher) else load_policy(policy)
    settings = Settings()
    lock_url = _url("lock", locks, settings.resolved_lock_url)
    store_url = _url("store", store, settings.resolved_store_url)
    lock_opts = dict(lock_options or {})
    if locks is None:  # as connect() without a URL: the settings' lock defaults apply
        lock_opts.setdefault("ttl_ms", settings.ttl_ms)
        lock_opts.setdefault("timeout_s", settings.wait_timeout_s)
    store_opts = dict(store_options or {})
    sync_locks = _opened("lock", lock_url, lambda: connect(lock_url, **lock_opts))
    opened: list[Callable[[], None]] = [sync_locks.close]
    try:
        sync_store = _opened("store", store_url,
                             lambda: open_store(store_url, install=install, **store_opts))
        opened.append(sync_store.close)
        return OpenedGuard(rules, locks=sync_locks, store=sync_store, lock_url=lock_url,
                           store_url=store_url, lock_options=lock_opts, store_options=store_opts,
                           **options)
    except BaseException:
        for close in reversed(opened):
            close()
        raise


@dataclass(eq=False)
class _Pair:
    """One event loop's asyncio lock manager and store, and the task that closes them."""

    locks: AsyncLockManager
    store: AsyncGuardedStore
    closer: asyncio.Task[None] | None = field(default=None, repr=False)


class OpenedGuard(ToolGuard):
    """The ``ToolGuard`` ``open_guard`` returns: it owns its connections and closes them.

    ``with guard:`` / ``guard.close()`` close the sync pair; inside a coroutine,
    ``async with guard:`` / ``await guard.aclose()`` close this loop's asyncio pair
    and the sync pair. Every other loop's pair closes when that loop shuts down.
    A closed guard refuses further calls with ``GuardMisconfigured``.
    """

    def __init__(self, policy: Policy | PolicyWatcher, *, locks: LockManager,
                 store: GuardedStore, lock_url: str, store_url: str,
                 lock_options: Mapping[str, Any], store_options: Mapping[str, Any],
                 **options: Any) -> None:
        self.lock_url = lock_url
        self.store_url = store_url
        self._lock_options = dict(lock_options)
        self._store_options = dict(store_options)
        self._pairs: dict[asyncio.AbstractEventLoop, _Pair] = {}
        self._latest: _Pair | None = None  # what a thread without a loop sees (stable ids)
        self._mutex = threading.Lock()
        self._closed = False
        #: The production controls per event loop (None: threads without one); their asyncio
        #: locks and pools belong to one loop, as the pair's do.
        self._controls: dict[asyncio.AbstractEventLoop | None, Controls] = {}
        super().__init__(policy, locks=locks, store=store, **options)

    @property
    def controls(self) -> Controls:
        """The controls built for the running loop's pair, else those of the sync path."""
        found = self._controls.get(_running_loop())
        return found if found is not None else self._controls[None]

    @controls.setter
    def controls(self, value: Controls) -> None:
        self._controls[_running_loop()] = value
        self._controls.setdefault(None, value)

    # The asyncio edges: the pair of the running loop, opened on first use in it.

    @property
    def async_locks(self) -> AsyncLockManager | None:
        pair = self._pair()
        return None if pair is None else pair.locks

    @async_locks.setter
    def async_locks(self, value: AsyncLockManager | None) -> None:
        _refuse_edge("async_locks", value)

    @property
    def async_store(self) -> AsyncGuardedStore | None:
        pair = self._pair()
        return None if pair is None else pair.store

    @async_store.setter
    def async_store(self, value: AsyncGuardedStore | None) -> None:
        _refuse_edge("async_store", value)

    def _pair(self) -> _Pair | None:
        loop = _running_loop()
        if loop is None:  # a thread without a loop (the sync path, a worker thread)
            return self._latest
        with self._mutex:
            if self._closed:
                return None
            pair = self._pairs.get(loop)
            if pair is None:
                for gone in [old for old in self._pairs if old.is_closed()]:
                    del self._pairs[gone]  # a loop closed without cancelling its tasks
                    self._controls.pop(gone, None)
                pair = self._open_pair(loop)
            return pair

    def _open_pair(self, loop: asyncio.AbstractEventLoop) -> _Pair:
        """Open this loop's pair (no I/O: the pools open on their first use, in the loop)."""
        pair = _Pair(connect_async(self.lock_url, **self._lock_options),
                     open_async_store(self.store_url, **self._store_options))
        pair.closer = loop.create_task(self._close_at_loop_end(loop, pair),
                                       name="toolguard: closes the guard's asyncio pair")
        self._pairs[loop] = self._latest = pair
        return pair

    async def _close_at_loop_end(self, loop: asyncio.AbstractEventLoop, pair: _Pair) -> None:
        """Wait until cancelled, then close ``pair``. ``asyncio.run`` cancels the tasks left
        when its coroutine returns, before it closes the loop: the pools close while their
        loop still runs. (psycopg's pool takes a cancellation of its own tasks for a failed
        connection attempt and tries again: it must be closed, not cancelled.)"""
        try:
            await loop.create_future()
        finally:
            with self._mutex:
                if self._pairs.get(loop) is pair:
                    del self._pairs[loop]
                if self._latest is pair:
                    self._latest = None
                self._controls.pop(loop, None)
            try:
                await pair.store.close()
            finally:
                await pair.locks.aclose()

    # --- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the sync lock manager and store (idempotent). Inside a coroutine whose loop
        has a pair open, use ``await guard.aclose()``: closing that pair needs the loop."""
        running = _running_loop()
        with self._mutex:
            if running is not None and running in self._pairs:
                msg = "this guard's asyncio pair is open in the running loop: await guard.aclose()"
                raise GuardMisconfigured(msg)
            if self._closed:
                return
            self._closed = True
            locks, store = self.locks, self.store
        self.locks = self.store = None
        try:
            if store is not None:
                store.close()
        finally:
            if locks is not None:
                locks.close()

    async def aclose(self) -> None:
        """Close the running loop's asyncio pair, then the sync pair (in a thread)."""
        with self._mutex:
            pair = self._pairs.get(asyncio.get_running_loop())
        if pair is not None and pair.closer is not None:
            pair.closer.cancel()
            await finish(asyncio.wait({pair.closer}))
            if not pair.closer.cancelled():
                pair.closer.result()  # the error closing it raised
        await asyncio.to_thread(self.close)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _sync_edges(self) -> tuple[LockManager, GuardedStore]:
        if self._closed:
            raise GuardMisconfigured(_CLOSED)
        return super()._sync_edges()

    def _async_edges(self) -> tuple[AsyncLockManager, AsyncGuardedStore]:
        if self._closed:
            raise GuardMisconfigured(_CLOSED)
        return super()._async_edges()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _refuse_edge(name: str, value: object) -> None:
    if value is not None:
        msg = (f"an opened guard opens its asyncio edges itself, one pair per event loop; "
               f"to give your own {name}=, build a ToolGuard(...)")
        raise GuardMisconfigured(msg)


def _url(role: str, given: str | None, default: Callable[[], str]) -> str:
    """``given`` or the settings' URL; a relative SQLite path made absolute now, so that
    every pair this guard opens later (another loop, another working directory) uses the
    files its sync pair opened."""
    url: object = default() if given is None else given
    if not isinstance(url, str):
        msg = f"open_guard's {role} URL must be a string, got {type(url).__name__}"
        raise ConfigurationError(msg)
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        path = _opened(role, url, lambda: sqlite_path(url))
        return f"sqlite:///{Path(path).resolve()}"
    return url


def _opened(role: str, url: str, make: Callable[[], T]) -> T:
    """``make()``; a plain ``ConfigurationError`` says which URL (without its password)."""
    try:
        return make()
    except ConfigurationError as error:
        if type(error) is not ConfigurationError:  # GuardMisconfigured, MissingExtra...: as is
            raise
        shown = redacted_url(url)
        text = str(error)
        head = "" if shown in text else f" {shown!r}"
        msg = f"open_guard's {role} URL{head}: {text}"
        raise ConfigurationError(msg) from error

