"""Checkpoints and signed notes: the C2SP text format byte for byte, interoperability with Go's
note package, and every way a presented checkpoint can fail verification."""

from __future__ import annotations

import base64
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.services.vault_server import run_vault
from vault.errors import InvalidArgument, VerificationError
from vault.ledger.checkpoint import Checkpoint, SigningKey, Verifier
from vault.ledger.merkle import EMPTY_ROOT, leaf_hash

ORIGIN = "pinvault.test/ledger"

# The example in the documentation of golang.org/x/mod/sumdb/note.
GO_SIGNER = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
GO_VERIFIER = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
GO_TEXT = (
    "If you think cryptography is the answer to your problem,\n"
    "then you don't know what your problem is.\n"
)
GO_NOTE = (
    GO_TEXT + "\n"
    "— PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdng"
    "otpRZb6KE6RyyBwJnAM=\n"
)
GO_SECOND_SIGNATURE = (
    "— EnochRoot rwz+eBzmZa0SO3NbfRGzPCpDckykFXSdeX+MNtCOXm2/5n2tiOHp+vAF1aGrQ5ovTG01oOTGwnWLox"
    "33WWd1RvMc+QQ=\n"
)

# The example in c2sp.org/tlog-checkpoint.
C2SP_BODY = "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n"

ROOT = leaf_hash(b"some ledger")


@pytest.fixture(scope="module")
def key() -> SigningKey:
    return SigningKey(ORIGIN, bytes(range(32)))


@pytest.fixture(scope="module")
def other_key() -> SigningKey:
    return SigningKey(ORIGIN, bytes(range(1, 33)))


def test_body_is_the_c2sp_text() -> None:
    checkpoint = Checkpoint(ORIGIN, 7, ROOT)
    expected = f"{ORIGIN}\n7\n{base64.b64encode(ROOT).decode()}\n"
    assert checkpoint.body() == expected
    with_ext = Checkpoint(ORIGIN, 7, ROOT, ("ext one", "ext two"))
    assert with_ext.body() == expected + "ext one\next two\n"
    assert Checkpoint.parse_body(with_ext.body()) == with_ext


def test_the_c2sp_example_parses_and_reencodes() -> None:
    checkpoint = Checkpoint.parse_body(C2SP_BODY)
    assert checkpoint.origin == "example.com/behind-the-sofa"
    assert checkpoint.size == 20852163
    assert checkpoint.body() == C2SP_BODY


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (f"{ORIGIN}\n7\n{base64.b64encode(ROOT).decode()}", "newline"),
        (f"{ORIGIN}\n7\n", "lines"),
        (f"\n7\n{base64.b64encode(ROOT).decode()}\n", "origin line is empty"),
        (f"{ORIGIN}\n07\n{base64.b64encode(ROOT).decode()}\n", "size line '07'"),
        (f"{ORIGIN}\n-7\n{base64.b64encode(ROOT).decode()}\n", "size line"),
        (f"{ORIGIN}\n7.0\n{base64.b64encode(ROOT).decode()}\n", "size line"),
        (f"{ORIGIN}\n٧\n{base64.b64encode(ROOT).decode()}\n", "size line"),
        (f"{ORIGIN}\n{1 << 63}\n{base64.b64encode(ROOT).decode()}\n", "size line"),
        (f"{ORIGIN}\n7\n{base64.b64encode(ROOT[:31]).decode()}\n", "root line"),
        (f"{ORIGIN}\n7\n{ROOT.hex()}\n", "root line"),
        (f"{ORIGIN}\n7\n{base64.b64encode(ROOT).decode().rstrip('=')}\n", "root line"),
        (f"{ORIGIN}\n7\n{base64.b64encode(ROOT).decode()}\n\n", "extension line is empty"),
    ],
)
def test_malformed_bodies_are_refused(body: str, complaint: str) -> None:
    with pytest.raises(VerificationError, match="malformed checkpoint") as caught:
        Checkpoint.parse_body(body)
    assert complaint in str(caught.value)


