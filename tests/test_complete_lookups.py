"""Look-ups that prove nothing was left out (docs/ledger-format.md, "Index entries"): a hostile
server or network in front of an honest client (tests/services/tampering_proxy.py) that leaves
an entry out of a look-up, or answers that a pinned digest was never pinned, is refused by the
`vault` command and by the Python client; an honest "never pinned" is a proven answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.conftest import StartVault
from tests.services.tampering_proxy import Abort, TamperingProxy
from tests.services.vault_server import VaultRun, VaultServer
from vault.client import VaultClient
from vault.errors import FailedPrecondition, NotFound, VerificationError
from vault.ledger.checkpoint import SigningKey
from vault.ledger.db import open_database
from vault.ledger.entry import INDEX, Entry
from vault.ledger.log import Ledger
from vault.ledger.records import PinSpec, StoredEntry
from vault.ledger.subject_map import MAP_FORMAT
from vault.ledger.subject_map_store import INDEX_EVERY
from vault.store.manifest import build_manifest, encode_manifest
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

NEVER_PINNED = "sha256:" + "5" * 64


@pytest.fixture
def proxy(vault_server: VaultServer) -> Iterator[TamperingProxy]:
    with TamperingProxy(vault_server.address) as hostile:
        yield hostile


def through(proxy: TamperingProxy, server: VaultServer, *args: str, state: Path) -> VaultRun:
    return server.run(*args, env={"PINVAULT_CLIENT_SERVER": proxy.address}, state_home=state)


def _refused(run: VaultRun, *words: str) -> None:
    error = json.loads(run.stderr)["error"]
    assert (run.returncode, error["kind"]) == (65, "integrity"), run.describe()
    assert all(w in error["message"] for w in words), error["message"]
    assert run.output == b""


def _fill(server: VaultServer) -> None:
    """Pin INDEX_EVERY digests nobody looks up: the commit that takes them brings the subject
    map up to the head and appends an `index` entry covering every entry before it."""
    with grpc.insecure_channel(server.address) as channel:
        rpc.LedgerStub(channel).PinBatch(
            pb.PinBatchRequest(
                pins=[
                    pb.PinRequest(
                        kind="config", subjects=[f"sha256:{n:064x}"], external=True, author="t"
                    )
                    for n in range(INDEX_EVERY)
                ]
            )
        )


def _pinned_twice(server: VaultServer, data: bytes) -> tuple[str, list[int]]:
    """A blob pinned once before an `index` entry covers it, and once after: a look-up's
    answer then holds one entry the map proves and one from the entries after it."""
    with server.client() as client:
        digest = str(client.put(data).blob.sha256)
        first = client.pin("dataset", digest, meta={"n": "1"})
        _fill(server)
        second = client.pin("dataset", digest, meta={"n": "2"})
        covers = [int(e.meta["covers"]) for e in client.log(kind=INDEX)]
    assert first.entry.index < max(covers) <= second.entry.index, covers
    return digest, [first.entry.index, second.entry.index]


def _without(index: int, address: str) -> Any:
    def rule(request: Any, answer: pb.LookupResponse) -> pb.LookupResponse:
        kept = [p for p in answer.entries if p.entry.index != index]
        del answer.entries[:]
        answer.entries.extend(kept)
        # A server that knows its tree proves what it kept, and only that.
        return _reproven(answer, address)

    return rule


def test_an_entry_left_out_of_a_lookup_is_refused_whether_the_map_or_the_tail_names_it(
    vault_server: VaultServer, proxy: TamperingProxy, tmp_path: Path
) -> None:
    digest, (covered, recent) = _pinned_twice(vault_server, b"pinned before and after an index")
    for left_out, words in ((covered, "signed subject map"), (recent, "after the subject map")):
        proxy.tamper("Ledger/Lookup", _without(left_out, vault_server.address))
        run = through(proxy, vault_server, "lookup", digest, "--json", state=tmp_path / "s")
        _refused(run, digest, "not complete", words)
        with (
            VaultClient(proxy.address) as client,
            pytest.raises(VerificationError, match="not complete"),
        ):
            client.lookup(digest)
    proxy.clear("Ledger/Lookup")
    with VaultClient(proxy.address) as client:
        assert [p.entry.index for p in client.lookup(digest)] == [covered, recent]


def test_a_pinned_digest_said_never_pinned_is_refused(
    vault_server: VaultServer, proxy: TamperingProxy, tmp_path: Path
) -> None:
    digest, _ = _pinned_twice(vault_server, b"pinned, then denied")
    upstream = grpc.insecure_channel(vault_server.address)
    ledger = rpc.LedgerStub(upstream)

    def everything_left_out(request: Any, answer: pb.LookupResponse) -> pb.LookupResponse:
        del answer.entries[:]
        return _reproven(answer, vault_server.address)

    def another_digests_absence(request: Any, answer: pb.LookupResponse) -> pb.LookupResponse:
        # A true proof that some other digest was never pinned, in the answer's place.
        absent = ledger.Lookup(pb.LookupRequest(digest=NEVER_PINNED, known_size=request.known_size))
        del answer.entries[:]
        answer.proof.CopyFrom(absent.proof)
        return _reproven(answer, vault_server.address)

    def not_found(request: Any, answer: pb.LookupResponse) -> Abort:
        # What a vault said of a digest never pinned before look-ups were proven complete.
        return Abort(grpc.StatusCode.NOT_FOUND, f"no entry pins {request.digest}")

    def no_index_entry(request: Any, answer: pb.LookupResponse) -> pb.LookupResponse:
        del answer.entries[:]
        del answer.map.entries[:]
        answer.ClearField("proof")
        return _reproven(answer, vault_server.address)

    cases = (
        (everything_left_out, ("not complete", "answer gives 0")),
        (another_digests_absence, ("subject map",)),
        (not_found, ("not pinned without proving it",)),
        (no_index_entry, ("no index entry",)),
    )
    try:
        for rule, words in cases:
            proxy.tamper("Ledger/Lookup", rule)
            run = through(proxy, vault_server, "lookup", digest, "--json", state=tmp_path / "s")
            _refused(run, digest if rule is not no_index_entry else "", *words)
            with VaultClient(proxy.address) as client, pytest.raises(VerificationError):
                client.lookup(digest)
    finally:
        upstream.close()


def test_a_digest_never_pinned_is_a_proven_answer(
    vault_server: VaultServer, proxy: TamperingProxy, tmp_path: Path
) -> None:
    _pinned_twice(vault_server, b"something pinned, so that the ledger is not empty")
    run = through(proxy, vault_server, "lookup", NEVER_PINNED, state=tmp_path / "s")
    assert run.returncode != 0 and "no entry pins" in run.stderr and "proven" in run.stderr
    with VaultClient(proxy.address) as client:
        with pytest.raises(NotFound, match="proven"):
            client.lookup(NEVER_PINNED)
        assert client.lookup_many([NEVER_PINNED]) == {NEVER_PINNED: []}


def test_a_batch_lookup_with_an_entry_left_out_or_its_tail_cut_is_refused(
    vault_server: VaultServer, proxy: TamperingProxy
) -> None:
    digest, (covered, recent) = _pinned_twice(vault_server, b"looked up in a batch")

    def left_out(request: Any, answer: pb.LookupBatchResponse) -> pb.LookupBatchResponse:
        for result in answer.results:
            kept = [p for p in result.entries if p.entry.index != covered]
            del result.entries[:]
            result.entries.extend(kept)
        # A server that knows its tree proves what it kept, and only that.
        return _reproven(answer, vault_server.address)

    def tail_cut(request: Any, answer: pb.LookupBatchResponse) -> pb.LookupBatchResponse:
        del answer.map.entries[-1]
        return answer

    def node_changed(request: Any, answer: pb.LookupBatchResponse) -> pb.LookupBatchResponse:
        # One node of the tree of bucket roots that the digests' proofs share.
        answer.map.top[len(answer.map.top) // 2] = bytes(32)
        return answer

    def node_left_out(request: Any, answer: pb.LookupBatchResponse) -> pb.LookupBatchResponse:
        del answer.map.top[-1]
        return answer

    def proofs_swapped(request: Any, answer: pb.LookupBatchResponse) -> pb.LookupBatchResponse:
        first, second = (pb.SubjectMapProof(), pb.SubjectMapProof())
        first.CopyFrom(answer.results[0].proof)
        second.CopyFrom(answer.results[1].proof)
        answer.results[0].proof.CopyFrom(second)
        answer.results[1].proof.CopyFrom(first)
        return answer

    def inclusion_changed(request: Any, answer: pb.LookupBatchResponse) -> pb.LookupBatchResponse:
        answer.inclusion[len(answer.inclusion) // 2] = bytes(32)
        return answer

    def inclusion_cut(request: Any, answer: pb.LookupBatchResponse) -> pb.LookupBatchResponse:
        del answer.inclusion[-1]
        return answer

    def inclusion_padded(request: Any, answer: pb.LookupBatchResponse) -> pb.LookupBatchResponse:
        answer.inclusion.append(answer.inclusion[0])
        return answer

    def two_bodies(request: Any, answer: pb.LookupBatchResponse) -> pb.LookupBatchResponse:
        # The entry the tail gives, given again in the result with another body.
        (named,) = [p for p in answer.results[0].entries if p.entry.index == recent]
        named.entry.body = named.entry.body.replace(b'"author":"', b'"author":"x')
        return answer

    for rule, words in (
        (left_out, "not complete"),
        (tail_cut, "stop at"),
        (node_changed, "leads to root"),
        (node_left_out, "too few nodes"),
        (proofs_swapped, "subject map's proof for"),
        (inclusion_changed, r"shared inclusion proof of 3 entries .* leads to root"),
        (inclusion_cut, r"shared inclusion proof of 3 entries .* too few"),
        (inclusion_padded, r"shared inclusion proof of 3 entries .* were needed"),
        (two_bodies, f"gives entry {recent} with two different bodies"),
    ):
        proxy.tamper("Ledger/LookupBatch", rule)
        with (
            VaultClient(proxy.address) as client,
            pytest.raises(VerificationError, match=words),
        ):
            client.lookup_many([digest, NEVER_PINNED])
    proxy.clear("Ledger/LookupBatch")
    with VaultClient(proxy.address) as client:
        found = client.lookup_many([digest, NEVER_PINNED])
    assert [p.entry.index for p in found[digest]] == [covered, recent]
    assert found[NEVER_PINNED] == []


def _reproven(answer: Any, address: str) -> Any:
    """A look-up's `answer` (single or batch) with its shared inclusion proof made anew for the
    entries it now holds, from their inclusion proofs (`MerkleTree.multiproof`'s nodes: at
    each height, left to right, the siblings of the paths' nodes that are not on a path and
    not missing)."""
    size = int(answer.checkpoint.note.split("\n")[1])
    indexes = {p.entry.index for p in answer.map.entries}
    if isinstance(answer, pb.LookupBatchResponse):
        indexes |= {p.entry.index for r in answer.results for p in r.entries}
    else:
        indexes |= {p.entry.index for p in answer.entries}
    with grpc.insecure_channel(address) as channel:
        ledger = rpc.LedgerStub(channel)
        paths = {
            i: list(ledger.GetInclusionProof(pb.InclusionProofRequest(index=i, size=size)).hashes)
            for i in indexes
        }
    nodes: list[bytes] = []
    on_path = set(paths)
    for level in range((size - 1).bit_length()):
        last = (size - 1) >> level
        for sibling in sorted({n ^ 1 for n in on_path if n ^ 1 <= last} - on_path):
            leaf = next(i for i in paths if (i >> level) ^ 1 == sibling)
            # Its path skips the levels where its node had no sibling.
            at = sum(1 for lv in range(level) if (leaf >> lv) ^ 1 <= (size - 1) >> lv)
            nodes.append(paths[leaf][at])
        on_path = {n >> 1 for n in on_path}
    del answer.inclusion[:]
    answer.inclusion.extend(nodes)
    return answer


def test_index_entries_are_the_vaults_own_and_cover_the_ledger(vault_server: VaultServer) -> None:
    _pinned_twice(vault_server, b"seen in the log")
    with vault_server.client() as client:
        entries = list(client.log(kind=INDEX))
        assert entries
        for entry in entries:
            assert isinstance(entry, Entry) and entry.subjects == ()
            assert int(entry.meta["covers"]) <= entry.index
        with pytest.raises(Exception, match="written only by the ledger's writer"):
            client.pin(INDEX, NEVER_PINNED, meta={"covers": "0"})


def test_the_schedulers_is_it_pinned_is_a_proven_yes_or_a_proven_no(
    vault_server: VaultServer, proxy: TamperingProxy
) -> None:
    """A job's admission is checked against complete look-ups of its inputs: an admission is a
    proven yes, a refusal for an input not pinned a proven no, and one a hostile server makes
    up is refused naming the entry that pins the input."""
    with vault_server.client() as client:
        image = str(client.put(b"an image, pinned").blob.sha256)
        dataset = str(client.put(encode_manifest(build_manifest([]))).blob.sha256)
        unpinned = str(client.put(b"an image nobody pinned").blob.sha256)
        image_pin = client.pin("image", image)
        client.pin("dataset", dataset)
    with VaultClient(proxy.address) as client:
        admitted = client.admit(image=image, dataset=dataset, seed=1, team="lab")
        assert admitted.run_id.startswith("sha256:")
        # Checked against a complete look-up before it is raised: the vault's own words.
        with pytest.raises(FailedPrecondition, match=f"image {unpinned} is not pinned as an"):
            client.admit(image=unpinned, dataset=dataset, seed=1, team="lab")

    def made_up(request: pb.AdmitRequest, answer: Any) -> Abort:
        return Abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"image {request.image} is not pinned as an image: pin it first",
        )

    proxy.tamper("Admission/Admit", made_up)
    with (
        VaultClient(proxy.address) as client,
        pytest.raises(VerificationError, match=f"but entry {image_pin.entry.index} pins it"),
    ):
        client.admit(image=image, dataset=dataset, seed=2, team="lab")


def _append_index_entry(server: VaultServer, origin: str, beyond: int, root: str) -> StoredEntry:
    """An `index` entry appended and signed by hand in the stopped server's ledger (as a server
    with the database and the key could), covering every entry before it and `beyond` more,
    with the map root `root`."""
    db = open_database(f"sqlite:///{server.db_path}")
    ledger = Ledger(
        db,
        SigningKey.load(server.data_dir / "checkpoint.key"),
        origin=origin,
        checkpoint_interval=3600,
    )
    try:
        meta = {"covers": str(ledger.size + beyond), "map": MAP_FORMAT, "map-root": root}
        (entry,) = ledger.append([PinSpec(INDEX, (), "vault-index", meta, False)])
        ledger.checkpoint(entry.index + 1)
        return entry
    finally:
        ledger.close()
        db.dispose()


def test_vault_verify_names_an_index_entry_whose_root_is_not_the_ledgers_map(
    start_vault: StartVault, tmp_path: Path
) -> None:
    """An `index` entry appended with a false root (as a server with the database and the key
    could) is in a signed, chained ledger; `vault verify` rebuilds the map and names it."""
    env = {"PINVAULT_LEDGER_ORIGIN": "complete.test/ledger"}
    server = start_vault(env=env)
    _pinned_twice(server, b"audited")
    assert server.run("verify").ok()
    assert server.stop() == 0
    forged = _append_index_entry(server, env["PINVAULT_LEDGER_ORIGIN"], 0, "ab" * 32)
    again = start_vault("again", data_dir=server.data_dir, env=env)
    # The map is rebuilt when asked, in one process and in chunks.
    for workers in ("1", "2"):
        run = again.run("verify", "--subject-map", "--workers", workers, "--chunk", "64")
        assert run.returncode == 65, run.describe()
        assert f"first break at index {forged.index}" in run.stdout, run.describe()
        assert "commits to subject map root abab" in run.stdout, run.describe()
    # Without it, the ledger's own checks pass: the entry is well formed and covers its past.
    assert again.run("verify").returncode == 0
    # One that covers more entries than come before it is named either way.
    assert again.stop() == 0
    ahead = _append_index_entry(server, env["PINVAULT_LEDGER_ORIGIN"], 5, "cd" * 32)
    run = start_vault("third", data_dir=server.data_dir, env=env).run("verify")
    assert run.returncode == 65, run.describe()
    assert f"index {ahead.index}: index entry {ahead.index} covers" in run.stdout, run.describe()


def test_before_the_first_index_entry_a_lookup_carries_the_whole_ledger_and_is_checked_whole(
    start_vault: StartVault, tmp_path: Path
) -> None:
    server = start_vault()
    with server.client() as client:
        digest = str(client.put(b"in a young ledger").blob.sha256)
        pins = [client.pin("dataset", digest, meta={"n": str(n)}).entry.index for n in range(2)]
        assert list(client.log(kind=INDEX)) == []
        assert [p.entry.index for p in client.lookup(digest)] == pins
        with pytest.raises(NotFound, match="proven"):
            client.lookup(NEVER_PINNED)

    def first_left_out(request: Any, answer: pb.LookupResponse) -> pb.LookupResponse:
        kept = list(answer.entries)[1:]
        del answer.entries[:]
        answer.entries.extend(kept)
        return answer

    def ledger_start_cut(request: Any, answer: pb.LookupResponse) -> pb.LookupResponse:
        del answer.map.entries[0]
        return answer

    with TamperingProxy(server.address) as proxy:
        for rule, words in ((first_left_out, "not complete"), (ledger_start_cut, "no index")):
            proxy.tamper("Ledger/Lookup", rule)
            run = through(proxy, server, "lookup", digest, "--json", state=tmp_path / "s")
            _refused(run, "complete", words)
