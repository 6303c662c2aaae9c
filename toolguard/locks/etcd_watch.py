"""The etcd backend's deletion watch: how a waiter learns that the entry ahead is gone.

One watch per backend object on the whole queue prefix (an HTTP stream read by
one thread, not etcd3gw's watcher, which costs a thread pool per watch and closes
its client's connection pool when stopped) rings the doorbell (``_Wake``) of the
waiter just behind each deleted entry: a thread's event, or a future on an asyncio
task's loop. Separate from ``toolguard.locks.etcd`` because it is a thread and a
stream of its own, shared by the sync and asyncio backends, that only borrows the
backend's endpoints and client factory; it survives compaction by waking every
waiter once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import requests

from toolguard.locks.etcd_wire import _b64, _prefix_end, _unb64

if TYPE_CHECKING:
    from toolguard.locks.etcd import EtcdBackend


class _Wake:
    """A waiter's doorbell: a thread's event, and for asyncio a future on its loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.event = threading.Event()
        self.loop = loop
        self.future: asyncio.Future[None] | None = loop.create_future() if loop else None

    def ring(self) -> None:
        self.event.set()
        if self.loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                self.loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result(None)


class _DeletionWatch:
    """One watch on every queue entry's deletion, rung into the local waiters' doorbells.

    ``subscribe(key, seen)`` rings at once when ``key`` was deleted after revision
    ``seen`` and the deletion has already streamed past, or when the stream cannot
    vouch for that range (it started later, or history was compacted): a spurious
    ring only costs the waiter one read, a missed one would cost it a poll.
    """

    RECENT = 4096  # deletions remembered for subscribers that arrive just after them
    IDLE_S = 30.0  # an idle stream is re-opened (from where it was) after this long

    def __init__(self, backend: EtcdBackend, queue_root: bytes) -> None:
        self._backend = backend
        self._root = queue_root
        self._lock = threading.Lock()
        self._waiting: dict[bytes, list[_Wake]] = {}
        self._recent: OrderedDict[bytes, int] = OrderedDict()
        self._origin = 0  # every deletion at a revision >= origin is streamed or rung
        self._next = 0  # start revision of the next stream
        self._thread: threading.Thread | None = None
        self._response: requests.Response | None = None
        self._stopped = threading.Event()
        self._endpoint = backend._current

    def subscribe(self, key: bytes, seen: int, wake: _Wake) -> None:
        with self._lock:
            if self._thread is None:
                self._origin = self._next = seen + 1
                self._thread = threading.Thread(target=self._run, name="toolguard-etcd-watch",
                                                daemon=True)
                self._thread.start()
            if seen + 1 < self._origin or self._recent.get(key, 0) > seen:
                wake.ring()
                return
            self._waiting.setdefault(key, []).append(wake)

    def unsubscribe(self, key: bytes, wake: _Wake) -> None:
        with self._lock:
            wakes = self._waiting.get(key, [])
            if wake in wakes:
                wakes.remove(wake)
            if not wakes:
                self._waiting.pop(key, None)

    def close(self) -> None:
        self._stopped.set()
        response = self._response
        if response is not None:
            _shutdown(response)
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        pause = 0.05
        while not self._stopped.is_set():
            try:
                self._stream()
                pause = 0.05
            except Exception:  # the stream broke: reopen it from where it was, on the next member
                self._endpoint = (self._endpoint + 1) % len(self._backend.endpoints)
                if self._stopped.wait(pause):
                    return
                pause = min(1.0, pause * 2)

    def _stream(self) -> None:
        client = self._backend._new_client(pool_size=1, endpoint=self._endpoint)
        request: dict[str, str | int | list[str]] = {
            "key": _b64(self._root), "range_end": _b64(_prefix_end(self._root)),
            "filters": ["NOPUT"], "start_revision": self._next}
        body = {"create_request": request}
        try:
            response = client.session.post(client.get_url("/watch"), json=body, stream=True,
                                           timeout=(self._backend.timeout_s, self.IDLE_S))
            self._response = response
            if self._stopped.is_set():
                return
            pending = b""
            for chunk in response.iter_content(chunk_size=None):
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    if line.strip():
                        self._deliver(json.loads(line).get("result", {}))
        except requests.exceptions.ConnectionError:
            if not self._stopped.is_set():
                raise
        finally:
            self._response = None
            client.session.close()

    def _deliver(self, result: dict[str, Any]) -> None:
        compacted = int(result.get("compact_revision", 0))
        if compacted or result.get("canceled"):  # history is gone: ring everyone, start afresh
            with self._lock:
                self._origin = self._next = max(self._next, compacted)
                wakes = [w for group in self._waiting.values() for w in group]
                self._waiting.clear()
            for wake in wakes:
                wake.ring()
            msg = f"etcd watch cancelled (compacted at {compacted})"
            raise RuntimeError(msg)
        rung: list[_Wake] = []
        with self._lock:
            for event in result.get("events", []):
                key, revision = _unb64(event["kv"]["key"]), int(event["kv"]["mod_revision"])
                self._recent[key] = revision
                self._recent.move_to_end(key)
                rung.extend(self._waiting.pop(key, []))
                self._next = max(self._next, revision + 1)
            while len(self._recent) > self.RECENT:
                self._recent.popitem(last=False)
        for wake in rung:
            wake.ring()


def _shutdown(response: requests.Response) -> None:
    """Unblock the thread reading a streamed response (closing alone does not wake a recv)."""
    with contextlib.suppress(Exception):
        sock = socket.fromfd(response.raw._fp.fileno(), socket.AF_INET, socket.SOCK_STREAM)
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    with contextlib.suppress(Exception):
        response.close()
