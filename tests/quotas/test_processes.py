"""Quotas across processes: no over-admission on any backend, and a crash leaks no slot."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest

from quotas import workers
from quotas.envs import QuotaEnv, facts, rule
from toolguard.controls.quotas import Quotas
from toolguard.errors import InFlightLimited

spawn = multiprocessing.get_context("spawn")
PROCESSES = 4


def run_workers(target, argument_lists) -> list:
    """One spawned process per argument list, all released at once; their results."""
    out, start = spawn.Queue(), spawn.Event()
    processes = [spawn.Process(target=workers.reporting, args=(out, target, *args, start),
                               daemon=True) for args in argument_lists]
    for process in processes:
        process.start()
    time.sleep(0.5)  # let every worker reach the start line
    start.set()
    results = []
    for _ in processes:
        status, value = out.get(timeout=100)
        assert status == "ok", value
        results.append(value)
    for process in processes:
        process.join(10)
    return results


@pytest.mark.timeout(120)
def test_rate_admits_exactly_the_limit(quota_env: QuotaEnv) -> None:
    quotas = [{"calls": 37, "window": "10m", "per": "agent"}]
    parts = run_workers(workers.admit_many, [(quota_env, quotas, [1.0] * 25)] * PROCESSES)
    results = [item for part in parts for item in part]
    assert len(results) == PROCESSES * 25
    assert sum(admitted for _, admitted in results) == 37  # not one more, and none lost
    backend, closing = quota_env.open()
    try:
        assert backend.usage(_scope(quotas)) == 37
    finally:
        closing.close()


def _scope(quotas: list[dict[str, object]]) -> str:
    from toolguard.controls.quotas import charges

    return charges(rule(quotas), facts())[0].scope


@pytest.mark.timeout(120)
def test_budget_is_never_overdrawn(quota_env: QuotaEnv) -> None:
    quotas = [{"budget": 500, "arg": "amount", "window": "10m", "per": "key"}]
    chooser = random.Random(7)
    costs = [[float(chooser.randint(1, 40)) for _ in range(20)] for _ in range(PROCESSES)]
    parts = run_workers(workers.admit_many, [(quota_env, quotas, part) for part in costs])
    results = [item for part in parts for item in part]
    drawn = sum(cost for cost, admitted in results if admitted)
    assert drawn <= 500
    # every refusal was right: nothing leaves the window, so the final sum bounds each moment
    assert all(drawn + cost > 500 for cost, admitted in results if not admitted)
    assert any(not admitted for _, admitted in results)  # the budget did run out
    backend, closing = quota_env.open()
    try:
        assert backend.usage(_scope(quotas)) == pytest.approx(drawn)
    finally:
        closing.close()


@pytest.mark.timeout(120)
def test_in_flight_cap_holds_across_processes(quota_env: QuotaEnv) -> None:
    quotas = [{"in_flight": 3, "per": "tool", "lease": "1m"}]
    active, peak = spawn.Value("i", 0), spawn.Value("i", 0)
    ran = sum(run_workers(workers.run_in_flight, [(quota_env, quotas, 15, active, peak)] * PROCESSES))
    assert peak.value <= 3
    assert ran > 0 and active.value == 0
    backend, closing = quota_env.open()
    try:
        assert backend.usage(_scope(quotas)) == 0  # every slot was given back
    finally:
        closing.close()


@pytest.mark.timeout(60)
def test_a_killed_process_frees_its_slot_within_the_lease(quota_env: QuotaEnv) -> None:
    quotas = [{"in_flight": 1, "per": "tool", "lease": "3s"}]
    report = spawn.Queue()
    holder = spawn.Process(target=workers.hold_slot, args=(quota_env, quotas, report), daemon=True)
    holder.start()
    assert report.get(timeout=30) == "holding"
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    backend, closing = quota_env.open()
    try:
        quotas_step = Quotas(backend)
        with pytest.raises(InFlightLimited):  # the dead holder's slot still counts...
            quotas_step.admit(rule(quotas), facts())
        deadline = time.monotonic() + 15
        while True:  # ...until its lease ends
            try:
                quotas_step.admit(rule(quotas), facts())
                break
            except InFlightLimited:
                assert time.monotonic() < deadline, "the slot of a killed process never freed"
                time.sleep(0.2)
    finally:
        closing.close()
