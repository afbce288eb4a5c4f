"""Server reflection as grpcurl uses it against a real `vault serve`: grpcurl asks for
`grpc.reflection.v1` first, lists the services, describes a method by its full name and calls
a method from descriptors it learnt only through reflection."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import grpc
from grpc_reflection.v1alpha import reflection_pb2

from tests.services.vault_server import VaultServer

REPO_ROOT = Path(__file__).resolve().parents[1]
# Built by scripts/test (`go install` at a pinned release); a missing one is a failure.
GRPCURL = REPO_ROOT / ".cache" / "bin" / "grpcurl"


def grpcurl(server: VaultServer, *args: str, options: tuple[str, ...] = ()) -> str:
    assert os.access(GRPCURL, os.X_OK), f"{GRPCURL} is missing: scripts/test builds it"
    result = subprocess.run(
        [str(GRPCURL), "-plaintext", "-max-time", "20", *options, server.address, *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, f"grpcurl {' '.join(args)}: {result.stderr}"
    return result.stdout


def test_list_shows_the_vault_services_through_reflection_v1(vault_server: VaultServer) -> None:
    services = grpcurl(vault_server, "list").split()
    for name in ("pinvault.v1.Store", "pinvault.v1.Ledger", "pinvault.v1.Tokens"):
        assert name in services
    assert "grpc.reflection.v1.ServerReflection" in services
    assert "grpc.health.v1.Health" in services
    # grpcurl would fall back to v1alpha on its own: the v1 service must answer itself.
    described = grpcurl(vault_server, "describe", "grpc.reflection.v1.ServerReflection")
    assert "rpc ServerReflectionInfo" in described


def test_the_v1_service_answers_itself(vault_server: VaultServer) -> None:
    # The v1 and v1alpha messages are the same on the wire.
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with grpc.insecure_channel(vault_server.address) as channel:
        call = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        (answer,) = list(call(iter([request]), timeout=10))
    names = {s.name for s in answer.list_services_response.service}
    assert {"pinvault.v1.Ledger", "grpc.reflection.v1.ServerReflection"} <= names


def test_describe_resolves_a_method_symbol(vault_server: VaultServer) -> None:
    described = grpcurl(vault_server, "describe", "pinvault.v1.Ledger.Lookup")
    assert "pinvault.v1.Ledger.Lookup is a method" in described
    assert "rpc Lookup" in described
    message = grpcurl(vault_server, "describe", "pinvault.v1.Checkpoint")
    assert "string note = 1;" in message


def test_a_call_built_from_reflection_answers_json(vault_server: VaultServer) -> None:
    answer = json.loads(
        grpcurl(vault_server, "pinvault.v1.Ledger/GetCheckpoint", options=("-d", "{}"))
    )
    assert answer["note"].splitlines()[1] == "0"
