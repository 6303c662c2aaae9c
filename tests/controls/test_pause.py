"""The kill switch: pauses in the store, seen by every process, cached with a known bound."""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest
from store.envs import StoreEnv
from typer.testing import CliRunner

from controls import workers
from toolguard.cli import app
from toolguard.controls.pause import AsyncPauseBoard, PauseBoard, PauseSet
from toolguard.errors import BackendUnavailable, Paused, StoreError
from toolguard.store import migrations, open_store

spawn = multiprocessing.get_context("spawn")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pause_a_tool_an_agent_or_everything(store) -> None:
    board = PauseBoard(store, cache_s=0)
    board.check("transfer", "payments")
    board.pause("tool", "transfer", by="alice", reason="incident 42")
    with pytest.raises(Paused, match=r"tool 'transfer' is paused by alice: incident 42") as caught:
        board.check("transfer", "payments")
    assert caught.value.reason == "paused"
    board.check("refund", "payments")
    board.pause("agent", "payments", by="bob")
    with pytest.raises(Paused, match="agent 'payments'"):
        board.check("refund", "payments")
    board.check("refund", None)  # a call without an agent is not "agent payments"
    assert board.resume("tool", "transfer", by="alice") and board.resume("agent", "payments")
    assert not board.resume("agent", "payments")
    board.check("transfer", "payments")
    board.pause("all", by="carol")
    with pytest.raises(Paused, match="every call is paused by carol"):
        board.check("anything", None)
    board.resume("all")
    board.check("anything", None)


def test_every_pause_and_resume_is_audited_with_who(store) -> None:
    board = PauseBoard(store, cache_s=0)
    board.pause("tool", "transfer", by="alice", reason="incident 42")
    board.pause("tool", "transfer", by="alice", reason="still investigating")  # updates
    board.resume("tool", "transfer", by="bob")
    board.resume("tool", "transfer", by="bob")  # nothing to lift: nothing audited
    rows = store.query_audit(decision="operator", newest_first=False)
    assert [(r.reason, r.tool, r.args["by"]) for r in rows] == [
        ("paused", "transfer", "alice"), ("paused", "transfer", "alice"),
        ("resumed", "transfer", "bob")]
    assert rows[1].detail == "tool transfer paused by alice: still investigating"
    assert [r.reason for r in board.records()] == []


def test_the_cache_bounds_how_late_a_pause_is_seen(store) -> None:
    clock = Clock()
    elsewhere = PauseBoard(store, cache_s=0)
    here = PauseBoard(store, cache_s=1.0, clock=clock)
    here.check("transfer", None)  # reads the (empty) set
    elsewhere.pause("tool", "transfer")
    clock.now += 0.999
    here.check("transfer", None)  # still the cached set: no round trip yet
    clock.now += 0.002
    with pytest.raises(Paused):  # older than cache_s: read again
        here.check("transfer", None)
    elsewhere.resume("tool", "transfer")
    here.pause("tool", "refund")  # a pause through this board is seen here at once
    with pytest.raises(Paused):
        here.check("refund", None)


def test_a_pause_from_another_process_is_seen(store_env: StoreEnv, store) -> None:
    board = PauseBoard(store, cache_s=0)
    out = spawn.Queue()
    process = spawn.Process(target=workers.pause_from_elsewhere,
                            args=(store_env, "agent", "rogue", out))
    process.start()
    assert out.get(timeout=60) == "paused"
    process.join(10)
    with pytest.raises(Paused, match="agent 'rogue' is paused by other-process"):
        board.check("transfer", "rogue")


def test_fails_closed_without_the_store(postgres_url: str, tmp_path) -> None:
    gone = open_store("postgresql://postgres@127.0.0.1:1/nowhere", timeout_s=0.5, min_size=0)
    try:
        with pytest.raises(BackendUnavailable):
            PauseBoard(gone).check("transfer", None)
    finally:
        gone.close()
    old = open_store(f"sqlite:///{tmp_path}/old.db")
    try:
        old.install(migrations("sqlite")[:1])  # a store from before the kill switch
        with pytest.raises(StoreError) as caught:
            PauseBoard(old).check("transfer", None)
        assert caught.value.reason == "schema_not_installed"
    finally:
        old.close()


def test_a_pause_set_is_immutable_and_cheap() -> None:
    empty = PauseSet()
    assert empty.refusal("t", "a") is None and empty == PauseSet()


def test_async_twin(store_env: StoreEnv, store) -> None:
    async def scenario() -> None:
        astore = store_env.open_async()
        try:
            board = AsyncPauseBoard(astore, cache_s=0)
            await board.check("transfer", "payments")
            await board.pause("tool", "transfer", by="alice")
            with pytest.raises(Paused):
                await board.check("transfer", "payments")
            assert await board.resume("tool", "transfer")
            await board.check("transfer", "payments")
        finally:
            await astore.close()

    asyncio.run(scenario())
    assert [r.reason for r in store.query_audit(decision="operator")] == ["resumed", "paused"]


def test_cli_pause_and_resume(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path}/store.db"
    open_store(url, install=True).close()
    runner = CliRunner()
    listed = runner.invoke(app, ["pause", "--url", url])
    assert listed.exit_code == 0 and "Nothing is paused." in listed.stdout
    done = runner.invoke(app, ["pause", "transfer", "--tool", "--reason", "incident", "--by", "alice",
                               "--url", url])
    assert done.exit_code == 0, done.output
    assert "tool 'transfer' is paused by alice: incident" in done.stdout
    listed = runner.invoke(app, ["pause", "--url", url])
    assert "tool 'transfer' is paused by alice: incident (since " in listed.stdout
    store = open_store(url)
    try:
        with pytest.raises(Paused):
            PauseBoard(store, cache_s=0).check("transfer", None)
        both = runner.invoke(app, ["pause", "bot", "--url", url])  # a tool or an agent: both
        assert "tool 'bot' is paused" in both.stdout and "agent 'bot' is paused" in both.stdout
        assert runner.invoke(app, ["resume", "bot", "--url", url]).exit_code == 0
        assert runner.invoke(app, ["resume", "transfer", "--url", url]).exit_code == 0
        again = runner.invoke(app, ["resume", "transfer", "--url", url])
        assert again.exit_code == 1 and "was not paused" in again.output
        PauseBoard(store, cache_s=0).check("transfer", None)
        assert runner.invoke(app, ["resume", "--url", url]).exit_code == 2
        assert runner.invoke(app, ["pause", "x", "--tool", "--agent", "--url", url]).exit_code == 2
        everything = runner.invoke(app, ["pause", "--all", "--url", url])
        assert "every call is paused" in everything.stdout
        with pytest.raises(Paused):
            PauseBoard(store, cache_s=0).check("anything", None)
    finally:
        store.close()
