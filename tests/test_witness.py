"""Witnessed checkpoints: a vault configured with witnesses submits every checkpoint to them
(c2sp.org/tlog-witness) and serves it with their cosignatures, and a client that requires them
refuses any checkpoint they did not cosign. The witness is the transparency-dev witness itself
(its omniwitness program, built from its Go module), so a rollback of the whole server or a
fork between two servers, which the vault's own key cannot reveal to a new client, is caught."""

from __future__ import annotations

import base64
import re
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from tests.conftest import StartVault
from tests.services import tilecheck
from tests.services import witness as witness_service
from tests.services.tampering_proxy import TamperingProxy
from tests.services.vault_server import VaultServer, run_vault
from tests.services.witness import WitnessServer
from vault.client import VaultClient
from vault.client.trust import TrustedLog
from vault.errors import VerificationError
from vault.ledger.checkpoint import Checkpoint, SigningKey
from vault.ledger.cosignature import WitnessKey, WitnessPolicy, cosigned_message, require
from vault.ledger.merkle import EMPTY_ROOT, leaf_hash
from vault.wire import pinvault_pb2 as pb

ORIGIN = "witness.test/ledger"


@pytest.fixture(scope="module")
def witness_program() -> Path:
    """The witness, built once (a build that fails fails the tests that use it)."""
    return witness_service.build()


@pytest.fixture
def vault_key(tmp_path: Path) -> Path:
    """The vault's checkpoint key, made before the vault starts so that the witness can be
    told it (a server restored from a copy, or a second server on a copy, signs with it too)."""
    path = tmp_path / "checkpoint.key"
    SigningKey.generate(ORIGIN).save(path)
    return path


@pytest.fixture
def witness(witness_program: Path, vault_key: Path) -> Iterator[WitnessServer]:
    logs = {ORIGIN: str(SigningKey.load(vault_key).verifier())}
    with WitnessServer(logs) as server:
        yield server


def vault_env(key_file: Path, *witnesses: WitnessServer, timeout: float = 5.0) -> dict[str, str]:
    return {
        "PINVAULT_LEDGER_ORIGIN": ORIGIN,
        "PINVAULT_LEDGER_KEY_FILE": str(key_file),
        "PINVAULT_WITNESSES_ENDPOINTS": ", ".join(w.endpoint for w in witnesses),
        "PINVAULT_WITNESSES_TIMEOUT": str(timeout),
    }


def requiring(server: VaultServer, *witnesses: WitnessKey, k: int | None = None) -> VaultClient:
    """A new client (no trust state: it never saw this vault) that requires the witnesses."""
    return VaultClient(
        server.address, witnesses=[str(w) for w in witnesses], min_witnesses=k, timeout=60
    )


def pin_some(client: VaultClient, count: int, label: str) -> str:
    blob = str(client.put(f"dataset manifest {label}".encode()).blob.sha256)
    for n in range(count):
        client.pin("dataset", blob, meta={"branch": label, "n": str(n)})
    return blob


def missing(size: int, witness: WitnessKey, got: int = 0, k: int = 1, n: int = 1) -> str:
    """What a client requiring witnesses says of a checkpoint they did not cosign."""
    return (
        f"the checkpoint of size {size} is cosigned by {got} of the witnesses required "
        f"({k} of {n}): no valid cosignature by {witness.label}"
    )


def signature_lines(note: str) -> list[str]:
    return note.split("\n\n")[-1].splitlines()


