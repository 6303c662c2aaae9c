"""The fault suite's workload: agents doing read-modify-write deposits under fenced locks.

Every scenario runs the same small workload (a few agents, as threads of the
test process or as spawned processes, on a handful of accounts) while a fault
is injected, then checks the same invariants on what the agents reported, the
ledger tables, the intent table and the audit log.

An agent's deposit is one *intent* with an idempotency key. Its outcome is
final when the store said so (accepted, replayed, rejected as stale); anything
else (a cut connection, a lock server away, a lease lost) leaves the outcome
unknown, and the agent retries the same intent, same key, until it is final.
After the run, the test resolves the intents of agents that died with an
outcome unknown the same way. Applied at most once is then checked against
the ledger: every applied intent appears in the log exactly once.

Agents journal every step as one JSON line (``os.write`` on an ``O_APPEND``
file for processes, so a SIGKILL loses nothing written before it).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from store.envs import create_ledger, ledger_state, rows

from toolguard.errors import (
    DuplicateIntent,
    StaleFencingToken,
    ToolGuardError,
)
from toolguard.locks import LockManager, connect, heartbeat
from toolguard.store import GuardedStore, IntentRecord, Replay, open_store
from toolguard.store.recovery import run_fenced

__all__ = [
    "FINAL",
    "INVARIANTS",
    "AgentPlan",
    "Cell",
    "Journal",
    "Setup",
    "check_invariants",
    "resolve_unknown",
    "run_agent",
    "run_process",
]

#: Outcomes the store decided; anything else is retried with the same idempotency key.
FINAL = ("accepted", "replayed", "rejected", "error")
INVARIANTS = ("no_stale_write", "ledger_exact", "rejections_audited", "progress")
PROGRESS_BOUND_S = 15.0


@dataclass(frozen=True)
class Setup:
    """Where the agents' locks and store are (picklable: spawned agents get a copy)."""

    lock_url: str
    store_url: str
    prefix: str
    store_options: Mapping[str, Any] = field(default_factory=dict)
    lock_options: Mapping[str, Any] = field(default_factory=dict)
    accounts: tuple[str, ...] = ("a", "b", "c")
    ttl_ms: int = 500
    wait_s: float = 3.0

    def key(self, account: str) -> str:
        return f"{self.prefix}:acct:{account}"

    def open_store(self, **options: Any) -> GuardedStore:
        return open_store(self.store_url, **{**self.store_options, **options})

    def locks(self) -> LockManager:
        return connect(self.lock_url, ttl_ms=self.ttl_ms, timeout_s=self.wait_s,
                       **self.lock_options)

    def separate_locks(self) -> LockManager:
        """A manager as another process has one: it shares its claims with no other manager
        of this process (``connect``'s managers for one URL share theirs)."""
        made = self.locks()
        return LockManager(made.backend, space=f"separate-{uuid.uuid4().hex}",
                           ttl_ms=made.ttl_ms, timeout_s=made.timeout_s,
                           round_wait_s=made.round_wait_s, backoff_base_s=made.backoff_base_s,
                           backoff_cap_s=made.backoff_cap_s)

    def install(self) -> GuardedStore:
        """Install the store schema and the ledger tables; returns the open store."""
        store = self.open_store(install=True)
        create_ledger(store, self.accounts)
        return store


@dataclass(frozen=True)
class AgentPlan:
    """How one agent behaves.

    ``mode`` "run_fenced" uses ``toolguard.store.recovery.run_fenced``; "manual" takes the
    lock, then (maybe) stalls, then writes through ``store.fenced`` itself, which is where a
    pause between lock and write goes: ``pause_p`` is the chance of a GC-like stall of
    ``pause_s`` with renewals stopped; ``think_s`` a plain delay with renewals running.
    ``hold_s`` is spent inside the fenced transaction, between the read and the write;
    ``linger_s`` after the writes, just before the commit.
    """

    mode: str = "run_fenced"
    pause_p: float = 0.0
    pause_s: float = 0.0
    think_s: float = 0.0
    hold_s: float = 0.0
    linger_s: float = 0.0
    seed: int = 0


