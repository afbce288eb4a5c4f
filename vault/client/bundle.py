"""Proof bundles (docs/bundle.md): one JSON file holding what proves a run, a digest's pins or
one entry (the entries, an inclusion proof of each in one signed checkpoint, the checkpoint with
its cosignatures, the keys, and the run's documents), written from a vault by `collect` and
checked with no vault by `verify_bundle`, which does no I/O."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from vault.canonical import canonical_json, load_json_object
from vault.digest import Digest
from vault.errors import FailedPrecondition, InvalidArgument, VerificationError
from vault.ledger.checkpoint import MAX_TREE_SIZE, Checkpoint, Verifier
from vault.ledger.cosignature import Cosignature, WitnessKey, WitnessPolicy
from vault.ledger.entry import Entry
from vault.ledger.merkle import leaf_hash, verify_inclusion
from vault.ledger.runid import RunInputs

if TYPE_CHECKING:
    from vault.client.client import VaultClient
    from vault.client.results import ProvenEntry

FORMAT_VERSION: Final = 1
MEDIA_TYPE: Final = f"application/vnd.pinvault.bundle.v{FORMAT_VERSION}+json"
_MEDIA_TYPE = re.compile(r"application/vnd\.pinvault\.bundle\.v([0-9]+)\+json")
# A run of a million outputs is under 2 GiB of bundle; a file past this bound is refused unread.
MAX_BUNDLE_BYTES: Final = 1 << 31
MAX_RUN_MANIFEST_BYTES: Final = 64 * 1024 * 1024
# The largest index a JSON reader of any language reads exactly.
MAX_INDEX: Final = 2**53 - 1
SUBJECT_TYPES: Final = ("run", "digest", "entry")
RUN_MANIFEST_TYPE: Final = "pinvault.run-manifest"

_FIELDS: Final = frozenset(
    {"mediaType", "subject", "verificationMaterial", "tlogEntries", "documents"}
)
_MATERIAL_FIELDS: Final = frozenset({"verifierKey", "witnessKeys", "checkpoint"})
_ENTRY_FIELDS: Final = frozenset({"logIndex", "canonicalizedBody", "inclusionProof"})
DOCUMENTS: Final = ("runInputs", "runManifest", "replicateScript", "datasetManifest")


def replicate_script(manifest: str) -> bytes:
    """The `replicate.sh` the run library writes beside a run whose manifest is `manifest`."""
    return f'#!/bin/sh\nexec vault replay {manifest} "$@"\n'.encode()


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class Subject:
    """What a bundle proves: a run (by its run id), the pins of a digest, or one entry."""

    type: str
    digest: str = ""
    index: int = -1

    def __str__(self) -> str:
        return f"entry {self.index}" if self.type == "entry" else f"{self.type} {self.digest}"

    def as_json(self) -> dict[str, Any]:
        if self.type == "entry":
            return {"type": "entry", "index": self.index}
        return {"type": self.type, "digest": self.digest}


@dataclass(frozen=True, slots=True)
class BundledEntry:
    """An entry's canonical bytes and the proof of its inclusion in the bundle's checkpoint."""

    index: int
    body: bytes
    proof: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Bundle:
    """A proof bundle as its file holds it; nothing in it is believed until `verify_bundle`."""

    subject: Subject
    verifier_key: str
    checkpoint: str
    entries: tuple[BundledEntry, ...]
    witness_keys: tuple[str, ...] = ()
    # Role (one of DOCUMENTS) -> the document's bytes.
    documents: dict[str, bytes] = field(default_factory=dict)

    def encode(self) -> bytes:
        """The bundle file: JSON, keys sorted, one line, ending in a newline."""
        doc = {
            "mediaType": MEDIA_TYPE,
            "subject": self.subject.as_json(),
            "verificationMaterial": {
                "verifierKey": self.verifier_key,
                "witnessKeys": list(self.witness_keys),
                "checkpoint": self.checkpoint,
            },
            "tlogEntries": [
                {
                    "logIndex": e.index,
                    "canonicalizedBody": _b64(e.body),
                    "inclusionProof": [_b64(h) for h in e.proof],
                }
                for e in self.entries
            ],
            "documents": {role: _b64(data) for role, data in sorted(self.documents.items())},
        }
        return canonical_json(doc) + b"\n"

    @classmethod
    def decode(cls, data: bytes) -> Bundle:
        """A bundle from its file's bytes; InvalidArgument, in one line naming the field, for
        anything that is not a bundle of this format version."""
        if data.endswith(b"\n"):
            data = data[:-1]
        obj = load_json_object("bundle", data, MAX_BUNDLE_BYTES)
        media_type = obj.get("mediaType")
        if not isinstance(media_type, str):
            raise InvalidArgument(f"not a pinvault bundle: it has no mediaType {MEDIA_TYPE!r}")
        version = _MEDIA_TYPE.fullmatch(media_type)
        if version is None:
            raise InvalidArgument(
                f"not a pinvault bundle: mediaType {media_type[:80]!r} is not {MEDIA_TYPE!r}"
            )
        if version[1] != str(FORMAT_VERSION):
            raise InvalidArgument(
                f"bundle format version {version[1][:20]} is not supported: this vault reads "
                f"version {FORMAT_VERSION} ({MEDIA_TYPE})"
            )
        _fields("bundle", obj, _FIELDS)
        material = _object("verificationMaterial", obj["verificationMaterial"])
        _fields("verificationMaterial", material, _MATERIAL_FIELDS)
        witness_keys = _list("verificationMaterial.witnessKeys", material["witnessKeys"])
        entries = _list("tlogEntries", obj["tlogEntries"])
        documents = _object("documents", obj["documents"])
        unknown = sorted(set(documents) - set(DOCUMENTS))
        if unknown:
            raise InvalidArgument(
                f"bundle documents: unknown document {unknown[0][:40]!r} (known: "
                f"{', '.join(DOCUMENTS)})"
            )
        return cls(
            subject=_subject(obj["subject"]),
            verifier_key=_string("verificationMaterial.verifierKey", material["verifierKey"]),
            witness_keys=tuple(
                _string(f"verificationMaterial.witnessKeys[{n}]", key)
                for n, key in enumerate(witness_keys)
            ),
            checkpoint=_string("verificationMaterial.checkpoint", material["checkpoint"]),
            entries=tuple(_entry(n, e) for n, e in enumerate(entries)),
            documents={role: _unb64(f"documents.{role}", text) for role, text in documents.items()},
        )


@dataclass(frozen=True, slots=True)
class ProvenBundle:
    """A bundle once verified: the checkpoint, who signed and cosigned it, the entries it
    proves, and whether the keys came from the verifier's side or only from the bundle."""

    bundle: Bundle
    checkpoint: Checkpoint
    signer: Verifier
    cosignatures: tuple[Cosignature, ...]
    entries: tuple[Entry, ...]
    # Whether the checkpoint key and the witness keys were named by whoever verifies (not
    # read from the bundle itself).
    key_given: bool
    witnesses_given: bool
    # What the documents were checked to be, for the summary.
    documents: tuple[str, ...]

    def summary(self) -> str:
        """One line: what was proven, in which checkpoint, signed and cosigned by whom."""
        count = len(self.entries)
        what = f"{count} {'entry' if count == 1 else 'entries'}"
        subject = self.bundle.subject
        if subject.type == "digest" and any(
            e.kind == "dataset" and e.subjects[0] == subject.digest for e in self.entries
        ):
            name = f"dataset {subject.digest}"
        else:
            name = str(subject)
        line = (
            f"{name}: {what} proven in checkpoint {self.checkpoint.size} of "
            f"{self.checkpoint.origin} signed by {self.signer.label}"
        )
        if self.cosignatures:
            line += ", cosigned by witness " + ", ".join(c.witness.label for c in self.cosignatures)
        if self.documents:
            line += "; " + ", ".join(self.documents) + " match"
        return line

    def warnings(self) -> list[str]:
        """What the verification rests on that only the bundle vouches for."""
        found = []
        if not self.key_given:
            found.append(
                f"the checkpoint key {self.signer.label} was taken from the bundle itself: this "
                "shows the bundle is consistent, not that the vault signed it; name the vault's "
                "key with --key (or client.verifier_key), or verify where your trust state "
                "holds this vault"
            )
        if not self.witnesses_given and self.cosignatures:
            found.append(
                "the witness keys were taken from the bundle itself: name the witnesses you "
                "trust with --witness (or client.witnesses)"
            )
        return found