def test_checkpoints_are_cosigned_by_the_witness_and_a_client_requiring_it_accepts_them(
    start_vault: StartVault, witness: WitnessServer, vault_key: Path, tmp_path: Path
) -> None:
    server = start_vault(env=vault_env(vault_key, witness))
    before = int(time.time())
    with requiring(server, witness.key) as client:
        blob = pin_some(client, 2, "a")
        assert [p.entry.index for p in client.lookup(blob)] == [0, 1]
        checkpoint, cosignatures = client.witnessed()
        note = client.checkpoint_note()
    assert checkpoint.size == 2
    assert [c.witness for c in cosignatures] == [witness.key]
    assert before <= cosignatures[0].timestamp <= time.time() + 1
    # The note as served: the vault's signature, then the witness's own line, which verifies
    # with the witness's key alone.
    vault_line, witness_line = signature_lines(note)
    assert vault_line.startswith(f"— {ORIGIN} ")
    assert witness_line.startswith(f"— {witness.key.name} ")
    assert [c.line for c in require(note, [witness.key])] == [witness_line + "\n"]

    run = server.run("verify", "--witness", str(witness.key)).ok()
    lines = run.stdout.splitlines()
    assert lines[0] == (
        f"witnesses: checkpoint of size 2 cosigned by {witness.key.label} (1 of 1 required)"
    )
    assert "ledger OK" in lines

    # A witness this vault does not use has cosigned nothing: requiring it refuses the vault,
    # naming it, unless one of the two suffices.
    absent = WitnessKey("witness.test/absent", SigningKey.generate("absent").verifier().public_key)
    keys = ("--witness", str(witness.key), "--witness", str(absent))
    run = server.run("verify", *keys, state_home=tmp_path / "state-2")
    assert run.returncode == 65
    assert run.error_line() == "vault: " + missing(2, absent, got=1, k=2, n=2)
    run = server.run("verify", *keys, "--min-witnesses", "1", state_home=tmp_path / "state-3")
    assert run.ok().stdout.splitlines()[0] == (
        f"witnesses: checkpoint of size 2 cosigned by {witness.key.label} (1 of 2 required)"
    )


def test_a_rolled_back_server_is_refused_by_the_witness_and_by_clients_requiring_it(
    start_vault: StartVault, witness: WitnessServer, vault_key: Path, tmp_path: Path
) -> None:
    server = start_vault(env=vault_env(vault_key, witness))
    with requiring(server, witness.key) as client:
        pin_some(client, 2, "a")
    server.stop()
    earlier = server.copy_data(tmp_path / "earlier")

    # A restart is no rollback: the server learns the witness's size from its 409 answer and
    # proves consistency from there.
    server.start()
    with requiring(server, witness.key) as client:
        pin_some(client, 3, "b")
        assert client.checkpoint().size == 5

    # The operator restores the whole data folder from the earlier copy and appends.
    server.stop()
    shutil.rmtree(server.data_dir)
    shutil.copytree(earlier, server.data_dir)
    server.start()
    with server.client() as plain:
        pin_some(plain, 1, "c")

    # The vault's own signatures are all in order: `vault verify` of a new client passes.
    fresh = server.run("verify", state_home=tmp_path / "fresh").ok()
    assert "ledger OK" in fresh.stdout.splitlines()
    # Requiring the witness, the same new client refuses it.
    run = server.run("verify", "--witness", str(witness.key), state_home=tmp_path / "fresh-2")
    assert run.returncode == 65
    assert run.error_line() == "vault: " + missing(3, witness.key)
    with requiring(server, witness.key) as client, pytest.raises(VerificationError) as caught:
        client.checkpoint()
    assert str(caught.value) == missing(3, witness.key)
    refused = f"witness {witness.key.label} ({witness.url}) refused: "
    assert re.search(
        re.escape(refused) + "it has cosigned a checkpoint of size 5 of this ledger, and this "
        r"server's latest is of size [23]: the ledger was rolled back$",
        server.log(),
        re.MULTILINE,
    )

    # Catching up past the size the witness saw does not help: the tree does not extend it.
    with server.client() as plain:
        pin_some(plain, 3, "d")
    with requiring(server, witness.key) as client, pytest.raises(VerificationError) as caught:
        client.checkpoint()
    assert str(caught.value) == missing(6, witness.key)
    assert (
        refused + f"POST {witness.url}/add-checkpoint with the checkpoint of size 5 (old size "
        "5): HTTP 422, the checkpoint does not extend the one the witness cosigned last (a fork "
        "or a rewritten history)"
    ) in server.log()


