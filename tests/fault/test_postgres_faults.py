"""PostgreSQL faults: the server crashed and restarted, client connections cut or stalled.

The store is on a private PostgreSQL; the locks either on the machine's Redis
(only the store is faulted) or on the same private PostgreSQL (the PostgreSQL
lock backend: locks and store go down together).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

import toolguard.locks.postgres
from fault.conftest import DurablePgServer
from fault.harness import LINK_FAULTS, FaultRun, break_link, timed
from fault.workload import AgentPlan, Setup
from toolguard.errors import BackendUnavailable, LockTimeout
from toolguard.locks import connect

pytestmark = pytest.mark.fault

LOCKS = ["redis-locks", "pg-locks"]


def pg_setup(request: pytest.FixtureRequest, locks: str, store_url: str, unique: str) -> Setup:
    lock_url = request.getfixturevalue("redis_url") if locks == "redis-locks" else store_url
    return Setup(lock_url=lock_url, store_url=store_url, prefix=f"tgf:{unique}",
                 store_options={"timeout_s": 3, "max_size": 6},
                 ttl_ms=500, wait_s=3)


def _via(url: str, port: int) -> str:
    return url.replace(f":{url.rsplit(':', 1)[1].split('/')[0]}/", f":{port}/")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("locks", LOCKS)
def test_postgres_crashed_and_restarted(request: pytest.FixtureRequest, locks: str,
                                        durable_postgres: DurablePgServer, unique: str,
                                        tmp_path: Path) -> None:
    setup = pg_setup(request, locks, durable_postgres.url, unique)
    with FaultRun(f"postgres ({locks}): SIGKILL, restart", setup, tmp_path) as run:
        run.start_threads(4)
        run.warm_up()
        run.fault_started()
        durable_postgres.crash()  # postmaster and backends: open transactions die mid-flight
        time.sleep(0.3)
        durable_postgres.start()  # crash recovery replays the WAL
        run.healed()
        run.finish()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault", list(LINK_FAULTS))
@pytest.mark.parametrize("locks", LOCKS)
def test_postgres_connections_broken(request: pytest.FixtureRequest, locks: str, fault: str,
                                     durable_postgres: DurablePgServer, proxies, unique: str,
                                     tmp_path: Path) -> None:
    proxy = proxies(durable_postgres.port)
    direct = pg_setup(request, locks, durable_postgres.url, unique)
    through = _via(durable_postgres.url, proxy.port)
    setup = replace(direct, store_url=through,
                    lock_url=through if locks == "pg-locks" else direct.lock_url)
    with FaultRun(f"postgres ({locks}): connections {fault}", setup, tmp_path,
                  direct=direct) as run:
        run.start_threads(4)
        run.warm_up()
        run.fault_started()
        break_link(proxy, fault)
        run.healed()
        run.finish()


#: Rounds of held replies and cut connections; the test stops at the first caught COMMIT.
ROUNDS = 20


@pytest.mark.timeout(90)
def test_postgres_commit_reply_lost(request: pytest.FixtureRequest, postgres_url: str,
                                    pg_schema: str, redis_url: str, proxies, unique: str,
                                    tmp_path: Path) -> None:
    """The COMMIT reaches the server but its reply never reaches the agent.

    Replies are held, then the connections are cut: an agent whose COMMIT was in
    flight saw its write fail, yet it was applied. Retried with the same
    idempotency key it must come back as a replay, not a second deposit.
    """
    port = int(postgres_url.rsplit(":", 1)[1].split("/")[0])
    proxy = proxies(port)
    direct = Setup(lock_url=redis_url, store_url=postgres_url, prefix=f"tgf:{unique}",
                   store_options={"schema": pg_schema, "timeout_s": 3, "max_size": 6},
                   ttl_ms=500, wait_s=3)
    setup = replace(direct, store_url=_via(postgres_url, proxy.port))
    with FaultRun("postgres: commit reply lost", setup, tmp_path, direct=direct) as run:
        # Agents linger after their writes: the next thing they send is most likely the COMMIT.
        run.start_threads(4, AgentPlan(linger_s=0.1))
        run.warm_up()
        run.fault_started()
        for _ in range(ROUNDS):  # a round catches the agents that were lingering
            proxy.stall(replies_only=True)
            time.sleep(0.5)  # on a loaded machine the held COMMIT still reaches the server
            proxy.cut()
            time.sleep(0.1)
            proxy.heal()
            run.healed()
            run.wait_applied(2, since=run.healed_at, timeout_s=10)
            if any(e.get("event") == "replayed" for e in run.events()):
                break
        cells = run.finish()
    replays = [e for e in run.events() if e.get("event") == "replayed"]
    assert replays, (f"no COMMIT was caught in flight in {ROUNDS} rounds: "
                     f"{cells['ledger_exact'].detail}")


@pytest.mark.timeout(60)
def test_postgres_lock_calls_are_bounded_while_stalled(postgres_url: str, proxies, unique: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Release never hangs on a link that stopped answering (DESIGN, semantics 4).

    psycopg has no read timeout; the backend's watchdog cuts a statement's
    socket after ``CALL_TIMEOUT_S`` (5 s by default; 1 s here to keep the test short).
    """
    monkeypatch.setattr(toolguard.locks.postgres, "CALL_TIMEOUT_S", 1.0)
    port = int(postgres_url.rsplit(":", 1)[1].split("/")[0])
    proxy = proxies(port)
    locks = connect(_via(postgres_url, proxy.port), ttl_ms=500, timeout_s=1)
    try:
        lease = locks.acquire([f"tgf:{unique}:held"])
        proxy.stall()
        took, _ = timed(lease.release, 3.0)
        assert took is not None, "release hung on a stalled link"
        took, outcome = timed(lambda: locks.acquire([f"tgf:{unique}:new"], timeout_s=1), 4.0)
        assert took is not None, "acquire ignored its deadline on a stalled link"
        assert isinstance(outcome, BackendUnavailable | LockTimeout), outcome
        proxy.heal()
        with locks.acquire([f"tgf:{unique}:new"], timeout_s=5) as again:  # and back to normal
            assert again.tokens
    finally:
        proxy.heal()
        locks.close()
