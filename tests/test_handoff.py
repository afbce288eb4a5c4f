"""The file handoff: a client on the vault's host passes its open file over the server's Unix
socket instead of streaming the bytes. Puts and gets through it give the same blobs as streamed
ones, a corrupt stored byte still never reaches the caller's file, and the socket parks only
what a later authorised call may use, once."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import blake3
import grpc
import pytest

from tests.conftest import StartVault
from tests.services.vault_server import VaultServer
from tests.test_access import Vault, vault  # noqa: F401  (the fixture)
from vault.client import VaultClient, transfer
from vault.client.handoff import HANDOFF_MIN, Mode, PipedGet, hand_off
from vault.errors import IntegrityError, InvalidArgument, PermissionDenied, Unavailable
from vault.store.chunks import CHUNK_SIZE
from vault.store.handoff import MAX_PARKED
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

SIZE = 5 * CHUNK_SIZE + 12345  # not a whole number of chunks


def write_file(path: Path, size: int = SIZE, seed: int = 0) -> bytes:
    data = hashlib.shake_256(seed.to_bytes(4, "little")).digest(size)
    path.write_bytes(data)
    return data


@pytest.fixture
def client(vault_server: VaultServer, tmp_path: Path) -> Any:
    with vault_server.client(state=tmp_path / "trust.json") as client:
        yield client


def desk(client: VaultClient) -> pb.HandoffInfo:
    info: pb.HandoffInfo = client.store.Handoff(pb.HandoffRequest())
    return info


def test_the_server_names_its_handoff_socket_in_the_data_folder(
    vault_server: VaultServer, client: VaultClient
) -> None:
    info = desk(client)
    assert info.socket == str(vault_server.data_dir / "handoff.sock")
    assert Path(info.socket).is_socket()
    assert len(info.instance) == 32
    assert f"  handoff socket {info.socket}" in vault_server.banner


def test_a_handed_off_put_and_get_match_sha256sum_and_b3sum(
    client: VaultClient, tmp_path: Path
) -> None:
    source = tmp_path / "model.bin"
    data = write_file(source)
    put = client.put(source, handoff=True)
    sha = subprocess.run(["sha256sum", source], capture_output=True, check=True, text=True)
    b3 = subprocess.run(["b3sum", source], capture_output=True, check=True, text=True)
    assert str(put.blob.sha256) == "sha256:" + sha.stdout.split()[0]
    assert str(put.blob.blake3) == "blake3:" + b3.stdout.split()[0]
    assert put.blob.size == len(data)
    assert put.created

    again = client.put(source, handoff=True)
    assert not again.created and again.blob == put.blob

    for digest in (put.blob.sha256, put.blob.blake3):
        target = tmp_path / f"back-{digest.algorithm}.bin"
        info = client.get(str(digest), target, handoff=True)
        assert info == put.blob
        assert target.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".bin") == [
        "back-blake3.bin",
        "back-sha256.bin",
        "model.bin",
    ]
    assert [p for p in tmp_path.iterdir() if "partial" in p.name] == []

    # A blob small enough to be read whole in one trip still comes through the pipe.
    tiny = client.put(b"tiny blob", handoff=False).blob
    client.get(str(tiny.sha256), tmp_path / "tiny.out", handoff=True)
    assert (tmp_path / "tiny.out").read_bytes() == b"tiny blob"


def test_streamed_and_handed_off_puts_store_the_same_blob(
    client: VaultClient, tmp_path: Path
) -> None:
    source = tmp_path / "data.bin"
    write_file(source, seed=1)
    streamed = client.put(source, handoff=False)
    handed = client.put(source, handoff=True)
    assert streamed.created and not handed.created
    assert handed.blob == streamed.blob


def test_large_files_are_handed_off_unasked_and_small_ones_stream(
    client: VaultClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed: list[str] = []

    def counted(socket_path: str, instance: str, fd: int, mode: Mode) -> str:
        handed.append(mode)
        return hand_off(socket_path, instance, fd, mode)

    monkeypatch.setattr(transfer, "hand_off", counted)
    big = tmp_path / "big.bin"
    data = write_file(big, HANDOFF_MIN + 1, seed=2)
    result = client.put(big)
    assert result.blob.size == len(data)
    assert handed == ["read"]
    out = tmp_path / "out.bin"
    client.get(str(result.blob.sha256), out)
    assert out.read_bytes() == data
    assert handed == ["read", "write"]

    small = tmp_path / "small.bin"
    write_file(small, HANDOFF_MIN - 1, seed=3)
    assert client.put(small).blob.size == HANDOFF_MIN - 1
    assert client.put(b"small bytes").blob.size == len(b"small bytes")
    client.get(str(result.blob.sha256), out, handoff=False)
    assert out.read_bytes() == data
    assert handed == ["read", "write"]
    with pytest.raises(InvalidArgument, match="only a file named by its path"):
        client.put(b"bytes have no file", handoff=True)


def test_a_corrupt_stored_byte_never_reaches_the_handed_off_file(
    vault_server: VaultServer, client: VaultClient, tmp_path: Path
) -> None:
    source = tmp_path / "victim.bin"
    write_file(source, seed=3)
    put = client.put(source, handoff=True)
    stored = vault_server.blob_path(str(put.blob.sha256))
    with open(stored, "r+b") as f:
        f.seek(3 * CHUNK_SIZE + 7)
        byte = f.read(1)
        f.seek(3 * CHUNK_SIZE + 7)
        f.write(bytes([byte[0] ^ 0x01]))
    target = tmp_path / "fetched.bin"
    with pytest.raises(IntegrityError, match=f"chunk at byte offset {3 * CHUNK_SIZE} hashes to"):
        client.get(str(put.blob.sha256), target, handoff=True)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir() if "fetched" in p.name] == []


def test_a_range_streams_and_cannot_be_handed_off(client: VaultClient, tmp_path: Path) -> None:
    source = tmp_path / "ranged.bin"
    data = write_file(source, seed=4)
    put = client.put(source, handoff=True)
    with pytest.raises(InvalidArgument, match="a range cannot be handed off"):
        client.get(str(put.blob.sha256), tmp_path / "r.bin", offset=10, length=20, handoff=True)
    client.get(str(put.blob.sha256), tmp_path / "r.bin", offset=CHUNK_SIZE + 10, length=20)
    assert (tmp_path / "r.bin").read_bytes() == data[CHUNK_SIZE + 10 : CHUNK_SIZE + 30]


def test_a_server_without_handoff_streams_and_says_so_when_asked(
    start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault(env={"PINVAULT_SERVER_HANDOFF": "false"})
    source = tmp_path / "plain.bin"
    data = write_file(source, HANDOFF_MIN + 3, seed=5)
    with server.client(state=tmp_path / "trust.json") as client:
        assert desk(client).socket == ""
        assert not (server.data_dir / "handoff.sock").exists()
        with pytest.raises(Unavailable, match="takes no handed-off files"):
            client.put(source, handoff=True)
        put = client.put(source)
        client.get(str(put.blob.sha256), tmp_path / "out.bin")
        assert (tmp_path / "out.bin").read_bytes() == data


def test_a_socket_path_too_long_for_an_address_still_works(
    start_vault: StartVault, tmp_path: Path
) -> None:
    data_dir = tmp_path / ("d" * 60) / ("e" * 60)
    server = start_vault(data_dir=data_dir)
    source = tmp_path / "long.bin"
    data = write_file(source, seed=6)
    with server.client(state=tmp_path / "trust.json") as client:
        assert len(desk(client).socket) > 108
        put = client.put(source, handoff=True)
        client.get(str(put.blob.sha256), tmp_path / "out.bin", handoff=True)
    assert (tmp_path / "out.bin").read_bytes() == data


# -- the socket and its tickets ---------------------------------------------------------------


def park(info: pb.HandoffInfo, fd: int, mode: str) -> str:
    return hand_off(info.socket, info.instance, fd, mode)  # type: ignore[arg-type]


def park_file(info: pb.HandoffInfo, path: Path) -> str:
    """A ticket for `path` handed off for reading; the server keeps its own descriptor."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return park(info, fd, "read")
    finally:
        os.close(fd)


