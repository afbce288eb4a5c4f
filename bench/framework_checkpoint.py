"""A PyTorch checkpoint through the run library (`StateDictCheckpoints.save`: every tensor a
blob by digest, small ones many to a call, the manifest pinned last), beside, in the same run,
the same tensors sent one put each, four in flight (how a checkpoint's files went before they
were batched), and `torch.save` of the state to a local file with fsync. Every round's tensors
are new, so each save really stores them all; a last figure is a save of unchanged state,
which sends nothing but the manifest.

    uv run python -m bench.framework_checkpoint [--tensors 600] [--kib 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.common import row, vault_server
from vault.client import VaultClient
from vault.runs import start
from vault.runs.dataset import add_dataset
from vault.runs.frameworks.torch import StateDictCheckpoints


def state(tensors: int, kib: int, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    elements = kib * 1024 // 4
    return {
        "model": {
            f"layer{n}.weight": torch.randn(elements, generator=generator) for n in range(tensors)
        }
    }


def per_tensor_puts(client: VaultClient, blobs: list[bytes]) -> None:
    def put(data: bytes) -> None:
        client.put(data, expected="sha256:" + hashlib.sha256(data).hexdigest())

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(put, blobs))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensors", type=int, default=600)
    parser.add_argument("--kib", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="pinvault-bench-") as tmp, vault_server() as server:
        client = VaultClient(server.address, state=Path(tmp) / "state.json")
        image = str(client.put(b"bench image").blob.sha256)
        client.pin("image", image)
        folder = Path(tmp) / "dataset"
        folder.mkdir()
        (folder / "data.csv").write_bytes(b"x\n1\n")
        dataset = add_dataset(client, folder, name="bench").digest
        admission = client.admit(image=image, dataset=dataset, seed=1)
        env = {
            "PINVAULT_RUN_ID": admission.run_id,
            "PINVAULT_IMAGE": image,
            "PINVAULT_DATASET": dataset,
            "PINVAULT_SEED": "1",
        }
        run = start(client, environ=env, output_dir=tmp)
        checkpoints = StateDictCheckpoints(run)
        ours: list[float] = []
        puts: list[float] = []
        local: list[float] = []
        seed = 0
        for n in range(args.rounds + 1):
            seed += 1
            s = state(args.tensors, args.kib, seed)
            begin = time.perf_counter()
            checkpoints.save(s, n)
            ours.append(time.perf_counter() - begin)

            seed += 1
            blobs = [
                t.numpy().tobytes() for t in state(args.tensors, args.kib, seed)["model"].values()
            ]
            begin = time.perf_counter()
            per_tensor_puts(client, blobs)
            puts.append(time.perf_counter() - begin)

            path = Path(tmp) / f"state-{n}.pt"
            begin = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(s, f)
                f.flush()
                os.fsync(f.fileno())
            local.append(time.perf_counter() - begin)
        same = state(args.tensors, args.kib, seed=10_000)
        checkpoints.save(same, 100)
        unchanged = []
        for n in range(args.rounds):
            begin = time.perf_counter()
            checkpoints.save(same, 101 + n)
            unchanged.append(time.perf_counter() - begin)
        run.close()
        client.close()
    # The first round warms both paths up.
    a, b, c = (statistics.median(x[1:]) for x in (ours, puts, local))
    d = statistics.median(unchanged)
    size = args.tensors * args.kib / 1024
    print(
        f"{args.tensors} tensors of {args.kib} KiB ({size:.1f} MiB), {args.rounds} rounds, medians"
    )
    print(f"{'':<44} {'pinvault':>16} {'baseline':>16}")
    print(
        row(
            "save vs one put per tensor (4 in flight)",
            f"{a * 1000:.0f} ms",
            f"{b * 1000:.0f} ms",
            b / a,
            "faster",
        )
    )
    print(
        row(
            "save vs torch.save to a local file + fsync",
            f"{a * 1000:.0f} ms",
            f"{c * 1000:.0f} ms",
            c / a,
            "(local)",
        )
    )
    print(
        row(
            "save of unchanged state vs new state",
            f"{d * 1000:.0f} ms",
            f"{a * 1000:.0f} ms",
            a / d,
            "nothing sent",
        )
    )


if __name__ == "__main__":
    main()
