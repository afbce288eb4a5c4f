"""VaultClient, the typed Python client of a pinvault server: put, get, stat, find-missing, pin,
look-up with proof, admission, tokens, checkpoints, log and audit. It fails closed: no data and
no entry is returned unless it was verified (bytes against their digest, entries against a
signed, consistent checkpoint)."""

from __future__ import annotations

import getpass
import os
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Final

from vault.client.channel import Credentials, open_channel, rpc_errors, with_default_port
from vault.client.complete import check_complete, check_tail
from vault.client.proofs import (
    check_inclusion,
    check_proven,
    check_proven_together,
    names_any,
    not_about,
)
from vault.client.results import Admission, BlobInfo, ProvenEntry, PutResult, Stat
from vault.client.state import LedgerStates, StateFile, TrustState
from vault.client.trust import DEFAULT_MAX_WITNESS_AGE
from vault.digest import Digest
from vault.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    VaultError,
    VerificationError,
)
from vault.ledger.checkpoint import Checkpoint, Verifier
from vault.ledger.cosignature import Cosignature, WitnessPolicy
from vault.ledger.entry import Entry
from vault.ledger.runid import RunInputs
from vault.wire import pinvault_pb2 as pb
from vault.wire import pinvault_pb2_grpc as rpc

# Transfers, direct transfers and the audit load when first used: a command that only looks
# something up (`vault stat` in a scheduler's prologue) starts without them.
if TYPE_CHECKING:
    from vault.client.ranges import RangeReader, VerifiedChunks
    from vault.client.reader import BlobReader
    from vault.client.transfer import Transfer
    from vault.ledger.audit import AuditReport


def default_author() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


