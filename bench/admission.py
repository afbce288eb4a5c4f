"""Admission decisions over gRPC for jobs whose pins exist (the scheduler's hot path), from 16
concurrent callers, beside a bare gRPC echo service with the same callers.

    uv run python -m bench.admission [--seconds 5] [--runs 1000]
"""

from __future__ import annotations

import argparse
import os

import grpc

from bench.common import Load, load, row, vault_server
from bench.lookup import CONCURRENCY, echo_rate
from vault.client import VaultClient
from vault.dataset import FileEntry, build_manifest, encode_manifest
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=1000, help="distinct runs admitted again")
    args = parser.parse_args()
    with vault_server() as server:
        with VaultClient(server.address) as client:
            image = str(client.put(os.urandom(1 << 20)).blob.sha256)
            client.pin("image", image)
            files = [
                FileEntry(f"part-{i}", 4096, 0o644, str(client.put(os.urandom(4096)).blob.sha256))
                for i in range(100)
            ]
            dataset = str(client.put(encode_manifest(build_manifest(files))).blob.sha256)
            client.pin("dataset", dataset)
            # The jobs of a busy cluster: each admitted once before, asked about again.
            for seed in range(args.runs):
                client.admit(image=image, dataset=dataset, seed=seed, team="bench")
        requests = [
            pb.AdmitRequest(
                image=image, dataset=dataset, seed=str(seed), team="bench", author="bench"
            )
            for seed in range(args.runs)
        ]
        echo = echo_rate(args.seconds, requests[0].SerializeToString())

        channel = None
        counter = 0

        async def admit() -> None:
            nonlocal channel, counter
            if channel is None:
                channel = grpc.aio.insecure_channel(server.address)
            counter += 1
            response = await rpc.AdmissionStub(channel).Admit(requests[counter % len(requests)])
            assert not response.new

        vault: Load = load(admit, concurrency=CONCURRENCY, seconds=args.seconds)

    print(f"{CONCURRENCY} concurrent callers, {args.seconds:.0f} s each, {args.runs} runs")
    print(f"  echo  {echo}")
    print(f"  admit {vault}")
    print(
        row(
            "admission decisions (pins exist)",
            f"{vault.rate:,.0f}/s",
            f"{echo.rate:,.0f}/s",
            vault.rate / echo.rate,
            "goal p99 < 5 ms",
        )
    )
    print(f"admission p99 {vault.p99 * 1000:.2f} ms (goal < 5 ms)")


if __name__ == "__main__":
    main()
