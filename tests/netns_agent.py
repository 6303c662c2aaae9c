"""Entry point of an agent process inside a network namespace (started by ``tests/netns.py``).

``python netns_agent.py SPEC`` where SPEC is a pickled dict with ``role``:

* ``workload``: the fault suite's agents (``fault.workload.run_process``).
* ``stale_holder``: take the lock of one account, report when the lease is lost, wait
  for the test's go-ahead (a file), then write under the lost lease: the store decides.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from typing import Any


def stale_holder(setup: Any, name: str, account: str, journal_path: str, go_path: str,
                 ttl_ms: int) -> None:
    from fault.scripted import ScriptedAgent
    from fault.workload import Journal

    journal = Journal(journal_path)
    agent = ScriptedAgent(name, setup, journal, ttl_ms=ttl_ms)
    try:
        lease = agent.lock(account)
        lease.lost_event.wait(120)
        journal.add(event="lease_lost", agent=name, reason=str(lease.lost_reason)[:200])
        while not os.path.exists(go_path):
            time.sleep(0.01)
        agent.write(lease, account)
    finally:
        agent.close()
        journal.add(event="finished", agent=name)
        journal.close()


def main() -> None:
    with open(sys.argv[1], "rb") as spec_file:
        spec = pickle.load(spec_file)
    role = spec.pop("role")
    if role == "workload":
        from fault.workload import run_process

        run_process(**spec)
    elif role == "stale_holder":
        stale_holder(**spec)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