class VaultClient:
    """A connection to one vault server.

    `state` is the file where the last verified checkpoint is kept, or `state_folder` a folder
    keeping one per ledger (so that one ledger reached at two addresses has one trust state);
    with neither, it is kept in memory. `verifier_key` pins the vault's checkpoint key
    (otherwise the key is trusted on first use and kept in the trust state). `witnesses` are
    the cosignature/v1 keys of witnesses (c2sp.org/tlog-witness) of which at least
    `min_witnesses` (default: all) must have cosigned every checkpoint this client believes, so
    that a vault that rolled back or forked its ledger is refused even by a client that never
    saw it before, the newest cosignature no older than `max_witness_age` seconds, so that a
    vault that keeps serving one old checkpoint (hiding every entry since) is refused too.

    One client may be shared by threads; clients in several processes may share a state."""

    def __init__(
        self,
        target: str,
        *,
        state: Path | None = None,
        verifier_key: str | None = None,
        author: str | None = None,
        team: str | None = None,
        timeout: float | None = None,
        credentials: Credentials | None = None,
        witnesses: Sequence[str] = (),
        min_witnesses: int | None = None,
        state_folder: Path | None = None,
        max_witness_age: float = DEFAULT_MAX_WITNESS_AGE,
    ) -> None:
        if state and state_folder:
            raise InvalidArgument("a client keeps its trust state in a file or a folder, not both")
        self.witnesses = _witness_policy(witnesses, min_witnesses)
        target = with_default_port(target)
        self.target = target
        self.channel = open_channel(target, credentials)
        self.store = rpc.StoreStub(self.channel)
        self.ledger = rpc.LedgerStub(self.channel)
        self.admission = rpc.AdmissionStub(self.channel)
        self.tokens = rpc.TokensStub(self.channel)
        self.state: StateFile | LedgerStates | None = (
            StateFile(state) if state else LedgerStates(state_folder) if state_folder else None
        )
        self.author = author or default_author()
        # Empty: the vault takes the credential's team (in local mode, "local").
        self.team = team or ""
        self.timeout = timeout
        self._trust = TrustState(
            self.ledger,
            self.state,
            verifier_key,
            self.witnesses,
            target=target,
            timeout=timeout,
            max_witness_age=max_witness_age,
        )
        # Whether this client has verified a checkpoint of the vault (see `pin`).
        self._vouched = False
        self._transfer_lock = threading.Lock()
        self._transfer_made: Transfer | None = None
        # blake3 digest -> the sha256 digest this client computed from the same bytes.
        self._aliases: dict[Digest, Digest] = {}
        # Digest (both spellings) -> the chunk root this client computed of the bytes it put,
        # for blobs of more than one chunk: what its pins of them record.
        self._put_roots: OrderedDict[str, bytes] = OrderedDict()
        # The chunk lists of blobs read by range lately, verified against their chunk roots.
        self._chunk_lists: OrderedDict[Digest, VerifiedChunks] = OrderedDict()

    @property
    def _transfer(self) -> Transfer:
        # Made on first use, once, for every thread that shares the client.
        with self._transfer_lock:
            if self._transfer_made is None:
                from vault.client.transfer import Transfer

                self._transfer_made = Transfer(self.store, self.timeout)
            return self._transfer_made

    def close(self) -> None:
        """End the connection."""
        self.channel.close()

    def __enter__(self) -> VaultClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ content

    def put(
        self,
        source: str | os.PathLike[str] | IO[bytes] | bytes,
        *,
        expected: str | None = None,
        progress: Callable[[int], None] | None = None,
        handoff: bool | None = None,
        chunk_root: bool = False,
    ) -> PutResult:
        """Store bytes in the vault; returns once they are durable. The client hashes what it
        sends (BLAKE3, cheap) and checks the server stored exactly that.

        A file of at least `HANDOFF_MIN` bytes on the vault's own host is handed to the server,
        which reads it itself (vault.client.handoff); anything else streams. `handoff=True` asks
        for the handoff whatever the size and fails if it cannot be had; `False` always
        streams. With `chunk_root=True` the client also computes the chunk root of what it
        sends (one more BLAKE3 pass over the bytes), which its pins of the blob then record
        (see `pin`), so that ranges of it are verified alone: for a blob to be pinned on its
        own and read by range later, not for one only a manifest names."""
        result = self._transfer.put(
            source, expected=expected, progress=progress, handoff=handoff, chunk_root=chunk_root
        )
        self._remember_root(result)
        return result

    def _remember_root(self, result: PutResult) -> None:
        from vault.client.ranges import CHUNK_SIZE

        # A blob of one chunk costs no more to verify whole than by range: it records none.
        if result.chunk_root is None or result.blob.size <= CHUNK_SIZE:
            return
        # Puts run on many threads at once (a checkpoint's files).
        with self._transfer_lock:
            for digest in (str(result.blob.sha256), str(result.blob.blake3)):
                self._put_roots[digest] = result.chunk_root
                self._put_roots.move_to_end(digest)
            while len(self._put_roots) > _KEPT_ROOTS:
                self._put_roots.popitem(last=False)

    def put_direct(
        self,
        path: str | os.PathLike[str],
        *,
        part_size: int | None = None,
        uploads: str | os.PathLike[str] | None = None,
        copies: int | None = None,
    ) -> PutResult:
        """Store a file by uploading it straight to the vault's object store with a request the
        vault signs for exactly this file's SHA-256 (the store refuses other bytes); returns
        once the vault has verified the upload and catalogued it. For vaults with mirrors; the
        bytes do not pass through the vault's server on their way in but once, to be
        verified. A file larger than one PUT takes (5 GiB), or any with `part_size`, goes up in
        parts, each bound to its own SHA-256; with `uploads` (a folder), an upload in parts
        cut short is resumed by the next put of the same file, which sends only the parts
        missing. The file goes to `copies` mirrors at once (default: every mirror the vault
        keeps the blob on); the result names those that held a verified copy when it
        returned."""
        from vault.client.direct import put_direct

        return put_direct(
            self.store,
            self.timeout,
            Path(path),
            part_size=part_size,
            uploads=None if uploads is None else Path(uploads),
            copies=copies,
        )

    def get_direct(self, digest: str, path: str | os.PathLike[str]) -> BlobInfo:
        """Write a verified blob to `path`, read straight from a mirror copy in the vault's
        object store with a request the vault signs; checked here against the digest, as every
        read is, before the file appears."""
        from vault.client.direct import get_direct

        return get_direct(self.store, self.timeout, digest, Path(path))

    def put_many(
        self,
        sources: Sequence[str | os.PathLike[str] | bytes],
        *,
        expected: Sequence[str | None] | None = None,
    ) -> list[PutResult]:
        """Store many small blobs (files or bytes, each at most BATCH_BLOB bytes) in one call,
        whose syncs the vault shares among them; returns one result per source, in order, once
        every blob is durable. A call takes at most 10,000 blobs and 256 MiB. As `put` does,
        the client hashes what it sends and checks the vault stored exactly that; a blob the
        vault refused (its bytes do not match its `expected` digest) is an IntegrityError
        naming it, though the others of the call are stored."""
        return self._transfer.put_many(sources, expected=expected)

    def open(
        self, digest: str, *, offset: int = 0, length: int | None = None, check_chunks: bool = True
    ) -> BlobReader:
        """A file-like reader of a blob or a range of it.

        A whole blob streams: each chunk is checked against the server's chunk list as it
        comes, and reading the end raises IntegrityError unless everything matches the digest,
        so act on the bytes only once the end was read.

        A range is verified before any of it is read. If a verified pin of the digest records
        the blob's chunk root (see `verified_chunks`), only the chunks covering the range are
        fetched, each checked against the chunk list that root vouches for; otherwise the whole
        blob is fetched into an unlinked private file and its digest checked first (the
        server's chunk list alone is bound to nothing signed)."""
        chunks = None if offset == 0 and length is None else self.verified_chunks(digest)
        return self._transfer.open(
            digest, offset=offset, length=length, check_chunks=check_chunks, chunks=chunks
        )

    def copy_to(
        self,
        digest: str,
        out: int,
        *,
        offset: int = 0,
        length: int | None = None,
        spool: str | os.PathLike[str] | None = None,
    ) -> BlobInfo:
        """Write a verified blob (or range) to the descriptor `out`, such as standard output,
        which cannot take bytes back: the whole blob is first fetched into an unlinked private
        file in `spool` (default: the user's cache folder, ~/.cache/pinvault) and checked
        against its digest, and only then is any byte copied to `out`. On failure nothing
        reaches `out`. A range of a blob whose chunk root a verified pin records is fetched
        alone (see `open`), and spooled until all of it was checked."""
        chunks = None if offset == 0 and length is None else self.verified_chunks(digest)
        return self._transfer.copy_to(
            digest, out, offset=offset, length=length, spool=spool, chunks=chunks
        )

    def get(
        self,
        digest: str,
        path: str | os.PathLike[str],
        *,
        offset: int = 0,
        length: int | None = None,
        progress: Callable[[int], None] | None = None,
        handoff: bool | None = None,
    ) -> BlobInfo:
        """Write a verified blob (or range) to `path`; the file appears only once verified.

        The bytes go into a new file beside `path` (created O_EXCL|O_NOFOLLOW, mode 0600, so
        nothing planted there is followed), renamed onto `path` only once the whole digest
        matched; on failure, an interrupt too, only that file is removed. For a whole blob it
        is named after the digest, and one left by a get killed outright is resumed from: only
        if this client could have made it, and only its chunks that match the blob's chunk
        list are kept (vault.client.partial). A client on the vault's own host hands the server
        the write end of a pipe, never the file: the server writes each verified chunk into it
        and the client hashes and writes the file itself (vault.store.handoff says why; a
        resumed get streams the rest).
        `handoff=False` streams; `handoff=True` fails if the handoff cannot be had. A range is
        fetched alone if a verified pin records the blob's chunk root, else cut from the whole
        blob once that is verified (see `open`)."""
        whole = offset == 0 and length is None
        chunks = None if whole or handoff else self.verified_chunks(digest)
        return self._transfer.get(
            digest,
            path,
            offset=offset,
            length=length,
            progress=progress,
            handoff=handoff,
            chunks=chunks,
        )

    def verified_chunks(self, digest: str) -> VerifiedChunks | None:
        """The blob's chunk hashes, verified against the chunk root that the verified pins of
        `digest` record (vault.client.ranges), with which any range of it is verified alone;
        None when the whole blob must be verified instead: the digest is not a sha256 digest
        (pins name stored blobs by it), no pin records a root, pins disagree on it, or the
        vault lists no chunk hashes. A pin whose proof fails raises VerificationError, and a
        chunk list that does not hash to the recorded root IntegrityError naming the digest:
        neither falls back. A 4 GiB blob's list is 128 KiB."""
        from vault.client.ranges import fetch_chunk_hashes, signed_root

        wanted = Digest.parse(digest)
        if wanted.algorithm != "sha256":
            return None
        with self._transfer_lock:
            known = self._chunk_lists.get(wanted)
        if known is not None:
            return known
        try:
            pins = self.lookup(str(wanted))
        except NotFound:
            return None
        root = signed_root(wanted, pins)
        if root is None:
            return None
        chunks = fetch_chunk_hashes(self.store, self.timeout, wanted, root)
        if chunks is not None:
            with self._transfer_lock:
                self._chunk_lists[wanted] = chunks
                while len(self._chunk_lists) > _KEPT_CHUNK_LISTS:
                    self._chunk_lists.popitem(last=False)
        return chunks

    def open_ranges(self, digest: str) -> RangeReader | None:
        """A reader of random ranges of a blob, each fetching only the chunks it covers, all
        verified against the blob's chunk root (see `verified_chunks`); None when the blob must
        be verified whole instead."""
        from vault.client.ranges import RangeReader

        chunks = self.verified_chunks(digest)
        return None if chunks is None else RangeReader(self.store, self.timeout, chunks)

    def stat(self, digest: str) -> Stat:
        """The vault's description of a blob and the entries it lists as pinning it, neither
        verified (`get`/`open` verify bytes, `lookup` entries). NotFound if the vault lacks it,
        InvalidArgument for a malformed digest."""
        with rpc_errors():
            response = self.store.Stat(pb.StatRequest(digest=str(Digest.parse(digest))))
        return Stat(
            BlobInfo.from_wire(response.blob), [Entry.decode(e.body) for e in response.pins]
        )

    def find_missing(self, digests: Sequence[str]) -> list[str]:
        """Those of `digests` the vault does not hold (its word: a get verifies the rest)."""
        with rpc_errors():
            return list(self.store.FindMissing(pb.FindMissingRequest(digests=digests)).missing)

    def scrub(self, *, rate_mb_s: float = 0.0) -> Iterator[pb.ScrubProgress]:
        """Have the vault re-verify every copy on every tier now, repairing bad ones
        (Store.Scrub): its progress, then its totals, in a message marked `finished`."""
        with rpc_errors():
            yield from self.store.Scrub(pb.ScrubRequest(rate_mb_s=rate_mb_s))

    def verify_blobs(self) -> Iterator[pb.VerifyBlobsProgress]:
        """Have the vault re-hash every stored blob against its digest: its progress, then
        its findings (Store.VerifyBlobs)."""
        with rpc_errors():
            yield from self.store.VerifyBlobs(pb.VerifyBlobsRequest())

    # ------------------------------------------------------------------ ledger

    def pin(
        self,
        kind: str,
        digests: str | Sequence[str],
        *,
        meta: dict[str, str] | None = None,
        external: bool = False,
        chunk_root: bool | None = None,
    ) -> ProvenEntry:
        """Append a pin and return it once its inclusion in a signed checkpoint is verified.
        The first pin of a client verifies the vault's current checkpoint before it asks (its
        key, and consistency with the last checkpoint trusted), so that a vault this client
        does not trust gets no entry it would then refuse to believe.

        The pin records its first subject's chunk root (`chunk-root`, vault.client.ranges), so
        that ranges of the blob can be verified alone: by default when this client put the
        blob (of more than one chunk) with `put(..., chunk_root=True)`; with
        `chunk_root=True` also for a stored blob it did not put so, whose whole bytes it then
        reads and verifies to compute the root; never with `False`."""
        if not self._vouched:
            self.checkpoint()
        subjects = [digests] if isinstance(digests, str) else list(digests)
        if chunk_root is not False:
            meta = self._with_root(subjects, meta, external, compute=bool(chunk_root))
        request = pb.PinRequest(
            kind=kind, subjects=subjects, meta=meta or {}, external=external, author=self.author
        )
        with rpc_errors():
            response = self.ledger.Pin(request, timeout=self.timeout)
        entry = Entry.decode(response.entry.body)
        # The vault adds `team` to a pin that names a run: the team it wrote for, from the
        # caller's credential (docs/run-manifest.md).
        recorded = dict(entry.meta)
        if "team" not in (meta or {}):
            recorded.pop("team", None)
        if entry.kind != kind or recorded != dict(meta or {}) or entry.external != external:
            raise VerificationError("the vault recorded a different entry than the one asked for")
        if len(entry.subjects) != len(subjects) or not all(
            self._same_blob(asked, recorded, external)
            for asked, recorded in zip(subjects, entry.subjects, strict=True)
        ):
            raise VerificationError(
                f"asked to pin {', '.join(subjects)}, the vault recorded entry {entry.index} "
                f"naming {', '.join(entry.subjects)}",
                index=entry.index,
            )
        return self.prove(response.entry.index, response.entry.body)

    def _with_root(
        self, subjects: list[str], meta: dict[str, str] | None, external: bool, *, compute: bool
    ) -> dict[str, str] | None:
        """`meta` with the chunk root of the pin's first subject (vault.client.ranges), if this
        client put that blob and computed it (or, with `compute`, from the blob's whole bytes,
        verified against its digest), so that the blob's ranges can be verified alone; the
        vault checks it against the blob before it appends the pin."""
        from vault.client.ranges import CHUNK_ROOT, CHUNK_SIZE

        if not subjects or external or (meta and CHUNK_ROOT in meta):
            return meta
        with self._transfer_lock:
            root = self._put_roots.get(subjects[0])
        if root is None and compute:
            size, root = self._transfer.chunk_root_of(Digest.parse(subjects[0]))
            if size <= CHUNK_SIZE:
                root = None
        if root is None:
            return meta
        return {**(meta or {}), CHUNK_ROOT: root.hex()}

    def prove(self, index: int, body: bytes) -> ProvenEntry:
        """Verify that `body` is entry `index` of the vault's ledger."""
        with rpc_errors():
            proof = self.ledger.GetInclusionProof(
                pb.InclusionProofRequest(index=index), timeout=self.timeout
            )
        checkpoint = self._trust.advance(proof.checkpoint.note)
        return check_inclusion(index, body, list(proof.hashes), checkpoint)

    def lookup(self, digest: str) -> list[ProvenEntry]:
        """The entries that pin a digest, each verified to be in a signed checkpoint that is
        consistent with everything this client verified before, and to name the digest (see
        `_about` for a blake3 alias)."""
        wanted = Digest.parse(digest)
        known = self._trust.known_size()
        try:
            with rpc_errors():
                response = self.ledger.Lookup(
                    pb.LookupRequest(digest=str(wanted), known_size=known), timeout=self.timeout
                )
        except NotFound as exc:
            # The vault answers a digest never pinned with a proof of it, never with an error.
            raise VerificationError(
                f"the vault said {wanted} is not pinned without proving it: {exc}"
            ) from None
        checkpoint = self._trust.accept(
            response.checkpoint.note, list(response.consistency.hashes), known
        )
        proven = check_proven_together(
            [*response.map.entries, *response.entries], response.inclusion, checkpoint
        )
        tail = check_tail(response.map, checkpoint, proven[: len(response.map.entries)])
        entries = self._about(wanted, proven[len(response.map.entries) :])
        check_complete([(str(wanted), entries, response.proof)], tail)
        if not entries:
            raise NotFound(
                f"no entry pins {wanted} (proven for the {checkpoint.size} entries of the "
                "signed ledger)"
            )
        return entries

    def lookup_many(self, digests: Sequence[str]) -> dict[str, list[ProvenEntry]]:
        """`lookup` of many digests in one call: each digest as given, to its entries."""
        wanted = [Digest.parse(d) for d in digests]
        known = self._trust.known_size()
        with rpc_errors():
            response = self.ledger.LookupBatch(
                pb.LookupBatchRequest(digests=[str(w) for w in wanted], known_size=known),
                timeout=self.timeout,
            )
        checkpoint = self._trust.accept(
            response.checkpoint.note, list(response.consistency.hashes), known
        )
        if len(response.results) != len(wanted):
            raise VerificationError(
                f"asked about {len(wanted)} digests, the vault answered {len(response.results)}"
            )
        # The tail's entries first, then each result's, proven by the answer's shared proof.
        messages = list(response.map.entries)
        for result in response.results:
            messages += result.entries
        proven = check_proven_together(messages, response.inclusion, checkpoint)
        tail = check_tail(response.map, checkpoint, proven[: len(response.map.entries)])
        at = len(response.map.entries)
        found: dict[str, list[ProvenEntry]] = {}
        answers = []
        for asked, digest, result in zip(digests, wanted, response.results, strict=True):
            if result.digest != str(digest):
                raise VerificationError(
                    f"asked about {digest}, the vault answered about {result.digest!r}"
                )
            entries = self._about(digest, proven[at : at + len(result.entries)])
            at += len(result.entries)
            answers.append((str(digest), entries, result.proof))
            found[asked] = entries
        check_complete(answers, tail)
        return found

    def _about(self, wanted: Digest, entries: list[ProvenEntry]) -> list[ProvenEntry]:
        """`entries`, once each is found to name `wanted` in its verified body.

        Pins name a stored blob by its sha256 digest, so a look-up by its blake3 alias finds
        entries naming another digest, which nothing signed ties to the alias. Such an entry is
        accepted only if this client hashed the blob's bytes itself: it fetches the blob by its
        blake3 digest (verifying that), computes its sha256 in the same pass, and accepts
        entries naming that. A blob the store does not hold cannot be tied, and such entries
        are refused."""
        names = {str(wanted)}
        tied: Digest | None = None
        for proven in entries:
            if names_any(names, proven):
                continue
            if wanted.algorithm == "blake3" and tied is None:
                tied = self._sha256_of(wanted)
                if tied is not None:
                    names.add(str(tied))
                    if names_any(names, proven):
                        continue
            raise not_about(str(wanted), proven, str(tied) if tied else None)
        return entries

    def _sha256_of(self, alias: Digest) -> Digest | None:
        """The sha256 digest of the blob named by a blake3 `alias`, computed by this client from
        bytes verified against the alias; None if the store does not hold the blob."""
        if alias not in self._aliases:
            try:
                self._aliases[alias] = self._transfer.sha256_of(alias)
            except NotFound:
                return None
        return self._aliases[alias]

    def _same_blob(self, asked: str, recorded: str, external: bool) -> bool:
        """Whether a pin's subject as recorded names the blob asked for: the same digest, or,
        for a stored blob asked for by blake3, the sha256 this client computes of its bytes."""
        if recorded == asked:
            return True
        wanted = Digest.parse(asked)
        if external or wanted.algorithm != "blake3":
            return False
        tied = self._sha256_of(wanted)
        return tied is not None and str(tied) == recorded

    # ------------------------------------------------------------------ admission

    def admit(
        self,
        *,
        image: str,
        dataset: str,
        seed: str | int,
        config: str = "",
        team: str = "",
        run_id: str = "",
        replay_of: str = "",
    ) -> Admission:
        """Ask the vault to admit a job on these inputs. The answer is checked: the run id is
        the digest of these very inputs, and the run's pin is proved in a signed checkpoint."""
        inputs = RunInputs.checked(image=image, dataset=dataset, config=config, seed=seed)
        known = self._trust.known_size()
        request = pb.AdmitRequest(
            image=inputs.image,
            dataset=inputs.dataset,
            config=inputs.config,
            seed=str(inputs.seed),
            team=team or self.team,
            run_id=run_id,
            replay_of=replay_of,
            author=self.author,
            known_size=known,
        )
        try:
            with rpc_errors():
                response = self.admission.Admit(request, timeout=self.timeout)
        except FailedPrecondition as exc:
            if " is not pinned as " in str(exc):
                self._prove_inputs(inputs, exc)
            raise
        checkpoint = self._trust.accept(
            response.checkpoint.note, list(response.consistency.hashes), known
        )
        self._prove_inputs(inputs, None)
        # The run's inputs document is these inputs plus the nonce the vault chose when it
        # first admitted the run (none for runs admitted before nonces); the run id is its digest.
        try:
            admitted = RunInputs.decode(response.inputs)
        except InvalidArgument as exc:
            raise VerificationError(f"the vault's inputs document is malformed: {exc}") from None
        if admitted.bare != inputs or response.run_id != admitted.run_id:
            raise VerificationError(
                f"the vault admitted run {response.run_id}, but its inputs document "
                f"{admitted.run_id} is not of these inputs"
            )
        proven = check_proven(response.entry, checkpoint)
        entry = proven.entry
        if (
            entry.kind != "run"
            or entry.subjects[:1] != (admitted.run_id,)
            or entry.meta.get("seed") != str(inputs.seed)
        ):
            raise VerificationError(
                f"the vault's pin for run {admitted.run_id} (entry {entry.index}) is not a pin of "
                "this run"
            )
        return Admission(
            admitted.run_id,
            admitted,
            proven,
            response.new,
            response.lease,
            response.team,
            response.image_blobs,
        )

    def _prove_inputs(self, inputs: RunInputs, refusal: FailedPrecondition | None) -> None:
        """Check what the vault said of a job's inputs against complete look-ups: once it
        admitted the job, each input must be proven pinned as its role; once it refused one
        as not pinned, no entry may pin it so (the refusal then stands as proven)."""
        roles = [("image", inputs.image), ("dataset", inputs.dataset)]
        if inputs.config:
            roles.append(("config", inputs.config))
        found = self.lookup_many([digest for _, digest in roles])
        for role, digest in roles:
            pins = [p.entry.index for p in found[digest] if p.entry.kind == role]
            article = "an" if role == "image" else "a"
            if refusal is None and not pins:
                raise VerificationError(
                    f"the vault admitted the job, but no entry of the signed ledger pins its "
                    f"{role} {digest} as {article} {role}"
                )
            if refusal is not None and pins and f"{role} {digest} is not pinned" in str(refusal):
                raise VerificationError(
                    f"the vault refused the job saying its {role} {digest} is not pinned, but "
                    f"entry {pins[0]} pins it as {article} {role}"
                )

    def release_replay(self, lease: str, *, team: str = "") -> None:
        """Give a replay's slot back; NotFound if the lease is unknown or expired."""
        with rpc_errors():
            self.admission.ReleaseReplay(
                pb.ReleaseReplayRequest(lease=lease, team=team or self.team),
                timeout=self.timeout,
            )

    # ------------------------------------------------------------------ tokens

    def create_token(self, *, name: str, team: str, role: str) -> tuple[pb.TokenInfo, str]:
        """A new bearer token and its secret, which the vault shows this once."""
        with rpc_errors():
            response = self.tokens.CreateToken(
                pb.CreateTokenRequest(name=name, team=team, role=role), timeout=self.timeout
            )
        return response.token, response.secret

    def list_tokens(self) -> list[pb.TokenInfo]:
        """The vault's tokens (never their secrets); PermissionDenied unless an admin asks."""
        with rpc_errors():
            return list(self.tokens.ListTokens(pb.ListTokensRequest(), timeout=self.timeout).tokens)

    def revoke_token(self, token_id: str) -> None:
        """Revoke a token at once; NotFound for an unknown id."""
        with rpc_errors():
            self.tokens.RevokeToken(pb.RevokeTokenRequest(token_id=token_id), timeout=self.timeout)

    # ------------------------------------------------------------------ checkpoints and log

    def checkpoint(self) -> Checkpoint:
        """The latest checkpoint, verified and proved consistent with the last one verified."""
        checkpoint = self._trust.advance(self.checkpoint_note(verify=False))
        self._vouched = True
        return checkpoint

    def checkpoint_note(self, *, verify: bool = True) -> str:
        """The latest checkpoint's signed note text (verified unless asked not to)."""
        with rpc_errors():
            note: str = self.ledger.GetCheckpoint(
                pb.GetCheckpointRequest(), timeout=self.timeout
            ).note
        if verify:
            self._trust.advance(note)
        return note

    def witnessed(self) -> tuple[Checkpoint, list[Cosignature]]:
        """The latest checkpoint, verified as `checkpoint` does, and the cosignatures on it of
        the witnesses this client requires (none when it requires none)."""
        note = self.checkpoint_note()
        checkpoint = self.verifier().open(note)
        return checkpoint, [] if self.witnesses is None else self.witnesses.check(note)

    def inclusion_proof(self, index: int, size: int = 0) -> pb.InclusionProof:
        """The vault's proof that entry `index` is in the tree of `size` entries (0: the
        latest), unverified: `prove` checks one."""
        with rpc_errors():
            proof: pb.InclusionProof = self.ledger.GetInclusionProof(
                pb.InclusionProofRequest(index=index, size=size)
            )
        return proof

    def consistency_proof(self, old_size: int, new_size: int = 0) -> pb.ConsistencyProof:
        """The vault's proof that the tree of `new_size` entries (0: the latest) extends the
        one of `old_size`, unverified: `checkpoint` checks one."""
        with rpc_errors():
            proof: pb.ConsistencyProof = self.ledger.GetConsistencyProof(
                pb.ConsistencyProofRequest(old_size=old_size, new_size=new_size)
            )
        return proof

    def log(
        self,
        *,
        start: int = 0,
        limit: int | None = None,
        kind: str = "",
        digest: str = "",
        author: str = "",
        since: str = "",
        until: str = "",
    ) -> Iterator[Entry]:
        """Entries in index order, page by page, filtered on the server."""
        left = limit
        while True:
            page = 1000 if left is None else min(left, 1000)
            with rpc_errors():
                response = self.ledger.Log(
                    pb.LogRequest(
                        start=start,
                        limit=page,
                        kind=kind,
                        digest=digest,
                        author=author,
                        since=since,
                        until=until,
                    )
                )
            for e in response.entries:
                entry = Entry.decode(e.body)
                if entry.index != e.index:
                    raise VerificationError(
                        f"entry {e.index} says it is entry {entry.index}", index=e.index
                    )
                yield entry
            if left is not None:
                left -= len(response.entries)
            if not response.next or (left is not None and left <= 0):
                return
            start = response.next

    def verifier(self) -> Verifier:
        """The key checkpoints are verified with: the pinned one, or the one trusted on first
        use; VerificationError if the vault's checkpoint does not verify with it."""
        with self._trust.trusted() as trusted:
            return trusted.verifier

    def audit(
        self,
        progress: Callable[[int, int], None] | None = None,
        *,
        workers: int = 1,
        chunk: int | None = None,
        subject_map: bool = False,
    ) -> AuditReport:
        """Re-derive the whole ledger from the server's stored rows (see vault.ledger.audit).
        The stored entries are checked against the vault's latest checkpoint too (with
        witnesses required, once it is found cosigned), and once they pass, that checkpoint
        against the last one this client verified, to which it then moves: a vault that
        shows this client a history other than the one it saw before fails its audit
        (RollbackError or VerificationError naming the sizes). With more than one worker and a
        ledger of at least two chunks, worker processes audit chunks of `chunk` entries side by
        side (see vault.client.audit; `chunk` defaults to its CHUNK); the report is the same.
        `subject_map`: also rebuild the subject map and check the newest `index` entry's root
        (its memory grows with the ledger's distinct digests)."""
        from vault.client.audit import CHUNK

        refusal: VaultError | None = None
        try:
            latest: str | None = self.checkpoint_note(verify=self.witnesses is not None)
        except (IntegrityError, VerificationError) as exc:
            # The vault refuses to sign a ledger that fails its own check: the audit of its
            # stored rows still names where it breaks.
            latest, refusal = None, exc
        with self._trust.trusted() as trusted:
            verifier, origin = trusted.verifier, trusted.origin
        report = self._audit(
            verifier,
            origin,
            latest,
            progress,
            workers,
            CHUNK if chunk is None else chunk,
            subject_map,
        )
        if latest is None:
            if report.ok and refusal is not None:
                raise refusal
            return report
        if report.ok:
            self._trust.advance(latest)
        return report

    def _audit(
        self,
        verifier: Verifier,
        origin: str,
        latest: str | None,
        progress: Callable[[int, int], None] | None,
        workers: int,
        chunk: int,
        subject_map: bool = False,
    ) -> AuditReport:
        from vault.client.audit import audit_in_chunks
        from vault.ledger.audit import Auditor

        with rpc_errors():
            notes = [
                n
                for batch in self.ledger.ReadCheckpoints(pb.ReadCheckpointsRequest())
                for n in batch.notes
            ] + ([] if latest is None else [latest])
            auditor = Auditor(verifier, origin, notes, subject_map=subject_map)
            if workers > 1:
                # The head's size and the rows past it, from one snapshot; every row below the
                # head is immutable, so the chunks may read them from later snapshots.
                tail = self.ledger.ReadEntries(pb.ReadEntriesRequest(from_head=True))
                first = next(tail)
                head = first.head_size
                # A server that starts at index 0 regardless does not know `from_head`.
                if head >= 2 * chunk and not (first.entries and first.entries[0].index < head):
                    audit_in_chunks(
                        self.channel,
                        auditor,
                        head,
                        workers=workers,
                        chunk=chunk,
                        progress=progress,
                        subject_map=subject_map,
                    )
                    auditor.feed(first.entries)
                    for batch in tail:
                        auditor.feed(batch.entries)
                    return auditor.finish(head)
                tail.cancel()
            head = 0
            for batch in self.ledger.ReadEntries(pb.ReadEntriesRequest(start=0)):
                head = batch.head_size
                auditor.feed(batch.entries)
                if progress:
                    progress(auditor.report.entries, head)
        return auditor.finish(head)


# Chunk roots of blobs put, and verified chunk lists of blobs read by range, that a client
# keeps (64 bytes and, for a 4 GiB blob, 128 KiB each).
_KEPT_ROOTS: Final = 4096
_KEPT_CHUNK_LISTS: Final = 16


def _witness_policy(keys: Sequence[str], required: int | None) -> WitnessPolicy | None:
    if isinstance(keys, str):
        raise InvalidArgument("witnesses: expected a sequence of witness keys, found one string")
    if not keys:
        if required:
            raise InvalidArgument(
                f"{required} witness cosignatures required, but no witness keys are given"
            )
        return None
    return WitnessPolicy.from_strings(keys, required)


def iter_digests(values: Iterable[str]) -> list[str]:
    return [str(Digest.parse(v)) for v in values]