class Journal:
    """Where an agent's events go: a list (threads) or an append-only JSON-lines file."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = None if path is None else str(path)
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._fd = None if path is None else os.open(self.path, os.O_WRONLY | os.O_APPEND
                                                     | os.O_CREAT, 0o644)

    def add(self, **event: Any) -> None:
        event.setdefault("at", time.monotonic())  # CLOCK_MONOTONIC: one clock for all processes
        if self._fd is not None:
            os.write(self._fd, (json.dumps(event) + "\n").encode())
        else:
            with self._lock:
                self._events.append(event)

    def events(self) -> list[dict[str, Any]]:
        if self.path is not None:
            return read_events(self.path)
        with self._lock:
            return list(self._events)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(path: str | Path) -> list[dict[str, Any]]:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


# --- one deposit --------------------------------------------------------------------------


def intent_for(name: str, op: Mapping[str, Any], setup: Setup) -> IntentRecord:
    """The intent of a deposit; rebuilt identically by whoever retries it."""
    return IntentRecord(tool="deposit", idempotency_key=op["intent"],
                        args_hash=f"{op['account']}:{op['delta']}", agent=op.get("agent", name),
                        intent_id=op["intent"], keys=(setup.key(op["account"]),),
                        args={"account": op["account"], "delta": op["delta"]})


def deposit_body(setup: Setup, op: Mapping[str, Any], plan: AgentPlan,
                 journal: Journal) -> Callable[[Any], int]:
    """Read-modify-write inside the fenced transaction: the read decides the write."""
    key = setup.key(op["account"])

    def body(tx: Any) -> int:
        journal.add(event="in_body", intent=op["intent"], token=tx.tokens[key])
        balance, version = tx.execute("SELECT balance, version FROM ledger_account WHERE id = %s",
                                      (op["account"],)).fetchone()
        if plan.hold_s:
            time.sleep(plan.hold_s)
        tx.execute("UPDATE ledger_account SET balance = %s, version = %s WHERE id = %s",
                   (balance + op["delta"], version + 1, op["account"]))
        tx.execute("INSERT INTO ledger_log (account, version, token, delta, intent_id) "
                   "VALUES (%s, %s, %s, %s, %s)",
                   (op["account"], version + 1, tx.tokens[key], op["delta"], op["intent"]))
        if plan.linger_s:
            time.sleep(plan.linger_s)
        return int(balance + op["delta"])

    return body


def attempt(setup: Setup, plan: AgentPlan, store: GuardedStore, locks: LockManager,
            op: Mapping[str, Any], journal: Journal, rng: random.Random,
            wait_s: float | None = None, faulty: bool = False) -> dict[str, Any]:
    """One try of a deposit intent; the outcome as a journal event (not yet written)."""
    key = setup.key(op["account"])
    intent = intent_for(op.get("agent", "?"), op, setup)
    body = deposit_body(setup, op, plan, journal)
    wait = setup.wait_s if wait_s is None else wait_s
    try:
        if plan.mode == "run_fenced":
            outcome = run_fenced(locks, store, [key], body, intent=intent, ttl_ms=setup.ttl_ms,
                                 timeout_s=wait)
            if outcome.replayed:  # its fence advance is kept: the key's high-water may be this
                return {"event": "replayed", "token": outcome.tokens.get(key)}
            return {"event": "accepted", "token": outcome.tokens[key],
                    "reseeded": outcome.reseeded}
        return _manual(setup, plan, store, locks, op, intent, body, journal, rng, wait, faulty)
    except StaleFencingToken as error:
        return {"event": "rejected", "token": error.token, "current": error.current}
    except ToolGuardError as error:
        kind = "error" if error.reason in ("idempotency_conflict", "invalid_intent") else "unknown"
        return {"event": kind, "error": f"{type(error).__name__}: {error}"[:300]}
    except Exception as error:  # a driver error the store did not map: outcome unknown
        return {"event": "unknown", "error": f"{type(error).__name__}: {error}"[:300]}


def _manual(setup: Setup, plan: AgentPlan, store: GuardedStore, locks: LockManager,
            op: Mapping[str, Any], intent: IntentRecord, body: Callable[[Any], int],
            journal: Journal, rng: random.Random, wait: float, faulty: bool) -> dict[str, Any]:
    key = setup.key(op["account"])
    if isinstance(store.begin_intent(intent), Replay):
        return {"event": "replayed"}
    lease = locks.acquire([key], ttl_ms=setup.ttl_ms, timeout_s=wait)
    paused = False
    try:
        journal.add(event="locked", intent=op["intent"], token=lease.tokens[key])
        if faulty and plan.pause_p and rng.random() < plan.pause_p:
            # A GC-like stall: renewals stop too, so the lease runs out on the server and
            # another agent may take the lock and write before this one wakes up.
            heartbeat().remove(lease)
            time.sleep(plan.pause_s)
            paused = True
        elif plan.think_s:
            time.sleep(rng.uniform(0, plan.think_s))
        try:
            with store.fenced(lease.tokens, intent) as tx:
                tx.lease = lease
                tx.record(body(tx))
        except DuplicateIntent:
            return {"event": "replayed", "token": lease.tokens[key], "paused": paused}
        return {"event": "accepted", "token": lease.tokens[key], "paused": paused}
    except StaleFencingToken as error:
        return {"event": "rejected", "token": error.token, "current": error.current,
                "paused": paused}
    finally:
        with contextlib.suppress(Exception):
            lease.release()


# --- agents -------------------------------------------------------------------------------


def run_agent(setup: Setup, plan: AgentPlan, name: str, store: GuardedStore, locks: LockManager,
              journal: Journal, stop: Callable[[], bool],
              faulty: Callable[[], bool] = lambda: False) -> None:
    """Deposit until ``stop()``; an intent with an unknown outcome is retried, same key.

    Injected pauses (``plan.pause_p``) happen only while ``faulty()``.
    """
    rng = random.Random(f"{plan.seed}-{name}")
    pending: dict[str, Any] | None = None
    count = 0
    while not stop():
        if pending is None:
            count += 1
            pending = {"intent": f"{name}-{count}-{uuid.uuid4().hex[:8]}", "agent": name,
                       "account": rng.choice(setup.accounts), "delta": rng.randint(1, 9)}
        began = time.monotonic()
        journal.add(event="try", **pending)
        result = attempt(setup, plan, store, locks, pending, journal, rng, faulty=faulty())
        journal.add(intent=pending["intent"], agent=name, account=pending["account"], began=began,
                    **result)
        if result["event"] in FINAL:
            pending = None
        else:
            time.sleep(rng.uniform(0.01, 0.05))


def run_process(setup: Setup, plan: AgentPlan, name: str, threads: int, journal_path: str,
                stop_path: str, fault_path: str) -> None:
    """Entry point of a spawned agent process: ``threads`` agents until ``stop_path`` exists
    (pauses are injected while ``fault_path`` exists)."""
    journal = Journal(journal_path)
    store = setup.open_store()
    locks = setup.locks()
    journal.add(event="started", agent=name, pid=os.getpid())

    def stop() -> bool:
        return os.path.exists(stop_path)

    def faulty() -> bool:
        return os.path.exists(fault_path)

    workers = [threading.Thread(target=run_agent, args=(setup, replace(plan, seed=plan.seed + i),
                                                        f"{name}.{i}", store, locks, journal, stop,
                                                        faulty))
               for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    locks.close()
    store.close()
    journal.add(event="finished", agent=name)
    journal.close()


# --- after the run -------------------------------------------------------------------------


def intents(events: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per intent: what it was and every outcome reported for it, in order."""
    found: dict[str, dict[str, Any]] = {}
    for event in sorted(events, key=lambda e: e["at"]):
        kind = event.get("event")
        if kind == "try" and event["intent"] not in found:
            found[event["intent"]] = {"intent": event["intent"], "agent": event["agent"],
                                      "account": event["account"], "delta": event["delta"],
                                      "outcomes": [], "tries": 0}
        if "intent" not in event or event["intent"] not in found:
            continue
        record = found[event["intent"]]
        if kind == "try":
            record["tries"] += 1
        elif kind in (*FINAL, "unknown"):
            record["outcomes"].append(dict(event))
    return found


