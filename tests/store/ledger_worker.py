"""Writers for the ledger tests, run in spawned processes (or threads of the test itself).

Each writer does read-modify-write deposits inside fenced transactions and
reports every outcome; the test then checks the ledger against the reports,
the audit log and the fence.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store.envs import StoreEnv, deposit
from toolguard.errors import BackendUnavailable, LockLost, LockTimeout, StaleFencingToken
from toolguard.locks import heartbeat
from toolguard.store import IntentRecord

__all__ = ["Plan", "run_process", "run_threads"]


@dataclass(frozen=True)
class Plan:
    env: StoreEnv
    accounts: tuple[str, ...]
    threads: int
    ops: int
    ttl_ms: int
    pause_p: float  # chance that a holder stalls between lock and write, renewals stopped
    pause_s: float
    seed: int


def _writer(plan: Plan, store: Any, locks: Any, name: str, out: list[dict[str, Any]]) -> None:
    rng = random.Random(f"{plan.seed}-{name}")
    for _ in range(plan.ops):
        account = rng.choice(plan.accounts)
        key = plan.env.key(f"acct:{account}")
        delta = rng.randint(1, 9)
        intent_id = uuid.uuid4().hex
        report: dict[str, Any] = {"account": account, "delta": delta, "intent_id": intent_id,
                                  "writer": name}
        try:
            lease = locks.acquire([key], ttl_ms=plan.ttl_ms, timeout_s=60)
        except (LockTimeout, BackendUnavailable) as error:
            out.append({**report, "outcome": "no_lock", "error": str(error)})
            continue
        report["token"] = lease.tokens[key]
        try:
            if rng.random() < plan.pause_p:
                # A stall like a GC pause: renewals stop too, so the lease expires on the
                # server and another writer may take the lock meanwhile.
                heartbeat().remove(lease)
                time.sleep(plan.pause_s)
                report["paused"] = True
            intent = IntentRecord(tool="deposit", agent=name, intent_id=intent_id, keys=(key,),
                                  args={"account": account, "delta": delta})
            try:
                with store.fenced(lease, intent) as tx:
                    deposit(tx, account, delta, intent_id)
                out.append({**report, "outcome": "accepted"})
            except StaleFencingToken as error:
                out.append({**report, "outcome": "rejected", "current": error.current})
            except LockLost as error:
                # The lease ran out before the commit (a pause, a SIGSTOP); a stopped holder
                # may also have had its transaction ended by the next holder meanwhile.
                out.append({**report, "outcome": "lease_lost", "error": str(error)})
        except (LockLost, BackendUnavailable) as error:
            out.append({**report, "outcome": "error", "error": str(error)})
        finally:
            lease.release()


def run_threads(plan: Plan, name: str) -> list[dict[str, Any]]:
    """``plan.threads`` writers in this process; returns every writer's reports."""
    store = plan.env.open()
    locks = plan.env.locks(ttl_ms=plan.ttl_ms)
    out: list[dict[str, Any]] = []
    try:
        threads = [threading.Thread(target=_writer, args=(plan, store, locks, f"{name}.{i}", out))
                   for i in range(plan.threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        locks.close()
        store.close()
    return out


def run_process(plan: Plan, name: str, report_path: str) -> None:
    """Entry point of a spawned writer process: reports go to ``report_path`` as JSON."""
    reports = run_threads(plan, name)
    tmp = Path(report_path).with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "reports": reports}))
    tmp.replace(report_path)