def test_of_two_forked_servers_only_one_branch_is_cosigned(
    start_vault: StartVault, witness: WitnessServer, vault_key: Path, tmp_path: Path
) -> None:
    env = vault_env(vault_key, witness)
    a = start_vault("a", env=env)
    with requiring(a, witness.key) as client:
        blob = pin_some(client, 2, "common")
    a.stop()
    b_data = a.copy_data(tmp_path / "b-data")
    a.start()
    b = start_vault("b", env=env, data_dir=b_data)

    # Each server appends an entry 2 of its own; a's reaches the witness first.
    with requiring(a, witness.key) as client:
        on_a = client.pin("dataset", blob, meta={"branch": "a"})
    with b.client() as plain:
        on_b = plain.pin("dataset", blob, meta={"branch": "b"})
    assert on_a.entry.index == on_b.entry.index == 2
    assert on_a.checkpoint.root != on_b.checkpoint.root

    # A client that never saw either believes whichever server it asks, on the key alone...
    with b.client() as plain:
        assert plain.checkpoint().root == on_b.checkpoint.root
    # ...but requiring the witness, it believes only the branch the witness cosigned.
    with requiring(a, witness.key) as client:
        assert client.checkpoint().root == on_a.checkpoint.root
    with requiring(b, witness.key) as client, pytest.raises(VerificationError) as caught:
        client.lookup(blob)
    assert str(caught.value) == missing(3, witness.key)
    run = b.run("verify", "--witness", str(witness.key), state_home=tmp_path / "fresh")
    assert run.error_line() == "vault: " + missing(3, witness.key)
    a.run("verify", "--witness", str(witness.key), state_home=tmp_path / "fresh").ok()
    assert "the checkpoint of size 3 (old size 3): HTTP 422" in b.log()


def _cosignature(key: Ed25519PrivateKey, name: str, timestamp: int, body: str) -> str:
    """A cosignature/v1 line by `key` under `name`, as a witness writes one."""
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    key_id = WitnessKey(name, public).key_id
    signature = struct.pack(">Q", timestamp) + key.sign(cosigned_message(timestamp, body))
    return f"— {name} {base64.b64encode(key_id + signature).decode()}\n"


def test_a_forged_or_garbled_cosignature_is_refused(
    start_vault: StartVault, witness: WitnessServer, vault_key: Path, tmp_path: Path
) -> None:
    server = start_vault(env=vault_env(vault_key, witness))
    with requiring(server, witness.key) as client:
        blob = pin_some(client, 1, "a")
        older = client.checkpoint_note()
        client.pin("dataset", blob, meta={"n": "again"})
        note = client.checkpoint_note()
    body = note.split("\n\n")[0]
    vault_line, witness_line = signature_lines(note)
    name, encoded = witness_line[2:].split(" ")
    raw = bytearray(base64.b64decode(encoded))
    raw[-1] ^= 0x01
    flipped = f"— {name} {base64.b64encode(bytes(raw)).decode()}\n"
    cut = f"— {name} {base64.b64encode(bytes(raw[:-8])).decode()}\n"
    impostor = _cosignature(Ed25519PrivateKey.generate(), name, int(time.time()), body + "\n")
    signed_by_vault = f"{body}\n\n{vault_line}\n"
    label = witness.key.label
    does_not_verify = (
        f"cosignature by witness {label} does not verify: the checkpoint or the cosignature "
        "was altered"
    )
    forgeries = {
        "a flipped bit": (signed_by_vault + flipped, does_not_verify),
        "a cut signature": (
            signed_by_vault + cut,
            f"cosignature by witness {label} is 64 bytes, not 72: it was truncated or altered",
        ),
        "another key under the witness's name": (
            signed_by_vault + impostor,
            missing(2, witness.key),
        ),
        "the witness's cosignature of an older checkpoint": (
            signed_by_vault + signature_lines(older)[1] + "\n",
            does_not_verify,
        ),
        "no cosignature": (signed_by_vault, missing(2, witness.key)),
    }
    with TamperingProxy(server.address) as proxy:
        for case, (forged, said) in forgeries.items():
            proxy.tamper("Ledger/GetCheckpoint", lambda _, __, f=forged: pb.Checkpoint(note=f))
            client = VaultClient(proxy.address, witnesses=[str(witness.key)], timeout=60)
            with client, pytest.raises(VerificationError) as caught:
                client.checkpoint()
            assert str(caught.value) == said, case
            # A client that requires no witness takes the vault's signature alone.
            with VaultClient(proxy.address, timeout=60) as plain:
                assert plain.checkpoint().size == 2, case
        run = server.run(
            "verify",
            "--witness",
            str(witness.key),
            env={"PINVAULT_CLIENT_SERVER": proxy.address},
            state_home=tmp_path / "through-proxy",
        )
        assert run.error_line() == f"vault: {missing(2, witness.key)}"