def refusal(info: pb.HandoffInfo, fds: list[int], message: bytes) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(info.socket)
        socket.send_fds(connection, [message], fds)
        return connection.recv(1024).decode()


def test_the_socket_takes_files_for_reading_and_only_pipes_for_writing(
    client: VaultClient, tmp_path: Path
) -> None:
    info = desk(client)
    read_end, write_end = os.pipe()
    source = tmp_path / "f.bin"
    write_file(source, 100)
    read_only = os.open(source, os.O_RDONLY)
    write_only = os.open(source, os.O_WRONLY)
    read_write = os.open(source, os.O_RDWR)
    try:
        assert refusal(info, [read_end], b"read") == (
            "error only regular files can be handed off for reading\n"
        )
        assert refusal(info, [write_only], b"read") == (
            "error a file handed off for reading was opened write-only\n"
        )
        for fd in (read_only, write_only, read_write):
            assert refusal(info, [fd], b"write") == (
                "error only the write end of a pipe can be handed off for a get: "
                "the server writes no file\n"
            )
        assert refusal(info, [read_end], b"write") == (
            "error the pipe handed off for a get is not its write end\n"
        )
        assert "unknown handoff mode 'delete'" in refusal(info, [read_only], b"delete")
        assert "expected one file descriptor, got 2" in refusal(
            info, [read_only, write_only], b"read"
        )
        with pytest.raises(OSError, match="belongs to another vault server"):
            hand_off(info.socket, "0" * 32, read_only, "read")
    finally:
        for fd in (read_end, write_end, read_only, write_only, read_write):
            os.close(fd)


