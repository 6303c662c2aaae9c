"""Nothing a guarded call does blocks the event loop (checked with ``blockbuster``).

A guard's first asyncio call used to list and read the packaged SQL migration
files inside the loop (the schema-version check): under a blocking-call
detector, as LangChain's own test suite runs, that call failed with
``BlockingError`` though the tool never ran, and so did every later call.
"""

from __future__ import annotations

import asyncio
from typing import Any

from blocking import no_blocking

from guard.harness import HarnessFactory
from guard.tools import LEAD_POLICY
from toolguard.call.context import CallContext
from toolguard.call.intent import Intent


def test_a_guards_first_async_call_does_not_block_the_loop(harness: HarnessFactory) -> None:
    h = harness(LEAD_POLICY)

    async def body(ctx: CallContext) -> str:
        return "ok"

    async def scenario() -> list[Any]:
        async with h.async_edges() as guard:
            with no_blocking():
                return [(await guard.arun(Intent(tool="add_score", agent="scorer",
                                                  call_id=f"c{n}",
                                                  args={"lead_id": "a", "delta": 1}),
                                           body)).kind for n in range(3)]

    assert asyncio.run(scenario()) == ["accepted"] * 3
