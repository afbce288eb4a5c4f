"""Batch look-ups: every digest's entries, each with the inclusion proof a single look-up would
give, the proofs of one batch computed together (each node read once, each tile let go of read
once); and proofs against a tree that ends inside a tile the tree let go of."""

from __future__ import annotations

import hashlib
import random
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.services.vault_server import VaultServer
from vault.client.results import BlobInfo
from vault.errors import VerificationError
from vault.ledger.checkpoint import Checkpoint, SigningKey
from vault.ledger.db import Database, open_database
from vault.ledger.log import Ledger
from vault.ledger.merkle import (
    INNER,
    STRATUM,
    TILE_LEAVES,
    MerkleTree,
    leaf_hash,
    verify_inclusion,
    verify_multiproof,
)
from vault.ledger.records import PinSpec
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

ORIGIN = "test.example/lookup-batch"
TILES = 5
LEAVES = [leaf_hash(b"entry %d" % n) for n in range(TILES * TILE_LEAVES + 77)]
WHOLE = MerkleTree(LEAVES)


class Tiles:
    """Where a tree reads back the leaves and inner nodes of the tiles it let go of, counting
    each read of a tile's leaves, as a tree reads them from disk."""

    def __init__(self) -> None:
        self.reads: Counter[int] = Counter()

    def lower(self, tile: int) -> Iterable[bytes]:
        self.reads[tile] += 1
        return [WHOLE.nodes(0, tile * TILE_LEAVES, (tile + 1) * TILE_LEAVES)]

    def get(self, tile: int) -> bytes | None:
        span = TILE_LEAVES >> INNER
        return WHOLE.nodes(INNER, tile * span, (tile + 1) * span)

    def suspect(self, tile: int) -> None:
        raise AssertionError(f"tile {tile}'s inner nodes are right, yet were suspected")


def resumed(tiles: Tiles, *, grown: bool = False) -> MerkleTree:
    """The tree of WHOLE's leaves as a server holds it after a restart: the nodes below height 8
    of every full tile let go of; `grown`: then grown by the last leaves, as appends do."""
    held = (TILES - 1 if grown else TILES) * TILE_LEAVES
    stratum = WHOLE.nodes(STRATUM, 0, held >> STRATUM)
    tree = MerkleTree.resume(held, stratum, tiles.lower, tiles)
    tree.extend(LEAVES[held:])
    return tree


def trees() -> dict[str, MerkleTree]:
    return {
        "held whole": MerkleTree(LEAVES),
        "resumed from tiles": resumed(Tiles()),
        "resumed, then grown": resumed(Tiles(), grown=True),
    }


@pytest.mark.parametrize("shape", ["held whole", "resumed from tiles", "resumed, then grown"])
def test_a_batch_of_proofs_is_each_leaf_s_own_proof_in_every_tree_size(shape: str) -> None:
    rng = random.Random(shape)
    for size in (1, 2, 3, 255, 256, 257, 300, 511, 512, 513, 700, 1000, len(LEAVES)):
        tree = trees()[shape]  # nothing cached from another size
        batches = [
            [size - 1],
            list(range(size)),
            list(range(0, size, TILE_LEAVES)),
            rng.sample(range(size), min(size, 40)),
        ]
        for batch in batches:
            proofs = tree.inclusion_proofs(batch, size)
            assert sorted(proofs) == sorted(set(batch))
            for index, proof in proofs.items():
                assert list(proof) == WHOLE.inclusion_proof(index, size), (shape, size, index)
                verify_inclusion(LEAVES[index], index, size, proof, WHOLE.root(size))


