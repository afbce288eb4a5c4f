"""The Ledger service: pins appended by group commit, look-ups answered with inclusion proofs
against one signed checkpoint, the log, checkpoints and proofs, and the stored entries and
checkpoints an auditor re-derives."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from hashlib import sha256
from typing import Any, Final, TypeVar

from vault.digest import Digest, check_digest, digest_key, is_sha256
from vault.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
    VaultError,
)
from vault.ledger.entry import time_bound
from vault.ledger.log import Ledger
from vault.ledger.merkle import items_root
from vault.ledger.records import LogFilter, PinSpec, SignedCheckpoint, StoredEntry
from vault.ledger.subject_map import KeyProof
from vault.ledger.subject_map_store import INDEX_EVERY
from vault.server.admission import ADMITTED, TEAM, Runs
from vault.server.auth import Identity, caller
from vault.server.content import Content, StoredBlob
from vault.server.edge import Service, streaming, unary, unary_async
from vault.server.witnessing import Witnessing
from vault.store.chunks import CHUNK_SIZE
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

MAX_LOG_PAGE: Final = 1000
MAX_LOOKUP_BATCH: Final = 100_000
# The most entries a look-up's answer carries after what the subject map covers: more means the
# map is catching up (an upgraded ledger's first), and the look-up is asked to retry.
MAX_TAIL: Final = 20_000
_ATTEMPTS: Final = 3
# The metadata key of a pin that records its first subject's chunk root: the RFC 9162 Merkle
# tree hash over the BLAKE3 of each chunk, in lowercase hex (vault.client.ranges reads it).
CHUNK_ROOT: Final = "chunk-root"
_ROOT_TEXT: Final = re.compile(r"[0-9a-f]{64}")


# Well-formed sha256 digests, one a line: a batch of them is checked in one match.
_SHA256_LINES: Final = re.compile(r"(?:sha256:[0-9a-f]{64}\n)*")
_SHA256_LINE: Final = len("sha256:") + 64 + 1


def sha256_keys(digests: Sequence[str]) -> list[bytes] | None:
    """The digest key of each of `digests` (its 32 raw bytes, as `digest_key` gives it) if
    every one is a well-formed sha256 digest, else None: a batch look-up's thousand digests
    checked and decoded in a few calls rather than a few each."""
    text = "\n".join(digests) + "\n"
    # Lines of exactly the length of a digest, as many as there are digests: no digest holds
    # a line break of its own.
    if len(text) != _SHA256_LINE * len(digests) or _SHA256_LINES.fullmatch(text) is None:
        return None
    raw = bytes.fromhex(text.replace("sha256:", ""))  # fromhex skips the line breaks
    return [raw[at : at + 32] for at in range(0, len(raw), 32)]


Named = TypeVar("Named")


@dataclass(frozen=True, slots=True)
class Tail:
    """A look-up's tail: the entries after what the subject map covers, and the nodes of the
    map's tree of bucket roots that prove the answer's buckets."""

    entries: list[StoredEntry]
    nodes: list[bytes]


def _fill_proof(message: pb.SubjectMapProof, proof: KeyProof | None) -> None:
    if proof is None:
        return
    message.bucket_size = proof.bucket_size
    message.position = proof.position
    add = message.records.add
    for position, record, path in proof.records:
        add(position=position, record=record, path=path)


def _add_entries(add: Callable[[], pb.ProvenEntry], entries: Iterable[tuple[int, bytes]]) -> None:
    """Each (index, body) as a ProvenEntry made by `add`, with no proof of its own: the
    answer's shared inclusion proof proves it."""
    for index, body in entries:
        entry = add().entry
        entry.index = index
        entry.body = body


def entry_message(entry: StoredEntry) -> pb.Entry:
    return pb.Entry(index=entry.index, body=entry.body)


def _index(entry: StoredEntry) -> int:
    return entry.index


def _checkpoint(signed: SignedCheckpoint) -> pb.Checkpoint:
    return pb.Checkpoint(note=signed.note)


