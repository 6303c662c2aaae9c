"""Run the workload around one fault, then resolve, check, record and assert.

    run = FaultRun("redis: SIGKILL + restart", setup, tmp_path)
    run.start_threads(3)
    run.warm_up()
    run.fault_started(); server.restart(); run.healed()
    run.finish()            # waits for progress, stops agents, checks, records, asserts

``setup`` is what the agents use (maybe through a proxy); ``direct`` (default: the
same) is what the test itself uses to install, resolve and check, never faulted.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fault.report import RESULTS, record
from fault.workload import (
    FINAL,
    INVARIANTS,
    PROGRESS_BOUND_S,
    AgentPlan,
    Cell,
    Journal,
    Setup,
    check_invariants,
    read_events,
    resolve_unknown,
    run_agent,
    run_process,
)
from toolguard.errors import BackendUnavailable

__all__ = ["LINK_FAULTS", "FaultRun", "break_link", "spawn", "timed"]

log = logging.getLogger("toolguard.fault")
spawn = multiprocessing.get_context("spawn")


class FaultRun:
    """One scenario: its agents, the fault's timeline, and the checks at the end."""

    def __init__(self, scenario: str, setup: Setup, tmp_path: Path, *,
                 direct: Setup | None = None) -> None:
        self.scenario = scenario
        self.setup = setup
        self.direct = direct or setup
        self.tmp_path = tmp_path
        self.store = self.direct.install()
        self.journal = Journal()  # the test process's agents and the resolver
        self._stop = threading.Event()
        self.stop_path = tmp_path / f"stop-{os.getpid()}-{id(self)}"
        self.fault_path = tmp_path / f"fault-{os.getpid()}-{id(self)}"
        self._faulty = threading.Event()
        self.threads: list[threading.Thread] = []
        self.processes: list[Any] = []
        self.process_journals: list[Path] = []
        self._closers: list[Any] = []
        self.fault_at: float | None = None
        self.healed_at: float | None = None

    def __enter__(self) -> FaultRun:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """On an error before ``finish``: stop the agents, close the store, and put the
        scenario in the table as failed (it did not get as far as its checks)."""
        if not self._stop.is_set():
            self.stop(timeout_s=10)
        with contextlib.suppress(Exception):
            self.store.close()
        if exc is not None and self.scenario not in RESULTS:
            reason = f"scenario aborted: {type(exc).__name__}: {str(exc)[:200]}"
            record(self.scenario, {name: Cell(False, reason) for name in INVARIANTS})

    # --- agents ---------------------------------------------------------------------------

    def start_threads(self, count: int, plan: AgentPlan | None = None, name: str = "t") -> None:
        """``count`` agents in this process sharing one store and one lock manager."""
        plan = plan or AgentPlan()
        store = self.setup.open_store()
        locks = self.setup.locks()
        self._closers += [locks.close, store.close]
        for i in range(count):
            thread = threading.Thread(
                target=run_agent, name=f"agent-{name}{i}",
                args=(self.setup, replace(plan, seed=plan.seed + i), f"{name}{i}", store, locks,
                      self.journal, self._stop.is_set, self._faulty.is_set),
                daemon=True)
            thread.start()
            self.threads.append(thread)

    def start_processes(self, count: int, threads: int, plan: AgentPlan | None = None,
                        name: str = "p") -> list[Any]:
        """``count`` spawned processes of ``threads`` agents each."""
        plan = plan or AgentPlan()
        started = []
        for i in range(count):
            path = self.tmp_path / f"journal-{name}{i}.jsonl"
            process = spawn.Process(target=run_process, name=f"agent-{name}{i}", daemon=True,
                                    args=(self.setup, replace(plan, seed=plan.seed + 100 * i),
                                          f"{name}{i}", threads, str(path), str(self.stop_path),
                                          str(self.fault_path)))
            process.start()
            self.processes.append(process)
            self.process_journals.append(path)
            started.append(process)
        return started

    def events(self) -> list[dict[str, Any]]:
        found = self.journal.events()
        for path in self.process_journals:
            found.extend(read_events(path))
        return found

    def applied(self, since: float | None = None, account: str | None = None) -> int:
        """Writes accepted (or replayed), counting only attempts begun at or after ``since``."""
        return sum(1 for e in self.events() if e.get("event") in ("accepted", "replayed")
                   and (since is None or e.get("began", 0) >= since)
                   and account in (None, e.get("account")))

    def applied_between(self, start: float, end: float) -> int:
        """Writes accepted (or replayed) whose attempt began in ``[start, end)``, from one read
        of the events (two ``applied`` calls would count the writes made between them)."""
        return sum(1 for e in self.events() if e.get("event") in ("accepted", "replayed")
                   and start <= e.get("began", 0) < end)

    def wait_applied(self, count: int, *, since: float | None = None, timeout_s: float = 15.0,
                     accounts: list[str] | None = None) -> bool:
        """Wait until ``count`` writes were applied (and one on each of ``accounts``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.applied(since) >= count and all(self.applied(since, a)
                                                    for a in accounts or ()):
                return True
            time.sleep(0.05)
        return False

    def warm_up(self, count: int = 4, timeout_s: float = 20.0) -> None:
        """Wait until the agents have made progress before any fault."""
        if not self.wait_applied(count, timeout_s=timeout_s):
            msg = f"{self.scenario}: the agents made no progress before the fault: " \
                  f"{self._last_errors()}"
            raise AssertionError(msg)

    def _last_errors(self) -> list[str]:
        return [e.get("error", "") for e in self.events() if e.get("event") == "unknown"][-3:]

    # --- the fault --------------------------------------------------------------------------

    def fault_started(self) -> None:
        """The fault begins now (agents with a pause plan start pausing)."""
        self.fault_at = time.monotonic()
        self._faulty.set()
        self.fault_path.touch()

    def healed(self) -> None:
        """The fault is over now: progress is measured from here."""
        self.fault_path.unlink(missing_ok=True)
        self._faulty.clear()
        self.healed_at = time.monotonic()

    def holding(self) -> dict[str, str]:
        """Agents whose latest event says they hold a lock (locked, or inside the fenced
        write), with the account they hold."""
        events = sorted(self.events(), key=lambda e: e["at"])
        accounts = {e["intent"]: e["account"] for e in events if e.get("event") == "try"}
        latest: dict[str, dict[str, Any]] = {}
        for event in events:
            agent = event.get("agent") or _agent_of(event.get("intent", ""))
            if agent:
                latest[agent] = event
        return {a: accounts.get(e["intent"], "?") for a, e in latest.items()
                if e.get("event") in ("in_body", "locked")}

    def wait_holding_process(self, timeout_s: float = 10.0,
                             exclude: tuple[Any, ...] = ()) -> tuple[Any, list[str]] | None:
        """A live agent process with an agent holding a lock right now, and the accounts held."""
        deadline = time.monotonic() + timeout_s
        by_name = {p.name.removeprefix("agent-"): p for p in self.processes}
        while time.monotonic() < deadline:
            held: dict[Any, list[str]] = {}
            for agent, account in self.holding().items():
                process = by_name.get(agent.split(".", 1)[0])
                if process is not None and process.is_alive() and process not in exclude:
                    held.setdefault(process, []).append(account)
            if held:
                process, accounts = next(iter(held.items()))
                return process, accounts
            time.sleep(0.005)
        return None

    # --- the end ----------------------------------------------------------------------------

    def stop(self, timeout_s: float = 20.0) -> list[str]:
        """Stop every agent; returns the names of those that did not stop in time."""
        self._stop.set()
        self.stop_path.touch()
        deadline = time.monotonic() + timeout_s
        stuck = []
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                stuck.append(thread.name)
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(process.pid, signal.SIGCONT)
            process.join(max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                stuck.append(process.name)
                process.kill()
                process.join(5)
        for close in self._closers:
            with contextlib.suppress(Exception):
                close()
        return stuck

    def _settle(self, timeout_s: float = 10.0) -> None:
        """Let the test's own store find its feet after the fault.

        Its pooled connections may have died with the server while idle: the first
        use of such a connection fails once (``BackendUnavailable``) and the pool drops
        the dead ones. A check must not mistake that for a violated invariant.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.store.high_waters([self.direct.key(a) for a in self.direct.accounts])
                return
            except BackendUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def finish(self, *, expect_rejections: bool = False, progress: int = 3,
               bound_s: float = PROGRESS_BOUND_S,
               progress_accounts: list[str] | None = None) -> dict[str, Cell]:
        """Wait for progress after the heal, stop, resolve, check every invariant, record it."""
        if self.healed_at is not None:
            self.wait_applied(progress, since=self.healed_at, timeout_s=bound_s,
                              accounts=progress_accounts)
        stuck = self.stop()
        self._settle()
        locks = self.direct.locks()
        try:
            resolved = resolve_unknown(self.direct, self.store, locks, self.journal, self.events())
        finally:
            locks.close()
        events = self.events()
        cells = check_invariants(self.direct, self.store, events, healed_at=self.healed_at,
                                 expect_rejections=expect_rejections, bound_s=bound_s,
                                 progress_accounts=progress_accounts)
        if stuck:
            cells["progress"] = Cell(False, f"agents did not stop within 20s: {stuck}")
        if resolved:
            ledger = cells["ledger_exact"]
            ledger.detail += f", {resolved} resolved after the run"
        record(self.scenario, cells)
        self.store.close()
        counts = {k: sum(1 for e in events if e.get("event") == k) for k in (*FINAL, "unknown")}
        log.warning("%s: %s", self.scenario, counts)
        failed = {name: cell.detail for name, cell in cells.items() if cell.ok is False}
        assert not failed, f"{self.scenario}: invariants violated: {failed}"
        return cells


