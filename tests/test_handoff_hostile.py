"""A hostile process answering on the vault server's handoff socket, as another uid: it passes
every handed-off descriptor on to the real server (so every transfer succeeds), keeps a copy,
and once the client has verified what it got, tries to change it. Nothing the client verified
changes after, and what it is handed for a get is a pipe, never a file."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.services.vault_server import REPO_ROOT, VaultServer
from vault.client import VaultClient
from vault.client.handoff import HANDOFF_MIN
from vault.client.reader import read_all
from vault.runs.fs import VaultFileSystem
from vault.store.chunks import CHUNK_SIZE
from vault.wire import pinvault_pb2 as pb

SIZE = HANDOFF_MIN + CHUNK_SIZE // 3  # handed off unasked

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs the hostile process as nobody")


class Hostile:
    """The hostile process, in the real server's place until `close`."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        # The real socket, moved where a process of another uid may connect to it.
        self._folder = Path(tempfile.mkdtemp(prefix="pinvault-real-"))
        self._folder.chmod(0o711)
        self.real = self._folder / "handoff.sock"
        os.rename(socket_path, self.real)
        self.real.chmod(0o777)
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.services.hostile_handoff",
                str(socket_path),
                str(self.real),
                str(pwd.getpwnam("nobody").pw_uid),
            ],
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None and self._process.stdin is not None
        self._stdin, self._stdout = self._process.stdin, self._process.stdout
        assert self._stdout.readline() == "ready\n"

    def rewrite(self) -> list[dict[str, str]]:
        """Try to change everything handed off so far; what it got, and how each try went."""
        self._stdin.write("rewrite\n")
        self._stdin.flush()
        done: list[dict[str, str]] = json.loads(self._stdout.readline())
        return done

    def close(self) -> None:
        self._stdin.close()
        self._process.wait(timeout=10)
        self._stdout.close()
        self.socket_path.unlink()
        os.rename(self.real, self.socket_path)
        self._folder.rmdir()


@pytest.fixture
def client(vault_server: VaultServer, tmp_path: Path) -> Iterator[VaultClient]:
    with vault_server.client(state=tmp_path / "trust.json") as client:
        yield client


@pytest.fixture
def hostile(client: VaultClient) -> Iterator[Hostile]:
    info = client.store.Handoff(pb.HandoffRequest())
    hostile = Hostile(Path(info.socket))
    try:
        yield hostile
    finally:
        hostile.close()


def stored(client: VaultClient, seed: int) -> tuple[str, bytes]:
    data = hashlib.shake_256(seed.to_bytes(4, "little")).digest(SIZE)
    return str(client.put(data).blob.sha256), data


def only_pipes_written(tried: list[dict[str, Any]]) -> None:
    """Every descriptor handed off for a get was a pipe, and writing it after reached nothing."""
    gets = [t for t in tried if t["mode"] == "write"]
    assert gets, tried
    for t in gets:
        assert (t["kind"], t["access"], t["write"]) == ("pipe", "write-only", "EPIPE"), t


def test_vault_get_output_does_not_change_after_its_check(
    vault_server: VaultServer, client: VaultClient, hostile: Hostile, tmp_path: Path
) -> None:
    digest, data = stored(client, 1)
    target = tmp_path / "weights.bin"
    vault_server.run("get", digest, "-o", str(target)).ok()
    assert target.read_bytes() == data
    tried = hostile.rewrite()
    assert target.read_bytes() == data
    only_pipes_written(tried)


def test_the_fsspec_reader_returns_only_the_bytes_it_verified(
    client: VaultClient, hostile: Hostile
) -> None:
    digest, data = stored(client, 2)
    fs = VaultFileSystem(client)
    with fs.open(f"vault://{digest}", "rb") as f:
        assert f.read(4096) == data[:4096]
        tried = hostile.rewrite()
        f.seek(0)
        assert f.read() == data
    only_pipes_written(tried)


def test_a_range_read_through_its_spool_returns_only_verified_bytes(
    client: VaultClient, hostile: Hostile
) -> None:
    digest, data = stored(client, 3)
    reader = client.open(digest, offset=0, length=CHUNK_SIZE + 10)
    try:
        tried = hostile.rewrite()
        assert read_all(reader) == data[: CHUNK_SIZE + 10]
    finally:
        reader.close()
    only_pipes_written(tried)


def test_a_restored_checkpoint_file_does_not_change_after_its_check(
    client: VaultClient, hostile: Hostile, tmp_path: Path
) -> None:
    # A checkpoint restore writes each file with the client's get, as `vault get -o` does.
    digest, data = stored(client, 4)
    target = tmp_path / "restored" / "model.pt"
    target.parent.mkdir()
    client.get(digest, target)
    tried = hostile.rewrite()
    assert target.read_bytes() == data
    only_pipes_written(tried)


def test_a_put_hands_its_file_read_only_and_only_where_it_gives_nothing_more(
    client: VaultClient, hostile: Hostile, tmp_path: Path
) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    kept = private / "kept.bin"
    shared = private / "shared.bin"
    data = hashlib.shake_256(b"put").digest(SIZE)
    for path, mode in ((kept, 0o644), (shared, 0o666)):
        path.write_bytes(data)
        path.chmod(mode)
    assert client.put(kept).blob.size == SIZE
    # Writable by the handoff socket's owner through the descriptor (and /proc), whatever
    # folder hides it: streamed instead.
    assert client.put(shared).blob.size == SIZE
    tried = hostile.rewrite()
    assert kept.read_bytes() == data and shared.read_bytes() == data
    assert (kept.stat().st_mode & 0o777, shared.stat().st_mode & 0o777) == (0o644, 0o666)
    assert tried == [
        {
            "mode": "read",
            "kind": "file",
            "access": "read-only",
            "write": "EBADF",
            "reopen": "EACCES",
            "chmod": "EPERM",
        }
    ]
