"""Spawned processes for the controls tests: each opens its own store."""

from __future__ import annotations

from typing import Any

from store.envs import StoreEnv

from toolguard.pause import PauseBoard


def pause_from_elsewhere(env: StoreEnv, kind: str, name: str, out: Any) -> None:
    store = env.open()
    try:
        PauseBoard(store).pause(kind, name, by="other-process", reason="from another process")
        out.put("paused")
    finally:
        store.close()
