"""Shared pieces of the benchmarks: a vault server in its own process on port 0, timing with
warm-up and medians, and load generation from concurrent callers."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Server:
    address: str
    data_dir: Path
    process: subprocess.Popen[bytes]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PINVAULT_CLIENT_SERVER"] = self.address
        env["XDG_STATE_HOME"] = str(self.data_dir / "client-state")
        return env

    @property
    def pid(self) -> int:
        return self.process.pid


@contextmanager
def vault_server(
    data_dir: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """`vault serve` in a child process, listening on a port the kernel picks."""
    with tempfile.TemporaryDirectory(
        prefix="pinvault-bench-", dir=os.environ.get("BENCH_TMP")
    ) as tmp:
        data = data_dir or Path(tmp) / "data"
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("PINVAULT_")}
        child_env.update(env or {})
        child_env["PINVAULT_DATA_DIR"] = str(data)
        process = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "serve", "--listen", "127.0.0.1:0"],
            cwd=ROOT,
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert process.stdout is not None
        line = process.stdout.readline().decode()
        found = re.search(r"serving on (\S+)", line)
        if not found:
            process.kill()
            raise RuntimeError(f"vault serve did not start: {line!r}")
        try:
            yield Server(found.group(1), data, process)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()


def median_time(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def run(cmd: list[str], **kw: object) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, **kw)  # type: ignore[call-overload]


@dataclass
class Load:
    requests: int
    seconds: float
    p50: float
    p99: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    def __str__(self) -> str:
        return f"{self.rate:,.0f} req/s  p50 {self.p50 * 1000:.2f} ms  p99 {self.p99 * 1000:.2f} ms"


def load(call: Callable[[], Awaitable[object]], *, concurrency: int, seconds: float) -> Load:
    """`concurrency` callers, each calling back to back for `seconds` (after a warm-up)."""

    async def main() -> Load:
        latencies: list[float] = []
        deadline = 0.0

        async def caller(record: bool) -> None:
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                await call()
                if record:
                    latencies.append(time.perf_counter() - start)

        deadline = time.perf_counter() + min(1.0, seconds / 3)
        await asyncio.gather(*(caller(False) for _ in range(concurrency)))
        begin = time.perf_counter()
        deadline = begin + seconds
        await asyncio.gather(*(caller(True) for _ in range(concurrency)))
        elapsed = time.perf_counter() - begin
        latencies.sort()
        return Load(
            len(latencies),
            elapsed,
            latencies[len(latencies) // 2],
            latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        )

    return asyncio.run(main())


def make_file(path: Path, size: int) -> Path:
    """A file of random bytes (incompressible, so no tier can cheat)."""
    if not path.exists() or path.stat().st_size != size:
        with open(path, "wb") as f:
            left = size
            while left:
                n = min(left, 1 << 20)
                f.write(os.urandom(n))
                left -= n
    return path


def row(label: str, value: str, baseline: str, ratio: float, goal: str) -> str:
    return f"{label:<44} {value:>16} {baseline:>16} {ratio:>7.2f}x  {goal}"