def test_a_ticket_serves_one_call_of_its_own_kind(
    vault_server: VaultServer, client: VaultClient, tmp_path: Path
) -> None:
    info = desk(client)
    source = tmp_path / "once.bin"
    data = write_file(source, 1000, seed=7)
    ticket = park_file(info, source)
    with grpc.insecure_channel(vault_server.address) as channel:
        store = rpc.StoreStub(channel)

        def put(ticket: str, *more: pb.PutRequest, size: int = len(data)) -> pb.PutResponse:
            header = pb.PutRequest(header=pb.PutHeader(handoff=ticket, handoff_size=size))
            meant = "sha256:" + hashlib.sha256(data[:size]).hexdigest()
            commit = pb.PutRequest(commit=pb.PutCommit(size=size, digest=meant))
            response: pb.PutResponse = store.Put(iter([header, *more, commit]))
            return response

        assert put(ticket).blob.sha256 == "sha256:" + hashlib.sha256(data).hexdigest()
        with pytest.raises(grpc.RpcError) as again:
            put(ticket)
        assert again.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown or expired handoff ticket" in (again.value.details() or "")

        ticket = park_file(info, source)
        request = pb.GetRequest(digest="sha256:" + hashlib.sha256(data).hexdigest(), handoff=ticket)
        with pytest.raises(grpc.RpcError) as wrong:
            list(store.Get(request))
        assert wrong.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "given for reading; this call needs it for writing" in (wrong.value.details() or "")

        ticket = park_file(info, source)
        with pytest.raises(grpc.RpcError) as mixed:
            put(ticket, pb.PutRequest(data=b"extra"))
        assert mixed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "carries no bytes of its own" in (mixed.value.details() or "")

        # The server stores what the client hashed: the first `handoff_size` bytes, even if
        # the file has grown since; a file shorter than that is refused.
        first_half = put(park_file(info, source), size=500)
        assert first_half.blob.sha256 == "sha256:" + hashlib.sha256(data[:500]).hexdigest()
        with pytest.raises(grpc.RpcError) as short:
            put(park_file(info, source), size=len(data) + 1)
        assert short.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"ends at byte {len(data)}, before the {len(data) + 1} bytes" in (
            short.value.details() or ""
        )