def final(record: Mapping[str, Any]) -> str | None:
    finals = [o["event"] for o in record["outcomes"] if o["event"] in FINAL]
    return finals[-1] if finals else None


def resolve_unknown(setup: Setup, store: GuardedStore, locks: LockManager, journal: Journal,
                    events: list[dict[str, Any]], *, deadline_s: float = 20.0) -> int:
    """Retry every intent whose outcome is still unknown, with its own idempotency key.

    These are intents of agents stopped or killed mid-attempt. Returns how many there were.
    """
    open_ = [r for r in intents(events).values() if final(r) is None]
    until = time.monotonic() + deadline_s
    rng = random.Random(0)
    for record in open_:
        op = {k: record[k] for k in ("intent", "agent", "account", "delta")}
        while time.monotonic() < until:
            journal.add(event="try", **op, resolver=True)
            result = attempt(setup, AgentPlan(), store, locks, op, journal, rng, wait_s=5.0)
            journal.add(intent=op["intent"], agent=op["agent"], resolver=True, **result)
            if result["event"] in FINAL:
                break
            time.sleep(0.1)
    return len(open_)


@dataclass
class Cell:
    ok: bool | None  # None: not applicable
    detail: str = ""

    @property
    def mark(self) -> str:
        return {True: "pass", False: "FAIL", None: "n/a"}[self.ok]