def test_a_witness_that_hangs_holds_up_no_call_and_cosigns_again_once_it_answers(
    start_vault: StartVault, witness: WitnessServer, vault_key: Path
) -> None:
    server = start_vault(env=vault_env(vault_key, witness, timeout=1.0))
    with requiring(server, witness.key) as client:
        blob = pin_some(client, 1, "a")
    witness.freeze()
    try:
        started = time.monotonic()
        with server.client() as plain:
            for n in range(5):
                plain.pin("dataset", blob, meta={"while": "frozen", "n": str(n)})
        # One call waits out the time-out at most; the others skip the silent witness.
        assert time.monotonic() - started < 5.0
        with requiring(server, witness.key) as client, pytest.raises(VerificationError) as caught:
            client.checkpoint()
        assert str(caught.value) == missing(6, witness.key)
    finally:
        witness.thaw()
    deadline = time.monotonic() + 30
    while True:
        try:
            with requiring(server, witness.key) as client:
                assert client.checkpoint().size == 6
            break
        except VerificationError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert f"witness {witness.key.label} ({witness.url}) answers again" in server.log()


def _serve_refused(tmp_path: Path, env: dict[str, str]) -> str:
    """`vault serve` with `env`: its one line of error, once it exited 2 creating nothing."""
    run = run_vault(
        "serve",
        "--listen",
        "127.0.0.1:0",
        env={"PINVAULT_DATA_DIR": str(tmp_path / "data"), **env},
        state_home=tmp_path / "state",
        timeout=30,
    )
    assert run.returncode == 2, run.describe()
    assert not (tmp_path / "data").exists()
    return run.error_line()


def test_a_bad_witness_list_stops_serve_with_one_line(tmp_path: Path) -> None:
    key = WitnessKey("witness.test/w", SigningKey.generate("w").verifier().public_key)
    checkpoint_key = SigningKey.generate("witness.test/w").verifier()
    cases = {
        "http://127.0.0.1:9": "witness 'http://127.0.0.1:9' has no key after it",
        f"{key}": f"expected `URL KEY` pairs with an http(s) URL, found '{key}' where a URL "
        "belongs",
        f"http://127.0.0.1:9 {checkpoint_key}": (
            f"witness 'http://127.0.0.1:9': '{checkpoint_key}' is a checkpoint signing key's "
            "verifier (algorithm 0x01), not a witness's cosignature/v1 key (algorithm 0x04)"
        ),
        f"http://127.0.0.1:9 {key}, http://127.0.0.1:10 {key}": (
            f"witness {key.label} is named twice"
        ),
    }
    for n, (value, said) in enumerate(cases.items()):
        line = _serve_refused(tmp_path / str(n), {"PINVAULT_WITNESSES_ENDPOINTS": value})
        assert line == f"vault: INVALID_ARGUMENT: witnesses.endpoints: {said}"
    line = _serve_refused(
        tmp_path / "quorum",
        {
            "PINVAULT_WITNESSES_ENDPOINTS": f"http://127.0.0.1:9 {key}",
            "PINVAULT_WITNESSES_QUORUM": "2",
        },
    )
    assert line == "vault: INVALID_ARGUMENT: witnesses.quorum: 2 cosignatures asked of 1 witnesses"


