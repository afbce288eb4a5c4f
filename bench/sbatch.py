"""What the pinvault admission plugin adds to `sbatch`: submit latency (median and p99) into a
private one-node Slurm with slurm/job_submit.lua asking through the admission agent and through
the `vault admit` command, beside the same Slurm without the plugin, submitted in turn in the
same run. Needs root, Debian's Slurm and munge, and lua-socket for the agent (see scripts/test).

    uv run python -m bench.sbatch [--jobs 100]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import row
from tests.services.agent import AdmissionAgent
from tests.services.slurm import SlurmCluster
from tests.services.vault_server import VAULT_COMMAND, VaultServer

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "slurm" / "job_submit.lua"
GOAL_P99_ADDED = 0.300
# Held jobs go through job_submit like any other but never run, so the node's load stays out
# of the figures; each cluster's controller sees only submissions.
SBATCH_ARGS = ("--parsable", "--hold", "--output=/dev/null", "--account=bench", "--wrap=true")


def submit(cluster: SlurmCluster, env: dict[str, str]) -> float:
    start = time.perf_counter()
    result = cluster.run("sbatch", *SBATCH_ARGS, env=env)
    took = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"sbatch failed: {result.stderr.strip()}")
    return took


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def pin_inputs(vault: VaultServer, folder: Path) -> dict[str, str]:
    image = folder / "image.tar"
    image.write_bytes(b"bench image\n")
    digest = vault.run("put", str(image)).ok().stdout.split()[0]
    vault.run("pin", "image", digest).ok()
    dataset = folder / "dataset"
    dataset.mkdir()
    (dataset / "data.csv").write_text("x\n1\n")
    manifest = vault.run("dataset", "add", str(dataset)).ok().stdout.split()[0]
    return {"PINVAULT_IMAGE": digest, "PINVAULT_DATASET": manifest, "PINVAULT_SEED": "7"}


def report(label: str, samples: list[float], base: list[float]) -> None:
    ms = 1000
    o50, o99 = statistics.median(samples), percentile(samples, 0.99)
    b50, b99 = statistics.median(base), percentile(base, 0.99)
    print(
        row(
            f"{label}, median",
            f"{o50 * ms:.0f} ms",
            f"{b50 * ms:.0f} ms",
            o50 / b50,
            f"added {(o50 - b50) * ms:.0f} ms",
        )
    )
    print(
        row(
            f"{label}, p99",
            f"{o99 * ms:.0f} ms",
            f"{b99 * ms:.0f} ms",
            o99 / b99,
            f"added {(o99 - b99) * ms:.0f} ms, goal < {GOAL_P99_ADDED * ms:.0f} ms",
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=100, help="submissions on each path")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if len(VAULT_COMMAND) != 1:
        raise SystemExit("the `vault` script is not installed in the venv: run `uv sync`")
    # /tmp keeps the sockets' paths within the 108 bytes a Unix socket allows.
    with tempfile.TemporaryDirectory(prefix="pinvault-bench-", dir="/tmp") as tmp:
        folder = Path(tmp)
        # The clusters run in network namespaces of their own; the vault's socket path
        # reaches into them where a 127.0.0.1 port would not.
        with (
            VaultServer(folder / "vault", listen=f"unix:{folder}/vault.sock") as vault,
            AdmissionAgent(folder / "agent", vault.address) as agent,
        ):
            pins = pin_inputs(vault, folder)
            client = folder / "client.toml"
            client.write_text(f'[client]\nserver = "{vault.address}"\n')
            by_command = (
                f"vault = {VAULT_COMMAND[0]}\nclient_config = {client}\n"
                f"state_dir = {folder / 'controller-state'}\ntimeout = 8\n"
            )
            # No client_config: should the agent not be asked, every job would be refused.
            by_agent = f"agent = {agent.socket}\ntimeout = 8\n"
            with (
                SlurmCluster() as plain,
                SlurmCluster(job_submit=PLUGIN, files={"pinvault.conf": by_command}) as pinned,
            ):
                conf = pinned.conf_dir / "pinvault.conf"
                paths = {"agent": by_agent, "command": by_command}

                def through(path: str) -> float:
                    # The plugin reads its configuration at every submission.
                    conf.write_text(paths[path])
                    return submit(pinned, pins)

                for _ in range(args.warmup):
                    submit(plain, pins)
                    through("agent")
                    through("command")
                base: list[float] = []
                timed: dict[str, list[float]] = {"agent": [], "command": []}
                # Taking turns spreads the machine's noise over every series alike.
                for _ in range(args.jobs):
                    base.append(submit(plain, pins))
                    for path, samples in timed.items():
                        samples.append(through(path))
    print(f"sbatch submit latency, {args.jobs} jobs each; baseline: the same Slurm, no plugin")
    report("sbatch, admitted through the agent", timed["agent"], base)
    report("sbatch, admitted by `vault admit`", timed["command"], base)
    added = percentile(timed["agent"], 0.99) - percentile(base, 0.99)
    print(f"goal {'met' if added < GOAL_P99_ADDED else 'NOT met'}: added p99 through the agent")


if __name__ == "__main__":
    main()
