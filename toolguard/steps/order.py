"""The ordering step: an ``after:`` rule waits (bounded) for the earlier tool's applied record.

``wait_for_order(store, prepared, call)`` (sync) and ``await_order`` (asyncio)
return once every earlier tool named by ``after:`` has an applied record on
the call's resources, or raise ``OutOfOrder`` when the rule's wait is over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

from toolguard.errors import OutOfOrder
from toolguard.runtime import telemetry
from toolguard.steps.prepared import Prepared
from toolguard.store import AsyncGuardedStore, GuardedStore

__all__ = ["OrderWait", "await_order", "wait_for_order"]

_ORDER_POLL_MIN_S = 0.02
_ORDER_POLL_MAX_S = 0.25


class OrderWait:
    """The bounded wait of an ``after:`` rule: what to check, and how long to pause between looks.

    As a context manager around the wait, it reports a wait that paused at least once
    (``toolguard.order.waits``), satisfied or ended ``out_of_order``.
    """

    def __init__(self, prepared: Prepared, call: telemetry.Call) -> None:
        self.prepared = prepared
        self.call = call
        self.started = time.monotonic()
        self.deadline = self.started + prepared.rule.after_wait_s
        self.pause = _ORDER_POLL_MIN_S
        self.paused = False

    def __enter__(self) -> OrderWait:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: object) -> None:
        if self.paused:
            outcome = "satisfied" if error is None else \
                ("out_of_order" if isinstance(error, OutOfOrder) else "error")
            self.call.order_waited(time.monotonic() - self.started, outcome)

    def checks(self) -> Iterator[tuple[str, str]]:
        """``(earlier tool, resource key)`` pairs whose applied record must exist."""
        for earlier, keys in self.prepared.after:
            for key in keys:
                yield earlier, key

    def pause_or_raise(self, missing: tuple[str, str]) -> float:
        """The next pause (doubling up to a cap), or ``OutOfOrder`` once the wait is over."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _out_of_order(self.prepared, missing)
        pause, self.pause = min(self.pause, left), min(self.pause * 2, _ORDER_POLL_MAX_S)
        self.paused = True
        return pause


def wait_for_order(store: GuardedStore, prepared: Prepared, call: telemetry.Call) -> None:
    """Return once the ``after:`` rule is satisfied; ``OutOfOrder`` when its wait is over."""
    if not prepared.after:
        return
    wait = OrderWait(prepared, call)
    with call.step(telemetry.SPAN_ORDER_WAIT), wait:
        while (missing := next((c for c in wait.checks() if not store.has_applied(*c)), None)):
            time.sleep(wait.pause_or_raise(missing))


async def await_order(store: AsyncGuardedStore, prepared: Prepared, call: telemetry.Call) -> None:
    """The asyncio twin of ``wait_for_order``."""
    if not prepared.after:
        return
    wait = OrderWait(prepared, call)
    with call.step(telemetry.SPAN_ORDER_WAIT), wait:
        while True:
            missing = None
            for check in wait.checks():
                if not await store.has_applied(*check):
                    missing = check
                    break
            if missing is None:
                return
            await asyncio.sleep(wait.pause_or_raise(missing))


def _out_of_order(prepared: Prepared, missing: tuple[str, str]) -> OutOfOrder:
    earlier, key = missing
    msg = (f"{prepared.record.tool} must run after {earlier} on {key}, and no applied "
           f"{earlier} was recorded within {prepared.rule.after_wait_s:g}s")
    return OutOfOrder(msg)