def test_a_non_canonical_root_encoding_is_refused() -> None:
    # 32 bytes leave 4 unused bits in the last base64 digit; setting one changes the text
    # but not the bytes, so two texts would name one root.
    canonical = base64.b64encode(ROOT).decode()
    last = canonical[-2]
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    altered = canonical[:-2] + alphabet[alphabet.index(last) ^ 1] + "="
    assert base64.b64decode(altered) == ROOT
    with pytest.raises(VerificationError, match="root line"):
        Checkpoint.parse_body(f"{ORIGIN}\n7\n{altered}\n")


def test_a_checkpoint_cannot_be_built_that_would_not_parse() -> None:
    with pytest.raises(ValueError):
        Checkpoint("two\nlines", 1, ROOT)
    with pytest.raises(ValueError):
        Checkpoint("", 1, ROOT)
    with pytest.raises(ValueError):
        Checkpoint(ORIGIN, -1, ROOT)
    with pytest.raises(ValueError):
        Checkpoint(ORIGIN, 1, ROOT[:16])
    with pytest.raises(ValueError):
        Checkpoint(ORIGIN, 1, ROOT, ("",))


def test_go_note_vectors_sign_and_verify_byte_for_byte() -> None:
    signer = SigningKey.from_string(GO_SIGNER)
    assert str(signer) == GO_SIGNER
    assert signer.key_id.hex() == "c74f20a3"
    assert str(signer.verifier()) == GO_VERIFIER
    assert signer.sign_note(GO_TEXT) == GO_NOTE
    verifier = Verifier.from_string(GO_VERIFIER)
    assert verifier.open_note(GO_NOTE) == GO_TEXT
    # A second signature by a key we do not know is ignored.
    assert verifier.open_note(GO_NOTE + GO_SECOND_SIGNATURE) == GO_TEXT


def test_sign_then_open_round_trips(key: SigningKey) -> None:
    checkpoint = Checkpoint(ORIGIN, 7, ROOT)
    note = key.sign(checkpoint)
    body, signature_line = note.split("\n\n")
    assert body + "\n" == checkpoint.body()
    assert signature_line.startswith(f"— {ORIGIN} ")
    raw = base64.b64decode(signature_line.split(" ")[2])
    assert raw[:4] == key.key_id and len(raw) == 68
    assert key.verifier().open(note) == checkpoint
    # Ed25519 is deterministic: one key and one checkpoint give one note.
    assert key.sign(checkpoint) == note


def test_the_empty_ledger_checkpoint(key: SigningKey) -> None:
    checkpoint = Checkpoint(ORIGIN, 0, EMPTY_ROOT)
    assert key.verifier().open(key.sign(checkpoint)) == checkpoint


def test_a_checkpoint_signed_by_another_key_is_refused(
    key: SigningKey, other_key: SigningKey
) -> None:
    note = other_key.sign(Checkpoint(ORIGIN, 7, ROOT))
    with pytest.raises(VerificationError) as caught:
        key.verifier().open(note)
    message = str(caught.value)
    assert f"not signed by key {ORIGIN}+{key.key_id.hex()}" in message
    assert other_key.key_id.hex() in message


def test_a_key_with_another_name_is_not_ours(key: SigningKey) -> None:
    same_seed = SigningKey("someone.else/log", bytes(range(32)))
    note = same_seed.sign(Checkpoint(ORIGIN, 7, ROOT))
    with pytest.raises(VerificationError, match="not signed by key"):
        key.verifier().open(note)


def test_other_signatures_are_ignored_but_ours_is_required(
    key: SigningKey, other_key: SigningKey
) -> None:
    checkpoint = Checkpoint(ORIGIN, 7, ROOT)
    ours = key.sign(checkpoint)
    theirs = other_key.sign(checkpoint)
    their_line = theirs.split("\n\n")[1]
    assert key.verifier().open(ours + their_line) == checkpoint
    our_line = ours.split("\n\n")[1]
    assert key.verifier().open(theirs + our_line) == checkpoint


def test_a_modified_body_fails_the_signature(key: SigningKey) -> None:
    note = key.sign(Checkpoint(ORIGIN, 7, ROOT))
    tampered = note.replace(f"{ORIGIN}\n7\n", f"{ORIGIN}\n8\n", 1)
    assert tampered != note
    with pytest.raises(VerificationError, match="does not verify"):
        key.verifier().open(tampered)
    other_root = base64.b64encode(leaf_hash(b"other")).decode()
    tampered = note.replace(base64.b64encode(ROOT).decode(), other_root, 1)
    with pytest.raises(VerificationError, match="does not verify"):
        key.verifier().open(tampered)


