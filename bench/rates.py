"""Request rates of one vault call beside a bare gRPC echo service, from the same callers in the
same run (bench/h2load.py): the shared part of the look-up, append and admission benchmarks.

The echo service (bench/echo_server.py) is measured two ways. Echoing the message decodes and
encodes it, as any service defined in a .proto must; that is the baseline the goals compare
with. Echoing the bytes untouched is printed beside it, the floor of the gRPC server itself.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from google.protobuf.message import Message

from bench.common import ROOT, Load
from bench.h2load import unary_load

CONCURRENCY = 16


@contextmanager
def echo_server(message: str) -> Iterator[str]:
    """The echo service in its own process, echoing `message` (a pinvault message's name)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.echo_server", message], cwd=ROOT, stdout=subprocess.PIPE
    )
    assert process.stdout is not None
    found = re.search(r"on (\S+)", process.stdout.readline().decode())
    try:
        if not found:
            raise RuntimeError("the echo server did not start")
        yield found.group(1)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait()


@dataclass
class Rates:
    echo_bytes: Load
    echo_message: Load
    vault: Load

    @property
    def ratio(self) -> float:
        """The vault's rate over the message echo's."""
        return self.vault.rate / self.echo_message.rate

    def report(self, label: str, callers: str = "h2load, on one connection") -> str:
        return "\n".join(
            [
                f"{CONCURRENCY} calls in flight from {callers}",
                f"  echo, bytes untouched  {self.echo_bytes}",
                f"  echo, message decoded  {self.echo_message}",
                f"  {label:<21}  {self.vault}",
                f"  {label}: {self.ratio:.2f}x the message echo, "
                f"{self.vault.rate / self.echo_bytes.rate:.2f}x the bytes echo",
            ]
        )


def compare(
    address: str, method: str, request: Message, answer_size: int, *, seconds: float
) -> Rates:
    """`request` sent to `method` on the vault at `address`, every answer `answer_size` bytes,
    and to both echoes, from the same callers."""
    data = request.SerializeToString()
    with echo_server(type(request).__name__) as echo:
        echo_bytes = unary_load(echo, "/bench.Echo/Echo", data, len(data), seconds=seconds)
        echo_message = unary_load(echo, "/bench.Echo/EchoMessage", data, len(data), seconds=seconds)
    vault = unary_load(address, method, data, answer_size, seconds=seconds)
    return Rates(echo_bytes, echo_message, vault)
