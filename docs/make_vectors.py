"""Writes the ledger-format test vectors: docs/ledger-vectors.json and the vectors section of
docs/ledger-format.md. Run from the repository root: `.venv/bin/python docs/make_vectors.py`."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

from vault.digest import blake3_of, sha256_of
from vault.ledger.checkpoint import Checkpoint, SigningKey
from vault.ledger.entry import (
    ZERO_HASH,
    Entry,
    check_author,
    check_kind,
    check_subjects,
)
from vault.ledger.merkle import MerkleTree, leaf_hash

DOCS = Path(__file__).resolve().parent
JSON_PATH = DOCS / "ledger-vectors.json"
MARKDOWN_PATH = DOCS / "ledger-format.md"
BEGIN = "<!-- vectors:begin (written by docs/make_vectors.py; do not edit by hand) -->"
END = "<!-- vectors:end -->"

ORIGIN = "pinvault.example/vectors"
SEED = hashlib.sha256(b"pinvault ledger-format test vector key").digest()

IMAGE = str(sha256_of(b"example image manifest"))
DATASET = str(sha256_of(b"example dataset manifest"))
CONFIG = str(sha256_of(b"example config"))
MODEL = str(sha256_of(b"example model weights"))

# (kind, subjects, meta, external, author, time)
LEDGER: list[tuple[str, list[str], dict[str, str], bool, str, str]] = [
    (
        "image",
        [IMAGE],
        {"ref": "registry.lab.example/train:2025.03"},
        True,
        "ci@lab.example",
        "2025-03-03T09:00:00.000000Z",
    ),
    (
        "dataset",
        [DATASET],
        {"name": "imagenet-subset", "rows": "120000"},
        False,
        "data-team",
        "2025-03-03T09:05:12.250000Z",
    ),
    (
        "config",
        [CONFIG],
        {"path": "configs/resnet.yaml", "comment": 'line one\nline two "quoted"'},
        False,
        "alice",
        "2025-03-03T10:00:00.000001Z",
    ),
    (
        "run",
        [IMAGE, DATASET, CONFIG],
        {"run-id": "r-0001", "seed": "1234"},
        False,
        "scheduler",
        "2025-03-03T10:00:01.000000Z",
    ),
    (
        "artefact",
        [MODEL],
        {"note": "Modèle entraîné à Zürich — 日本語 ✓"},
        False,
        "zoë@lab.example",
        "2025-03-04T18:30:00.500000Z",
    ),
    (
        "checkpoint",
        [str(sha256_of(b"example checkpoint step 5000"))],
        {"run-id": "r-0001", "step": "5000"},
        False,
        "scheduler",
        "2025-03-04T18:31:00.000000Z",
    ),
    (
        "run",
        [str(blake3_of(b"example run manifest r-0002"))],
        {"replicates": "r-0001", "run-id": "r-0002"},
        False,
        "bob",
        "2025-03-05T08:00:00.000000Z",
    ),
]
INCLUSION = (2, 7)
CONSISTENCY = (3, 7)


def build() -> dict[str, Any]:
    entries: list[dict[str, Any]] = []
    hashes: list[bytes] = []
    prev = ZERO_HASH
    for index, (kind, subjects, meta, external, author, time) in enumerate(LEDGER):
        entry = Entry(
            index=index,
            kind=check_kind(kind),
            subjects=check_subjects(subjects),
            author=check_author(author),
            time=time,
            prev=prev,
            # Entry 2's newline is what pinvault 0.1 appended and verifiers must still accept;
            # appends refuse it now (check_meta), so the vectors keep only its ordering.
            meta=dict(sorted(meta.items())),
            external=external,
        )
        body = entry.encode()
        prev = leaf_hash(body)
        hashes.append(prev)
        entries.append(
            {
                "index": index,
                "kind": kind,
                "subjects": list(entry.subjects),
                "meta": dict(entry.meta),
                "external": external,
                "author": author,
                "time": time,
                "prev": entry.prev.hex(),
                "body": body.decode("utf-8"),
                "body_sha256": hashlib.sha256(body).hexdigest(),
                "leaf_hash": prev.hex(),
            }
        )
    tree = MerkleTree(hashes)
    index, size = INCLUSION
    old, new = CONSISTENCY
    key = SigningKey(ORIGIN, SEED)
    checkpoint = Checkpoint(ORIGIN, len(hashes), tree.root())
    note = key.sign(checkpoint)
    signature = note.split("\n\n")[1].rstrip("\n").rsplit(" ", 1)[1]
    return {
        "origin": ORIGIN,
        "entries": entries,
        "roots": [{"size": n, "root": tree.root(n).hex()} for n in range(1, len(hashes) + 1)],
        "inclusion": {
            "index": index,
            "size": size,
            "leaf_hash": tree.leaf(index).hex(),
            "root": tree.root(size).hex(),
            "proof": [h.hex() for h in tree.inclusion_proof(index, size)],
        },
        "consistency": {
            "old_size": old,
            "new_size": new,
            "old_root": tree.root(old).hex(),
            "new_root": tree.root(new).hex(),
            "proof": [h.hex() for h in tree.consistency_proof(old, new)],
        },
        "checkpoint": {
            "seed": SEED.hex(),
            "signing_key": str(key),
            "verifier_key": str(key.verifier()),
            "public_key": key.verifier().public_key.hex(),
            "key_id": key.key_id.hex(),
            "size": checkpoint.size,
            "root_base64": base64.b64encode(checkpoint.root).decode("ascii"),
            "body": checkpoint.body(),
            "signature": signature,
            "note": note,
        },
    }


def render(vectors: dict[str, Any]) -> str:
    """The Markdown vectors section: every value of the JSON, verbatim."""
    out: list[str] = [BEGIN, ""]
    out.append(
        f"Origin and key name: `{vectors['origin']}`. Each entry is shown with its inputs, its "
        "canonical body (UTF-8; the line in the block is the whole body, with no trailing "
        "newline), the SHA-256 of the body and its leaf hash."
    )
    for entry in vectors["entries"]:
        out += [
            "",
            f"#### Entry {entry['index']}",
            "",
            f"- kind `{entry['kind']}`, author `{entry['author']}`, time `{entry['time']}`, "
            f"external `{str(entry['external']).lower()}`",
            "- subjects: " + ", ".join(f"`{s}`" for s in entry["subjects"]),
            "- meta: "
            + ", ".join(
                f"`{k}` = `{json.dumps(v, ensure_ascii=False)}`" for k, v in entry["meta"].items()
            ),
            f"- prev: `{entry['prev']}`",
            "",
            "```json",
            entry["body"],
            "```",
            "",
            f"- SHA-256(body): `{entry['body_sha256']}`",
            f"- leaf hash: `{entry['leaf_hash']}`",
        ]
    out += ["", "#### Roots", "", "| size | root |", "|---|---|"]
    out += [f"| {r['size']} | `{r['root']}` |" for r in vectors["roots"]]
    inc = vectors["inclusion"]
    out += [
        "",
        f"#### Inclusion proof: index {inc['index']} in the tree of size {inc['size']}",
        "",
        f"Leaf hash `{inc['leaf_hash']}`, root `{inc['root']}`. Proof, in order:",
        "",
    ]
    out += [f"{n}. `{h}`" for n, h in enumerate(inc["proof"], start=1)]
    con = vectors["consistency"]
    out += [
        "",
        f"#### Consistency proof: size {con['old_size']} to size {con['new_size']}",
        "",
        f"Old root `{con['old_root']}`, new root `{con['new_root']}`. Proof, in order:",
        "",
    ]
    out += [f"{n}. `{h}`" for n, h in enumerate(con["proof"], start=1)]
    cp = vectors["checkpoint"]
    out += [
        "",
        f"#### Signed checkpoint at size {cp['size']}",
        "",
        f"- Ed25519 seed (RFC 8032 private key): `{cp['seed']}`",
        f"- public key: `{cp['public_key']}`",
        f"- key id: `{cp['key_id']}`",
        f"- signing key: `{cp['signing_key']}`",
        f"- verifier key: `{cp['verifier_key']}`",
        f"- root (base64): `{cp['root_base64']}`",
        f"- signature line value, base64(key id || signature): `{cp['signature']}`",
        "",
        "The checkpoint body (the signed note text):",
        "",
        "```text",
        cp["body"] + "```",
        "",
        "The whole signed note:",
        "",
        "```text",
        cp["note"] + "```",
        "",
        END,
    ]
    return "\n".join(out)


def main() -> None:
    vectors = build()
    JSON_PATH.write_text(json.dumps(vectors, indent=2, ensure_ascii=False) + "\n", "utf-8")
    markdown = MARKDOWN_PATH.read_text("utf-8")
    head, begin, rest = markdown.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"{MARKDOWN_PATH} lacks the vectors markers")
    MARKDOWN_PATH.write_text(head + render(vectors) + tail, "utf-8")


if __name__ == "__main__":
    main()
