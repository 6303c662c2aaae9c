"""A cancelled acquisition leaves no lock behind, even when its request lands late (every backend).

An asyncio acquisition cancelled while its request to the server is still out
(in a worker thread, as the SQLite and etcd backends send theirs, or already
on the wire) must not give the key back before the request has landed: a
release sent first finds nothing to release, then the late request takes the
key for an owner nobody runs. On etcd that key sat on the process's lease,
kept alive by the process's other leases, so every other holder waited until
it timed out.

The late landing is modelled by a backend whose acquire requests reach the
real server ``LATE_S`` after they were sent, whatever happens to the caller.
After the cancellation, a manager that asks the server as another process
would (no shared claims) and one of this process (shared claims) each get the
key at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from locks.backends import LockEnv
from toolguard.locks import LockManager, open_backend
from toolguard.locks.base import Attempt

TTL_MS = 30_000  # an orphaned lock would outlive every wait below
LATE_S = 0.3
WAIT_S = 5.0


class LateRequests:
    """An async backend whose acquire requests reach the server ``LATE_S`` late."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.landed: list[asyncio.Future[Attempt]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    async def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        async def late() -> Attempt:
            await asyncio.sleep(LATE_S)
            return await self._real.try_acquire(key, owner, ttl_ms)

        request = asyncio.ensure_future(late())
        self.landed.append(request)
        return await asyncio.shield(request)  # the caller may go; the request goes on


@pytest.mark.parametrize("cancel_after_s", [0.0, 0.05])
def test_a_cancelled_acquisition_leaves_the_key_free(backend: LockEnv,
                                                     cancel_after_s: float) -> None:
    key = backend.key("cancelled")

    async def main() -> None:
        manager = backend.async_manager(ttl_ms=TTL_MS)
        late = LateRequests(manager.backend)
        manager.backend = late
        try:
            taking = asyncio.create_task(manager._acquire(key, None, None))
            await asyncio.sleep(cancel_after_s)
            taking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await taking
            await asyncio.gather(*late.landed, return_exceptions=True)  # every request is in
            await asyncio.to_thread(taken_elsewhere, backend, key)
            again = await manager.acquire(key, timeout_s=WAIT_S)  # and in this process
            await again.arelease()
        finally:
            manager.backend = late._real
            await manager.aclose()

    asyncio.run(main())


def taken_elsewhere(backend: LockEnv, key: str) -> None:
    """The server grants ``key`` to a manager of another lock space at once."""
    with LockManager(open_backend(backend.url, **backend.factory.options)) as elsewhere:
        lease = elsewhere.acquire(key, ttl_ms=5_000, timeout_s=WAIT_S)
        lease.release()
