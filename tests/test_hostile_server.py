"""A hostile server or network in front of an honest client: a proxy (tests/services/
tampering_proxy.py) forwards every call to a real `vault serve` and rewrites its answers. The
client, as the `vault` command and as the Python client, must accept no entry and hand on no
byte it did not verify: each attack below is refused with a non-zero exit and nothing accepted.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.services.tampering_proxy import TamperingProxy, flip_chunk
from tests.services.vault_server import VaultRun, VaultServer
from vault.client import VaultClient
from vault.client.state import ledger_file_name
from vault.errors import IntegrityError, VerificationError
from vault.store.chunks import CHUNK_SIZE
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

MiB = CHUNK_SIZE


def random_bytes(size: int, seed: object) -> bytes:
    return random.Random(str(seed)).randbytes(size)


@pytest.fixture
def proxy(vault_server: VaultServer) -> Iterator[TamperingProxy]:
    with TamperingProxy(vault_server.address) as hostile:
        yield hostile


@pytest.fixture
def upstream(vault_server: VaultServer) -> Iterator[grpc.Channel]:
    """The real server, as the hostile one reaches it to build its lies from true answers."""
    with grpc.insecure_channel(vault_server.address) as channel:
        yield channel


def through(proxy: TamperingProxy, server: VaultServer, *args: str, state: Path) -> VaultRun:
    """`vault ARGS` against the hostile proxy, with a trust state of its own."""
    return server.run(*args, env={"PINVAULT_CLIENT_SERVER": proxy.address}, state_home=state)


def stored(server: VaultServer, data: bytes, pin: str | None = "dataset") -> tuple[str, str]:
    with server.client() as client:
        blob = client.put(data).blob
        if pin:
            client.pin(pin, str(blob.sha256), meta={"n": str(random.random())})
    return str(blob.sha256), str(blob.blake3)


# -- 5. a look-up answer is about the digest asked for ---------------------------------------


def test_a_lookup_answered_with_another_digests_proven_entries_is_refused(
    vault_server: VaultServer, proxy: TamperingProxy, upstream: grpc.Channel, tmp_path: Path
) -> None:
    asked, _ = stored(vault_server, b"the blob asked about")
    other, _ = stored(vault_server, b"another blob, also pinned")
    ledger = rpc.LedgerStub(upstream)

    def other_entries(request: pb.LookupRequest, answer: pb.LookupResponse) -> Any:
        # Genuine entries with genuine inclusion proofs, for the wrong digest.
        return ledger.Lookup(pb.LookupRequest(digest=other, known_size=request.known_size))

    proxy.tamper("Ledger/Lookup", other_entries)
    run = through(proxy, vault_server, "lookup", asked, "--json", state=tmp_path / "state")
    # With --json, the error is one JSON object on standard error (docs/cli.md).
    error = json.loads(run.stderr)["error"]
    assert (run.returncode, error["kind"]) == (65, "integrity"), run.describe()
    line = error["message"]
    assert f"asked for entries naming {asked}" in line and other in line, line
    assert run.output == b""

    with VaultClient(proxy.address) as client, pytest.raises(VerificationError, match=asked):
        client.lookup(asked)
    proxy.clear("Ledger/Lookup")
    with VaultClient(proxy.address) as client:
        assert all(asked in p.entry.subjects for p in client.lookup(asked))


def test_a_batch_lookup_with_entries_swapped_or_relabelled_is_refused(
    vault_server: VaultServer, proxy: TamperingProxy
) -> None:
    first, _ = stored(vault_server, b"first of a batch")
    second, _ = stored(vault_server, b"second of a batch")

    def swapped(request: Any, answer: pb.LookupBatchResponse) -> pb.LookupBatchResponse:
        a, b = answer.results
        entries_a, entries_b = list(a.entries), list(b.entries)
        del a.entries[:], b.entries[:]
        a.entries.extend(entries_b)
        b.entries.extend(entries_a)
        return answer

    def relabelled(request: Any, answer: pb.LookupBatchResponse) -> pb.LookupBatchResponse:
        answer.results[0].digest, answer.results[1].digest = second, first
        return answer

    for rule, complaint in ((swapped, f"asked for entries naming {first}"), (relabelled, "")):
        proxy.tamper("Ledger/LookupBatch", rule)
        with (
            VaultClient(proxy.address) as client,
            pytest.raises(VerificationError, match=complaint or f"asked about {first}"),
        ):
            client.lookup_many([first, second])
    proxy.clear("Ledger/LookupBatch")
    with VaultClient(proxy.address) as client:
        found = client.lookup_many([first, second])
    assert [first in p.entry.subjects for p in found[first]] == [True] * len(found[first])
    assert [second in p.entry.subjects for p in found[second]] == [True] * len(found[second])


def test_a_lookup_by_blake3_accepts_sha256_entries_only_for_the_bytes_it_hashed(
    vault_server: VaultServer, proxy: TamperingProxy, upstream: grpc.Channel, tmp_path: Path
) -> None:
    data = random_bytes(MiB + 5, "alias")
    sha256, alias = stored(vault_server, data)
    other, _ = stored(vault_server, b"a blob the alias does not name")
    state = tmp_path / "state"

    # Honest: the entries name the sha256 digest, which the client ties to the alias by
    # fetching the blob by its blake3 digest and hashing it.
    found = through(proxy, vault_server, "lookup", alias, "--json", state=state).ok().json()
    assert found and all(e["subjects"] == [sha256] for e in found)
    assert "Store/Get" in proxy.calls

    ledger = rpc.LedgerStub(upstream)
    proxy.tamper(
        "Ledger/Lookup",
        lambda request, answer: ledger.Lookup(
            pb.LookupRequest(digest=other, known_size=request.known_size)
        ),
    )
    line = through(proxy, vault_server, "lookup", alias, state=state).error_line()
    assert f"asked for entries naming {alias} (whose bytes the client hashed to {sha256})" in line
    assert other in line

    # Nor can the server vouch for the alias with other bytes: they must hash to the alias.
    store = rpc.StoreStub(upstream)

    def other_bytes(request: pb.GetRequest, answers: Iterator[Any]) -> Iterator[pb.GetResponse]:
        for answer in store.Get(pb.GetRequest(digest=other)):
            if answer.WhichOneof("part") == "header":
                answer.header.blob.blake3 = alias
            yield answer

    proxy.tamper("Store/Get", other_bytes)
    line = through(proxy, vault_server, "lookup", alias, state=tmp_path / "fresh").error_line()
    assert "DATA_LOSS" in line and f"{alias}: the bytes received do not match" in line, line


def test_a_pin_recorded_for_another_digest_is_refused(
    vault_server: VaultServer, proxy: TamperingProxy, upstream: grpc.Channel, tmp_path: Path
) -> None:
    asked, _ = stored(vault_server, b"the blob to pin", pin=None)
    other, _ = stored(vault_server, b"the blob the vault pins instead", pin=None)
    ledger = rpc.LedgerStub(upstream)

    def pin_other(request: pb.PinRequest, answer: Any) -> Any:
        forged = pb.PinRequest()
        forged.CopyFrom(request)
        forged.subjects[:] = [other]
        return ledger.Pin(forged)

    proxy.tamper("Ledger/Pin", pin_other)
    line = through(proxy, vault_server, "pin", "config", asked, state=tmp_path).error_line()
    assert f"asked to pin {asked}, the vault recorded entry" in line and other in line, line


# -- 7. standard output gets only verified bytes ---------------------------------------------


def test_get_to_stdout_writes_nothing_when_a_chunk_and_its_hash_are_forged(
    vault_server: VaultServer, proxy: TamperingProxy, tmp_path: Path
) -> None:
    data = random_bytes(3 * MiB + 100, "stdout")
    sha256, alias = stored(vault_server, data, pin=None)
    state = tmp_path / "state"
    assert through(proxy, vault_server, "get", sha256, state=state).ok().output == data

    proxy.tamper("Store/Get", flip_chunk(at=2 * MiB))
    for digest in (sha256, alias):
        run = through(proxy, vault_server, "get", digest, state=state)
        line = run.error_line()
        assert "DATA_LOSS" in line and f"{digest}: the bytes received do not match" in line
        assert run.output == b"", f"{len(run.output)} unverified bytes reached standard output"
    # The spool the bytes waited in has no name, and none is left behind.
    assert [p for p in (state / "cache").rglob("*") if p.is_file()] == []


def test_get_to_a_file_leaves_nothing_when_the_blob_is_forged(
    vault_server: VaultServer, proxy: TamperingProxy, tmp_path: Path
) -> None:
    data = random_bytes(2 * MiB + 1, "to a file")
    sha256, _ = stored(vault_server, data, pin=None)
    proxy.tamper("Store/Get", flip_chunk(at=MiB))
    folder = tmp_path / "out"
    folder.mkdir()
    line = through(
        proxy, vault_server, "get", sha256, "-o", str(folder / "x"), state=tmp_path / "s"
    ).error_line()
    assert "DATA_LOSS" in line and sha256 in line
    assert list(folder.iterdir()) == []


# -- 6. a range is verified as part of its whole blob ----------------------------------------


def test_a_range_whose_chunk_and_chunk_hash_are_forged_is_refused(
    vault_server: VaultServer, proxy: TamperingProxy, tmp_path: Path
) -> None:
    data = random_bytes(3 * MiB + 7, "range")
    sha256, _ = stored(vault_server, data, pin=None)
    state = tmp_path / "state"
    window = ["--offset", str(MiB + 10), "--length", "4096"]
    honest = through(proxy, vault_server, "get", sha256, *window, state=state).ok()
    assert honest.output == data[MiB + 10 : MiB + 10 + 4096]

    proxy.tamper("Store/Get", flip_chunk(at=MiB))
    run = through(proxy, vault_server, "get", sha256, *window, state=state)
    assert "DATA_LOSS" in run.error_line() and run.output == b""
    target = tmp_path / "range.bin"
    run = through(proxy, vault_server, "get", sha256, *window, "-o", str(target), state=state)
    assert "DATA_LOSS" in run.error_line()
    assert list(tmp_path.glob("*range*")) == []
    with VaultClient(proxy.address) as client, pytest.raises(IntegrityError, match=sha256):
        client.open(sha256, offset=MiB + 10, length=4096).read()

    # A forged chunk outside the range is caught too: the range is cut from a verified whole.
    proxy.tamper("Store/Get", flip_chunk(at=3 * MiB))
    with VaultClient(proxy.address) as client, pytest.raises(IntegrityError, match=sha256):
        client.open(sha256, offset=10, length=100).read()


# -- 8. downloads never follow a planted file ------------------------------------------------


def test_get_never_writes_through_a_planted_partial_file(
    vault_server: VaultServer, proxy: TamperingProxy, tmp_path: Path
) -> None:
    data = random_bytes(MiB + 3, "planted")
    sha256, _ = stored(vault_server, data, pin=None)
    folder = tmp_path / "downloads"
    folder.mkdir()
    precious = tmp_path / "precious"
    precious.write_bytes(b"the user's own file")
    planted = folder / ".out.bin.pinvault-partial"
    planted.symlink_to(precious)
    target = folder / "out.bin"
    old_umask = os.umask(0o022)
    os.umask(old_umask)

    # Straight to the real server (whose handoff writes into the file the client made) ...
    vault_server.run("get", sha256, "-o", str(target), state_home=tmp_path / "s").ok()
    assert target.read_bytes() == data and not target.is_symlink()
    assert target.stat().st_mode & 0o777 == 0o666 & ~old_umask
    assert precious.read_bytes() == b"the user's own file"
    assert planted.is_symlink() and os.readlink(planted) == str(precious)
    assert sorted(p.name for p in folder.iterdir()) == [planted.name, "out.bin"]

    # ... and through a hostile one, whose forged bytes leave nothing but what was there.
    target.unlink()
    proxy.tamper("Store/Get", flip_chunk(at=MiB))
    run = through(proxy, vault_server, "get", sha256, "-o", str(target), state=tmp_path / "s")
    assert "DATA_LOSS" in run.error_line()
    assert precious.read_bytes() == b"the user's own file"
    assert sorted(p.name for p in folder.iterdir()) == [planted.name]


def test_get_replaces_a_planted_target_symlink_instead_of_writing_through_it(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    data = b"fetched"
    sha256, _ = stored(vault_server, data, pin=None)
    precious = tmp_path / "precious"
    precious.write_bytes(b"the user's own file")
    target = tmp_path / "out.bin"
    target.symlink_to(precious)
    vault_server.run("get", sha256, "-o", str(target), state_home=tmp_path / "s").ok()
    assert not target.is_symlink() and target.read_bytes() == data
    assert precious.read_bytes() == b"the user's own file"


def test_the_honest_server_through_the_proxy_still_serves_everything(
    vault_server: VaultServer, proxy: TamperingProxy, tmp_path: Path
) -> None:
    data = random_bytes(2 * MiB + 9, "honest")
    sha256, alias = stored(vault_server, data)
    state = tmp_path / "state"
    assert through(proxy, vault_server, "get", alias, state=state).ok().output == data
    target = tmp_path / "out"
    through(proxy, vault_server, "get", sha256, "-o", str(target), state=state).ok()
    assert hashlib.sha256(target.read_bytes()).hexdigest() == sha256.removeprefix("sha256:")
    run = through(proxy, vault_server, "get", sha256, "--offset", str(2 * MiB), state=state)
    assert run.ok().output == data[2 * MiB :]
    assert through(proxy, vault_server, "lookup", alias, state=state).ok().stdout


def test_the_trust_state_is_never_written_through_a_planted_file(
    vault_server: VaultServer, tmp_path: Path
) -> None:
    sha256, _ = stored(vault_server, b"looked up with a planted state folder")
    state_home = tmp_path / "state"
    folder = state_home / "pinvault"
    folder.mkdir(parents=True)
    precious = tmp_path / "precious"
    precious.write_bytes(b"the user's own file")
    key = vault_server.signing_key()
    name = ledger_file_name(key.name, str(key.verifier())).removesuffix(".json")
    (folder / f"{name}.tmp").symlink_to(precious)
    vault_server.run("lookup", sha256, state_home=state_home).ok()
    assert precious.read_bytes() == b"the user's own file"
    (trust,) = vault_server.trust_files(state_home)
    assert not trust.is_symlink() and trust.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [f"{name}.tmp", f"{name}.lock", f"{name}.json", "servers.json", "servers.lock"]
    )

    # A planted lock is refused, in one line, and nothing is written through it.
    (folder / f"{name}.lock").unlink()
    (folder / f"{name}.lock").symlink_to(precious)
    line = vault_server.run("lookup", sha256, state_home=state_home).error_line()
    assert f"{name}.lock" in line, line
    assert precious.read_bytes() == b"the user's own file"
