"""Worker processes for the multi-process quota tests (spawned: nothing inherited)."""

from __future__ import annotations

import threading
import time
from typing import Any

from quotas.envs import QuotaEnv, facts, rule
from toolguard.controls.quotas import Quotas
from toolguard.errors import QuotaExceeded

THREADS = 4


def reporting(out: Any, target: Any, *args: Any) -> None:
    """Run ``target(*args)`` and put its result (or the error's text) on ``out``."""
    try:
        out.put(("ok", target(*args)))
    except BaseException as error:  # the test fails on it, with the worker's reason
        out.put(("error", f"{type(error).__name__}: {error}"))


def _threads(count: int, target: Any) -> None:
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def admit_many(env: QuotaEnv, quotas: list[dict[str, Any]], costs: list[float], start: Any,
               ) -> list[tuple[float, bool]]:
    """Try one call per cost (spread over ``threads``); ``(cost, admitted)`` for each."""
    backend, closing = env.open()
    tool = rule(quotas)
    out: list[tuple[float, bool]] = []
    lock = threading.Lock()

    def work(index: int) -> None:
        for cost in costs[index::THREADS]:
            try:
                Quotas(backend).admit(tool, facts(amount=cost))
                admitted = True
            except QuotaExceeded:
                admitted = False
            with lock:
                out.append((cost, admitted))

    start.wait(60)
    try:
        _threads(THREADS, work)
    finally:
        closing.close()
    return out


def run_in_flight(env: QuotaEnv, quotas: list[dict[str, Any]], rounds: int, active: Any, peak: Any,
                  start: Any) -> int:
    """Admit, count oneself into ``active`` while "running", leave; returns how many ran."""
    backend, closing = env.open()
    tool = rule(quotas)
    ran = [0] * THREADS

    def work(index: int) -> None:
        for _ in range(rounds):
            try:
                admission = Quotas(backend).admit(tool, facts())
            except QuotaExceeded:
                time.sleep(0.001)
                continue
            with active.get_lock():
                active.value += 1
                peak.value = max(peak.value, active.value)
            time.sleep(0.002)
            with active.get_lock():
                active.value -= 1
            admission.finish(applied=True)
            ran[index] += 1

    start.wait(60)
    try:
        _threads(THREADS, work)
    finally:
        closing.close()
    return sum(ran)


def hold_slot(env: QuotaEnv, quotas: list[dict[str, Any]], report: Any) -> None:
    """Take an in-flight slot, say so, and wait to be killed (never releasing it)."""
    backend, _ = env.open()
    Quotas(backend).admit(rule(quotas), facts())
    report.put("holding")
    time.sleep(600)