def verify_bundle(
    bundle: Bundle,
    *,
    verifier: Verifier | None = None,
    witnesses: WitnessPolicy | None = None,
    trusted: Checkpoint | None = None,
) -> ProvenBundle:
    """Check everything a bundle says, with no I/O: the checkpoint's signature by `verifier`
    (else by the bundle's own key), that it does not contradict the checkpoint `trusted` the
    verifier holds of the same ledger, the cosignatures `witnesses` require (else those of the
    bundle's witness keys), every entry's inclusion in the checkpoint, that every entry is about
    the subject, and that the documents are the ones the entries name. VerificationError naming
    the step and the entry that failed."""
    own_key = _verifier(bundle.verifier_key)
    signer = verifier or own_key
    checkpoint = signer.open(bundle.checkpoint)
    if (
        trusted is not None
        and trusted.origin == checkpoint.origin
        and trusted.size == checkpoint.size
        and trusted.root != checkpoint.root
    ):
        raise VerificationError(
            f"the bundle's checkpoint of size {checkpoint.size} has root "
            f"{checkpoint.root.hex()}, but the checkpoint of that size you verified before has "
            f"root {trusted.root.hex()}: the vault has shown two different histories"
        )
    policy = witnesses
    if policy is None and bundle.witness_keys:
        try:
            policy = WitnessPolicy([WitnessKey.from_string(k) for k in bundle.witness_keys])
        except InvalidArgument as exc:
            raise VerificationError(f"bundle witness keys: {exc}") from None
    cosigned = tuple(policy.check(bundle.checkpoint)) if policy is not None else ()
    entries = _proven_entries(bundle, checkpoint)
    subject = bundle.subject
    documents: list[str] = []
    if subject.type == "entry":
        if [e.index for e in entries] != [subject.index]:
            raise VerificationError(
                f"the bundle is of entry {subject.index} but holds entries "
                f"{', '.join(str(e.index) for e in entries)}"
            )
    else:
        for entry in entries:
            if subject.digest not in entry.subjects:
                raise VerificationError(
                    f"entry {entry.index} does not name {subject}: it names "
                    f"{', '.join(entry.subjects)}",
                    index=entry.index,
                )
    if subject.type == "run":
        documents = _check_run(subject.digest, entries, bundle.documents)
    else:
        misplaced = sorted(set(bundle.documents) - {"datasetManifest"})
        if misplaced:
            raise VerificationError(f"a bundle of {subject.type} holds a {misplaced[0]} document")
        if "datasetManifest" in bundle.documents:
            documents = [_check_dataset(subject, entries, bundle.documents["datasetManifest"])]
    return ProvenBundle(
        bundle,
        checkpoint,
        signer,
        cosigned,
        tuple(entries),
        key_given=verifier is not None,
        witnesses_given=witnesses is not None,
        documents=tuple(documents),
    )