def check_invariants(setup: Setup, store: GuardedStore, events: list[dict[str, Any]], *,
                     healed_at: float | None, expect_rejections: bool = False,
                     bound_s: float = PROGRESS_BOUND_S,
                     progress_accounts: Iterable[str] | None = None) -> dict[str, Cell]:
    """Evaluate every invariant; never raises for a violated one (the caller asserts).

    ``progress_accounts``: the progress check needs a write on each of these accounts
    (default: any write at all).
    """
    records = intents(events)
    cells: dict[str, Cell] = {}
    cells["no_stale_write"] = _no_stale_write(setup, store, records)
    cells["ledger_exact"] = _ledger_exact(setup, store, records)
    cells["rejections_audited"] = _rejections_audited(store, records, expect_rejections)
    cells["progress"] = _progress(records, healed_at, bound_s, progress_accounts)
    return cells


def _guard(check: Callable[[], Cell]) -> Cell:
    try:
        return check()
    except Exception as error:  # a check that cannot even run is a failed cell
        return Cell(False, f"check raised {type(error).__name__}: {error}")


def _no_stale_write(setup: Setup, store: GuardedStore, records: Mapping[str, Any]) -> Cell:
    def check() -> Cell:
        problems: list[str] = []
        _, log = ledger_state(store)
        # A replay checks and advances its fences before it finds the intent applied, and
        # keeps the advance: the high-water may be a replay's token, newer than any write.
        replays: dict[str, list[int]] = {}
        for r in records.values():
            for o in r["outcomes"]:
                if o["event"] == "replayed" and isinstance(o.get("token"), int):
                    replays.setdefault(r["account"], []).append(o["token"])
        for account, entries in log.items():
            tokens = [token for _, token, _, _ in entries]
            back = [(a, b) for a, b in itertools.pairwise(tokens) if b < a]
            if back:
                problems.append(f"{account}: accepted tokens went backwards {back[:3]}")
            mark = store.high_water(setup.key(account))
            newest = max([*tokens, *replays.get(account, ())], default=None)
            if tokens and mark != newest:
                problems.append(f"{account}: high-water {mark} != newest accepted or replayed "
                                f"{newest} (newest accepted {max(tokens)})")
        rejected = [o for r in records.values() for o in r["outcomes"] if o["event"] == "rejected"]
        for outcome in rejected:
            if not (outcome.get("current") and outcome.get("token")
                    and outcome["current"] > outcome["token"]):
                problems.append(f"rejection without a newer token seen: {outcome}")
        # A write below the high-water mark, made now, must be refused by the store.
        probed = 0
        for account in setup.accounts:
            key = setup.key(account)
            mark = store.high_water(key)
            if mark <= 1:
                continue
            probed += 1
            probe = IntentRecord(tool="deposit", agent="probe", intent_id=f"probe-{account}",
                                 keys=(key,))
            try:
                with store.fenced({key: mark - 1}, probe) as tx:
                    tx.execute("UPDATE ledger_account SET balance = balance + 1000 WHERE id = %s",
                               (account,))
                problems.append(f"{account}: a write with token {mark - 1} < {mark} was accepted")
            except StaleFencingToken as error:
                if error.current != mark:
                    problems.append(f"{account}: probe rejected with current={error.current}")
        detail = f"{len(rejected)} stale rejected, {probed} probes refused"
        return Cell(not problems, "; ".join(problems[:4]) or detail)

    return _guard(check)


