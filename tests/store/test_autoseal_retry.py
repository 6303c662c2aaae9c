"""A store's sealer whose seals fail waits longer before each next try (pure unit test).

A store that is down, or whose schema was dropped under it, is not asked (and
the log not written) every second: the wait doubles after each failure, up to
``MAX_RETRY_S``, and is back to ``seconds`` after a seal that worked.
"""

from __future__ import annotations

import itertools
import threading
import time

from toolguard.store.autoseal import AutoSeal, AutoSealer
from toolguard.store.chain import SealResult


def test_failing_seals_back_off_and_a_success_resets_the_wait() -> None:
    tries: list[float] = []
    working = threading.Event()

    def seal() -> SealResult:
        tries.append(time.monotonic())
        if not working.is_set():
            msg = "the toolguard schema is not installed here"
            raise RuntimeError(msg)
        return SealResult(seals=1, rows=1, head=None)  # type: ignore[arg-type]  (unread here)

    sealer = AutoSealer(seal, AutoSeal(seconds=0.05))
    try:
        sealer.wrote()
        time.sleep(1.6)  # without backoff: about 32 tries; with it 0.05+0.1+0.2+0.4+0.8
        failed = len(tries)
        assert 2 <= failed <= 6, tries
        gaps = [b - a for a, b in itertools.pairwise(tries)]
        assert gaps[-1] >= 3 * 0.05, gaps  # the waits grew past the configured 0.05 s
        working.set()
        sealer.wrote()
        deadline = time.monotonic() + 10
        while sealer.pending and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sealer.pending == 0
        assert sealer._failures == 0
    finally:
        sealer.close()
