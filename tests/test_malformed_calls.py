"""Requests a real `vault serve` cannot take, sent as hand-made bytes over a real channel: a
message that does not decode is refused with INVALID_ARGUMENT naming the method, and an integer
past 2^63 - 1 (which no index, size or offset the vault keeps can reach) with INVALID_ARGUMENT
naming the field, in local mode and with credentials, whatever the method's kind; the server
logs no error and goes on serving."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from tests.services.vault_server import VaultServer
from tests.test_access import CREDENTIALS, first_admin_token
from vault.client import Credentials, VaultClient
from vault.errors import InvalidArgument
from vault.server.decoding import decoder
from vault.wire import pinvault_pb2 as pb

WIDE = 2**64 - 1
TOO_WIDE = f"is {WIDE}, past 9223372036854775807, the most the vault takes"
# Field 1 says 16 bytes follow; 5 do.
UNDECODABLE = b"\x0a\x10short"
DIGEST = "sha256:" + "ab" * 32
FIELD = descriptor_pb2.FieldDescriptorProto


@dataclass(frozen=True)
class Served:
    server: VaultServer
    token: str

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def client(self) -> VaultClient:
        return VaultClient(
            self.server.address, credentials=Credentials(token=self.token), timeout=60
        )


@pytest.fixture(scope="module", params=["local", "credentials"])
def served(
    request: pytest.FixtureRequest,
    clean_environment: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    env = CREDENTIALS if request.param == "credentials" else {}
    with VaultServer(tmp_path_factory.mktemp(request.param), env=env) as server:
        yield Served(server, first_admin_token(server) if env else "")
        assert "Traceback" not in server.log(), server.log()


def call(served: Served, kind: str, method: str, body: Any) -> grpc.RpcError:
    """Call `method` with raw bytes (a list of messages for a stream); the error it ends in."""
    with grpc.insecure_channel(served.server.address) as channel:
        options = {"metadata": served.metadata, "timeout": 30}
        try:
            if kind == "unary":
                channel.unary_unary(method)(body, **options)
            elif kind == "server-streaming":
                list(channel.unary_stream(method)(body, **options))
            else:
                channel.stream_unary(method)(iter(body), **options)
        except grpc.RpcError as exc:
            return exc
    raise AssertionError(f"{method} answered a request it must refuse")


UNDECODABLE_CALLS = {
    "Ledger.Lookup": ("unary", "pinvault.v1.LookupRequest"),
    "Ledger.ReadEntries": ("server-streaming", "pinvault.v1.ReadEntriesRequest"),
    "Store.Put": ("client-streaming", "pinvault.v1.PutRequest"),
}


@pytest.mark.parametrize("rpc", list(UNDECODABLE_CALLS))
def test_a_request_that_does_not_decode_is_an_invalid_argument(served: Served, rpc: str) -> None:
    kind, message = UNDECODABLE_CALLS[rpc]
    service, name = rpc.split(".")
    body = [UNDECODABLE] if kind == "client-streaming" else UNDECODABLE
    error = call(served, kind, f"/pinvault.v1.{service}/{name}", body)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.details() == f"{rpc}: the request could not be decoded as a {message} message"


def test_a_health_check_that_does_not_decode_is_an_invalid_argument(served: Served) -> None:
    error = call(served, "unary", "/grpc.health.v1.Health/Check", UNDECODABLE)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.details() == (
        "Health.Check: the request could not be decoded as a grpc.health.v1.HealthCheckRequest "
        "message"
    )


def test_a_put_whose_later_message_does_not_decode_stores_nothing(served: Served) -> None:
    header = pb.PutRequest(header=pb.PutHeader()).SerializeToString()
    data = pb.PutRequest(data=b"never stored").SerializeToString()
    error = call(served, "client-streaming", "/pinvault.v1.Store/Put", [header, data, UNDECODABLE])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "Store.Put: the request could not be decoded" in (error.details() or "")
    digest = "sha256:" + hashlib.sha256(b"never stored").hexdigest()
    with served.client() as client:
        assert client.find_missing([digest]) == [digest]
    assert not list((served.server.data_dir / "hot" / "tmp").iterdir())


TOO_WIDE_CALLS: dict[str, tuple[str, str, Any]] = {
    "Ledger.Log": ("unary", "start", pb.LogRequest(start=WIDE)),
    "Ledger.Lookup": ("unary", "known_size", pb.LookupRequest(digest=DIGEST, known_size=WIDE)),
    "Ledger.GetInclusionProof": (
        "unary",
        "index",
        pb.InclusionProofRequest(index=WIDE, size=WIDE),
    ),
    "Ledger.GetConsistencyProof": (
        "unary",
        "new_size",
        pb.ConsistencyProofRequest(old_size=1, new_size=WIDE),
    ),
    "Ledger.ReadEntries": ("server-streaming", "start", pb.ReadEntriesRequest(start=WIDE)),
    "Store.Get": ("server-streaming", "offset", pb.GetRequest(digest=DIGEST, offset=WIDE)),
    "Store.Put": (
        "client-streaming",
        "header.handoff_size",
        pb.PutRequest(header=pb.PutHeader(handoff="ticket", handoff_size=WIDE)),
    ),
    "Admission.Admit": ("unary", "known_size", pb.AdmitRequest(known_size=WIDE)),
}


@pytest.mark.parametrize("rpc", list(TOO_WIDE_CALLS))
def test_an_integer_past_63_bits_is_an_invalid_argument_naming_its_field(
    served: Served, rpc: str
) -> None:
    kind, field, message = TOO_WIDE_CALLS[rpc]
    service, name = rpc.split(".")
    body = message.SerializeToString()
    error = call(
        served,
        kind,
        f"/pinvault.v1.{service}/{name}",
        [body] if kind == "client-streaming" else body,
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.details() == f"{rpc}: {field} {TOO_WIDE}"


def test_the_largest_integer_the_vault_takes_is_answered_as_usual(served: Served) -> None:
    largest = 2**63 - 1
    error = call(
        served,
        "unary",
        "/pinvault.v1.Ledger/GetInclusionProof",
        pb.InclusionProofRequest(index=0, size=largest).SerializeToString(),
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND, error
    assert error.details() == f"the ledger has 0 entries, fewer than {largest}"


def synthetic_message() -> Any:
    """A message type with a too-wide integer in every kind of place: repeated, in a nested
    message, in a list of messages and as a map's value."""
    file = descriptor_pb2.FileDescriptorProto(name="wide_test.proto", package="wide_test")
    inner = file.message_type.add(name="Inner")
    inner.field.add(name="size", number=1, type=FIELD.TYPE_UINT64, label=FIELD.LABEL_OPTIONAL)
    outer = file.message_type.add(name="Outer")
    entry = outer.nested_type.add(name="SizesEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=FIELD.TYPE_STRING, label=FIELD.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=FIELD.TYPE_FIXED64, label=FIELD.LABEL_OPTIONAL)
    for name, number, kind, label, type_name in (
        ("offsets", 1, FIELD.TYPE_UINT64, FIELD.LABEL_REPEATED, ""),
        ("one", 2, FIELD.TYPE_MESSAGE, FIELD.LABEL_OPTIONAL, ".wide_test.Inner"),
        ("many", 3, FIELD.TYPE_MESSAGE, FIELD.LABEL_REPEATED, ".wide_test.Inner"),
        ("sizes", 4, FIELD.TYPE_MESSAGE, FIELD.LABEL_REPEATED, ".wide_test.Outer.SizesEntry"),
        ("note", 5, FIELD.TYPE_STRING, FIELD.LABEL_OPTIONAL, ""),
    ):
        field = outer.field.add(name=name, number=number, type=kind, label=label)
        if type_name:
            field.type_name = type_name
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("wide_test.Outer"))


@pytest.mark.parametrize(
    ("fill", "named"),
    [
        (lambda m: m.offsets.extend([1, WIDE]), "offsets[1]"),
        (lambda m: setattr(m.one, "size", WIDE), "one.size"),
        (lambda m: (m.many.add(size=1), m.many.add(size=WIDE)), "many[1].size"),
        (lambda m: m.sizes.update({"a": 1, "b": WIDE}), "sizes['b']"),
    ],
)
def test_a_too_wide_integer_is_found_wherever_it_is(fill: Any, named: str) -> None:
    kind = synthetic_message()
    decode = decoder("Test.Call", kind.FromString)
    assert decode is not None
    fine = kind(offsets=[1, 2**63 - 1], note="x")
    assert decode(fine.SerializeToString()) == fine
    wrong = kind()
    fill(wrong)
    with pytest.raises(InvalidArgument) as refused:
        decode(wrong.SerializeToString())
    assert str(refused.value) == f"Test.Call: {named} {TOO_WIDE}"