@pytest.mark.parametrize("shape", ["held whole", "resumed from tiles", "resumed, then grown"])
def test_a_shared_proof_gives_each_leaf_its_own_proof_in_every_tree_size(shape: str) -> None:
    rng = random.Random(shape)
    for size in (1, 2, 3, 255, 256, 257, 300, 511, 512, 513, 700, 1000, len(LEAVES)):
        tree = trees()[shape]
        for batch in (
            [size - 1],
            list(range(size)),
            list(range(0, size, TILE_LEAVES)),
            rng.sample(range(size), min(size, 40)),
            [0, size - 1, size // 2],
        ):
            nodes = tree.multiproof(batch, size)
            paths = verify_multiproof({i: LEAVES[i] for i in batch}, size, nodes, WHOLE.root(size))
            assert sorted(paths) == sorted(set(batch))
            for index, path in paths.items():
                assert path == WHOLE.inclusion_proof(index, size), (shape, size, index)
            # Each node of the union of the paths once, and none the leaves give.
            union = {(n, h) for path in paths.values() for n, h in enumerate(path)}
            assert len(nodes) <= len(union)
            if len(batch) == size:
                assert nodes == []


def test_a_shared_proof_with_a_node_added_left_out_or_changed_is_refused() -> None:
    tree = MerkleTree(LEAVES[:40])
    rng = random.Random(7)
    for size in range(1, 41):
        root = tree.root(size)
        for batch in ([0], [size - 1], rng.sample(range(size), min(size, 5)), list(range(size))):
            leaves = {i: LEAVES[i] for i in batch}
            nodes = tree.multiproof(batch, size)
            verify_multiproof(leaves, size, nodes, root)
            lies = [
                ([*nodes, LEAVES[0]], "too many|were needed"),
                *[
                    (nodes[:at] + nodes[at + 1 :], "too few|another root|expected")
                    for at in range(len(nodes))
                ],
                *[
                    ([*nodes[:at], _flip(nodes[at]), *nodes[at + 1 :]], "expected")
                    for at in range(len(nodes))
                ],
            ]
            if len(nodes) > 1:
                lies.append((nodes[::-1], "expected"))
            for bad, complaint in lies:
                if bad == nodes:
                    continue
                with pytest.raises(VerificationError, match=complaint):
                    verify_multiproof(leaves, size, bad, root)
            # A leaf changed, or claimed at another index.
            first = batch[0]
            with pytest.raises(VerificationError, match="expected"):
                verify_multiproof({**leaves, first: _flip(leaves[first])}, size, nodes, root)
            if size > len(batch):
                moved = next(i for i in range(size) if i not in leaves)
                elsewhere = {moved if i == first else i: h for i, h in leaves.items()}
                with pytest.raises(VerificationError):
                    verify_multiproof(elsewhere, size, nodes, root)
        with pytest.raises(VerificationError, match=f"no leaf {size} in the tree"):
            verify_multiproof({size: LEAVES[0]}, size, [], root)
        alone = tree.multiproof([0], size)
        if alone:
            with pytest.raises(VerificationError, match=r"node 0 of .* must be 32 bytes"):
                verify_multiproof({0: LEAVES[0]}, size, [b"short", *alone[1:]], root)


def _flip(node: bytes) -> bytes:
    return bytes([node[0] ^ 1]) + node[1:]


def test_a_batch_reads_each_tile_it_needs_once() -> None:
    tiles = Tiles()
    tree = resumed(tiles)
    # Every leaf of tile 1, one leaf of tile 3: tile 3 from its inner nodes and 16 of its
    # leaves, tile 1 hashed once for all its proofs.
    batch = [*range(TILE_LEAVES, 2 * TILE_LEAVES), 3 * TILE_LEAVES + 5]
    proofs = tree.inclusion_proofs(batch, tree.size)
    assert len(proofs) == len(batch)
    assert tiles.reads == Counter({1: 1, 3: 1})
    # Their shared proof needs no node of tile 1 below height 8: all are on the paths.
    tiles = Tiles()
    tree = resumed(tiles)
    assert len(tree.multiproof(batch, tree.size)) > 0
    assert tiles.reads == Counter({3: 1})


def test_a_proof_in_a_tree_that_ends_inside_a_tile_let_go_of_is_right() -> None:
    # Tile 1 holds leaves 256 to 511; the tree of 300 leaves ends inside it, so some of a
    # proof's nodes there are ragged edges, not the full tile's nodes.
    for index in (256, 290, 299):
        tree = resumed(Tiles())
        proof = tree.inclusion_proof(index, 300)
        verify_inclusion(LEAVES[index], index, 300, proof, WHOLE.root(300))
        assert proof == WHOLE.inclusion_proof(index, 300)


def test_a_reopened_ledger_proves_an_entry_against_a_checkpoint_signed_before(
    tmp_path: Path,
) -> None:
    """A ledger opened again takes its older nodes from its tiles; a proof against an older
    checkpoint whose tree ends inside one of those tiles verifies against that checkpoint.
    (A server checks its tiles a second after it starts, which reads them whole: this is
    the ledger as it is until then, or once its cache of tiles has moved on.)"""
    key = SigningKey.generate(ORIGIN)

    def opened_ledger() -> tuple[Database, Ledger]:
        db = open_database(f"sqlite:///{tmp_path / 'vault.db'}")
        ledger = Ledger(
            db,
            key,
            origin=ORIGIN,
            checkpoint_interval=3600,
            tiles=tmp_path / "tiles",
            tiles_check_interval=None,
        )
        return db, ledger

    db, ledger = opened_ledger()
    ledger.append([_external(n) for n in range(300)])
    # 300 pins and the `index` entry their commit appends (vault.ledger.subject_map_store).
    kept = ledger.checkpoint(301).checkpoint
    assert kept.size == 301
    ledger.append([_external(n) for n in range(300, 904)])
    ledger.checkpoint(906)
    ledger.write_tiles()
    ledger.close()
    db.dispose()
    db, ledger = opened_ledger()
    try:
        assert ledger.fault is None
        # 290 first: the proof of an entry before tile 1 reads tile 1 whole (for the tree's
        # ragged edge), which the tree then keeps.
        for index in (290, 256, 300, 3):
            body = ledger.entry(index).body
            verify_inclusion(
                leaf_hash(body), index, 301, ledger.inclusion_proof(index, 301), kept.root
            )
        for index, proof in ledger.inclusion_proofs(range(250, 301), 301).items():
            verify_inclusion(leaf_hash(ledger.entry(index).body), index, 301, proof, kept.root)
    finally:
        ledger.close()
        db.dispose()


def _external(n: int) -> PinSpec:
    return PinSpec.checked(
        kind="artefact", subjects=(f"sha256:{n:064x}",), author="tester@lab", external=True
    )


def test_bad_batches_of_proofs_are_refused() -> None:
    tree = MerkleTree(LEAVES[:10])
    assert tree.inclusion_proofs([], 10) == {}
    with pytest.raises(ValueError, match="no leaf 10 in a tree of size 10"):
        tree.inclusion_proofs([3, 10], 10)
    with pytest.raises(ValueError, match="no leaf -1 in a tree of size 10"):
        tree.inclusion_proofs([-1, 3], 10)
    with pytest.raises(ValueError, match="no tree of size 11"):
        tree.inclusion_proofs([3], 11)


# -- over gRPC, from a restarted server ---------------------------------------------------------


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def pin(*subjects: str) -> pb.PinRequest:
    return pb.PinRequest(kind="artefact", subjects=subjects, external=True, author="tester@lab")


BOTH, FIRST, SECOND, SHARED = (sha256(b"%d" % n) for n in range(4))
ABSENT = sha256(b"never pinned")
KEPT = [sha256(b"kept %d" % n) for n in range(300)]
MORE = [sha256(b"more %d" % n) for n in range(600)]


@dataclass(frozen=True)
class Restarted:
    server: VaultServer
    # A checkpoint of the first 301 entries, as a client kept it from before the restart.
    kept: Checkpoint
    bodies: dict[int, bytes]
    blob: BlobInfo


def opened(server: VaultServer, note: str) -> Checkpoint:
    return server.signing_key().verifier().open(note)


def published(server: VaultServer, size: int) -> None:
    """Wait until the tiles of `size` entries and their inner nodes are on disk."""
    checkpoint = server.data_dir / "tiles" / "checkpoint"
    inner = server.data_dir / "tile-nodes"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (
            checkpoint.exists()
            and checkpoint.read_text().split("\n")[1] == str(size)
            and inner.exists()
            and inner.stat().st_size >= (size // TILE_LEAVES) * (TILE_LEAVES >> INNER) * 32
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"the tiles of {size} entries were not published in 30 s")


@pytest.fixture(scope="module")
def restarted(
    clean_environment: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Restarted]:
    """A server of 906 entries restarted once their tiles are on disk: it then holds the
    nodes below height 8 of entries 0 to 767 only in its tiles."""
    with VaultServer(tmp_path_factory.mktemp("vault")) as server:
        with server.client() as client:
            blob = client.put(b"a blob looked up by its blake3 alias").blob
        with grpc.insecure_channel(server.address) as channel:
            ledger = rpc.LedgerStub(channel)
            ledger.PinBatch(pb.PinBatchRequest(pins=[pin(d) for d in KEPT]))
            kept = opened(server, ledger.GetCheckpoint(pb.GetCheckpointRequest()).note)
            pins = [pin(d) for d in MORE[:300]]
            pins += [pin(FIRST, SECOND), pin(SHARED), pin(SHARED, BOTH), pin(str(blob.sha256))]
            pins += [pin(d) for d in MORE[300:]]
            ledger.PinBatch(pb.PinBatchRequest(pins=pins))
            bodies = {
                e.index: e.body for e in ledger.Log(pb.LogRequest(start=0, limit=1000)).entries
            }
        # Each batch's commit also appended an `index` entry, after its pins: at 300 and 905.
        assert kept.size == 301 and len(bodies) == 906
        assert [i for i, body in bodies.items() if b'"kind":"index"' in body] == [300, 905]
        published(server, 906)
        server.restart()
        yield Restarted(server, kept, bodies, blob)


def test_a_batch_look_up_answers_what_single_look_ups_answer(restarted: Restarted) -> None:
    server = restarted.server
    asked = [FIRST, SHARED, ABSENT, SECOND, str(restarted.blob.blake3), BOTH, FIRST]
    asked += KEPT[::7] + MORE[::7]
    known = 5
    with grpc.insecure_channel(server.address) as channel:
        ledger = rpc.LedgerStub(channel)
        batch = ledger.LookupBatch(pb.LookupBatchRequest(digests=asked, known_size=known))
        size = opened(server, batch.checkpoint.note).size
        assert [r.digest for r in batch.results] == asked
        for digest, result in zip(asked, batch.results, strict=True):
            if digest == ABSENT:
                assert not result.entries
                continue
            single = ledger.Lookup(pb.LookupRequest(digest=digest, known_size=known))
            assert opened(server, single.checkpoint.note).size == size
            assert [(e.entry.index, e.entry.body) for e in result.entries] == [
                (e.entry.index, e.entry.body) for e in single.entries
            ]
            # The entries carry no proofs of their own: the answer's shared proof proves them.
            assert [list(proven.inclusion) for proven in result.entries] == [
                [] for _ in result.entries
            ]
        leaves = {
            p.entry.index: leaf_hash(p.entry.body)
            for p in [*batch.map.entries, *(p for r in batch.results for p in r.entries)]
        }
        checkpoint = opened(server, batch.checkpoint.note)
        paths = verify_multiproof(leaves, size, batch.inclusion, checkpoint.root)
        for index, path in paths.items():
            proof = ledger.GetInclusionProof(pb.InclusionProofRequest(index=index, size=size))
            assert path == list(proof.hashes)
        assert len(batch.inclusion) < sum(map(len, paths.values())) / 2
        consistency = ledger.GetConsistencyProof(
            pb.ConsistencyProofRequest(old_size=known, new_size=size)
        )
    assert [len(batch.results[n].entries) for n in range(7)] == [1, 2, 0, 1, 1, 1, 1]
    # One entry names both FIRST and SECOND.
    assert batch.results[0].entries[0].entry.index == batch.results[3].entries[0].entry.index
    assert batch.consistency == pb.ConsistencyProof(
        old_size=known, new_size=size, hashes=consistency.hashes
    )
    # The client checks each proof against the checkpoint it verified. The server reads the
    # entries of a few hundred digests a statement: FIRST and SECOND, which one entry names,
    # are in two of them.
    with server.client() as client:
        found = client.lookup_many([FIRST, *KEPT, *MORE, SECOND, SHARED, BOTH])
    assert [p.entry.index for d in KEPT + MORE for p in found[d]] == [
        *range(300),
        *range(301, 601),
        *range(605, 905),
    ]
    assert {d: [p.entry.index for p in found[d]] for d in (FIRST, SECOND, SHARED, BOTH)} == {
        FIRST: [601],
        SECOND: [601],
        SHARED: [602, 603],
        BOTH: [603],
    }


def test_proofs_against_a_checkpoint_kept_from_before_the_restart_verify(
    restarted: Restarted,
) -> None:
    # Entries 256 to 511 are one tile the server let go of; the tree of 301 ends inside it.
    kept = restarted.kept
    with grpc.insecure_channel(restarted.server.address) as channel:
        ledger = rpc.LedgerStub(channel)
        for index in (290, 256, 300, 255, 3):
            proof = ledger.GetInclusionProof(pb.InclusionProofRequest(index=index, size=301))
            body = restarted.bodies[index]
            verify_inclusion(leaf_hash(body), index, kept.size, proof.hashes, kept.root)


def test_a_malformed_digest_in_a_batch_is_named(restarted: Restarted) -> None:
    with grpc.insecure_channel(restarted.server.address) as channel:
        ledger = rpc.LedgerStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            ledger.LookupBatch(pb.LookupBatchRequest(digests=[*KEPT[:3], "sha256:XYZ"]))
        error: Any = caught.value
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'sha256:XYZ'" in error.details() and "\n" not in error.details()
        # A batch of sha256 digests is checked as a whole, one a line: digests that hold line
        # breaks or capitals are refused all the same, whatever the lines they make together.
        for bad in (
            [KEPT[0] + "\n" + KEPT[1], KEPT[2]],
            [KEPT[0] + "\n" + KEPT[1], ""],
            [KEPT[0], KEPT[1].upper()],
            [KEPT[0], KEPT[1] + "\n"],
        ):
            with pytest.raises(grpc.RpcError) as caught:
                ledger.LookupBatch(pb.LookupBatchRequest(digests=bad))
            error = caught.value
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
            assert "\n" not in error.details(), error.details()
        # The same digest twice is answered twice.
        twice = ledger.LookupBatch(pb.LookupBatchRequest(digests=[KEPT[5], KEPT[5], ABSENT]))
        assert [[e.entry.index for e in r.entries] for r in twice.results] == [[5], [5], []]
