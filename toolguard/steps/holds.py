"""The hold step: a read that keeps its key's lock for its caller until the caller writes it.

With ``hold: true`` on a ``reads:`` tool, the read takes its keys' lock (under
its own ``wait_timeout_s``) and the lease stays with its caller (agent +
conversation, ``Prepared.caller``) after the call: the model decides while
nobody else can read-to-write or write the key, and the caller's later write
on the key runs under that lease and its tokens (``run_fenced(held=...)``: no
second acquisition, so no self-deadlock). Another caller waits, or is refused
``lock_timeout``, as for any lock.

A hold ends, whichever comes first, when the caller's write on the key commits
or is refused; at ``guard.release_holds(caller)`` (the end of a ``create_agent``
run calls it); when the read or the caller's wait is cancelled; at
``max_hold_s`` (a reaper thread); when its lease is lost. A dead process's hold
expires with its TTL like any lease. A write after a hold ended otherwise than
by a write is refused ``hold_lost`` until the caller reads the key again; one
that raced the end meets its fence or ``lease_lost``, never applied. Each end
that is not a write leaves an audit row of its own (``hold``/``hold_ended``,
with why); the write's own row is the end of the others.

Deadlocks: a caller that holds keys and waits for more writes its wait into
the store (``toolguard.store.holds``) and searches the wait-for graph when it
starts waiting and every check interval while it waits (at most a heartbeat
interval, at most ``CHECK_S``). The youngest caller on a cycle yields: its
wait ends in ``hold_deadlock`` and every hold it has is released; the others
go on. Holds live in the process that took them: a caller's write must come
through the same process (the same guard) as its read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from toolguard.call.intent import Intent
from toolguard.errors import HoldDeadlock, HoldLost, LockLost, LockTimeout
from toolguard.locks import AsyncLockManager, Lease, LockManager
from toolguard.locks.lease import RENEW_FRACTION
from toolguard.runtime import telemetry
from toolguard.runtime.cancellation import finish
from toolguard.steps.prepared import Prepared
from toolguard.store.base import AuditEntry
from toolguard.store.holds import AsyncBoard, Board, yields
from toolguard.store.reads import caller_of

__all__ = ["CHECK_S", "Holds", "Joined", "WriteLeases", "caller_for", "caller_of_intent"]

log = logging.getLogger("toolguard.holds")

#: Longest a holding caller waits between two searches for a cycle.
CHECK_S = 0.5
#: How long a hold that ended otherwise than by a write refuses its caller's write.
_ENDED_KEPT_S = 3600.0
_MAX_ENDED = 10_000


def caller_for(agent: str, thread: str | None) -> str | None:
    """The caller whose holds ``guard.release_holds`` ends: an agent in one conversation."""
    return caller_of(agent, thread)


def caller_of_intent(intent: Intent) -> str | None:
    """The caller of ``intent`` as the read step counts it (``Prepared.caller``)."""
    flow = intent.workflow
    conversation = flow.conversation if flow.conversation is not None else (
        flow.thread_id or flow.run_id)
    return caller_of(intent.agent, conversation) if isinstance(intent.agent, str) else None


def check_every(ttl_ms: int) -> float:
    """How often a waiting holder looks for a cycle: a heartbeat interval, at most ``CHECK_S``."""
    return max(0.01, min(CHECK_S, ttl_ms / 1000 * RENEW_FRACTION))


@dataclass(eq=False)
class Held:
    """One hold: a lease on the keys a read took, kept for its caller."""

    caller: str
    keys: frozenset[str]
    lease: Lease
    prepared: Prepared
    deadline: float  # time.monotonic(): max_hold_s from the start
    board: Board | AsyncBoard
    store: Any
    loop: asyncio.AbstractEventLoop | None = None
    ended: str | None = None
    started: float = field(default_factory=time.monotonic)

    def entry(self, why: str) -> AuditEntry:
        record = self.prepared.record
        keys = tuple(sorted(self.keys))
        return AuditEntry(
            decision="hold", reason="hold_ended", tool=record.tool, agent=record.agent,
            intent_id=record.intent_id, workflow=record.workflow, keys=keys,
            tokens=dict(self.lease.tokens), policy_version=record.policy_version,
            detail=f"hold on {', '.join(keys)} ended: {why}")


class Joined:
    """The lease a write runs under: the write's keys from the caller's holds and a fresh lease.

    Only the write's own keys are fenced (a hold on keys it does not write is not advanced);
    it is lost or released when any part is.
    """

    def __init__(self, keys: Iterable[str], parts: Iterable[Lease]) -> None:
        self.parts = tuple(parts)
        self.keys = tuple(sorted(keys))
        tokens: dict[str, int] = {}
        for part in self.parts:
            tokens.update({k: t for k, t in part.tokens.items() if k in self.keys})
        self.tokens: Mapping[str, int] = MappingProxyType(tokens)
        self.acquired_at = min(p.acquired_at for p in self.parts)
        self.ttl_ms = min(p.ttl_ms for p in self.parts)

    @property
    def token(self) -> int:
        return max(self.tokens.values())

    @property
    def released(self) -> bool:
        return any(p.released for p in self.parts)

    @released.setter
    def released(self, value: bool) -> None:  # HeldLease's shape; only the parts release
        msg = "a joined lease is released through its parts"
        raise AttributeError(msg)

    @property
    def lost(self) -> bool:
        return any(p.lost for p in self.parts)

    def check(self) -> None:
        for part in self.parts:
            part.check()

    def remaining_s(self) -> float:
        return min(p.remaining_s() for p in self.parts)


@dataclass
class WriteLeases:
    """What a write by a holding caller runs under, and what ends with it."""

    lease: Joined
    holds: list[Held] = field(default_factory=list)
    fresh: Lease | None = None

    def note(self) -> str:
        """What the write's audit row says of the holds it ran under (for the operator)."""
        taken = "; ".join(f"{', '.join(sorted(h.keys))} held since call "
                          f"{h.prepared.record.intent_id}" for h in self.holds)
        return f"under the caller's hold ({taken}), which ends with this write"

    def sync(self, body: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``body`` noting the holds on the write's row (the row of its commit)."""
        if not self.holds:
            return body

        def run(tx: Any) -> Any:
            value = body(tx)
            tx.detail = f"{tx.detail}; {self.note()}" if tx.detail else self.note()
            return value

        return run

    def asynchronous(self, body: Callable[[Any], Awaitable[Any]]
                     ) -> Callable[[Any], Awaitable[Any]]:
        if not self.holds:
            return body

        async def run(tx: Any) -> Any:
            value = await body(tx)
            tx.detail = f"{tx.detail}; {self.note()}" if tx.detail else self.note()
            return value

        return run


class Holds:
    """The holds of one guard, by caller; ended holds remembered to refuse a late write."""

    def __init__(self) -> None:
        self._by_caller: dict[str, list[Held]] = {}
        self._ended: dict[tuple[str, str], tuple[str, float]] = {}
        self._cond = threading.Condition()
        self._reaper: threading.Thread | None = None

    # --- bookkeeping (under _cond, no I/O) ---------------------------------------------

    def holding(self, caller: str | None) -> list[Held]:
        """The caller's live holds."""
        if caller is None:
            return []
        with self._cond:
            return list(self._by_caller.get(caller, ()))

    def _add(self, held: Held) -> None:
        with self._cond:
            self._by_caller.setdefault(held.caller, []).append(held)
            for key in held.keys:
                self._ended.pop((held.caller, key), None)
            if self._reaper is None or not self._reaper.is_alive():
                self._reaper = threading.Thread(target=self._reap, name="toolguard-holds",
                                                daemon=True)
                self._reaper.start()
            self._cond.notify()

    def _take_out(self, held: Held, why: str, remember: bool) -> bool:
        """Unregister ``held``; False if it had ended already."""
        with self._cond:
            if held.ended is not None:
                return False
            held.ended = why
            mine = self._by_caller.get(held.caller, [])
            if held in mine:
                mine.remove(held)
            if not mine:
                self._by_caller.pop(held.caller, None)
            _measure(held, why)
            if remember:
                now = time.monotonic()
                for key in held.keys:
                    self._ended[(held.caller, key)] = (why, now)
                if len(self._ended) > _MAX_ENDED:
                    for old in sorted(self._ended, key=lambda k: self._ended[k][1])[
                            :len(self._ended) - _MAX_ENDED]:
                        del self._ended[old]
        return True

    def _lost_keys(self, caller: str, keys: Iterable[str]) -> dict[str, str]:
        """Keys of the caller whose hold ended otherwise than by a write (and why)."""
        now = time.monotonic()
        with self._cond:
            found = {}
            for key in keys:
                ended = self._ended.get((caller, key))
                if ended is not None and now - ended[1] < _ENDED_KEPT_S:
                    found[key] = ended[0]
            return found

    def _forget_ended(self, caller: str, keys: Iterable[str]) -> None:
        with self._cond:
            for key in keys:
                self._ended.pop((caller, key), None)

    def _reap(self) -> None:
        """End every hold past its ``max_hold_s`` (sync leases here, async ones on their loop)."""
        while True:
            with self._cond:
                now = time.monotonic()
                if not self._by_caller:  # nothing held: the next hold starts a new reaper
                    self._reaper = None
                    return
                due = [h for hs in self._by_caller.values() for h in hs if h.deadline <= now]
                if not due:
                    nxt = min((h.deadline for hs in self._by_caller.values() for h in hs),
                              default=now + 30.0)
                    self._cond.wait(timeout=max(0.001, nxt - now))
                    continue
            for held in due:
                why = f"max_hold_s ({held.prepared.rule.max_hold_s:g} s) passed"
                if not self._take_out(held, why, remember=True):
                    continue
                if held.loop is None:
                    self._free(held, why, True)
                    continue
                freeing = self._afree(held, why, True)
                try:  # an asyncio lease is released on its own loop
                    asyncio.run_coroutine_threadsafe(freeing, held.loop)
                except RuntimeError:  # its loop is closed: stop renewing, let the TTL end it
                    freeing.close()
                    held.lease.mark_lost(LockLost(f"hold ended: {why}", keys=held.lease.keys))

    # --- ending (sync) ------------------------------------------------------------------

    def _end(self, held: Held, why: str, *, remember: bool = True, audit: bool = True) -> None:
        if self._take_out(held, why, remember):
            self._free(held, why, audit)

    def _free(self, held: Held, why: str, audit: bool) -> None:
        """A sync hold taken out of the registry: its row, the release, the graph."""
        if audit:  # first: the row precedes whatever the next holder does
            with contextlib.suppress(Exception):
                held.store.audit(held.entry(why))
        try:
            held.lease.release()
        except Exception as error:  # it lapses with its TTL
            log.warning("could not release a hold on %s: %s", sorted(held.keys), error)
        self._unboard(held)

    def _unboard(self, held: Held) -> None:
        board = held.board
        try:
            if isinstance(board, Board):
                board.freed(held.caller, held.keys)
        except Exception as error:
            log.warning("could not remove a hold from the wait-for graph: %s", error)

    def release(self, caller: str | None, why: str = "released") -> int:
        """End every hold of ``caller`` (sync leases); the number ended."""
        ended = 0
        for held in self.holding(caller):
            if held.loop is not None and _running(held.loop):  # cannot wait for the loop here
                if self._take_out(held, why, remember=True):
                    held.loop.create_task(self._afree(held, why, True))
            elif held.loop is not None:
                if not self._take_out(held, why, remember=True):
                    continue
                freeing = self._afree(held, why, True)
                try:
                    future = asyncio.run_coroutine_threadsafe(freeing, held.loop)
                except RuntimeError:  # its loop is closed: stop renewing, the TTL ends it
                    freeing.close()
                    held.lease.mark_lost(LockLost(f"hold ended: {why}", keys=held.lease.keys))
                else:
                    try:
                        future.result(30)
                    except Exception:  # its loop is stuck: stop renewing, the TTL ends it
                        held.lease.mark_lost(LockLost(f"hold ended: {why}",
                                                      keys=held.lease.keys))
            else:
                self._end(held, why)
            ended += 1
        return ended

    # --- ending (asyncio) ---------------------------------------------------------------

    async def _aend(self, held: Held, why: str, *, remember: bool = True,
                    audit: bool = True) -> None:
        if self._take_out(held, why, remember):
            await finish(self._afree(held, why, audit))  # to its end, whatever is cancelled

    async def _afree(self, held: Held, why: str, audit: bool) -> None:
        """An async hold taken out of the registry: its row, the release, the graph."""
        if audit:  # first: the row precedes whatever the next holder does
            with contextlib.suppress(Exception):
                await held.store.audit(held.entry(why))
        try:
            await held.lease.arelease()
        except Exception as error:
            log.warning("could not release a hold on %s: %s", sorted(held.keys), error)
        board = held.board
        try:
            if isinstance(board, AsyncBoard):
                await board.freed(held.caller, held.keys)
        except Exception as error:
            log.warning("could not remove a hold from the wait-for graph: %s", error)

    async def arelease(self, caller: str | None, why: str = "released") -> int:
        """The asyncio twin of ``release`` (sync leases are released in a thread); taken out of
        the registry at once, then freed to the end whatever is cancelled meanwhile."""
        mine = [h for h in self.holding(caller) if self._take_out(h, why, remember=True)]

        async def free_all() -> None:
            for held in mine:
                if held.loop is None:
                    await asyncio.to_thread(self._free, held, why, True)
                else:
                    await self._afree(held, why, True)

        if mine:
            await finish(free_all())
        return len(mine)

    def taken_by(self, prepared: Prepared | None) -> list[Held]:
        """The holds the call ``prepared`` took (a cancelled call gives them back)."""
        if prepared is None or not prepared.rule.hold or prepared.caller is None:
            return []
        return [h for h in self.holding(prepared.caller) if h.prepared is prepared]

    def drop(self, prepared: Prepared | None) -> None:
        """A hold read was cancelled or interrupted after taking its hold: end it."""
        for held in self.taken_by(prepared):
            self._end(held, "the read was cancelled", remember=False)

    async def adrop(self, prepared: Prepared | None) -> None:
        for held in self.taken_by(prepared):
            await self._aend(held, "the read was cancelled", remember=False)

    # --- acquiring, with deadlock detection ----------------------------------------------

    def _acquire(self, locks: LockManager, board: Board, caller: str, keys: tuple[str, ...],
                 ttl_ms: int, timeout_s: float) -> Lease:
        if not self.holding(caller):  # holds nothing: cannot be on a cycle
            return locks.acquire(keys, ttl_ms=ttl_ms, timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        board.waiting(caller, keys, time.time() + timeout_s + 1.0)
        try:
            while True:
                self._yield_if_cycle(caller, board.graph())
                left = deadline - time.monotonic()
                try:
                    return locks.acquire(keys, ttl_ms=ttl_ms,
                                         timeout_s=max(0.0, min(left, check_every(ttl_ms))))
                except LockTimeout:
                    if time.monotonic() >= deadline:
                        raise
        except HoldDeadlock:
            self.release(caller, "hold_deadlock: another caller needed what it held")
            raise
        finally:
            with contextlib.suppress(Exception):
                board.stopped(caller)

    async def _aacquire(self, locks: AsyncLockManager, board: AsyncBoard, caller: str,
                        keys: tuple[str, ...], ttl_ms: int, timeout_s: float) -> Lease:
        if not self.holding(caller):
            return await locks.acquire(keys, ttl_ms=ttl_ms, timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        try:
            await board.waiting(caller, keys, time.time() + timeout_s + 1.0)
            while True:
                self._yield_if_cycle(caller, await board.graph())
                left = deadline - time.monotonic()
                try:
                    return await locks.acquire(
                        keys, ttl_ms=ttl_ms, timeout_s=max(0.0, min(left, check_every(ttl_ms))))
                except LockTimeout:
                    if time.monotonic() >= deadline:
                        raise
        except HoldDeadlock:
            await finish(self.arelease(caller, "hold_deadlock: another caller needed what it "
                                               "held"))
            raise
        finally:
            with contextlib.suppress(Exception):
                await finish(board.stopped(caller))

    @staticmethod
    def _yield_if_cycle(caller: str, graph: Any) -> None:
        cycle = yields(caller, graph)
        if cycle is not None:
            msg = (f"deadlock: this caller waited in a cycle of holds ({len(cycle)} callers) "
                   f"and was the youngest on it; it yields and its holds are released")
            raise HoldDeadlock(msg)

    # --- the read (sync) ----------------------------------------------------------------

    def read(self, locks: LockManager, store: Any, prepared: Prepared,
             run: Callable[[str], Any]) -> Any:
        """Take (or keep) the hold on the read's keys, then ``run(note)`` the read; the hold is
        kept when the read succeeds, released when it fails or is cancelled."""
        caller, rule = prepared.caller, prepared.rule
        assert caller is not None
        self._forget_ended(caller, prepared.reads)
        for gone in self.holding(caller):
            if gone.lease.lost and gone.keys & set(prepared.reads):
                self._end(gone, "its lease was lost", remember=False)
        mine = self.holding(caller)
        covered = frozenset().union(*(h.keys for h in mine))
        missing = tuple(k for k in prepared.reads if k not in covered)
        if not missing:
            return run(f"; already held by this caller (max_hold_s {rule.max_hold_s:g} s)")
        board = Board(store)
        lease = self._acquire(locks, board, caller, missing, rule.ttl_ms, rule.wait_timeout_s)
        held = Held(caller, frozenset(missing), lease, prepared,
                    time.monotonic() + rule.max_hold_s, board, store)
        kept = False
        try:
            board.held(caller, missing, time.time(), time.time() + rule.max_hold_s)
            decision = run(_note(held))
            kept = bool(getattr(decision, "ok", False))
            return decision
        finally:
            if kept:
                self._add(held)
            else:
                self._take_out(held, "read failed", remember=False)
                with contextlib.suppress(Exception):
                    lease.release()
                self._unboard(held)

    async def aread(self, locks: AsyncLockManager, store: Any, prepared: Prepared,
                    run: Callable[[str], Awaitable[Any]]) -> Any:
        """The asyncio twin of ``read``."""
        caller, rule = prepared.caller, prepared.rule
        assert caller is not None
        self._forget_ended(caller, prepared.reads)
        for gone in self.holding(caller):
            if gone.lease.lost and gone.keys & set(prepared.reads):
                await self._aend(gone, "its lease was lost", remember=False)
        mine = self.holding(caller)
        covered = frozenset().union(*(h.keys for h in mine))
        missing = tuple(k for k in prepared.reads if k not in covered)
        if not missing:
            return await run(f"; already held by this caller (max_hold_s {rule.max_hold_s:g} s)")
        board = AsyncBoard(store)
        lease = await self._aacquire(locks, board, caller, missing, rule.ttl_ms,
                                     rule.wait_timeout_s)
        held = Held(caller, frozenset(missing), lease, prepared,
                    time.monotonic() + rule.max_hold_s, board, store,
                    loop=asyncio.get_running_loop())
        kept = False
        try:
            await board.held(caller, missing, time.time(), time.time() + rule.max_hold_s)
            decision = await run(_note(held))
            kept = bool(getattr(decision, "ok", False))
            return decision
        finally:
            if kept:
                self._add(held)
            else:
                await finish(self._aend(held, "read failed", remember=False, audit=False))

    # --- the write ----------------------------------------------------------------------

    def _plan_write(self, prepared: Prepared) -> tuple[list[Held], tuple[str, ...]] | None:
        """The holds a write runs under and the keys it still has to take; None: no holds."""
        caller = prepared.caller
        if caller is None:
            return None
        lost = self._lost_keys(caller, prepared.keys)
        if lost:
            keys = sorted(lost)
            msg = (f"hold on {', '.join(keys)} ended before this write "
                   f"({'; '.join(sorted(set(lost.values())))})")
            raise HoldLost(msg, keys=keys)
        mine = self.holding(caller)
        if not mine:
            return None
        covering = [h for h in mine if h.keys & set(prepared.keys)]
        taken = frozenset().union(*(h.keys for h in covering))
        return covering, tuple(k for k in prepared.keys if k not in taken)

    @staticmethod
    def _gone(covering: list[Held]) -> Held | None:
        """A hold the write would run under whose lease is lost."""
        return next((h for h in covering if h.lease.lost or h.lease.released), None)

    @staticmethod
    def _lost(held: Held) -> HoldLost:
        keys = tuple(sorted(held.keys))
        return HoldLost(f"hold on {', '.join(keys)} was lost before this write", keys=keys)

    def write(self, locks: LockManager, store: Any, prepared: Prepared) -> WriteLeases | None:
        """The lease a holding caller's write runs under (None: no holds, the usual path)."""
        plan = self._plan_write(prepared)
        if plan is None:
            return None
        covering, missing = plan
        assert prepared.caller is not None
        gone = self._gone(covering)
        if gone is not None:
            self._end(gone, "its lease was lost")
            raise self._lost(gone)
        fresh = (self._acquire(locks, Board(store), prepared.caller, missing,
                               prepared.rule.ttl_ms, prepared.rule.wait_timeout_s)
                 if missing else None)
        parts = [h.lease for h in covering] + ([fresh] if fresh is not None else [])
        return WriteLeases(Joined(prepared.keys, parts), covering, fresh)

    async def awrite(self, locks: AsyncLockManager, store: Any,
                     prepared: Prepared) -> WriteLeases | None:
        """The asyncio twin of ``write``."""
        plan = self._plan_write(prepared)
        if plan is None:
            return None
        covering, missing = plan
        assert prepared.caller is not None
        gone = self._gone(covering)
        if gone is not None:
            await self._aend(gone, "its lease was lost")
            raise self._lost(gone)
        fresh = (await self._aacquire(locks, AsyncBoard(store), prepared.caller, missing,
                                      prepared.rule.ttl_ms, prepared.rule.wait_timeout_s)
                 if missing else None)
        parts = [h.lease for h in covering] + ([fresh] if fresh is not None else [])
        return WriteLeases(Joined(prepared.keys, parts), covering, fresh)

    def written(self, leases: WriteLeases | None) -> None:
        """The write ended (committed or refused): its holds end with it."""
        if leases is None:
            return
        if leases.fresh is not None:
            with contextlib.suppress(Exception):
                leases.fresh.release()
        for held in leases.holds:
            self._end(held, "written", remember=False, audit=False)

    async def awritten(self, leases: WriteLeases | None) -> None:
        if leases is None:
            return
        if leases.fresh is not None:
            with contextlib.suppress(Exception):
                await finish(leases.fresh.arelease())
        for held in leases.holds:
            await self._aend(held, "written", remember=False, audit=False)


def _note(held: Held) -> str:
    """What the read's audit row says of the hold it took (for the operator)."""
    tokens = ", ".join(f"{k} token {t}" for k, t in sorted(held.lease.tokens.items()))
    return (f"; hold taken ({tokens}) until this caller writes, its turn ends or "
            f"max_hold_s ({held.prepared.rule.max_hold_s:g} s) passes")


def _running(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether this thread runs ``loop`` now."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


#: How a hold ended, as the hold-duration metric names it (a bounded set), by the start of why.
_ENDS = (("written", "written"), ("released", "released"), ("the agent's turn", "released"),
         ("max_hold_s", "max_hold_s"), ("hold_deadlock", "hold_deadlock"),
         ("its lease was lost", "lease_lost"), ("the read was cancelled", "cancelled"))


def _measure(held: Held, why: str) -> None:
    """The hold's duration, by how it ended (a read that failed took no hold: not counted)."""
    kind = next((kind for start, kind in _ENDS if why.startswith(start)), None)
    if kind is None:
        return
    try:
        telemetry.hold_ended(time.monotonic() - held.started, held.prepared.rule.name or "_OTHER",
                             kind)
    except Exception:  # metrics never stop a hold from ending
        log.exception("could not record a hold's duration")