def _proven_entries(bundle: Bundle, checkpoint: Checkpoint) -> list[Entry]:
    if not bundle.entries:
        raise VerificationError("the bundle holds no entry")
    entries: list[Entry] = []
    last = -1
    for bundled in bundle.entries:
        index = bundled.index
        if index <= last:
            raise VerificationError(
                f"entry {index} follows entry {last}: a bundle lists each entry once, by "
                "increasing index",
                index=index,
            )
        last = index
        try:
            verify_inclusion(
                leaf_hash(bundled.body), index, checkpoint.size, bundled.proof, checkpoint.root
            )
        except VerificationError as exc:
            raise VerificationError(
                f"entry {index} is not proven in checkpoint {checkpoint.size}: {exc} (the "
                "entry's bytes or its proof were altered)",
                index=index,
            ) from None
        try:
            entry = Entry.decode(bundled.body)
        except VerificationError as exc:
            raise VerificationError(f"entry {index}: {exc}", index=index) from None
        if entry.index != index:
            raise VerificationError(f"entry {index} says it is entry {entry.index}", index=index)
        entries.append(entry)
    return entries


def _check_run(run_id: str, entries: Sequence[Entry], documents: dict[str, bytes]) -> list[str]:
    """The run's documents, checked against the run id and the run's entries; what matched."""
    unexpected = sorted(set(documents) - {"runInputs", "runManifest", "replicateScript"})
    if unexpected:
        raise VerificationError(f"a bundle of a run holds a {unexpected[0]} document")
    data = documents.get("runInputs")
    if data is None:
        raise VerificationError(f"the bundle of run {run_id} has no inputs document")
    if sha256(data) != run_id:
        raise VerificationError(
            f"the run inputs document hashes to {sha256(data)}, not to the run id {run_id}: "
            "it was altered"
        )
    try:
        inputs = RunInputs.decode(data)
    except InvalidArgument as exc:
        raise VerificationError(f"the run inputs document: {exc}") from None
    admitted = next(
        (
            e
            for e in entries
            if e.kind == "run" and e.meta.get("stage") == "admitted" and e.subjects[:1] == (run_id,)
        ),
        None,
    )
    if admitted is None:
        raise VerificationError(f"the bundle holds no admission entry of run {run_id}")
    if admitted.subjects[1:] != inputs.subjects or admitted.meta.get("seed") != str(inputs.seed):
        raise VerificationError(
            f"run {run_id}'s admission entry {admitted.index} is not of the inputs document",
            index=admitted.index,
        )
    matched = ["inputs document"]
    manifest = documents.get("runManifest")
    script = documents.get("replicateScript")
    if manifest is None:
        if script is not None:
            raise VerificationError("the bundle holds a replicate.sh but no run manifest")
        return matched
    digest = sha256(manifest)
    team = admitted.meta.get("team", "")
    sealed = [
        e
        for e in entries
        if e.kind == "run"
        and e.meta.get("stage") == "manifest"
        and e.subjects[:1] == (digest,)
        and run_id in e.subjects[1:]
    ]
    if not sealed:
        raise VerificationError(
            f"the run manifest hashes to {digest}, which no entry of the bundle pins as run "
            f"{run_id}'s manifest: it was altered"
        )
    if not team or not any(e.meta.get("team") == team for e in sealed):
        raise VerificationError(
            f"run manifest {digest} was sealed by team {sealed[0].meta.get('team') or 'none'} "
            f"(entry {sealed[0].index}), not by team {team or 'none'}, which the run was "
            "admitted for",
            index=sealed[0].index,
        )
    _check_manifest(run_id, digest, manifest, data, entries)
    matched.append("run manifest")
    if script is not None:
        if script != replicate_script(digest):
            raise VerificationError(
                f"replicate.sh is not the script that replays run manifest {digest}: it was altered"
            )
        matched.append("replicate.sh")
    return matched


