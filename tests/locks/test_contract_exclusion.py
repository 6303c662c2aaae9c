"""The lock contract under stopped processes: never two holders of one key at once.

Three agent processes (two with threads, one with asyncio tasks), three agents each,
contend for two keys while the test stops random processes for two to three TTLs:
holders, waiters and hand-offs in flight are all frozen past their TTLs. The
checker in ``locks.exclusion`` then looks at every lease the agents were given.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from locks.backends import LockEnv
from locks.exclusion import Workload, problems, run_workload


@pytest.mark.timeout(180)
def test_stopped_processes_never_leave_two_holders_of_a_key(backend: LockEnv,
                                                             tmp_path: Path) -> None:
    work = Workload(url=backend.url, keys=(backend.key("x"), backend.key("y")), ttl_ms=400,
                    options=dict(backend.factory.options))
    outcome = run_workload(work, tmp_path, ["sync", "sync", "async"], seconds=6.0)
    found = problems(outcome.records)
    assert not found, f"{len(found)} violations in {len(outcome.leases)} leases: {found[:5]}"
    assert outcome.stops >= 5
    for key in work.keys:  # both keys kept moving through the stops
        assert sum(1 for r in outcome.leases if r["key"] == key) >= 10
    assert not outcome.errors(), outcome.errors()[:3]