class LedgerService(Service, rpc.LedgerServicer):
    rpc_service = "Ledger"

    def __init__(
        self, ledger: Ledger, content: Content, witnessing: Witnessing | None = None
    ) -> None:
        self.ledger = ledger
        self.content = content
        # A new checkpoint may wait for the witnesses' answers, never on the event loop.
        self.inline = ledger.db.is_sqlite and witnessing is None
        self.runs = Runs(ledger, content)
        # The checkpoints served: with witnesses, with the cosignatures they gave.
        self.signed = ledger.checkpoint if witnessing is None else witnessing.checkpoint

    def _spec(
        self, request: pb.PinRequest, who: Identity, stored: Mapping[str, StoredBlob]
    ) -> PinSpec:
        spec = PinSpec.checked(
            kind=request.kind,
            subjects=request.subjects,
            author=who.author(request.author),
            meta=dict(request.meta) if request.meta else None,
            external=request.external,
        )
        if spec.kind == "run" and spec.meta.get("stage") == ADMITTED:
            raise PermissionDenied(
                f"a `run` entry with stage={ADMITTED} is an admission record, which only "
                "admission writes (vault admit, vault run, the scheduler): "
                f"{who.name} pinned one"
            )
        subjects: list[str] = []
        runs: list[str] = []
        first: StoredBlob | None = None
        for subject in spec.subjects:
            found = (
                stored.get(subject)
                if subject.startswith("sha256:")
                else self.content.find(Digest.parse(subject))
            )
            if found is None and not spec.external:
                raise FailedPrecondition(
                    f"blob {subject} is not in the store: put it first, or pin it as external "
                    "content kept elsewhere"
                )
            sha256 = subject if found is None else str(found.info.sha256)
            if not subjects:
                first = found
            # A stored blob is pinned by its sha256; external content keeps the name given.
            subjects.append(subject if spec.external else sha256)
            # Only a stored run inputs document's digest can be a run id.
            if found is not None and self.runs.could_be_run(found):
                runs.append(sha256)
        if len(set(subjects)) != len(subjects):
            raise InvalidArgument("the same blob is named twice (by sha256 and blake3)")
        root = spec.meta.get(CHUNK_ROOT)
        if root is not None:
            self._check_chunk_root(spec.subjects[0], None if spec.external else first, root)
        # A pin that names a run (by its run id, or an alias of it) is written for the run's
        # team, which the vault records itself from the caller's credential; anyone else is
        # refused (Runs.writer_team).
        team = self.runs.writer_team(tuple(runs), spec.meta, who) if runs else ""
        if not team and tuple(subjects) == spec.subjects:
            return spec  # a pin of batches' usual kind, as checked: no copy made
        meta = {**spec.meta, TEAM: team} if team else spec.meta
        return PinSpec(spec.kind, tuple(subjects), spec.author, meta, spec.external)

    def _check_chunk_root(self, subject: str, blob: StoredBlob | None, root: str) -> None:
        """Refuse a pin whose `chunk-root` is not the root of its first subject's chunk list:
        once appended, it binds the blob's chunk hashes to its digest for every reader of a
        range (vault.client.ranges), so only the root of the blob as stored may be. One chunk
        list read a pin (a pin records its first subject's root only)."""
        if blob is None:
            raise InvalidArgument(
                f"a {CHUNK_ROOT} names the chunks of a stored blob, and {subject} is "
                "external content"
            )
        if not _ROOT_TEXT.fullmatch(root):
            raise InvalidArgument(
                f"{CHUNK_ROOT} {root[:80]!r} of {blob.info.sha256}: expected 64 lowercase hex "
                "digits"
            )
        try:
            chunks = self.content.store.chunk_list(blob.info.sha256)
        except NotFound:
            raise FailedPrecondition(
                f"blob {blob.info.sha256} is not in the store: put it first"
            ) from None
        found = items_root(chunks.hashes).hex() if chunks.chunk_size == CHUNK_SIZE else None
        if found != root:
            raise InvalidArgument(
                f"{CHUNK_ROOT} {root} is not the chunk root of {blob.info.sha256}, which is "
                f"{found or f'unknown (its chunks are of {chunks.chunk_size} bytes)'}"
            )

    def _specs(self, pins: Sequence[pb.PinRequest]) -> list[PinSpec]:
        who = caller()
        # One query for the whole batch's stored blobs, not one a subject; a malformed subject
        # is left for its pin's own check to name.
        stored = self.content.find_many(
            [subject for pin in pins for subject in pin.subjects if is_sha256(subject)]
        )
        specs = []
        for number, pin in enumerate(pins):
            try:
                specs.append(self._spec(pin, who, stored))
            except VaultError as exc:
                if len(pins) == 1:
                    raise
                raise type(exc)(f"pin {number}: {exc}") from None
        return specs

    async def _append(self, pins: Sequence[pb.PinRequest]) -> list[StoredEntry]:
        specs = await self.call(self._specs, pins)
        # Waits for the group commit without holding a thread.
        return await self.ledger.append_async(specs)

    @unary_async
    async def Pin(self, request: pb.PinRequest) -> pb.PinResponse:
        (entry,) = await self._append([request])
        return pb.PinResponse(entry=entry_message(entry))

    @unary_async
    async def PinBatch(self, request: pb.PinBatchRequest) -> pb.PinBatchResponse:
        response = pb.PinBatchResponse()
        add = response.entries.add
        for e in await self._append(request.pins):
            add(index=e.index, body=e.body)
        return response

    def _lookup_keys(self, text: str) -> list[str]:
        """Pins name stored blobs by sha256; a blake3 alias is resolved through the catalog."""
        digest = check_digest(text)
        if digest.startswith("sha256:"):
            return [digest]
        found = self.content.find(Digest.parse(digest))
        return [digest] if found is None else [digest, str(found.info.sha256)]

    def prove(
        self,
        response: Any,
        groups: Sequence[tuple[Callable[[], pb.ProvenEntry], Sequence[StoredEntry]]],
        known_size: int,
    ) -> None:
        """Fill `response` (a message with `checkpoint` and `consistency`) in place: each
        group's entries, each added by its `add` with an inclusion proof against one signed
        checkpoint that covers them all, and that checkpoint's consistency with `known_size`."""
        indexes = {e.index for _, es in groups for e in es}
        signed = self._covering(max(indexes, default=-1) + 1, known_size)
        proofs = self.ledger.inclusion_proofs(indexes, signed.size)
        for add, entries in groups:
            for e in entries:
                proven = add()
                proven.entry.index = e.index
                proven.entry.body = e.body
                proven.inclusion.extend(proofs[e.index])
        self._seal(response, signed, known_size)

    def _covering(self, needed: int, known_size: int) -> SignedCheckpoint:
        """The signed checkpoint an answer's proofs are against: one that covers the first
        `needed` entries and the tree of `known_size` the client verified, if this vault has
        it."""
        if known_size > self.ledger.size:
            # The client saw a larger tree through another server of this vault (behind a
            # balancer): catch up with the database before proving consistency with it.
            self.ledger.sync()
        signed = self.signed(needed)
        if known_size > signed.size and known_size <= self.ledger.size:
            signed = self.signed(known_size)
        return signed

    def _seal(self, response: Any, signed: SignedCheckpoint, known_size: int) -> None:
        """Put the checkpoint `signed` in `response`, and its consistency with `known_size`."""
        size = signed.size
        response.checkpoint.note = signed.note
        consistency = response.consistency
        consistency.old_size = known_size
        consistency.new_size = size
        if 0 < known_size < size:
            consistency.hashes.extend(self.ledger.consistency_proof(known_size, size))

    def _complete(
        self,
        digests: Sequence[str],
        known_size: int,
        read: Callable[[], tuple[Named, int]],
        raw: list[bytes] | None = None,
    ) -> tuple[SignedCheckpoint, Tail, Sequence[KeyProof | None], Named] | None:
        """What answers a look-up of `digests` completely: the signed checkpoint it is answered
        against, the entries from the first the newest `index` entry does not cover up to that
        checkpoint (the `index` entry among them: its tail) with the nodes that prove the
        digests' buckets in the subject map, each digest's proof in its bucket (none before the
        first `index` entry, when every entry is in the tail), and what `read` gives (the
        entries naming the digests, and the newest index among them, or -1).

        The map is read first, then the entries, then the checkpoint is chosen to cover both
        (and the tree the caller verified); if entries were appended meanwhile, they are read
        again. So every entry naming a digest below the checkpoint is in the map or the tail,
        and in what is read. None if the map must first be brought up to the ledger (an
        upgraded ledger's first look-up): see `_answer`. `raw`: the digests' keys, if the
        caller has them from `sha256_keys`."""
        if raw is None:
            raw = sha256_keys(digests)
        if raw is None:
            raw = [digest_key(check_digest(d)) for d in digests]
        keys = [sha256(k).digest() for k in raw]
        found = self.ledger.subject_map.prove(keys)
        before = self.ledger.size
        named, newest = read()
        proofs: Sequence[KeyProof | None]
        nodes: list[bytes] = []
        if found is None:
            # No `index` entry yet (a ledger of fewer than INDEX_EVERY entries): every entry is
            # in the tail.
            covers, needed, proofs, longest = 0, newest + 1, [None] * len(keys), INDEX_EVERY
        else:
            epoch, covers, proofs, nodes = found
            needed, longest = max(epoch, newest) + 1, MAX_TAIL
        signed = self._covering(needed, known_size)
        if signed.size > before:
            named, _ = read()
        entries = self.ledger.entries_between(covers, signed.size)
        if len(entries) > longest:
            return None
        return signed, Tail(entries, nodes), proofs, named

    async def _answer(self, method: Callable[[Any], Any | None], request: Any) -> Any:
        """A look-up's answer from `method`, once the subject map covers enough of the ledger
        to prove it complete (asking the writer for an `index` entry when it does not)."""
        for _ in range(_ATTEMPTS):
            response = await self.call(method, request)
            if response is not None:
                return response
            await self.ledger.index_tick_async()
        raise Unavailable(
            "the subject map is catching up with the ledger (an upgraded ledger's first): retry"
        )

    @unary_async
    async def Lookup(self, request: pb.LookupRequest) -> pb.LookupResponse:
        response: pb.LookupResponse = await self._answer(self._lookup, request)
        return response

    def _lookup(self, request: pb.LookupRequest) -> pb.LookupResponse | None:
        keys = self._lookup_keys(request.digest)

        def read() -> tuple[list[StoredEntry], int]:
            if len(keys) == 1:
                entries = self.ledger.entries_naming(keys[0])
            else:
                found = self.ledger.entries_for(keys)
                entries = sorted({e.index: e for k in keys for e in found[k]}.values(), key=_index)
            return entries, entries[-1].index if entries else -1

        complete = self._complete(keys[:1], request.known_size, read)
        if complete is None:
            return None
        signed, tail, (proof,), named = complete
        entries = [(e.index, e.body) for e in named if e.index < signed.size]
        response = pb.LookupResponse()
        # The entries proven together, as in a batch: each node once.
        indexes = {index for index, _ in entries}.union(e.index for e in tail.entries)
        response.inclusion.extend(self.ledger.multiproof(indexes, signed.size))
        _add_entries(response.entries.add, entries)
        _add_entries(response.map.entries.add, ((e.index, e.body) for e in tail.entries))
        response.map.top.extend(tail.nodes)
        _fill_proof(response.proof, proof)
        self._seal(response, signed, request.known_size)
        return response

    def _named(
        self, digests: Sequence[str], raw: list[bytes] | None
    ) -> Mapping[str, Sequence[tuple[int, bytes]]]:
        """The index and body of each entry naming each of `digests`, in index order; `raw`:
        their keys from `sha256_keys`, if all are sha256 digests."""
        if raw is not None:  # the usual batch: nothing to check one by one
            by_key = self.ledger.entries_by_key(raw)
            return dict(zip(digests, map(by_key.__getitem__, raw), strict=True))
        # A blake3 alias names the same pins as its sha256 digest, as in Lookup.
        keys = {d: self._lookup_keys(d) for d in digests}
        found = self.ledger.entries_for(k for ks in keys.values() for k in ks)
        return {
            d: [
                (e.index, e.body)
                for e in (
                    found[ks[0]]
                    if len(ks) == 1
                    else sorted({e.index: e for k in ks for e in found[k]}.values(), key=_index)
                )
            ]
            for d, ks in keys.items()
        }

    @unary_async
    async def LookupBatch(self, request: pb.LookupBatchRequest) -> pb.LookupBatchResponse:
        response: pb.LookupBatchResponse = await self._answer(self._lookup_batch, request)
        return response

    def _lookup_batch(self, request: pb.LookupBatchRequest) -> pb.LookupBatchResponse | None:
        if len(request.digests) > MAX_LOOKUP_BATCH:
            raise InvalidArgument(
                f"too many digests: {len(request.digests)} (at most {MAX_LOOKUP_BATCH} a call)"
            )
        digests = list(request.digests)  # each read of the message makes new strings
        raw = sha256_keys(digests)

        def read() -> tuple[Mapping[str, Sequence[tuple[int, bytes]]], int]:
            found = self._named(digests, raw)
            return found, max((es[-1][0] for es in found.values() if es), default=-1)

        complete = self._complete(digests, request.known_size, read, raw)
        if complete is None:
            return None
        signed, tail, map_proofs, named = complete
        size = signed.size
        indexes = {index for entries in named.values() for index, _ in entries if index < size}
        response = pb.LookupBatchResponse()
        # The entries proven together, each node once, however many entries share it.
        response.inclusion.extend(
            self.ledger.multiproof(indexes.union(e.index for e in tail.entries), size)
        )
        # Each message made in place by its container's add: a message made alone and then
        # given to a container is copied.
        add = response.results.add
        for d, map_proof in zip(digests, map_proofs, strict=True):
            result = add(digest=d)
            add_entry = result.entries.add
            for index, body in named[d]:
                if index >= size:
                    break
                entry = add_entry().entry
                entry.index = index
                entry.body = body
            _fill_proof(result.proof, map_proof)
        response.map.top.extend(tail.nodes)
        _add_entries(response.map.entries.add, ((e.index, e.body) for e in tail.entries))
        self._seal(response, signed, request.known_size)
        return response

    @unary
    def Log(self, request: pb.LogRequest) -> pb.LogResponse:
        limit = min(request.limit or 100, MAX_LOG_PAGE)
        where = LogFilter(
            kind=request.kind or None,
            digest=str(Digest.parse(request.digest)) if request.digest else None,
            author=request.author or None,
            since=time_bound(request.since, "since") if request.since else None,
            until=time_bound(request.until, "until") if request.until else None,
        )
        entries = self.ledger.log(request.start, limit + 1, where)
        more = len(entries) > limit
        entries = entries[:limit]
        return pb.LogResponse(
            entries=[entry_message(e) for e in entries], next=entries[-1].index + 1 if more else 0
        )

    @unary
    def GetCheckpoint(self, request: pb.GetCheckpointRequest) -> pb.Checkpoint:
        return _checkpoint(self.signed(self.ledger.sync()))

    @unary
    def GetInclusionProof(self, request: pb.InclusionProofRequest) -> pb.InclusionProof:
        signed = self.signed(max(request.index + 1, request.size))
        size = request.size or signed.size
        return pb.InclusionProof(
            index=request.index,
            size=size,
            leaf_hash=self.ledger.leaf(request.index),
            hashes=self.ledger.inclusion_proof(request.index, size),
            checkpoint=_checkpoint(signed),
        )

    @unary
    def GetConsistencyProof(self, request: pb.ConsistencyProofRequest) -> pb.ConsistencyProof:
        new_size = request.new_size or self.ledger.checkpoint().size
        if max(new_size, request.old_size) > self.ledger.size:
            # A size another server of this vault signed: catch up before proving it.
            self.ledger.sync()
        return pb.ConsistencyProof(
            old_size=request.old_size,
            new_size=new_size,
            hashes=self.ledger.consistency_proof(request.old_size, new_size),
        )

    @unary
    def GetVerifierKey(self, request: pb.VerifierKeyRequest) -> pb.VerifierKey:
        return pb.VerifierKey(key=str(self.ledger.verifier), origin=self.ledger.origin)

    @streaming
    def ReadEntries(
        self, request: pb.ReadEntriesRequest, context: Any
    ) -> Iterator[pb.StoredEntries]:
        end = request.end or None
        if request.columns:
            for head, columns in self.ledger.read_columns(
                request.start, end, from_head=request.from_head
            ):
                yield pb.StoredEntries(
                    head_size=head,
                    columns=pb.StoredColumns(
                        indexes=columns.indexes,
                        bodies=columns.bodies,
                        leaf_hashes=columns.leaf_hashes,
                        kinds=columns.kinds,
                        authors=columns.authors,
                        times=columns.times,
                        external=map(bool, columns.external),
                        subject_counts=columns.subject_counts,
                        subjects=columns.subjects,
                    ),
                )
            return
        for head, batch in self.ledger.read_raw(request.start, end, from_head=request.from_head):
            yield pb.StoredEntries(
                head_size=head,
                entries=[
                    pb.StoredEntry(
                        index=r.index,
                        body=r.body,
                        leaf_hash=r.leaf_hash,
                        kind=r.kind,
                        author=r.author,
                        time=r.time,
                        external=r.external,
                        subjects=r.subjects,
                    )
                    for r in batch
                ],
            )

    @streaming
    def ReadCheckpoints(
        self, request: pb.ReadCheckpointsRequest, context: Any
    ) -> Iterator[pb.StoredCheckpoints]:
        for notes in self.ledger.stored_checkpoints():
            yield pb.StoredCheckpoints(notes=notes)
