"""One `vault serve` per data folder: a second one on the same folder refuses to start, naming
the first one's pid, and leaves everything of the first (its handoff socket above all) as it
was; a server killed outright leaves no lock behind, so the next one starts."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

from tests.conftest import StartVault
from tests.services.vault_server import VaultServer, run_vault
from vault.client.handoff import hand_off
from vault.wire import pinvault_pb2 as pb


def folder_state(data: Path) -> dict[str, int]:
    """Every entry of the data folder by its inode, but the last signed checkpoint, which the
    running server replaces whenever it signs."""
    return {
        p.relative_to(data).as_posix(): p.lstat().st_ino
        for p in data.rglob("*")
        if p.name != "last-checkpoint"
    }


def handed_off_put(server: VaultServer, path: Path) -> str:
    """Put `path` through the server's handoff socket, checking the socket answers as the one
    the server names; the blob's digest."""
    with server.client() as client:
        info: pb.HandoffInfo = client.store.Handoff(pb.HandoffRequest())
        assert info.socket == str(server.data_dir / "handoff.sock")
        fd = os.open(path, os.O_RDONLY)
        try:
            assert hand_off(info.socket, info.instance, fd, "read")
        finally:
            os.close(fd)
        return str(client.put(path, handoff=True).blob.sha256)


def test_a_second_server_on_the_same_data_folder_refuses_and_touches_nothing(
    start_vault: StartVault, tmp_path: Path
) -> None:
    first = start_vault()
    assert first.process is not None
    source = tmp_path / "weights.bin"
    source.write_bytes(os.urandom(1 << 20))
    digest = handed_off_put(first, source)
    before = folder_state(first.data_dir)

    second = run_vault(
        "serve",
        "--listen",
        "127.0.0.1:0",
        env={"PINVAULT_DATA_DIR": str(first.data_dir)},
        state_home=tmp_path / "state",
        timeout=30,
    )
    assert second.returncode == 78, second.describe()
    assert second.error_line() == (
        f"vault: FAILED_PRECONDITION: another vault server (pid {first.process.pid}) is "
        f"serving the data folder {first.data_dir}: stop it, or give this one a data folder "
        "of its own (data_dir)"
    )
    assert second.stdout == ""

    assert folder_state(first.data_dir) == before, "the second server changed the data folder"
    assert handed_off_put(first, source) == digest
    assert first.run("get", digest).ok().output == source.read_bytes()


def test_a_server_killed_outright_leaves_no_lock_behind(
    start_vault: StartVault, tmp_path: Path
) -> None:
    first = start_vault()
    source = tmp_path / "weights.bin"
    source.write_bytes(os.urandom(1 << 20))
    digest = handed_off_put(first, source)
    assert first.process is not None
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    first.process = None
    # Left behind by the killed server: its lock file and its handoff socket.
    assert (first.data_dir / "serve.lock").exists()
    assert (first.data_dir / "handoff.sock").is_socket()

    after = start_vault("after", data_dir=first.data_dir)
    assert after.process is not None
    assert (first.data_dir / "serve.lock").read_text() == f"{after.process.pid}\n"
    assert after.run("get", digest).ok().output == source.read_bytes()
    again = tmp_path / "more.bin"
    again.write_bytes(os.urandom(1 << 20))
    assert (
        handed_off_put(after, again) == "sha256:" + hashlib.sha256(again.read_bytes()).hexdigest()
    )
