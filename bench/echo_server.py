"""A bare gRPC echo service with the vault server's settings: the baseline for request rates.

python -m bench.echo_server   (prints the address it listens on)
"""

from __future__ import annotations

import signal
import threading
from concurrent import futures

import grpc

from vault.service import SERVER_OPTIONS

WORKERS = 32


def main() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS), options=SERVER_OPTIONS)
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo",
        {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request)},
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"echo serving on 127.0.0.1:{port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(0)


if __name__ == "__main__":
    main()
