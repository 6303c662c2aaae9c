"""A TCP relay that adds latency on demand: ``python netns_relay.py ADDR PORT TARGET_PORT MS``.

Listens on ``ADDR:PORT`` and forwards to ``ADDR:TARGET_PORT`` (the server in the same
namespace). After SIGUSR1 every chunk is held ``MS`` milliseconds in each
direction before it is forwarded, in order (SIGUSR2: no delay). Stand-in for
``tc qdisc ... netem delay`` where the kernel has no netem. Run by ``tests/netns.py``.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time

delay_s = 0.0


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hold_s: float) -> None:
    chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while data := await reader.read(65536):
            chunks.put_nowait((time.monotonic() + (hold_s if delay_s else 0.0), data))
        chunks.put_nowait((0.0, b""))

    async def write() -> None:
        while True:
            due, data = await chunks.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    reading = asyncio.create_task(read())
    try:
        await write()
    finally:
        reading.cancel()


async def serve(address: str, port: int, target: int, hold_s: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(address, target)
        except OSError:
            client_w.close()
            return
        ways = [asyncio.create_task(pump(client_r, server_w, hold_s)),
                asyncio.create_task(pump(server_r, client_w, hold_s))]
        try:
            await asyncio.wait(ways, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for way in ways:
                way.cancel()
            client_w.close()
            server_w.close()

    server = await asyncio.start_server(handle, address, port)
    async with server:
        await server.serve_forever()


def main() -> None:
    global delay_s
    address, port, target, ms = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

    def on() -> None:
        global delay_s
        delay_s = ms / 1000

    def off() -> None:
        global delay_s
        delay_s = 0.0

    loop = asyncio.new_event_loop()
    loop.add_signal_handler(signal.SIGUSR1, on)
    loop.add_signal_handler(signal.SIGUSR2, off)
    loop.run_until_complete(serve(address, port, target, ms / 1000))


if __name__ == "__main__":
    main()