def _agent_of(intent: str) -> str:
    return intent.split("-", 1)[0] if "-" in intent else ""


def backend_setup(kind: str, request: Any, unique: str, tmp_path: Path, **options: Any) -> Setup:
    """The standard pairing for lock backend ``kind`` on the shared, never-faulted servers.

    redis / postgres / etcd locks with the store in a schema of its own in the shared
    PostgreSQL; sqlite locks with a SQLite store (two files under ``tmp_path``).
    """
    prefix = f"tgf:{unique}"
    if kind == "sqlite":
        return Setup(lock_url=f"sqlite:///{tmp_path}/locks.db",
                     store_url=f"sqlite:///{tmp_path}/store.db", prefix=prefix, **options)
    postgres_url = request.getfixturevalue("postgres_url")
    schema = request.getfixturevalue("pg_schema")
    if kind == "redis":
        lock_url = request.getfixturevalue("redis_url")
    elif kind == "postgres":
        lock_url = postgres_url
    elif kind == "etcd":
        from etcd_server import shared_etcd_url  # skips locally / fails on CI without etcd

        lock_url = shared_etcd_url()
    else:
        raise ValueError(kind)
    return Setup(lock_url=lock_url, store_url=postgres_url, prefix=prefix,
                 store_options={"schema": schema, "timeout_s": 3, "max_size": 6}, **options)


#: How long each kind of broken link lasts: a cut heals after 1 s, a stall after three TTLs.
LINK_FAULTS = {"cut": 1.0, "stalled": 1.5}


def break_link(proxy: Any, fault: str) -> None:
    """Cut or stall every connection through ``proxy`` for its ``LINK_FAULTS`` time, then heal."""
    if fault == "cut":
        assert proxy.cut() > 0  # requests in flight: their outcome is unknown to the agent
    else:
        proxy.stall()  # renewals and transactions hang; leases run out
    time.sleep(LINK_FAULTS[fault])
    proxy.heal()


def timed(call: Any, limit_s: float) -> tuple[float | None, object]:
    """Run ``call`` in a thread; (seconds it took, its result or error), or (None, None)
    if it was still blocked after ``limit_s``."""
    box: list[tuple[float, object]] = []
    started = time.monotonic()

    def run() -> None:
        try:
            outcome: object = call()
        except Exception as error:  # the outcome is what we look at
            outcome = error
        box.append((time.monotonic() - started, outcome))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    return box[0] if box else (None, None)
