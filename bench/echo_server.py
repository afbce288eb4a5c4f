"""A bare gRPC echo service with the vault server's settings (the asyncio server, the same
options): the baseline for request rates. It answers each call with the request it was sent,
two ways:

- `bench.Echo/Echo` passes the bytes through untouched;
- `bench.Echo/EchoMessage` decodes them as MESSAGE (a pinvault message's name, for example
  LookupRequest) and encodes the message again, as any service defined in a .proto must.

    python -m bench.echo_server [MESSAGE]   (prints the address it listens on)
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

import grpc

from vault.server.service import SERVER_OPTIONS
from vault.wire import pinvault_pb2 as pb


async def echo(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    return request


async def main() -> None:
    message = getattr(pb, sys.argv[1] if len(sys.argv) > 1 else "LookupRequest")
    server = grpc.aio.server(options=SERVER_OPTIONS)
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "EchoMessage": grpc.unary_unary_rpc_method_handler(
            echo,
            request_deserializer=message.FromString,
            response_serializer=message.SerializeToString,
        ),
    }
    # As code generated from a .proto registers its services.
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
    server.add_registered_method_handlers("bench.Echo", handlers)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"echo serving on 127.0.0.1:{port}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(main())
