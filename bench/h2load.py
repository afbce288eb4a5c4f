"""Unary gRPC calls at a fixed concurrency from h2load, nghttp2's HTTP/2 load generator
(Debian's nghttp2-client, which the test set-up installs).

h2load is written in C, so it leaves the server nearly all of this machine's two cores; a Python
load generator takes about half of them, and its own scheduling delays then show up in the
latencies it measures. h2load sends one request again and again, on one connection with
`concurrency` calls in flight, as one client channel with that many callers does.

It reads HTTP status codes, and gRPC reports its own in trailers, which h2load does not read.
So each run checks what came back instead: a call that failed carries no message, and the bytes
of messages received must be exactly the calls done times the size of a good call's answer.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

from bench.common import Load


def unary_load(
    address: str,
    method: str,
    request: bytes,
    answer_size: int,
    *,
    concurrency: int = 16,
    seconds: float = 5.0,
    warmup: float = 1.0,
) -> Load:
    """Calls of `method` ("/package.Service/Method") with `request` (a serialised message),
    after an untimed warm-up; every answer must be an `answer_size`-byte message."""
    if shutil.which("h2load") is None:
        raise SystemExit("h2load not found: install Debian's nghttp2-client (scripts/test does)")
    with tempfile.TemporaryDirectory(prefix="pinvault-h2load-") as tmp:
        body = Path(tmp) / "request"
        body.write_bytes(b"\0" + struct.pack(">I", len(request)) + request)
        log = Path(tmp) / "calls"
        command = [
            "h2load",
            "--clients=1",
            f"--max-concurrent-streams={concurrency}",
            "--threads=1",
            f"--data={body}",
            "--header=content-type: application/grpc",
            "--header=te: trailers",
            f"http://{address}{method}",
        ]
        _run([*command, f"--duration={round(warmup * 1000)}ms"], answer_size)
        report = _run(
            [*command, f"--duration={round(seconds * 1000)}ms", f"--log-file={log}"], answer_size
        )
        # Each line: start time, HTTP status, microseconds until the whole answer was in.
        latencies = sorted(int(line.split("\t")[2]) / 1e6 for line in log.open())
    elapsed = re.search(r"finished in ([\d.]+)(m?s)", report)
    assert elapsed, report
    took = float(elapsed.group(1)) / (1000 if elapsed.group(2) == "ms" else 1)
    return Load(
        len(latencies),
        took,
        latencies[len(latencies) // 2],
        latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    )


def _run(command: list[str], answer_size: int) -> str:
    report = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    counts = re.search(
        r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, "
        r"(\d+) errored, (\d+) timeout",
        report,
    )
    data = re.search(r"\((\d+)\) data", report)
    if not counts or not data:
        raise RuntimeError(f"cannot read h2load's report:\n{report}")
    done, succeeded, *failures = map(int, counts.groups())
    received = int(data.group(1))
    if not done or succeeded != done or any(failures):
        raise RuntimeError(f"h2load: {counts.group(0)}")
    if received != done * (5 + answer_size):
        raise RuntimeError(
            f"h2load: {done} calls brought {received} bytes of messages, not "
            f"{done} x {5 + answer_size}: some calls failed"
        )
    return report
