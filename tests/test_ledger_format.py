"""The published ledger format (docs/ledger-format.md, docs/ledger-vectors.json) agrees with the
code: every vector is recomputed from its inputs, and every value appears in the document."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from vault.ledger.checkpoint import Checkpoint, SigningKey, Verifier
from vault.ledger.entry import ZERO_HASH, Entry
from vault.ledger.merkle import (
    CompactRange,
    MerkleTree,
    leaf_hash,
    verify_consistency,
    verify_inclusion,
)

DOCS = Path(__file__).resolve().parent.parent / "docs"
VECTORS: dict[str, Any] = json.loads((DOCS / "ledger-vectors.json").read_text("utf-8"))
MARKDOWN = (DOCS / "ledger-format.md").read_text("utf-8")


def _entries_from_inputs() -> list[Entry]:
    """Entries rebuilt from the vectors' inputs only, chaining `prev` ourselves."""
    entries = []
    prev = ZERO_HASH
    for position, item in enumerate(VECTORS["entries"]):
        assert item["index"] == position
        entry = Entry(
            index=position,
            kind=item["kind"],
            subjects=tuple(item["subjects"]),
            author=item["author"],
            time=item["time"],
            prev=prev,
            meta=item["meta"],
            external=item["external"],
        )
        entries.append(entry)
        prev = leaf_hash(entry.encode())
    return entries


def test_there_are_seven_entries_with_a_non_ascii_value() -> None:
    assert len(VECTORS["entries"]) == 7
    assert any(not item["body"].isascii() for item in VECTORS["entries"])


def test_entry_bodies_chain_and_leaf_hashes() -> None:
    for entry, item in zip(_entries_from_inputs(), VECTORS["entries"], strict=True):
        body = entry.encode()
        assert body == item["body"].encode("utf-8"), entry.index
        assert entry.prev.hex() == item["prev"]
        assert hashlib.sha256(body).hexdigest() == item["body_sha256"]
        assert hashlib.sha256(b"\x00" + body).hexdigest() == item["leaf_hash"]
        assert Entry.decode(body) == entry


def test_roots_at_every_size() -> None:
    hashes = [leaf_hash(e.encode()) for e in _entries_from_inputs()]
    tree = MerkleTree(hashes)
    compact = CompactRange()
    for size, (h, item) in enumerate(zip(hashes, VECTORS["roots"], strict=True), start=1):
        compact.append(h)
        assert item["size"] == size
        assert tree.root(size).hex() == item["root"]
        assert compact.root().hex() == item["root"]


def test_inclusion_proof() -> None:
    vector = VECTORS["inclusion"]
    assert (vector["index"], vector["size"]) == (2, 7)
    tree = MerkleTree(leaf_hash(e.encode()) for e in _entries_from_inputs())
    proof = tree.inclusion_proof(vector["index"], vector["size"])
    assert [h.hex() for h in proof] == vector["proof"]
    assert tree.leaf(vector["index"]).hex() == vector["leaf_hash"]
    assert tree.root(vector["size"]).hex() == vector["root"]
    verify_inclusion(
        bytes.fromhex(vector["leaf_hash"]),
        vector["index"],
        vector["size"],
        [bytes.fromhex(h) for h in vector["proof"]],
        bytes.fromhex(vector["root"]),
    )


def test_consistency_proof() -> None:
    vector = VECTORS["consistency"]
    assert (vector["old_size"], vector["new_size"]) == (3, 7)
    tree = MerkleTree(leaf_hash(e.encode()) for e in _entries_from_inputs())
    proof = tree.consistency_proof(vector["old_size"], vector["new_size"])
    assert [h.hex() for h in proof] == vector["proof"]
    assert tree.root(vector["old_size"]).hex() == vector["old_root"]
    assert tree.root(vector["new_size"]).hex() == vector["new_root"]
    verify_consistency(
        vector["old_size"],
        vector["new_size"],
        bytes.fromhex(vector["old_root"]),
        bytes.fromhex(vector["new_root"]),
        [bytes.fromhex(h) for h in vector["proof"]],
    )


def test_signed_checkpoint() -> None:
    vector = VECTORS["checkpoint"]
    origin = VECTORS["origin"]
    key = SigningKey(origin, bytes.fromhex(vector["seed"]))
    assert str(key) == vector["signing_key"]
    assert str(key.verifier()) == vector["verifier_key"]
    assert key.verifier().public_key.hex() == vector["public_key"]
    assert key.key_id.hex() == vector["key_id"]
    tree = MerkleTree(leaf_hash(e.encode()) for e in _entries_from_inputs())
    checkpoint = Checkpoint(origin, tree.size, tree.root())
    assert checkpoint.size == vector["size"]
    assert base64.b64encode(checkpoint.root).decode() == vector["root_base64"]
    assert checkpoint.body() == vector["body"]
    note = key.sign(checkpoint)
    assert note == vector["note"]
    assert note == f"{vector['body']}\n— {origin} {vector['signature']}\n"
    assert Verifier.from_string(vector["verifier_key"]).open(vector["note"]) == checkpoint


def _strings(value: Any, path: str = "") -> list[tuple[str, str]]:
    if isinstance(value, str):
        return [(path, value)]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [s for n, v in enumerate(value) for s in _strings(v, f"{path}[{n}]")]
    return []


def test_every_vector_value_appears_in_the_document() -> None:
    values = _strings(VECTORS)
    assert len(values) > 60
    for path, value in values:
        if ".meta." in path:
            # Shown JSON-quoted in the document, as a value with a newline must be.
            value = json.dumps(value, ensure_ascii=False)
        assert value in MARKDOWN, f"{path} = {value!r} is not in docs/ledger-format.md"


def test_the_document_and_json_are_what_the_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location("make_vectors", DOCS / "make_vectors.py")
    assert spec is not None and spec.loader is not None
    make_vectors = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_vectors)
    built = make_vectors.build()
    assert built == VECTORS, "run docs/make_vectors.py"
    section = make_vectors.render(built)
    assert section in MARKDOWN, "run docs/make_vectors.py"


@pytest.mark.parametrize(
    "reference",
    ["RFC 9162 §2.1.3.1", "RFC 9162 §2.1.3.2", "RFC 9162 §2.1.4.1", "RFC 9162 §2.1.4.2"],
)
def test_the_document_cites_the_proof_algorithms(reference: str) -> None:
    assert reference in MARKDOWN
