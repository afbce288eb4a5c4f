"""`vault get -o` interrupted: Ctrl-C or SIGTERM leaves no partial file behind; a get killed
outright leaves one, and the next get of the same blob keeps what of it matches the blob's chunk
list and fetches only the rest. Nothing else is ever taken from a partial file: a symlink or a
file the client did not make is never opened for writing, a byte that fails its chunk's check is
fetched again, and a chunk list that vouches for bad bytes fails the whole digest."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest

from tests.conftest import StartVault
from tests.services.tampering_proxy import TamperingProxy
from tests.services.vault_server import REPO_ROOT, VAULT_COMMAND, VaultServer, command_env
from vault.store.chunks import CHUNK_SIZE
from vault.wire import pinvault_pb2 as pb

MiB = CHUNK_SIZE
SIZE = 96 * MiB
WAIT = 60.0


def random_bytes(size: int, seed: object) -> bytes:
    return random.Random(str(seed)).randbytes(size)


DATA = random_bytes(SIZE, "resumed")
DIGEST = "sha256:" + hashlib.sha256(DATA).hexdigest()


@pytest.fixture(params=["handoff", "streamed"])
def server(request: pytest.FixtureRequest, start_vault: StartVault, tmp_path: Path) -> VaultServer:
    """A server holding DATA; on this host a get is handed off unless the server takes none."""
    env = {"PINVAULT_SERVER_HANDOFF": "false"} if request.param == "streamed" else {}
    server = start_vault(env=env)
    source = tmp_path / "source.bin"
    source.write_bytes(DATA)
    assert server.run("put", "--json", str(source)).ok().json()["sha256"] == DIGEST
    source.unlink()
    return server


def partials(folder: Path) -> list[Path]:
    return sorted(folder.glob(".*.pinvault-partial-*"))


def _as_in_a_terminal() -> None:
    """The get gets SIGINT as a command in the foreground of a terminal does, even when the
    tests run in the background of a shell, which starts them with SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_get(server: VaultServer, target: Path, *, address: str | None = None) -> Any:
    return subprocess.Popen(
        [*VAULT_COMMAND, "get", DIGEST, "-o", str(target)],
        preexec_fn=_as_in_a_terminal,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=command_env(
            state_home=server.state_home,
            extra={"PINVAULT_CLIENT_SERVER": address or server.address},
        ),
        cwd=REPO_ROOT,
    )


def stop_midway(get: Any, folder: Path, stop: signal.Signals) -> tuple[bytes, str]:
    """Freeze the get once its partial file holds 16 MiB, then send it `stop`; what it
    printed."""
    deadline = time.monotonic() + WAIT
    while not any(p.stat().st_size >= 16 * MiB for p in partials(folder)):
        if get.poll() is not None:
            out, err = get.communicate()
            raise AssertionError(
                f"the get ended ({get.returncode}) before it could be stopped\n"
                f"--- stdout\n{out[-2000:]!r}\n--- stderr\n{err.decode(errors='replace')[-4000:]}"
            )
        assert time.monotonic() < deadline, "the get wrote nothing"
        time.sleep(0.002)
    get.send_signal(signal.SIGSTOP)
    get.send_signal(stop)
    get.send_signal(signal.SIGCONT)
    out, err = get.communicate(timeout=WAIT)
    return out, err.decode()


def killed_midway(server: VaultServer, target: Path) -> Path:
    """A get of DATA into `target` killed outright (SIGKILL) half-way; the partial file it left,
    once nothing writes into it any more."""
    target.parent.mkdir(exist_ok=True)
    get = start_get(server, target)
    stop_midway(get, target.parent, signal.SIGKILL)
    assert get.returncode == -signal.SIGKILL
    (partial,) = partials(target.parent)
    # A handed-off get's server writes on until it sees the client gone.
    sizes = [-1, partial.stat().st_size]
    while sizes[-1] != sizes[-2]:
        time.sleep(0.2)
        sizes.append(partial.stat().st_size)
    assert sizes[-1] >= 16 * MiB
    return partial


def damage_stored_chunk(server: VaultServer, offset: int) -> None:
    """Flip a byte of the server's only copy: it can no longer serve that chunk."""
    with server.blob_path(DIGEST).open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x80]))


# -- interrupted ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stop", "status", "line"),
    [(signal.SIGTERM, 143, "vault: terminated"), (signal.SIGINT, 130, "vault: interrupted")],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_get_interrupted_mid_transfer_leaves_nothing_behind(
    server: VaultServer, tmp_path: Path, stop: signal.Signals, status: int, line: str
) -> None:
    folder = tmp_path / "downloads"
    folder.mkdir()
    get = start_get(server, folder / "out.bin")
    out, err = stop_midway(get, folder, stop)
    assert (get.returncode, err, out) == (status, line + "\n", b"")
    assert list(folder.iterdir()) == []


# -- resumed after a kill -------------------------------------------------------------------


