"""Admission decisions over gRPC for a job whose pins exist and which was admitted before (the
scheduler's hot path: a job asked about again), from 16 concurrent callers, beside a bare gRPC
echo service with the same callers (bench/rates.py).

    uv run python -m bench.admission [--seconds 5] [--runs 1000]
"""

from __future__ import annotations

import argparse
import os

import grpc

from bench.common import row, vault_server
from bench.rates import compare
from vault.client import VaultClient
from vault.store.manifest import FileEntry, build_manifest, encode_manifest
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

ADMIT = "/pinvault.v1.Admission/Admit"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=1000, help="runs admitted before the load")
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
            # The jobs of a busy cluster: admitted once before, asked about again.
            for seed in range(args.runs):
                client.admit(image=image, dataset=dataset, seed=seed, team="bench")
        request = pb.AdmitRequest(
            image=image, dataset=dataset, seed="0", team="bench", author="bench"
        )
        with grpc.insecure_channel(server.address) as channel:
            answer = rpc.AdmissionStub(channel).Admit(request)
        assert answer.run_id and not answer.new, "the job was not admitted before"
        rates = compare(server.address, ADMIT, request, answer.ByteSize(), seconds=args.seconds)

    print(f"{args.seconds:.0f} s a run")
    print(rates.report("admission"))
    print(
        row(
            "admission decisions (pins exist)",
            f"{rates.vault.rate:,.0f}/s",
            f"{rates.echo_message.rate:,.0f}/s",
            rates.ratio,
            "goal p99 < 5 ms",
        )
    )
    print(f"admission p99 {rates.vault.p99 * 1000:.2f} ms (goal < 5 ms)")


if __name__ == "__main__":
    main()
