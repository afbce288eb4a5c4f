"""Peak memory of the client and the server while a large blob goes in and comes back out,
beside the peak memory of `cp` copying the same file in the same run.

    uv run python -m bench.memory [--size-mib 4096]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, make_file, vault_server


def peak_rss_of_run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run a command under GNU time; its maximum resident set in bytes, and its stdout."""
    done = subprocess.run(
        ["/usr/bin/time", "-f", "maxrss=%M", *cmd],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.search(r"maxrss=(\d+)", done.stderr)
    assert found, done.stderr
    return int(found.group(1)) * 1024, done.stdout


def server_peak(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"VmHWM:\s+(\d+) kB", status)
    assert found
    return int(found.group(1)) * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=4096)
    args = parser.parse_args()
    mib = 1 << 20
    with tempfile.TemporaryDirectory(prefix="pinvault-bench-") as tmp:
        source = make_file(Path(tmp) / "source.bin", args.size_mib * mib)
        cp_peak, _ = peak_rss_of_run(["cp", str(source), str(Path(tmp) / "copy.bin")])
        (Path(tmp) / "copy.bin").unlink()
        with vault_server() as server:
            idle = server_peak(server.pid)
            vault = [sys.executable, "-m", "cli.main"]
            put_peak, out = peak_rss_of_run([*vault, "put", str(source)], env=server.env())
            digest = out.split()[0]
            after_put = server_peak(server.pid)
            get_peak, _ = peak_rss_of_run(
                [*vault, "get", digest, "-o", str(Path(tmp) / "out.bin")], env=server.env()
            )
            after_get = server_peak(server.pid)
    print(f"{args.size_mib} MiB blob; goal: under 200 MB each")
    print(
        f"  server peak RSS: {after_get / mib:,.0f} MiB "
        f"(idle {idle / mib:,.0f} MiB, after put {after_put / mib:,.0f} MiB)"
    )
    print(f"  client peak RSS: put {put_peak / mib:,.0f} MiB, get {get_peak / mib:,.0f} MiB")
    print(f"  baseline cp peak RSS: {cp_peak / mib:,.1f} MiB")


if __name__ == "__main__":
    main()