def _check_manifest(
    run_id: str, digest: str, manifest: bytes, inputs: bytes, entries: Sequence[Entry]
) -> None:
    """The run manifest says it is of this run and these inputs, and every output and
    checkpoint it lists is pinned for the run by an entry of the bundle."""
    what = f"run manifest {digest}"
    try:
        obj = load_json_object(what, manifest, MAX_RUN_MANIFEST_BYTES)
    except InvalidArgument as exc:
        raise VerificationError(str(exc)) from None
    if obj.get("type") != RUN_MANIFEST_TYPE or obj.get("v") != 1:
        raise VerificationError(f"{what} is not a {RUN_MANIFEST_TYPE} document of version 1")
    if canonical_json(obj) != manifest:
        raise VerificationError(f"{what} is not in canonical form")
    if obj.get("run") != run_id or canonical_json(obj.get("inputs")) != inputs:
        raise VerificationError(f"{what} is not a manifest of run {run_id} and its inputs")
    pinned = {(e.kind, e.subjects[0]) for e in entries if e.subjects[1:] == (run_id,)}
    outputs = obj.get("outputs")
    checkpoints = obj.get("checkpoints")
    if not isinstance(outputs, list) or not isinstance(checkpoints, list):
        raise VerificationError(f"{what} has no list of outputs or of checkpoints")
    for listed, kind, key in (
        (outputs, "artefact", "sha256"),
        (checkpoints, "checkpoint", "manifest"),
    ):
        for item in listed:
            named = item.get(key) if isinstance(item, dict) else None
            if not isinstance(named, str) or (kind, named) not in pinned:
                raise VerificationError(
                    f"{what} lists {'output' if kind == 'artefact' else 'checkpoint'} "
                    f"{named!r}, which no {kind} entry of the bundle pins for the run"
                )


def _check_dataset(subject: Subject, entries: Sequence[Entry], manifest: bytes) -> str:
    if sha256(manifest) != subject.digest:
        raise VerificationError(
            f"the dataset manifest hashes to {sha256(manifest)}, not to {subject.digest}: it "
            "was altered"
        )
    if not any(e.kind == "dataset" and e.subjects[0] == subject.digest for e in entries):
        raise VerificationError(f"the bundle holds no dataset entry pinning {subject.digest}")
    return "dataset manifest"


# ---------------------------------------------------------------------- writing from a vault


