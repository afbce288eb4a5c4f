"""Streamed put and get through a link with a round trip of milliseconds, as a client on
another host has, beside the same calls straight to the server in the same run.

The server's HTTP/2 window is fixed (vault/server/service.py, `STREAM_WINDOW`): a stream may
have that many bytes in flight before the server reads them. A window too small for the link's
round trip slows a put to window / round trip; this measures whether it does. The link is a
proxy in a child process that holds each chunk it forwards for the given delay, each way.

    uv run python -m bench.slow_link [--size-mib 256] [--repeat 3] [--delay-ms 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import make_file, row, vault_server
from vault.client import VaultClient


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while True:
            data = await reader.read(1 << 20)
            await queue.put((time.monotonic() + delay, data))
            if not data:
                return

    async def write() -> None:
        while True:
            due, data = await queue.get()
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if not data:
                writer.close()
                return
            writer.write(data)
            await writer.drain()

    await asyncio.gather(read(), write(), return_exceptions=True)


def proxy(listen: socket.socket, target: str, delay: float) -> None:
    """Forward each connection to `target`, holding every chunk `delay` seconds each way."""
    host, port = target.rsplit(":", 1)

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        r2, w2 = await asyncio.open_connection(host, int(port))
        await asyncio.gather(_pipe(r, w2, delay), _pipe(r2, w, delay), return_exceptions=True)

    async def main() -> None:
        server = await asyncio.start_server(handle, sock=listen)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def timed(client: VaultClient, source: Path, out: Path, repeat: int) -> tuple[float, float]:
    puts, gets = [], []
    for i in range(repeat + 1):
        with open(source, "r+b") as f:
            f.write(os.urandom(16))  # a new blob each time
        start = time.perf_counter()
        digest = str(client.put(str(source), handoff=False).blob.sha256)
        p = time.perf_counter() - start
        start = time.perf_counter()
        client.get(digest, out, handoff=False)
        g = time.perf_counter() - start
        out.unlink()
        if i:  # the first round is warm-up
            puts.append(p)
            gets.append(g)
    return statistics.median(puts), statistics.median(gets)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=2.0, help="each way")
    parser.add_argument("--serve-proxy", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_proxy:
        listen = socket.socket(fileno=int(args.serve_proxy[0]))
        proxy(listen, args.serve_proxy[1], args.delay_ms / 1000)
        return
    with tempfile.TemporaryDirectory(prefix="pinvault-bench-") as tmp:
        source = make_file(Path(tmp) / "source.bin", args.size_mib << 20)
        out = Path(tmp) / "out.bin"
        with vault_server() as server:
            listen = socket.create_server(("127.0.0.1", 0))
            command = [sys.executable, "-m", "bench.slow_link", "--delay-ms", str(args.delay_ms)]
            command += ["--serve-proxy", str(listen.fileno()), server.address]
            link = subprocess.Popen(command, pass_fds=(listen.fileno(),))
            try:
                direct = VaultClient(server.address, state=Path(tmp) / "direct.json")
                far = VaultClient(
                    f"127.0.0.1:{listen.getsockname()[1]}", state=Path(tmp) / "far.json"
                )
                near_put, near_get = timed(direct, source, out, args.repeat)
                far_put, far_get = timed(far, source, out, args.repeat)
                direct.close()
                far.close()
            finally:
                link.kill()
                link.wait()
    rtt = 2 * args.delay_ms
    print(f"{args.size_mib} MiB, median of {args.repeat}; link round trip {rtt:g} ms")
    mib = args.size_mib
    for label, far_t, near_t in (("put", far_put, near_put), ("get", far_get, near_get)):
        print(
            row(
                f"{label}, streamed over the link",
                f"{far_t:.3f} s",
                f"{near_t:.3f} s",
                far_t / near_t,
                f"as fast as without it ({mib / far_t:,.0f} MiB/s)",
            )
        )


if __name__ == "__main__":
    main()
