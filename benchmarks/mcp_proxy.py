"""The MCP gateway's added latency per call, beside calling the upstream directly, in one run.

    python benchmarks/mcp_proxy.py [--calls N]

Two MCP SDK clients over stdio, one session each, alive for the whole run:

* ``direct``: the bundled example server (``python -m toolguard.gateway.example``);
* ``gateway``: ``toolguard mcp example`` (the same server behind the gateway,
  with its bundled policy, embedded SQLite store and locks in a temporary folder).

Each round calls, on both in turn (so slow drifts of the machine hit both
alike), ``list_tickets`` (a read: validation, policy, audit row) and
``open_ticket`` (a write: a lock, the fenced transaction with the idempotency
record, the audit row). It prints p50/p99 per call, the added latency (p50
gateway minus p50 direct) and the ratio gateway/direct. Always exits 0: a slow
figure is a finding, not a crash.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import Table, fmt_ratio, fmt_s, ratio, summarize

ROOT = Path(__file__).resolve().parents[1]


async def _session(stack: AsyncExitStack, args: list[str], folder: Path) -> Any:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGUARD_")}
    env.update({"PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}",
                "TOOLGUARD_EXAMPLE_DB": str(folder / "board.db"),
                "FASTMCP_LOG_LEVEL": "WARNING"})
    params = StdioServerParameters(command=args[0], args=args[1:], env=env, cwd=str(folder))
    errlog = stack.enter_context((folder / "stderr.log").open("a"))
    read, write = await stack.enter_async_context(stdio_client(params, errlog=errlog))
    session = await stack.enter_async_context(ClientSession(read, write))
    await session.initialize()
    return session


async def run(calls: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        direct_dir, gateway_dir = Path(tmp, "direct"), Path(tmp, "gateway")
        direct_dir.mkdir()
        gateway_dir.mkdir()
        async with AsyncExitStack() as stack:
            direct = await _session(stack, [sys.executable, "-m", "toolguard.gateway.example"],
                                    direct_dir)
            gateway = await _session(stack, [sys.executable, "-m", "toolguard", "mcp",
                                             "example"], gateway_dir)
            timings: dict[tuple[str, str], list[float]] = {}
            for round_ in range(calls + 3):  # the first three rounds warm both paths up
                for label, session in (("direct", direct), ("gateway", gateway)):
                    for tool, arguments in (("list_tickets", {}),
                                            ("open_ticket", {"title": f"t{round_}"})):
                        started = time.perf_counter()
                        reply = await session.call_tool(tool, arguments)
                        elapsed = time.perf_counter() - started
                        if reply.is_error:
                            print(f"{label} {tool} failed: {reply.content}", file=sys.stderr)
                        if round_ >= 3:
                            timings.setdefault((label, tool), []).append(elapsed)
    table = Table(f"MCP gateway vs direct, {calls} calls each (stdio, embedded SQLite)",
                  ["tool", "direct p50", "direct p99", "gateway p50", "gateway p99",
                   "added p50", "ratio p50"])
    for tool in ("list_tickets", "open_ticket"):
        direct_s = summarize(timings[("direct", tool)])
        gateway_s = summarize(timings[("gateway", tool)])
        table.add_row(tool, fmt_s(direct_s.p50), fmt_s(direct_s.p99), fmt_s(gateway_s.p50),
                      fmt_s(gateway_s.p99), fmt_s(gateway_s.p50 - direct_s.p50),
                      fmt_ratio(ratio(gateway_s.p50, direct_s.p50)))
    table.print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per tool and path")
    args = parser.parse_args()
    asyncio.run(run(args.calls))


if __name__ == "__main__":
    main()