def test_a_truncated_signature_is_refused(key: SigningKey) -> None:
    note = key.sign(Checkpoint(ORIGIN, 7, ROOT))
    body, line = note.split("\n\n")
    prefix, b64 = line.rstrip("\n").rsplit(" ", 1)
    raw = base64.b64decode(b64)
    short = base64.b64encode(raw[:-3]).decode()
    with pytest.raises(VerificationError, match="not 64"):
        key.verifier().open(f"{body}\n\n{prefix} {short}\n")
    # Cut in the middle of the base64 text: no longer base64 at all.
    with pytest.raises(VerificationError, match="malformed note"):
        key.verifier().open(f"{body}\n\n{prefix} {b64[:-3]}\n")
    with pytest.raises(VerificationError, match="malformed note"):
        key.verifier().open(note[:-1])


def test_a_bad_signature_by_our_key_fails_even_beside_a_good_one(key: SigningKey) -> None:
    checkpoint = Checkpoint(ORIGIN, 7, ROOT)
    note = key.sign(checkpoint)
    line = note.split("\n\n")[1]
    prefix, b64 = line.rstrip("\n").rsplit(" ", 1)
    raw = bytearray(base64.b64decode(b64))
    raw[10] ^= 0x40
    forged = f"{prefix} {base64.b64encode(bytes(raw)).decode()}\n"
    with pytest.raises(VerificationError, match="does not verify"):
        key.verifier().open(note + forged)


@pytest.mark.parametrize(
    ("mangle", "complaint"),
    [
        (lambda n: n.replace("\n\n", "\n"), "no blank line"),
        (lambda n: n.replace("— ", "- "), "does not start with"),
        (lambda n: n.replace("\n\n", "\n\x07\n"), "control character"),
        (lambda n: n + "\n", "malformed note"),
        (lambda n: n.replace("— ", "—  "), "malformed note"),
        (lambda n: n + "— \n", "malformed note"),
        (lambda n: n.replace(ORIGIN, "\ud800", 1), "UTF-8"),
    ],
)
def test_malformed_notes_are_refused(
    key: SigningKey, mangle: Callable[[str], str], complaint: str
) -> None:
    note = key.sign(Checkpoint(ORIGIN, 7, ROOT))
    with pytest.raises(VerificationError, match=complaint):
        key.verifier().open(mangle(note))


def test_a_signed_note_that_is_not_a_checkpoint_is_refused(key: SigningKey) -> None:
    note = key.sign_note("hello\nworld\n")
    assert key.verifier().open_note(note) == "hello\nworld\n"
    with pytest.raises(VerificationError, match="malformed checkpoint"):
        key.verifier().open(note)


def test_oversized_notes_are_refused(key: SigningKey, other_key: SigningKey) -> None:
    checkpoint = Checkpoint(ORIGIN, 7, ROOT)
    note = key.sign(checkpoint)
    line = other_key.sign(checkpoint).split("\n\n")[1]
    assert key.verifier().open(note + line * 99) == checkpoint
    with pytest.raises(VerificationError, match="at most 100"):
        key.verifier().open(note + line * 100)
    huge = Checkpoint(ORIGIN, 7, ROOT, ("x" * (1 << 20),))
    with pytest.raises(VerificationError, match="over 1048576 bytes"):
        key.verifier().open(key.sign(huge))
    # Multi-byte characters count as bytes, not characters.
    wide = Checkpoint(ORIGIN, 7, ROOT, ("é" * 600_000,))
    with pytest.raises(VerificationError, match="over 1048576 bytes"):
        key.verifier().open(key.sign(wide))


def test_verifier_key_strings(key: SigningKey) -> None:
    text = str(key.verifier())
    name, key_id, encoded = text.split("+", 2)
    assert name == ORIGIN and key_id == key.key_id.hex()
    assert base64.b64decode(encoded)[0] == 1
    assert Verifier.from_string(text) == key.verifier()
    assert Verifier.from_string(text).public_key == base64.b64decode(encoded)[1:]


