"""`vault dataset add` of a folder of many small files, stored durably, beside two baselines
on the same folder in the same run: `cp -r DIR COPY && sync`, and `restic backup DIR` into a
fresh local restic repository on the same disk (a content-addressed store of the same files,
as the vault is); then a second add of the unchanged folder, which reads no file (the cache
of file digests, as `vault dataset add` keeps one). Each round copies the folder, backs it up
and adds it to a fresh vault with an empty cache; the figures are medians over the rounds.

    uv run python -m bench.dataset [--files 100000] [--size BYTES] [--rounds 3]

Without `--size` the files are 1 KiB to 64 KiB; `--files 10000 --size 4096` is 10,000 files
of 4 KiB. restic (the Debian package) is run with a password from RESTIC_PASSWORD (one is
made up when it is unset) and a cache folder of its own for each round.

Beside the seconds, the CPU seconds (user and system) each side spent, the vault's being its
client's and its server's together: on a machine shared with other work they vary far less
than the seconds do, and the system time shows what the file system costs each side.

Nothing is deleted until every round is done: on ext4 without a journal (this machine), a
file created within a minute or so of a mass deletion in the same block group costs a scan
past every recently deleted inode, so whichever side ran right after a deletion would pay for
it (the vault, when the copy was removed just before it).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import subprocess
import tempfile
import time
from dataclasses import astuple, dataclass
from pathlib import Path

from bench.common import vault_server
from vault.client import VaultClient
from vault.runs.dataset import add_dataset
from vault.store.hashcache import HashCache


def make_tree(root: Path, files: int, size: int | None = None) -> int:
    """Files of `size` bytes (by default 1 KiB to 64 KiB) of random bytes, 1,000 to a folder."""
    rng = random.Random(7)
    total = 0
    for n in range(files):
        folder = root / f"part-{n // 1000:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        length = size if size is not None else rng.randint(1 << 10, 64 << 10)
        (folder / f"file-{n:06d}.bin").write_bytes(os.urandom(length))
        total += length
    return total


@dataclass(frozen=True)
class Cost:
    """Seconds, and CPU seconds in user and system time."""

    seconds: float
    user: float
    system: float


def child_cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime, usage.ru_stime


def process_cpu(pid: int) -> tuple[float, float]:
    """User and system seconds of a running process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def restic_backup(tmp: Path, tree: Path, number: int) -> Cost:
    """The cost of `restic backup` of `tree` into a repository made for this round."""
    env = dict(os.environ)
    env.setdefault("RESTIC_PASSWORD", "pinvault-bench")
    env["RESTIC_REPOSITORY"] = str(tmp / f"restic-{number}")
    env["RESTIC_CACHE_DIR"] = str(tmp / f"restic-cache-{number}")
    subprocess.run(["restic", "init", "--quiet"], check=True, env=env)
    user, system = child_cpu()
    start = time.perf_counter()
    subprocess.run(["restic", "backup", "--quiet", str(tree)], check=True, env=env)
    seconds = time.perf_counter() - start
    after = child_cpu()
    return Cost(seconds, after[0] - user, after[1] - system)


def one_round(tmp: Path, tree: Path, number: int) -> tuple[float, Cost, Cost, float]:
    """Seconds for cp -r && sync, the cost of restic backup and of the first add, and the
    seconds of the second add."""
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(tree), str(tmp / f"copy-{number}")], check=True)
    subprocess.run(["sync"], check=True)
    copy = time.perf_counter() - start
    restic = restic_backup(tmp, tree, number)
    # As `vault dataset add` does, with a cache of file digests of its own: empty at first.
    cache = HashCache(tmp / f"file-hashes-{number}.db")
    with vault_server(data_dir=tmp / f"vault-{number}") as server:
        client = VaultClient(server.address, state=tmp / f"state-{number}.json")
        mine, theirs = os.times(), process_cpu(server.pid)
        start = time.perf_counter()
        first = add_dataset(client, tree, cache=cache)
        seconds = time.perf_counter() - start
        mine_after, theirs_after = os.times(), process_cpu(server.pid)
        add = Cost(
            seconds,
            mine_after.user - mine.user + theirs_after[0] - theirs[0],
            mine_after.system - mine.system + theirs_after[1] - theirs[1],
        )
        start = time.perf_counter()
        second = add_dataset(client, tree, cache=cache)
        again = time.perf_counter() - start
        client.close()
    cache.close()
    assert first.digest == second.digest and second.sent_files == 0
    return copy, restic, add, again


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--size", type=int, help="bytes a file (default: 1 KiB to 64 KiB)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(
        prefix="pinvault-bench-", dir=os.environ.get("BENCH_TMP")
    ) as name:
        tmp = Path(name)
        tree = tmp / "tree"
        size = make_tree(tree, args.files, args.size)
        subprocess.run(["sync"], check=True)
        rounds = [one_round(tmp, tree, number) for number in range(args.rounds)]
    copies, restics, adds, agains = zip(*rounds, strict=True)
    copy, again = statistics.median(copies), statistics.median(agains)
    restic, add = (
        Cost(*(statistics.median(column) for column in zip(*costs, strict=True)))
        for costs in ((astuple(c) for c in restics), (astuple(c) for c in adds))
    )
    files = args.files
    print(f"{files:,} files, {size / (1 << 20):,.0f} MiB; medians of {args.rounds} rounds")
    for number, (c, r, a, g) in enumerate(rounds):
        print(
            f"  round {number}: cp {c:.2f} s, restic {r.seconds:.2f} s, add {a.seconds:.2f} s, "
            f"add again {g:.2f} s"
        )
    print(f"  cp -r && sync            {files / copy:>10,.0f} files/s  ({copy:.2f} s)")
    print(
        f"  restic backup            {files / restic.seconds:>10,.0f} files/s  "
        f"({restic.seconds:.2f} s; CPU {restic.user:.2f} s user, {restic.system:.2f} s system)"
    )
    print(
        f"  vault dataset add        {files / add.seconds:>10,.0f} files/s  "
        f"({add.seconds:.2f} s; CPU {add.user:.2f} s user, {add.system:.2f} s system)  "
        f"{restic.seconds / add.seconds:.2f}x of restic (goal >= 1x), "
        f"{copy / add.seconds:.2f}x of cp"
    )
    print(
        f"  add again, unchanged     {files / again:>10,.0f} files/s  ({again:.2f} s)  "
        f"{add.seconds / again:.1f}x faster than the first (goal >= 5x)"
    )


if __name__ == "__main__":
    main()