def test_a_handed_off_put_needs_the_write_permission(
    vault: Vault,  # noqa: F811
    tmp_path: Path,
) -> None:
    source = tmp_path / "secret.bin"
    data = write_file(source, seed=8)
    with (
        vault.as_("rita", "vision", "reader") as reader,
        pytest.raises(PermissionDenied, match=r"may not call Store\.Put"),
    ):
        reader.put(source, handoff=True)
    with vault.as_("wes", "vision", "writer") as writer:
        put = writer.put(source, handoff=True)
        writer.get(str(put.blob.sha256), tmp_path / "out.bin", handoff=True)
    assert (tmp_path / "out.bin").read_bytes() == data
    assert put.blob.blake3.raw == blake3.blake3(data).digest()


def test_the_socket_parks_a_bounded_number_of_unclaimed_files(
    start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault()
    source = tmp_path / "parked.bin"
    write_file(source, 100)
    with server.client() as client:
        info = desk(client)
        fd = os.open(source, os.O_RDONLY)
        try:
            tickets = {park(info, fd, "read") for _ in range(MAX_PARKED)}
            assert len(tickets) == MAX_PARKED
            with pytest.raises(OSError, match=f"{MAX_PARKED} handed-off files wait unclaimed"):
                park(info, fd, "read")
        finally:
            os.close(fd)
        # Unasked, a client whose file is refused streams instead.
        big = tmp_path / "big.bin"
        data = write_file(big, HANDOFF_MIN, seed=9)
        put = client.put(big)
        assert put.blob.size == len(data)


def test_vault_put_and_get_of_a_file_past_the_handoff_size(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    source = tmp_path / "weights.bin"
    data = write_file(source, HANDOFF_MIN + CHUNK_SIZE // 3, seed=10)
    line = vault_server.run("put", str(source)).ok().stdout.strip()
    expected = "sha256:" + hashlib.sha256(data).hexdigest()
    assert line.startswith(expected)
    target = tmp_path / "fetched.bin"
    vault_server.run("get", expected, "-o", str(target)).ok()
    assert target.read_bytes() == data


class _HeldCall:
    """The messages of a Get a hostile server keeps open after writing its pipe: no message
    comes until the call is cancelled, which ends it as gRPC ends a cancelled call."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def __iter__(self) -> _HeldCall:
        return self

    def __next__(self) -> pb.GetResponse:
        self.cancelled.wait(60)
        raise StopIteration

    def cancel(self) -> None:
        self.cancelled.set()


def test_a_get_given_up_cancels_its_call_so_no_thread_waits_on_a_server_that_holds_it() -> None:
    """A handed-off get whose caller stops reading (an error writing its file, an interrupt)
    must not leave the thread taking the call's messages blocked for as long as a hostile
    server keeps the call open: closing the reader cancels the call."""
    read_end, write_end = os.pipe()
    call = _HeldCall()
    try:
        os.write(write_end, b"x" * 1024)
        piped = PipedGet(read_end, call, 0, 4096, 1024, contextlib.nullcontext)
        assert bytes(piped.next_chunk() or b"") == b"x" * 1024
        taker = next(t for t in threading.enumerate() if t.name == "pinvault-get-messages")
        piped.close()
        # Given back by the time close returns: none is left inside a call as the process exits.
        assert call.cancelled.is_set()
        assert not taker.is_alive()
    finally:
        call.cancel()
        os.close(read_end)
        os.close(write_end)


def test_a_spooled_range_refused_past_the_end_leaves_no_thread_in_its_call(
    client: VaultClient, tmp_path: Path
) -> None:
    """`vault get --offset … --length …` past a blob's end: the whole blob is handed off into a
    spool, the range refused once its size is known, and the call's message thread is gone by
    the time the refusal reaches the caller (one left inside gRPC can hang the process's exit)."""
    source = tmp_path / "short.bin"
    write_file(source, size=1000, seed=9)
    put = client.put(source)
    for _ in range(20):
        with (
            open(tmp_path / "out", "wb") as out,
            pytest.raises(
                InvalidArgument, match=r"range 900\+101 is beyond the end of .* \(1000 bytes\)"
            ),
        ):
            client.copy_to(str(put.blob.sha256), out.fileno(), offset=900, length=101)
        assert [t for t in threading.enumerate() if t.name == "pinvault-get-messages"] == []
    assert (tmp_path / "out").read_bytes() == b""
