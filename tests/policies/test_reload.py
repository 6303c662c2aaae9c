"""Hot reload: validated fully, swapped atomically, a broken file keeps the old policy."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from pydantic import BaseModel

from toolguard.errors import ConfigurationError, PolicyProblems
from toolguard.policies import Policy
from toolguard.policies.reload import PolicyWatcher

TOOLS = 40


def policy_text(ttl_ms: int, tools: int = TOOLS) -> str:
    lines = ["version: 1", "tools:"]
    for index in range(tools):
        lines += [f"  tool_{index}:", "    locks: ['thing:{id}']", f"    ttl_ms: {ttl_ms}"]
    return "\n".join(lines) + "\n"


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def test_a_broken_file_keeps_the_old_policy_and_says_where(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "policy.yml"
    write_atomically(path, policy_text(1000, tools=2))
    watcher = PolicyWatcher(path, settle_s=0)
    first = watcher.current
    assert not watcher.check()  # nothing changed
    write_atomically(path, policy_text(1000, tools=2).replace("ttl_ms: 1000", "ttl_ms: -5", 1))
    with caplog.at_level(logging.ERROR, logger="toolguard.policy"):
        assert not watcher.check()
    assert watcher.current is first and watcher.failures == 1
    assert f"{path}:5: tools.tool_0.ttl_ms: Input should be greater than 0" in caplog.text
    assert not watcher.check()  # the same broken file is not reported every round
    write_atomically(path, policy_text(2000, tools=2))
    assert watcher.check() and watcher.current.tools["tool_0"].ttl_ms == 2000
    write_atomically(path, "# only a comment changed\n" + policy_text(2000, tools=2))
    assert not watcher.check() and watcher.swaps == 1  # same meaning, same digest: no swap


def test_a_broken_policy_at_start_raises(tmp_path: Path) -> None:
    path = tmp_path / "policy.yml"
    path.write_text("version: 1\ntools: {x: {}}\n", encoding="utf-8")
    with pytest.raises(PolicyProblems, match="no locks"):
        PolicyWatcher(path)


def test_the_tools_schemas_are_checked_before_a_swap(tmp_path: Path) -> None:
    class Args(BaseModel):
        id: str

    path = tmp_path / "policy.yml"
    write_atomically(path, policy_text(1000, tools=1))
    watcher = PolicyWatcher(path, schemas={"tool_0": Args}, settle_s=0)
    write_atomically(path, policy_text(1000, tools=1).replace("{id}", "{lead_id}"))
    assert not watcher.check()  # the template names no argument of the real tool
    assert watcher.current.tools["tool_0"].locks[0].text == "thing:{id}"


def test_a_file_still_being_written_is_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "policy.yml"
    write_atomically(path, policy_text(1000))
    full = policy_text(2000)
    half = full[: full.index("  tool_20:")]  # valid YAML on its own: 20 tools

    def writer_finishes(_: float) -> None:  # the writer completes during the settle pause
        with path.open("a", encoding="utf-8") as handle:
            handle.write(full[len(half):])

    watcher = PolicyWatcher(path, settle_s=0.01, sleep=writer_finishes)
    with path.open("w", encoding="utf-8") as handle:  # an in-place save, caught half-way
        handle.write(half)
    assert not watcher.check()
    assert len(watcher.current.tools) == TOOLS and watcher.current.tools["tool_0"].ttl_ms == 1000
    watcher._sleep = lambda _: None
    assert watcher.check()
    assert len(watcher.current.tools) == TOOLS and watcher.current.tools["tool_0"].ttl_ms == 2000


@pytest.mark.timeout(120)
def test_swapped_under_load_no_reader_sees_a_half_loaded_policy(tmp_path: Path) -> None:
    path = tmp_path / "policy.yml"
    versions = {ttl: Policy.from_dict(_data(ttl)).digest for ttl in (1000, 2000)}
    write_atomically(path, policy_text(1000))
    watcher = PolicyWatcher(path, poll_s=0.005, settle_s=0).start()
    stop = threading.Event()
    problems: list[str] = []
    seen: set[str] = set()

    def read() -> None:
        while not stop.is_set():
            policy = watcher.current  # one snapshot, used for everything below
            ttls = {tool.ttl_ms for tool in policy.tools.values()}
            if len(policy.tools) != TOOLS or len(ttls) != 1:
                problems.append(f"{len(policy.tools)} tools, ttls {sorted(ttls)}")
            elif versions[ttls.pop()] != policy.digest:
                problems.append("content and digest disagree")
            else:
                seen.add(policy.digest)

    readers = [threading.Thread(target=read) for _ in range(4)]
    for reader in readers:
        reader.start()
    try:
        for round_ in range(30):
            text = policy_text(2000 if round_ % 2 == 0 else 1000)
            if round_ % 10 == 5:
                text = text.replace("ttl_ms: 2000", "ttl_ms: two", 1)  # broken: must be kept out
                text = text.replace("ttl_ms: 1000", "ttl_ms: one", 1)
            failures = watcher.failures
            write_atomically(path, text)
            deadline = time.monotonic() + 10
            want = versions[2000 if round_ % 2 == 0 else 1000]
            while (watcher.failures == failures if round_ % 10 == 5 else watcher.digest != want):
                assert time.monotonic() < deadline, "the watcher never picked up the change"
                time.sleep(0.002)
    finally:
        stop.set()
        for reader in readers:
            reader.join(10)
        watcher.stop()
    assert problems == []
    assert seen == set(versions.values())  # readers did see both policies
    assert watcher.swaps == 24 and watcher.failures == 3  # a broken round keeps the policy


def _data(ttl: int) -> dict[str, object]:
    return {"version": 1, "tools": {f"tool_{i}": {"locks": ["thing:{id}"], "ttl_ms": ttl}
                                    for i in range(TOOLS)}}


def test_sighup_reloads(tmp_path: Path) -> None:
    path = tmp_path / "policy.yml"
    write_atomically(path, policy_text(1000, tools=1))
    watcher = PolicyWatcher(path, poll_s=3600, settle_s=0)  # polling would take an hour
    previous = signal.getsignal(signal.SIGHUP)
    try:
        watcher.install_sighup()
        write_atomically(path, policy_text(3000, tools=1))
        os.kill(os.getpid(), signal.SIGHUP)
        deadline = time.monotonic() + 10
        while watcher.current.tools["tool_0"].ttl_ms != 3000:
            assert time.monotonic() < deadline, "SIGHUP did not reload the policy"
            time.sleep(0.01)
    finally:
        watcher.stop()
        signal.signal(signal.SIGHUP, previous)
    errors: list[BaseException] = []

    def elsewhere() -> None:
        try:
            watcher.install_sighup()
        except ConfigurationError as error:
            errors.append(error)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join(10)
    assert len(errors) == 1 and "main thread" in str(errors[0])


def test_swap_hook_and_folder(tmp_path: Path) -> None:
    folder = tmp_path / "policies"
    folder.mkdir()
    write_atomically(folder / "a.yml", "version: 1\ntools: {a: {read_only: true}}\n")
    swaps: list[tuple[int, int]] = []
    watcher = PolicyWatcher(folder, settle_s=0,
                            on_swap=lambda old, new: swaps.append((len(old.tools), len(new.tools))))
    write_atomically(folder / "b.yml", "version: 1\ntools: {b: {read_only: true}}\n")  # a new file
    assert watcher.check() and swaps == [(1, 2)]
    (folder / "b.yml").unlink()
    assert watcher.check() and swaps == [(1, 2), (2, 1)]


def test_a_deleted_or_emptied_file_keeps_the_old_policy_and_is_reported_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "policy.yml"
    write_atomically(path, policy_text(1000, tools=2))
    watcher = PolicyWatcher(path, settle_s=0)
    first = watcher.current
    with caplog.at_level(logging.ERROR, logger="toolguard.policy"):
        for broken in ("", "# nothing but a comment\n", "null\n", "- a list\n"):
            write_atomically(path, broken)
            assert not watcher.check() and watcher.current is first, broken
        reported = watcher.failures
        path.unlink()
        assert not watcher.check() and watcher.current is first
        assert watcher.failures == reported + 1
        for _ in range(3):  # still gone: not reported again every round
            assert not watcher.check()
        assert watcher.failures == reported + 1
    write_atomically(path, policy_text(3000, tools=2))  # back: loaded at once
    assert watcher.check() and watcher.current.tools["tool_0"].ttl_ms == 3000
