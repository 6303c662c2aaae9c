"""The faults and interleavings the lead-qualifier scenario injects, on purpose, every run.

- ``_Faults``: the outermost ``wrap_tool_call`` on every ``ToolNode``: marks the
  stalled call, kills the worker after the scorer's commit on ``L-102``
  (``ConnectionError``, so the ``RetryPolicy`` re-runs it), and reports refusals.
- ``_StallingLocks`` (guard on): the stalled caller freezes right after its lock
  grant, like a process in a GC pause, until a newer holder has written.
- ``_Interleaving`` (guard off): every agent reads a lead before any writes it.

The faults are ordered with events, never with sleeps alone, so every run
tells the same story.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from toolguard.demo.scenario import CRASHES, STALLED, WRITE_TOOLS

__all__ = ["CALL", "DemoEvent", "Faults", "Interleaving", "StallingLocks"]


@dataclass(frozen=True, slots=True)
class DemoEvent:
    """Progress while a pipeline runs (for the CLI's live view)."""

    kind: str  # lead_done | stall | crash | interrupt | resume | rejected | failed | network | late
    lead_id: str
    detail: str = ""
    agent: str | None = None


@dataclass(frozen=True, slots=True)
class Call:
    """One tool call as the harness marked it: who sent it, its id, and whether it stalls."""

    agent: str
    call_id: str
    stalled: bool


#: The call in progress (agent, tool-call id, stalled?), for the tools and the locks.
CALL: ContextVar[Call | None] = ContextVar("toolguard_demo_call", default=None)

_STALL_MAX_S = 10.0
_RENDEZVOUS_TIMEOUT_S = 10.0


class Interleaving:
    """Guard off: every first-turn write on a lead reads before any of them writes.

    That is the interleaving slow model and API calls produce in production; a
    barrier pins it so the unguarded run shows the same anomalies every time.
    The stalled call additionally waits until the others have written.
    """

    def __init__(self, parties: Mapping[str, int]) -> None:
        self._barriers = {lead: threading.Barrier(n) for lead, n in parties.items() if n > 1}
        self._passed: set[str] = set()
        self._writes: Counter[str] = Counter()
        self._cond = threading.Condition()

    def before_write(self, lead_id: str, stalled: bool) -> None:
        barrier = self._barriers.get(lead_id)
        if barrier is None:
            return
        with self._cond:
            first = lead_id not in self._passed
        if first:
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(_RENDEZVOUS_TIMEOUT_S)
            with self._cond:
                self._passed.add(lead_id)
        if stalled:
            with self._cond:
                self._cond.wait_for(lambda: self._writes[lead_id] >= barrier.parties - 1,
                                    _STALL_MAX_S)

    def wrote(self, lead_id: str) -> None:
        with self._cond:
            self._writes[lead_id] += 1
            self._cond.notify_all()


class StallingLocks:
    """A lock manager whose stalled caller freezes right after the grant (a GC pause).

    A paused process renews nothing, so the lease leaves the heartbeat and
    expires on the server; the caller wakes once a newer holder has written
    the key (and at least 1.2 TTLs later), then goes on to its fenced write.
    When the stalled tool was already applied (a second run), nobody will
    write again, so it does not stall.
    """

    def __init__(self, locks: Any, store: Any, notify: Callable[[DemoEvent], None],
                 granted: threading.Event) -> None:
        self._locks = locks
        self._store = store
        self._notify = notify
        self._granted = granted  # the stalled call holds its lock: the others may go
        self._stalled: set[str] = set()
        self._mutex = threading.Lock()

    def acquire(self, keys: Any, *, ttl_ms: int | None = None, timeout_s: float | None = None) -> Any:
        lease = self._locks.acquire(keys, ttl_ms=ttl_ms, timeout_s=timeout_s)
        call = CALL.get()
        if call is not None and call.stalled:
            with self._mutex:
                first = call.call_id not in self._stalled
                self._stalled.add(call.call_id)
            if first:
                self._granted.set()
                self._stall(lease, call)
        return lease

    def _stall(self, lease: Any, call: Call) -> None:
        from toolguard.locks import heartbeat

        lead_id = call.call_id.split(":")[1]
        if any(self._store.has_applied(STALLED[0], key) for key in lease.tokens):
            # A second run: this call and every other one replay their recorded results, so no
            # newer holder will ever write. Waiting for one would only cost _STALL_MAX_S.
            self._notify(DemoEvent("stall", lead_id, agent=call.agent,
                                   detail=f"skipped: {STALLED[0]} was applied in an earlier run, "
                                          f"so this call replays its recorded result"))
            return
        heartbeat().remove(lease)
        started = time.monotonic()
        least = lease.ttl_ms / 1000 * 1.2
        overtaken = False
        while time.monotonic() - started < _STALL_MAX_S:
            overtaken = any(self._store.high_water(key) > token for key, token in lease.tokens.items())
            if overtaken and time.monotonic() - started >= least:
                break
            time.sleep(0.02)
        paused = time.monotonic() - started
        after = "a newer holder wrote meanwhile" if overtaken else "nobody else wrote meanwhile"
        self._notify(DemoEvent("stall", lead_id, agent=call.agent,
                               detail=f"paused {paused:.2f}s holding a {lease.ttl_ms} ms lease "
                                      f"(token {lease.token}); {after}"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._locks, name)


class Faults:
    """The ``wrap_tool_call`` the scenario puts outermost on every ``ToolNode``."""

    def __init__(self, inner: Any, notify: Callable[[DemoEvent], None],
                 granted: threading.Event | None = None) -> None:
        self.inner = inner  # agent -> GuardedToolCalls, or None for the unguarded run
        self.notify = notify
        #: Guarded run: the other first-turn calls on the stalled lead wait until the stalled
        #: call holds the lock, so it is the one overtaken (any order would be possible).
        self.granted = granted
        self._once: set[tuple[str, str, str]] = set()
        self._mutex = threading.Lock()
        self.crashes = 0
        self.stalls = 0

    def _first(self, kind: str, tool: str, lead_id: str) -> bool:
        with self._mutex:
            if (kind, tool, lead_id) in self._once:
                return False
            self._once.add((kind, tool, lead_id))
            return True

    def wrap(self, agent: str) -> Callable[[Any, Any], Any]:
        calls = None if self.inner is None else self.inner(agent)

        def wrapper(request: Any, execute: Callable[[Any], Any]) -> Any:
            call = request.tool_call
            tool, args = str(call.get("name")), call.get("args") or {}
            lead_id = str(args.get("lead_id", "")) if isinstance(args, Mapping) else ""
            stalled = (tool, lead_id) == STALLED and self._first("stall", tool, lead_id)
            if stalled:
                self.stalls += 1
            elif self.granted is not None and lead_id == STALLED[1] and tool in WRITE_TOOLS:
                self.granted.wait(_STALL_MAX_S)
            token = CALL.set(Call(agent, str(call.get("id")), stalled))
            try:
                output = execute(request) if calls is None else calls.wrap_tool_call(request, execute)
            finally:
                CALL.reset(token)
                if stalled and self.granted is not None:
                    self.granted.set()  # e.g. replayed: it never took the lock
            extra = getattr(output, "response_metadata", None) or {}
            verdict = extra.get("toolguard") if isinstance(extra, Mapping) else None
            if verdict and verdict.get("decision") not in ("accepted", "replayed"):
                kind = "failed" if verdict.get("decision") == "failed" else "rejected"
                self.notify(DemoEvent(kind, lead_id, agent=agent,
                                      detail=f"{tool}: {verdict.get('reason')}"))
            if (tool, lead_id) == CRASHES and self._first("crash", tool, lead_id):
                self.crashes += 1
                self.notify(DemoEvent("crash", lead_id, agent=agent,
                                      detail=f"{tool} committed, then the worker died before the "
                                             f"step was checkpointed; RetryPolicy re-runs it"))
                msg = "simulated worker crash after the commit, before the checkpoint"
                raise ConnectionError(msg)
            return output

        return wrapper


