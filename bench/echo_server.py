"""A bare gRPC echo service with the vault server's settings (the asyncio server, the same
options): the baseline for request rates.

    python -m bench.echo_server   (prints the address it listens on)
"""

from __future__ import annotations

import asyncio
import signal

import grpc

from vault.service import SERVER_OPTIONS


async def echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return request


async def main() -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"echo serving on 127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(main())