def test_verify_refuses_a_malformed_witness_requirement_with_one_line(tmp_path: Path) -> None:
    key = WitnessKey("witness.test/w", SigningKey.generate("w").verifier().public_key)
    run = run_vault("verify", "--witness", "nonsense", state_home=tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip() == (
        "vault: argument --witness: malformed witness key 'nonsense': expected <name>+<8 hex "
        "digits>+<base64 of 0x04 and a 32-byte Ed25519 key> (see vault verify --help)"
    )
    run = run_vault("verify", "--witness", str(key), "--min-witnesses", "2", state_home=tmp_path)
    assert run.returncode == 2
    assert run.error_line() == (
        "vault: INVALID_ARGUMENT: client.witnesses: the cosignatures required must be 1 to the "
        "1 witness keys given, found 2"
    )


def test_the_trusted_checkpoint_moves_only_to_checkpoints_k_of_n_witnesses_cosigned() -> None:
    """The rule itself, without I/O: a refused checkpoint leaves the trusted one as it was."""
    vault = SigningKey.generate(ORIGIN)
    keys = {name: Ed25519PrivateKey.generate() for name in ("w.test/a", "w.test/b", "w.test/c")}
    witnesses = [
        WitnessKey(name, key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))
        for name, key in keys.items()
    ]
    note = vault.sign(Checkpoint(ORIGIN, 1, leaf_hash(b"entry")))
    body = note.split("\n\n")[0] + "\n"

    def cosigned(*names: str) -> str:
        return note + "".join(_cosignature(keys[n], n, int(time.time()), body) for n in names)

    trusted = TrustedLog(vault.verifier(), ORIGIN, witnesses=WitnessPolicy(witnesses, 2))
    for refused in (note, cosigned("w.test/b")):
        with pytest.raises(VerificationError) as caught:
            trusted.update(refused, [])
        assert str(caught.value).startswith("the checkpoint of size 1 is cosigned by ")
        assert (trusted.size, trusted.root) == (0, EMPTY_ROOT)
    assert str(caught.value) == (
        "the checkpoint of size 1 is cosigned by 1 of the witnesses required (2 of 3): no valid "
        f"cosignature by {witnesses[0].label}, {witnesses[2].label}"
    )
    assert trusted.update(cosigned("w.test/c", "w.test/a"), []).size == 1
    assert [c.witness.name for c in require(cosigned("w.test/c", "w.test/a"), witnesses, 2)] == [
        "w.test/a",
        "w.test/c",
    ]


def test_an_idle_ledger_stays_freshly_cosigned_and_publishes_the_cosignatures_with_its_tiles(
    start_vault: StartVault, witness: WitnessServer, vault_key: Path, tmp_path: Path
) -> None:
    env = vault_env(vault_key, witness)
    # The witness named by its add-checkpoint URL, as the tlog-witness spec writes it.
    env["PINVAULT_WITNESSES_ENDPOINTS"] = f"{witness.url}/add-checkpoint {witness.key}"
    env["PINVAULT_WITNESSES_REFRESH"] = "1"
    server = start_vault(env=env, serve_args=("--tiles-http", "0"))
    (url,) = [
        line.split(" at ", 1)[1] for line in server.banner if "tiles (C2SP tlog-tiles)" in line
    ]
    notes = []
    with requiring(server, witness.key) as client:
        for n in range(3):
            pin_some(client, 1, f"idle-{n}")
            notes.append(client.checkpoint_note())
        first = client.witnessed()[1][0].timestamp
    assert "does not know this ledger's origin" not in server.log()

    # Idle: the same checkpoint is cosigned again, with a newer time, and handed out so.
    time.sleep(2.5)
    with requiring(server, witness.key) as client:
        checkpoint, cosignatures = client.witnessed()
        notes.append(client.checkpoint_note())
    assert checkpoint.size == 3
    assert cosignatures[0].timestamp > first

    # The published checkpoint carries the witness's cosignature line too.
    published = server.data_dir / "tiles" / "checkpoint"
    deadline = time.monotonic() + 20
    while len(signature_lines(published.read_text())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [c.witness for c in require(published.read_text(), [witness.key])] == [witness.key]

    # Every checkpoint handed out has its tiles: Go's tlog code checks each against them.
    binary = tilecheck.build()
    verifier = SigningKey.load(vault_key).verifier()
    for n, note in enumerate(notes):
        held = tmp_path / f"note-{n}"
        held.write_text(note)
        size = verifier.open(note).size
        outcome = tilecheck.run(binary, url, str(verifier), checkpoint=held, leaves=[size - 1])
        assert outcome.status == 0, (size, outcome.line)


def test_a_refusal_names_the_url_posted_to(
    start_vault: StartVault, witness: WitnessServer, vault_key: Path
) -> None:
    env = vault_env(vault_key, witness)
    env["PINVAULT_WITNESSES_ENDPOINTS"] = f"{witness.url}/elsewhere {witness.key}"
    server = start_vault(env=env)
    with server.client() as client:
        pin_some(client, 1, "x")
    deadline = time.monotonic() + 20
    while "refused" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert re.search(
        rf"\) refused: POST {re.escape(witness.url)}/elsewhere/add-checkpoint with the checkpoint "
        r"of size \d+ \(old size 0\): HTTP 404, nothing answers at that URL or the witness does "
        r"not know this ledger's origin",
        server.log(),
    )
