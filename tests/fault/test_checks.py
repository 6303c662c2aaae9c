"""The invariant checks themselves: they pass on a clean run and catch each violation.

A check that cannot fail proves nothing, so each one is shown a run that
breaks it (on the embedded SQLite store: no server needed).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from store.envs import rows

from fault.report import table
from fault.workload import AgentPlan, Journal, Setup, attempt, check_invariants

pytestmark = pytest.mark.fault


@pytest.mark.timeout(30)
def test_checks_pass_clean_runs_and_catch_violations(tmp_path: Path) -> None:
    setup = Setup(lock_url=f"sqlite:///{tmp_path}/locks.db",
                  store_url=f"sqlite:///{tmp_path}/store.db", prefix="chk", accounts=("a",),
                  ttl_ms=1_000)
    store = setup.install()
    locks = setup.locks()
    journal = Journal()
    started = time.monotonic()
    try:
        for n in range(1, 4):
            op = {"intent": f"i{n}", "agent": "x", "account": "a", "delta": n}
            journal.add(event="try", **op)
            began = time.monotonic()
            result = attempt(setup, AgentPlan(), store, locks, op, journal, random.Random(n))
            journal.add(intent=op["intent"], agent="x", account="a", began=began, **result)
        events = journal.events()
        clean = check_invariants(setup, store, events, healed_at=started)
        assert all(cell.ok for cell in clean.values()), {k: c.detail for k, c in clean.items()}

        # A rejection the audit log never heard of.
        ghost = [{"event": "try", "intent": "i9", "agent": "x", "account": "a", "delta": 9,
                  "at": time.monotonic()},
                 {"event": "rejected", "intent": "i9", "agent": "x", "token": 1, "current": 2,
                  "at": time.monotonic()}]
        cells = check_invariants(setup, store, [*events, *ghost], healed_at=started)
        assert cells["rejections_audited"].ok is False
        assert cells["no_stale_write"].ok and cells["ledger_exact"].ok

        # No write after the "heal".
        cells = check_invariants(setup, store, events, healed_at=time.monotonic() + 60)
        assert cells["progress"].ok is False

        # i1 applied a second time, with an old token, behind the store's back.
        (token,) = rows(store, "SELECT token FROM ledger_log WHERE intent_id = 'i1'")[0]
        rows(store, "INSERT INTO ledger_log (account, version, token, delta, intent_id) "
                    "VALUES ('a', 4, %s, 1, 'i1')", (token,))
        rows(store, "UPDATE ledger_account SET balance = balance + 1, version = 4")
        cells = check_invariants(setup, store, events, healed_at=started)
        assert cells["no_stale_write"].ok is False  # tokens went backwards
        assert cells["ledger_exact"].ok is False  # applied twice, balance off
        assert any("FAIL" in line for line in table({"tampered": cells}))
    finally:
        locks.close()
        store.close()
