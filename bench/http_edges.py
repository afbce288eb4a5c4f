"""The vault's HTTP edges (tiles, metrics, explorer) beside slowloris callers: genuine request
latency p50 and p99 with no dripping connections (the baseline) and then with 100 dripping
connections open to each endpoint from the same address, in the same run; and the server's
threads and open descriptors before and after 10,000 scrapes. The goal: p99 with the drips
under 100 ms, and threads and descriptors unchanged by the scrapes.

    uv run python -m bench.http_edges [--drips 100] [--calls 200] [--scrapes 10000]
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from bench.common import ROOT, row
from tests.services.drips import DRIP_SECONDS, Drips

GOAL_P99 = 0.100
TARGETS = {"tiles": "/checkpoint", "metrics": "/metrics", "explorer": "/api/vault"}
CLIENTS = 8


@contextmanager
def vault_with_edges() -> Iterator[tuple[int, dict[str, int]]]:
    """`vault serve` with its three HTTP endpoints on ports the kernel picks: its pid and the
    port of each."""
    with tempfile.TemporaryDirectory(prefix="pinvault-bench-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PINVAULT_")}
        env["PINVAULT_DATA_DIR"] = str(Path(tmp) / "data")
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cli.main",
                "serve",
                "--listen",
                "127.0.0.1:0",
                *("--tiles-http", "127.0.0.1:0", "--metrics-port", "0", "--explorer-http", "0"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert process.stdout is not None
        ports: dict[str, int] = {}
        try:
            while len(ports) < len(TARGETS):
                line = process.stdout.readline().decode()
                if not line:
                    raise RuntimeError("vault serve stopped before naming its endpoints")
                for name in TARGETS:
                    if line.strip().startswith(name) and (found := re.search(r" at (\S+)", line)):
                        ports[name] = urlsplit(found.group(1)).port or 0
            yield process.pid, ports
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()


def latencies(port: int, target: str, calls: int) -> list[float]:
    """`calls` GETs of `target`, each on a new connection (as a scraper or a browser's first
    request makes it); one refused or failed counts as 10 s."""
    taken = []
    for _ in range(calls):
        began = time.perf_counter()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", target)
            response = conn.getresponse()
            response.read()
            conn.close()
            # Any answer but a refusal: an empty vault's tiles endpoint has no checkpoint yet.
            ok = response.status < 500
        except OSError:
            ok = False
        taken.append(time.perf_counter() - began if ok else 10.0)
    return taken


def percentiles(seconds: list[float]) -> tuple[float, float]:
    return statistics.median(seconds), statistics.quantiles(seconds, n=100)[98]


def held(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def scrape(port: int, scrapes: int) -> None:
    def client(count: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for _ in range(count):
            conn.request("GET", "/metrics")
            conn.getresponse().read()
        conn.close()

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, [scrapes // CLIENTS] * CLIENTS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drips", type=int, default=100)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--scrapes", type=int, default=10_000)
    args = parser.parse_args()
    with vault_with_edges() as (pid, ports):
        baseline = {name: latencies(ports[name], t, args.calls) for name, t in TARGETS.items()}
        with Drips([(port, None) for port in ports.values()], args.drips):
            time.sleep(DRIP_SECONDS)
            dripped = {name: latencies(ports[name], t, args.calls) for name, t in TARGETS.items()}
        print(f"{'':<44} {'with drips':>16} {'without':>16}")
        for name in TARGETS:
            (p50, p99), (b50, b99) = percentiles(dripped[name]), percentiles(baseline[name])
            goal = f"goal p99 < {GOAL_P99 * 1000:.0f} ms"
            print(
                row(
                    f"{name} p50 ({args.drips} drips)",
                    f"{p50 * 1000:.1f} ms",
                    f"{b50 * 1000:.1f} ms",
                    p50 / b50,
                    "",
                )
            )
            print(
                row(
                    f"{name} p99 ({args.drips} drips)",
                    f"{p99 * 1000:.1f} ms",
                    f"{b99 * 1000:.1f} ms",
                    p99 / b99,
                    goal,
                )
            )
        time.sleep(1.0)  # the drips' connections are closed on the server's side too
        scrape(ports["metrics"], 400)  # every worker thread has opened what it keeps
        before = held(pid)
        began = time.perf_counter()
        scrape(ports["metrics"], args.scrapes)
        seconds = time.perf_counter() - began
        time.sleep(0.5)
        after = held(pid)
        print(f"{args.scrapes} scrapes in {seconds:.1f} s ({args.scrapes / seconds:.0f}/s)")
        print(f"{'':<44} {'after':>16} {'before':>16}")
        print(
            row(
                "server threads", str(after[0]), str(before[0]), after[0] / before[0], "goal: equal"
            )
        )
        print(
            row(
                "server open descriptors",
                str(after[1]),
                str(before[1]),
                after[1] / before[1],
                "goal: equal",
            )
        )


if __name__ == "__main__":
    main()
