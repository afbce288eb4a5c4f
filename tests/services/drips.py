"""Slowloris callers for tests and benchmarks: connections that send a request head one byte
at a time and never finish it, opened again as soon as the server closes one."""

from __future__ import annotations

import asyncio
import ssl
import threading
from types import TracebackType
from typing import Self

# Between the bytes of a dripping request head.
DRIP_SECONDS = 2.0
# Before a closed one is opened again: 10 a second each, a thousand a second for 100, without
# spinning the machine the test shares with the server.
RECONNECT_SECONDS = 0.1


class Drips:
    """`count` connections to each address that send a request head one byte every
    DRIP_SECONDS and never finish it; one closed by the server is opened again at once."""

    def __init__(self, addresses: list[tuple[int, ssl.SSLContext | None]], count: int) -> None:
        self.addresses = addresses
        self.count = count
        self.opened = 0
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)
        self._ready = threading.Event()

    def __enter__(self) -> Self:
        self._thread.start()
        # A server that cannot take them all in time is what a test is looking for: go on.
        self._ready.wait(30)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        connected = [asyncio.Event() for _ in range(self.count * len(self.addresses))]
        tasks = [
            asyncio.create_task(self._drip(port, tls, connected[i * self.count + n]))
            for i, (port, tls) in enumerate(self.addresses)
            for n in range(self.count)
        ]
        await asyncio.gather(*(event.wait() for event in connected))
        self._ready.set()
        await self._stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _drip(self, port: int, tls: ssl.SSLContext | None, connected: asyncio.Event) -> None:
        head = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Drip: " + b"a" * 10_000
        while True:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
            except OSError:
                connected.set()
                await asyncio.sleep(RECONNECT_SECONDS)
                continue
            self.opened += 1
            connected.set()
            try:
                for byte in head:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    try:
                        async with asyncio.timeout(DRIP_SECONDS):
                            if await reader.read(1024) == b"":
                                break
                    except TimeoutError:
                        pass
            except (OSError, ssl.SSLError):
                pass
            finally:
                writer.transport.abort()
            await asyncio.sleep(RECONNECT_SECONDS)