def _ledger_exact(setup: Setup, store: GuardedStore, records: Mapping[str, Any]) -> Cell:
    def check() -> Cell:
        problems: list[str] = []
        balances, log = ledger_state(store)
        applied = {i: r for i, r in records.items() if final(r) in ("accepted", "replayed")}
        unresolved = [i for i, r in records.items() if final(r) is None]
        errors = [(i, r["outcomes"][-1].get("error")) for i, r in records.items()
                  if final(r) == "error"]
        if unresolved:
            problems.append(f"{len(unresolved)} intents never resolved, e.g. {unresolved[:2]}")
        if errors:
            problems.append(f"unexpected errors: {errors[:2]}")
        logged = Counter(i for entries in log.values() for *_, i in entries)
        twice = [i for i, n in logged.items() if n > 1]
        if twice:
            problems.append(f"applied more than once: {twice[:3]}")
        if set(logged) != set(applied):
            lost = sorted(set(applied) - set(logged))[:3]
            ghost = sorted(set(logged) - set(applied))[:3]
            problems.append(f"ledger/outcome mismatch: applied but not in ledger {lost}, "
                            f"in ledger but not applied {ghost}")
        expected: dict[str, int] = defaultdict(int)
        for record in applied.values():
            expected[record["account"]] += record["delta"]
        for account, (balance, version) in balances.items():
            entries = log[account]
            deltas = sum(delta for _, _, delta, _ in entries)
            if not balance == deltas == expected[account]:
                problems.append(f"{account}: balance {balance}, log sum {deltas}, "
                                f"accepted deltas {expected[account]}")
            if [v for v, *_ in entries] != list(range(1, version + 1)):
                problems.append(f"{account}: versions not 1..{version}")
            for _, _, delta, intent in entries:
                if intent in records and records[intent]["delta"] != delta:
                    problems.append(f"{account}: {intent} applied delta {delta}")
        statuses = dict(rows(store, "SELECT idempotency_key, status FROM toolguard_intent"))
        wrong = [i for i in records if (statuses.get(i) == "applied") != (i in applied)]
        if wrong:
            problems.append(f"intent table disagrees for {wrong[:3]}")
        unknown = sum(1 for r in records.values() for o in r["outcomes"] if o["event"] == "unknown")
        replayed = sum(1 for r in applied.values() if final(r) == "replayed")
        detail = (f"{len(applied)} applied, {unknown} unknown outcomes retried, "
                  f"{replayed} resolved as replays")
        return Cell(not problems, "; ".join(problems[:4]) or detail)

    return _guard(check)


def _rejections_audited(store: GuardedStore, records: Mapping[str, Any],
                        expect_rejections: bool) -> Cell:
    def check() -> Cell:
        problems: list[str] = []
        stale = store.query_audit(reason="stale_fencing_token", limit=None)
        by_intent: dict[str | None, list[Any]] = defaultdict(list)
        for entry in stale:
            by_intent[entry.intent_id].append(entry)
            if entry.decision != "rejected":
                problems.append(f"stale row {entry.id} has decision {entry.decision}")
        seen = 0
        for intent, record in records.items():
            rejected = [o for o in record["outcomes"] if o["event"] == "rejected"]
            reseeded = [o for o in record["outcomes"] if o.get("reseeded")]
            seen += len(rejected) + len(reseeded)
            rows_ = by_intent.get(intent, [])
            tokens = Counter(t for e in rows_ for t in e.tokens.values())
            for outcome in rejected:
                if tokens[outcome["token"]] < 1:
                    problems.append(f"rejection of {intent} (token {outcome['token']}) not audited")
                else:
                    tokens[outcome["token"]] -= 1
            if len(rows_) < len(rejected) + len(reseeded):
                problems.append(f"{intent}: {len(rejected) + len(reseeded)} rejections, "
                                f"{len(rows_)} audit rows")
        strangers = [i for i in by_intent if i not in records and not str(i).startswith("probe-")]
        if strangers:
            problems.append(f"stale audit rows for unknown intents {strangers[:3]}")
        probes = sum(len(v) for i, v in by_intent.items() if str(i).startswith("probe-"))
        accepted = Counter(e.idempotency_key for e in store.query_audit(decision="accepted",
                                                                        limit=None))
        applied = {i for i, r in records.items() if final(r) in ("accepted", "replayed")}
        if set(accepted) != applied or any(n != 1 for n in accepted.values()):
            problems.append(f"accepted audit rows do not match applied intents "
                            f"({len(accepted)} keys, {sum(accepted.values())} rows, "
                            f"{len(applied)} applied)")
        if expect_rejections and seen == 0:
            problems.append("no agent was ever rejected: the fault did not make a stale holder")
        detail = f"{seen} agent rejections + {probes} probes audited"
        return Cell(not problems, "; ".join(problems[:4]) or detail)

    return _guard(check)


def _progress(records: Mapping[str, Any], healed_at: float | None, bound_s: float,
              accounts: Iterable[str] | None) -> Cell:
    if healed_at is None:
        return Cell(None, "no fault healed")
    wanted = sorted(set(accounts)) if accounts is not None else [None]
    delays = []
    for account in wanted:
        # An attempt begun after the heal: a write already under way then proves nothing.
        after = sorted(o["at"] for r in records.values() for o in r["outcomes"]
                       if o["event"] in ("accepted", "replayed") and o.get("began", 0) >= healed_at
                       and not o.get("resolver") and account in (None, r["account"]))
        where = "" if account is None else f" on account {account}"
        if not after:
            return Cell(False, f"no write{where} begun after the heal was accepted within "
                               f"{bound_s:.0f}s")
        delays.append((after[0] - healed_at, where))
    delay, where = max(delays)
    return Cell(delay <= bound_s, f"first write{where} begun after the heal accepted "
                                  f"{delay:.2f}s after it")