def collect(
    client: VaultClient,
    subject: Subject,
    entries: Sequence[ProvenEntry],
    documents: dict[str, bytes] | None = None,
) -> ProvenBundle:
    """A bundle of `entries` (each already proven by the client) with `documents`, every
    entry proven in the one checkpoint the client verifies last, and the whole bundle verified
    with the client's own key and witness policy before it is returned."""
    note = client.checkpoint_note()
    verifier = client.verifier()
    checkpoint = verifier.open(note)
    bundled: list[BundledEntry] = []
    for proven in sorted(entries, key=lambda p: p.entry.index):
        index = proven.entry.index
        body = proven.entry.encode()
        if index >= checkpoint.size:
            raise FailedPrecondition(
                f"entry {index} is not in the vault's checkpoint of size {checkpoint.size}: "
                "ask again"
            )
        proof = list(proven.proof)
        if (proven.checkpoint.size, proven.checkpoint.root) != (checkpoint.size, checkpoint.root):
            proof = list(client.inclusion_proof(index, checkpoint.size).hashes)
        verify_inclusion(leaf_hash(body), index, checkpoint.size, proof, checkpoint.root)
        bundled.append(BundledEntry(index, body, tuple(proof)))
    policy = client.witnesses
    bundle = Bundle(
        subject=subject,
        verifier_key=str(verifier),
        checkpoint=note,
        entries=tuple(bundled),
        witness_keys=tuple(str(w) for w in policy.witnesses) if policy is not None else (),
        documents=dict(documents or {}),
    )
    return verify_bundle(bundle, verifier=verifier, witnesses=policy)


def entry_subject(text: str) -> Subject | None:
    """`#INDEX` as the subject of one entry; None if `text` is not one."""
    if not text.startswith("#"):
        return None
    number = text[1:]
    if not number.isascii() or not number.isdigit() or int(number) > MAX_INDEX:
        raise InvalidArgument(f"bad entry {text[:40]!r}: expected #INDEX, such as #12")
    return Subject("entry", index=int(number))


# ---------------------------------------------------------------------- reading the file


def _verifier(text: str) -> Verifier:
    try:
        return Verifier.from_string(text)
    except InvalidArgument as exc:
        raise VerificationError(f"bundle verifier key: {exc}") from None


def _subject(value: object) -> Subject:
    obj = _object("subject", value)
    kind = obj.get("type")
    if kind not in SUBJECT_TYPES:
        raise InvalidArgument(
            f"bundle subject: type {str(kind)[:40]!r} is not one of {', '.join(SUBJECT_TYPES)}"
        )
    if kind == "entry":
        _fields("subject", obj, {"type", "index"})
        return Subject("entry", index=_index("subject.index", obj["index"]))
    _fields("subject", obj, {"type", "digest"})
    digest = _string("subject.digest", obj["digest"])
    try:
        parsed = Digest.parse(digest)
    except InvalidArgument as exc:
        raise InvalidArgument(f"bundle subject: {exc}") from None
    if kind == "run" and parsed.algorithm != "sha256":
        raise InvalidArgument(f"bundle subject: a run id is a sha256 digest, found {digest!r}")
    return Subject(str(kind), digest=str(parsed))


def _entry(number: int, value: object) -> BundledEntry:
    where = f"tlogEntries[{number}]"
    obj = _object(where, value)
    _fields(where, obj, _ENTRY_FIELDS)
    hashes = _list(f"{where}.inclusionProof", obj["inclusionProof"])
    return BundledEntry(
        index=_index(f"{where}.logIndex", obj["logIndex"]),
        body=_unb64(f"{where}.canonicalizedBody", obj["canonicalizedBody"]),
        proof=tuple(_unb64(f"{where}.inclusionProof[{n}]", h) for n, h in enumerate(hashes)),
    )


def _fields(what: str, obj: dict[str, Any], fields: frozenset[str] | set[str]) -> None:
    unknown = sorted(set(obj) - fields)
    if unknown:
        raise InvalidArgument(f"bundle {what}: unknown field {unknown[0][:40]!r}")
    missing = sorted(fields - set(obj))
    if missing:
        raise InvalidArgument(f"bundle {what}: field {missing[0]!r} is missing")


def _object(what: str, value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"bundle {what}: expected an object, found {_type(value)}")
    return value


def _list(what: str, value: object) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidArgument(f"bundle {what}: expected a list, found {_type(value)}")
    return value


def _string(what: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"bundle {what}: expected a string, found {_type(value)}")
    return value


def _index(what: str, value: object) -> int:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not 0 <= value <= min(MAX_INDEX, MAX_TREE_SIZE)
    ):
        raise InvalidArgument(
            f"bundle {what}: expected an integer 0 to 2^53-1, found {json.dumps(value)[:40]}"
        )
    return value


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(what: str, value: object) -> bytes:
    text = _string(what, value)
    try:
        if not text.isascii():
            raise ValueError("non-ASCII character")
        return binascii.a2b_base64(text, strict_mode=True)
    except (ValueError, binascii.Error) as exc:
        raise InvalidArgument(f"bundle {what}: not standard base64 with padding ({exc})") from None


def _type(value: object) -> str:
    return "null" if value is None else type(value).__name__
