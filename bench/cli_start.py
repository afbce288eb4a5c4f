"""Start-up of the `vault` command beside the bare interpreter's, in the same run: `python -c
pass`, `vault --help`, and `vault stat DIGEST` against a running local `vault serve`, each the
median of repeated runs, in wall-clock time and in CPU time (user + system: steadier on a
shared machine), with its ratio to `python -c pass`. For reference, `import grpc` with the
generated stubs is timed too: the floor of any command that talks to the vault, which `vault
stat` cannot go below; what it spends beyond that floor is printed last.

The command runs as installed: the console script, with byte code cached (a warm-up run writes
it; PYTHONDONTWRITEBYTECODE is dropped), from a folder outside the checkout.

    uv run python -m bench.cli_start [--repeat 15]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import vault_server

GOALS = {"vault --help": 5.0, "vault stat DIGEST": 8.0}


def timed(command: list[str], env: dict[str, str], cwd: str) -> tuple[float, float, int]:
    """Wall-clock and CPU seconds of one run, and its exit status."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    if args.repeat < 10:
        parser.error("--repeat: at least 10 runs a command")
    script = Path(sys.executable).with_name("vault")
    vault = [str(script)] if script.exists() else [sys.executable, "-m", "cli.main"]
    with vault_server() as server, tempfile.TemporaryDirectory() as cwd:
        env = {k: v for k, v in server.env().items() if k != "PYTHONDONTWRITEBYTECODE"}
        blob = Path(cwd) / "blob.bin"
        blob.write_bytes(os.urandom(4096))
        put = subprocess.run(
            [*vault, "put", str(blob)], env=env, cwd=cwd, capture_output=True, check=True
        )
        digest = put.stdout.decode().split()[0]
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "vault --help": [*vault, "--help"],
            "vault stat DIGEST": [*vault, "stat", digest],
            "python -c 'import grpc, stubs'": [
                sys.executable,
                "-c",
                "import grpc, vault.wire.pinvault_pb2_grpc",
            ],
        }
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        for command in commands.values():
            # Warm-up: caches the byte code and the page cache, as an installed command has.
            _, _, status = timed(command, env, cwd)
            assert status == 0, command
        # Interleaved, so that a change in the machine's load touches every command alike.
        for _ in range(args.repeat):
            for name, command in commands.items():
                wall, cpu, status = timed(command, env, cwd)
                assert status == 0, command
                samples[name].append((wall, cpu))
    medians = {
        name: (
            statistics.median(w for w, _ in runs),
            statistics.median(c for _, c in runs),
        )
        for name, runs in samples.items()
    }
    base_wall, base_cpu = medians["python -c pass"]
    print(f"medians of {args.repeat} runs each, interleaved")
    print(f"{'command':<34} {'wall':>9} {'ratio':>7} {'cpu':>9} {'ratio':>7}  goal")
    for name, (wall, cpu) in medians.items():
        goal = GOALS.get(name)
        print(
            f"{name:<34} {wall * 1000:7.1f}ms {wall / base_wall:6.2f}x "
            f"{cpu * 1000:7.1f}ms {cpu / base_cpu:6.2f}x  " + (f"<= {goal:g}x" if goal else "")
        )
    floor_wall, floor_cpu = medians["python -c 'import grpc, stubs'"]
    stat_wall, stat_cpu = medians["vault stat DIGEST"]
    print(
        f"vault stat beyond its floor (import grpc, stubs): "
        f"{(stat_wall - floor_wall) * 1000:.1f}ms wall, {(stat_cpu - floor_cpu) * 1000:.1f}ms cpu "
        f"({(stat_cpu - floor_cpu) / base_cpu:.2f}x python -c pass)"
    )


if __name__ == "__main__":
    main()
