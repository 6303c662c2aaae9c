"""Automatic sealing: a store seals the audit rows it wrote within a bound, on by default.

A row not sealed yet is covered only by its own hash, which says nothing when
the row is deleted. So every store that writes audit rows seals them itself:
``AutoSeal(rows=N, seconds=T)`` seals once the store has written ``N`` rows
since its last seal, or ``T`` seconds after the first of them, whichever comes
first, and once more when the store is closed. The seal runs in a thread of
its own (one per store, started by the first audit row it writes), never on a
writer's path: a guarded call never waits for it. A store that only reads
(``toolguard audit verify``, the review page) never seals.

A seal covers every row that may be sealed, whoever wrote it; a process that
dies leaves its last rows (at most ``N``, written in its last ``T`` seconds) for
the next sealer.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

from toolguard.errors import ConfigurationError
from toolguard.store.chain import SealResult

__all__ = ["DEFAULT_AUTOSEAL", "AutoSeal", "AutoSealer"]

log = logging.getLogger("toolguard.store")


@dataclass(frozen=True, slots=True)
class AutoSeal:
    """When a store seals its own audit rows: after ``rows`` rows, or ``seconds`` after the
    first row not sealed yet, and at close. ``wait_s``: how long a PostgreSQL seal waits for
    writers whose transactions are still open (their rows go to the next seal)."""

    rows: int = 1000
    seconds: float = 1.0
    wait_s: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.rows, int) or isinstance(self.rows, bool) or self.rows < 1:
            msg = f"AutoSeal rows must be a positive integer, got {self.rows!r}"
            raise ConfigurationError(msg)
        for name in ("seconds", "wait_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or \
                    not math.isfinite(value) or value <= 0:
                msg = f"AutoSeal {name} must be a positive number of seconds, got {value!r}"
                raise ConfigurationError(msg)

    def describe(self) -> str:
        return f"every {self.rows:,} rows or {self.seconds:g} s, and at close"


#: The stores' default: a row is sealed within about a second of being written.
DEFAULT_AUTOSEAL = AutoSeal()


#: The longest wait between two tries of a sealer whose seals fail.
MAX_RETRY_S = 10.0


class AutoSealer:
    """The sealing thread of one store: ``wrote()`` after each committed audit row, ``close()``
    at the end.

    ``seal`` is the store's own ``seal_audit`` (bound to its options). The thread starts
    with the first row, wakes every ``seconds`` (or at once when ``rows`` more were written)
    and seals if rows were written since its last seal; an error is logged and the rows
    wait for the next round (or another process's sealer). ``wrote()`` takes no lock the
    sealer holds: an atomic counter, and an event set once per ``rows`` rows, so a writer
    on an event loop never waits for the sealer.
    """

    def __init__(self, seal: Callable[[], SealResult], every: AutoSeal | None, *,
                 name: str = "toolguard-autoseal") -> None:
        self._seal = seal
        self.every = every
        self._name = name
        self._counter = itertools.count(1)
        self._written = 0  # rows counted so far (only ever assigned a value of ``_counter``)
        self._sealed = 0  # rows counted before the last seal that covered them began
        self._wake = threading.Event()
        self._closing = False
        self._started = False
        self._start = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failures = 0  # seals failed in a row: the next try waits longer

    @property
    def pending(self) -> int:
        """Rows this store wrote that no seal of its own has covered yet."""
        return max(0, self._written - self._sealed)

    @property
    def idle(self) -> bool:
        """Nothing to stop or seal: this store wrote no audit row."""
        return not self._started and not self.pending

    def wrote(self) -> None:
        """Count one committed audit row; no I/O, on the writer's path."""
        if self.every is None or self._closing:
            return
        count = next(self._counter)  # atomic in CPython
        self._written = max(self._written, count)
        if not self._started:
            self._start_thread()
        elif count % self.every.rows == 0:
            self._wake.set()

    def _start_thread(self) -> None:
        with self._start:
            if self._started:
                return
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
            self._started = True

    def _run(self) -> None:
        assert self.every is not None
        while True:
            # after failures the next try waits twice as long each time, up to MAX_RETRY_S:
            # a store that is down (or a schema dropped) is not asked every second
            wait = min(self.every.seconds * 2 ** min(self._failures, 16),
                       max(self.every.seconds, MAX_RETRY_S))
            self._wake.wait(timeout=wait)
            self._wake.clear()
            if self._closing:
                return
            self._seal_once()

    def _seal_once(self) -> None:
        target = self._written
        if target <= self._sealed:
            return
        try:
            result = self._seal()
        except Exception as error:  # the store may be what is down: the rows wait for the next try
            self._failures += 1
            log.warning("toolguard could not seal the audit log (%s rows wait; try %d): %s",
                        target - self._sealed, self._failures, error)
            return
        self._failures = 0
        if result.deferred is None:  # else a writer's open transaction held the range back
            self._sealed = max(self._sealed, target)

    def close(self) -> None:
        """Stop the thread, then seal what this store wrote since its last seal (in the caller)."""
        self._closing = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if self.every is not None:
            self._seal_once()
