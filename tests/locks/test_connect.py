"""``connect`` / ``connect_async`` defaults: settings apply the same way to sync and async code."""

from __future__ import annotations

import asyncio

import pytest

from toolguard.errors import ConfigurationError
from toolguard.locks import connect, connect_async


def test_settings_give_the_same_defaults_to_sync_and_async(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TOOLGUARD_LOCK_URL", f"sqlite:///{tmp_path / 'locks.db'}")
    monkeypatch.setenv("TOOLGUARD_TTL_MS", "4321")
    monkeypatch.setenv("TOOLGUARD_WAIT_TIMEOUT_S", "1.5")
    with connect() as sync_manager:
        assert (sync_manager.ttl_ms, sync_manager.timeout_s) == (4321, 1.5)

    async def main() -> tuple[int, float]:
        manager = connect_async()
        try:
            async with manager.acquire("k") as lease:
                assert lease.ttl_ms == 4321
            return manager.ttl_ms, manager.timeout_s
        finally:
            await manager.aclose()

    assert asyncio.run(main()) == (4321, 1.5)


def test_unknown_scheme_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        connect("mongodb://localhost")
    with pytest.raises(ConfigurationError):
        connect("sqlite:///")


def test_a_stale_hand_off_datagram_is_dropped(tmp_path) -> None:
    import socket

    from toolguard.locks.base import new_owner
    from toolguard.locks.sqlite import SqliteBackend

    backend = SqliteBackend(tmp_path / "locks.db")
    try:
        owner, late = new_owner(30_000), new_owner(30_000)
        assert backend.try_acquire("k", owner, 30_000).granted
        assert backend.try_acquire("k2", owner, 30_000).granted
        assert not backend.try_acquire("k", late, 30_000).granted
        assert not backend.try_acquire("k2", late, 30_000).granted
        last = backend.current_token("k")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(str(last).encode(), backend._wake_address(late, "k"))  # over already
            sock.sendto(b"garbage", backend._wake_address(late, "k"))
            sock.sendto(str(last + 7).encode(), backend._wake_address(late, "k2"))  # another key
            assert backend.wait("k", late, 0.3) is None
            sock.sendto(str(last + 1).encode(), backend._wake_address(late, "k"))
            assert backend.wait("k", late, 0.3) == last + 1
    finally:
        backend.close()