def test_a_get_killed_outright_resumes_from_what_it_wrote(
    server: VaultServer, tmp_path: Path
) -> None:
    target = tmp_path / "downloads" / "out.bin"
    partial = killed_midway(server, target)
    assert partial.name == f".out.bin.pinvault-partial-{DIGEST[7:23]}"
    assert partial.stat().st_mode & 0o777 == 0o600

    # The server can no longer serve the first chunk: only a get that keeps it from the
    # partial file, and fetches no more than the rest, can succeed.
    damage_stored_chunk(server, 10)
    elsewhere = tmp_path / "elsewhere.bin"
    assert "DATA_LOSS" in server.run("get", DIGEST, "-o", str(elsewhere)).error_line()
    assert not elsewhere.exists()

    server.run("get", DIGEST, "-o", str(target)).ok()
    assert hashlib.sha256(target.read_bytes()).hexdigest() == DIGEST[7:]
    assert [p.name for p in target.parent.iterdir()] == ["out.bin"]


def test_a_damaged_chunk_of_the_partial_file_is_fetched_again(
    server: VaultServer, tmp_path: Path
) -> None:
    target = tmp_path / "downloads" / "out.bin"
    partial = killed_midway(server, target)
    flip(partial, 5 * MiB + 3)
    damage_stored_chunk(server, 10)

    # Chunks 0-4 are kept (the server cannot serve chunk 0), chunk 5 onwards fetched again.
    server.run("get", DIGEST, "-o", str(target)).ok()
    assert target.read_bytes() == DATA
    assert partials(target.parent) == []


def test_a_damaged_chunk_the_server_cannot_serve_fails_the_get_and_is_not_used(
    server: VaultServer, tmp_path: Path
) -> None:
    target = tmp_path / "downloads" / "out.bin"
    partial = killed_midway(server, target)
    flip(partial, 3)
    damage_stored_chunk(server, 10)

    line = server.run("get", DIGEST, "-o", str(target)).error_line()
    assert "DATA_LOSS" in line and DIGEST in line
    assert list(target.parent.iterdir()) == []


# -- nothing planted is used ----------------------------------------------------------------


def plant_prefix(folder: Path, mode: int) -> Path:
    """A file at the name a get of DATA into folder/out.bin resumes from, holding DATA's first
    chunks, as a resumable partial file would."""
    planted = folder / f".out.bin.pinvault-partial-{DIGEST[7:23]}"
    planted.write_bytes(DATA[: 8 * MiB])
    planted.chmod(mode)
    return planted


def test_a_file_at_the_resumed_name_is_reused_only_if_the_client_could_have_made_it(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    with vault_server.client() as client:
        assert str(client.put(DATA).blob.sha256) == DIGEST
    folder = tmp_path / "downloads"
    folder.mkdir()
    target = folder / "out.bin"
    precious = tmp_path / "precious"
    precious.write_bytes(DATA[: 8 * MiB])
    precious.chmod(0o600)
    name = f".out.bin.pinvault-partial-{DIGEST[7:23]}"

    def get() -> None:
        vault_server.run("get", DIGEST, "-o", str(target), state_home=tmp_path / "s").ok()
        assert target.read_bytes() == DATA
        target.unlink()

    # A symlink to the user's own file: not followed, not removed.
    (folder / name).symlink_to(precious)
    get()
    assert (folder / name).is_symlink() and precious.read_bytes() == DATA[: 8 * MiB]
    (folder / name).unlink()

    # A second name of the user's own file: not written, so the file is unchanged.
    os.link(precious, folder / name)
    get()
    assert precious.read_bytes() == DATA[: 8 * MiB] and precious.stat().st_nlink == 2
    (folder / name).unlink()

    # A file of another mode, or another owner's: left as it is.
    planted = plant_prefix(folder, 0o644)
    get()
    assert planted.read_bytes() == DATA[: 8 * MiB] and planted.stat().st_mode & 0o777 == 0o644
    planted.unlink()
    if os.geteuid() == 0:
        planted = plant_prefix(folder, 0o600)
        os.chown(planted, 65534, 65534)
        get()
        assert planted.stat().st_uid == 65534 and planted.read_bytes() == DATA[: 8 * MiB]
        planted.unlink()

    # One the client could have made is resumed from, and consumed.
    plant_prefix(folder, 0o600)
    get()
    assert list(folder.iterdir()) == []


def lying_chunk_list(partial: bytes) -> Any:
    """A Get rule: list the first chunk's hash as that of `partial`'s first chunk."""

    def rule(request: pb.GetRequest, answers: Iterator[pb.GetResponse]) -> Iterator[pb.GetResponse]:
        for answer in answers:
            if answer.WhichOneof("part") == "hashes" and answer.hashes.offset == 0:
                answer.hashes.hashes[0] = blake3.blake3(partial[:MiB]).digest()
            yield answer

    return rule


def test_bytes_a_lying_chunk_list_vouches_for_fail_the_whole_digest(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    with vault_server.client() as client:
        assert str(client.put(DATA).blob.sha256) == DIGEST
    folder = tmp_path / "downloads"
    folder.mkdir()
    planted = plant_prefix(folder, 0o600)
    flip(planted, 100)
    with TamperingProxy(vault_server.address) as proxy:
        proxy.tamper("Store/Get", lying_chunk_list(planted.read_bytes()))
        run = vault_server.run(
            "get",
            DIGEST,
            "-o",
            str(folder / "out.bin"),
            state_home=tmp_path / "s",
            env={"PINVAULT_CLIENT_SERVER": proxy.address},
        )
    line = run.error_line()
    assert "DATA_LOSS" in line and "does not match the digest" in line, line
    assert list(folder.iterdir()) == []