@pytest.mark.parametrize(
    ("vkey", "complaint"),
    [
        ("", "malformed verifier key"),
        ("name-only", "malformed verifier key"),
        ("name+c74f20a+AAAA", "malformed verifier key"),
        ("name+c74f20a3+!!!!", "not base64"),
        ("name+c74f20a3+" + base64.b64encode(b"\x02" + bytes(32)).decode(), "Ed25519"),
        ("name+c74f20a3+" + base64.b64encode(b"\x01" + bytes(31)).decode(), "Ed25519"),
        ("na me+c74f20a3+" + base64.b64encode(b"\x01" + bytes(32)).decode(), "key name"),
    ],
)
def test_malformed_verifier_keys_are_refused(vkey: str, complaint: str) -> None:
    with pytest.raises(InvalidArgument, match=complaint):
        Verifier.from_string(vkey)


def test_a_verifier_key_with_the_wrong_key_id_is_refused() -> None:
    wrong = GO_VERIFIER.replace("c74f20a3", "c74f20a4")
    with pytest.raises(InvalidArgument, match=r"key id c74f20a4.*c74f20a3"):
        Verifier.from_string(wrong)
    with pytest.raises(InvalidArgument, match="corrupt"):
        SigningKey.from_string(GO_SIGNER.replace("c74f20a3", "00000000"))


def test_key_names_follow_the_note_rules() -> None:
    for bad in ("", "a b", "a+b", "a\tb", "a\u00a0b"):
        with pytest.raises(InvalidArgument):
            SigningKey.generate(bad)


def test_save_and_load_a_signing_key(tmp_path: Path) -> None:
    key = SigningKey.generate(ORIGIN)
    path = tmp_path / "ledger.key"
    key.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert text.startswith(f"PRIVATE+KEY+{ORIGIN}+{key.key_id.hex()}+")
    loaded = SigningKey.load(path)
    assert str(loaded) == str(key)
    assert loaded.verifier() == key.verifier()
    assert os.listdir(tmp_path) == ["ledger.key"]


def test_saving_never_replaces_a_key_unless_asked(tmp_path: Path) -> None:
    path = tmp_path / "ledger.key"
    first = SigningKey.generate(ORIGIN)
    first.save(path)
    second = SigningKey.generate(ORIGIN)
    with pytest.raises(FileExistsError):
        second.save(path)
    assert SigningKey.load(path).verifier() == first.verifier()
    assert os.listdir(tmp_path) == ["ledger.key"]
    second.save(path, overwrite=True)
    assert SigningKey.load(path).verifier() == second.verifier()
    assert os.listdir(tmp_path) == ["ledger.key"]


def test_a_corrupt_key_file_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "ledger.key"
    path.write_text("PRIVATE+KEY+x+00000000+AAAA\n")
    with pytest.raises(InvalidArgument, match=str(path)):
        SigningKey.load(path)


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        (bytes(range(256)), "not a key (not UTF-8 text)"),
        (b"PRIVATE+KEY+x+00000000+AAAA\n", "malformed signing key"),
    ],
)
def test_a_garbage_key_file_stops_serve_with_one_line(
    tmp_path: Path, content: bytes, complaint: str
) -> None:
    key = tmp_path / "checkpoint.key"
    key.write_bytes(content)
    env = {"PINVAULT_DATA_DIR": str(tmp_path / "data"), "PINVAULT_LEDGER_KEY_FILE": str(key)}
    run = run_vault("serve", "--listen", "127.0.0.1:0", env=env, timeout=60)
    assert run.returncode == 2, run.describe()
    line = run.error_line()
    assert line.startswith(f"vault: INVALID_ARGUMENT: ledger.key_file: signing key file {key}: ")
    assert complaint in line


def test_the_seed_is_never_printed() -> None:
    key = SigningKey(ORIGIN, bytes(range(32)))
    seed_b64 = base64.b64encode(b"\x01" + bytes(range(32))).decode()
    assert seed_b64 in str(key)
    assert seed_b64 not in repr(key)
