"""Hot reload through the guard: each call decides on one policy snapshot, and says which."""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from controls.guarded import intent, write
from toolguard.guard import ToolGuard
from toolguard.policies.reload import PolicyWatcher

LOW = """version: 1
tools:
  transfer:
    locks: ["lead:{lead_id}"]
    agents: [scorer]
    args: {amount: {le: 100}}
"""
HIGH = LOW.replace("le: 100", "le: 200")


class Transfer(BaseModel):
    lead_id: str
    amount: int


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def watched(h: Any, tmp_path: Path) -> tuple[ToolGuard, PolicyWatcher, Path]:
    path = tmp_path / "policy.yml"
    write_atomically(path, LOW)
    watcher = PolicyWatcher(path, settle_s=0)
    guard = ToolGuard(watcher, locks=h.locks, store=h.store, schemas={"transfer": Transfer})
    return guard, watcher, path


def test_a_running_guard_picks_up_a_changed_policy(harness: Any, tmp_path: Path) -> None:
    h = harness({"version": 1, "tools": {}})
    guard, watcher, path = watched(h, tmp_path)
    low = watcher.digest
    call = {"lead_id": "l1", "amount": 150}
    assert guard.run(intent("transfer", call, call_id="c1"), write).reason == "invalid_arguments"
    write_atomically(path, HIGH)
    assert watcher.check()
    assert guard.run(intent("transfer", call, call_id="c2"), write).ok
    versions = {row.intent_id: row.policy_version for row in h.audit()}
    assert versions == {"c1": low, "c2": watcher.digest} and low != watcher.digest


def test_a_broken_file_or_one_the_schemas_refuse_keeps_the_old_policy(
        harness: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    h = harness({"version": 1, "tools": {}})
    guard, watcher, path = watched(h, tmp_path)
    before = watcher.current
    with caplog.at_level(logging.ERROR, logger="toolguard.policy"):
        write_atomically(path, LOW.replace("le: 100", "le: [oops"))
        assert not watcher.check()
        # valid YAML, but its lock template names a field the registered schema does not have
        write_atomically(path, LOW.replace("{lead_id}", "{account}"))
        assert not watcher.check()
    assert watcher.current is before and watcher.failures == 2
    assert f"{path}:" in caplog.text and "account" in caplog.text
    assert guard.run(intent("transfer", {"lead_id": "l1", "amount": 50}, call_id="ok"), write).ok


def test_a_policy_swapped_under_load_is_never_seen_half_loaded(harness: Any,
                                                               tmp_path: Path) -> None:
    """Four threads call while the file flips between two versions that decide apart.

    A call of 150 is refused under LOW and accepted under HIGH: every row must name
    the version whose verdict it carries.
    """
    h = harness({"version": 1, "tools": {}})
    guard, watcher, path = watched(h, tmp_path)
    digests = {watcher.digest: "invalid_arguments"}
    write_atomically(path, HIGH)
    watcher.reload()
    digests[watcher.digest] = "applied"
    done = threading.Event()
    errors: list[BaseException] = []

    def caller(worker: int) -> None:
        try:
            for n in range(25):
                guard.run(intent("transfer", {"lead_id": f"l{worker}", "amount": 150},
                                 call_id=f"w{worker}-{n}"), write)
        except BaseException as error:  # the test reads it
            errors.append(error)

    def flipper() -> None:
        texts = [LOW, HIGH]
        flips = 0
        while not done.is_set():
            write_atomically(path, texts[flips % 2])
            watcher.reload()
            flips += 1

    flipping = threading.Thread(target=flipper)
    flipping.start()
    workers = [threading.Thread(target=caller, args=(n,)) for n in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    done.set()
    flipping.join(30)
    assert errors == []
    rows = h.audit()
    assert len(rows) == 100
    assert all(digests[row.policy_version] == row.reason for row in rows)
    assert watcher.swaps > 2 and set(Counter(row.reason for row in rows)) == set(digests.values())
