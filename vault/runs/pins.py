"""The pins a job names, checked by a client without appending anything: what `vault run` asks
before it submits and the Kubernetes webhook asks of every pod. The vault's admission checks the
same in its own ledger and store (and then appends the run), and refuses in the same words."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vault.client import ProvenEntry, VaultClient
from vault.digest import Digest
from vault.errors import FailedPrecondition, InvalidArgument, NotFound
from vault.runs.dataset import fetch_manifest, find_missing
from vault.store.image import MAX_IMAGE_MANIFEST, Named, check_image_held


def _an(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


@dataclass(frozen=True, slots=True)
class Found:
    """What a check found of an input: pinned only as external content (nothing of it is held),
    or held; for an image held as an OCI manifest or index, how many blobs it names (0: an image
    pinned as one file)."""

    external: bool
    image_blobs: int = 0


def require_pin(client: VaultClient, kind: str, digest: str) -> list[ProvenEntry]:
    """The `kind` pins of `digest`, each proved against a signed checkpoint; refused if none."""
    wanted = str(Digest.parse(digest))
    try:
        pins = [p for p in client.lookup(wanted) if p.entry.kind == kind]
    except NotFound:
        pins = []
    if not pins:
        raise FailedPrecondition(
            f"{kind} {wanted} is not pinned as {_an(kind)}: pin it first "
            f"(vault pin {kind} {wanted})"
        )
    return pins


def check_input(client: VaultClient, kind: str, digest: str) -> Found:
    """Refuse an input (`image` or `dataset`) that is not pinned as one or, unless it is pinned
    only as external content (kept elsewhere, an OCI registry say), whose content the store
    lacks; a dataset must also be a valid manifest whose every file the store holds."""
    wanted = str(Digest.parse(digest))
    if all(p.entry.external for p in require_pin(client, kind, wanted)):
        return Found(external=True)
    if kind != "dataset":
        if find_missing(client, [wanted]):
            raise FailedPrecondition(
                f"{kind} {wanted} is pinned but its content is not in the store"
            )
        if kind == "image":
            return Found(external=False, image_blobs=_check_image_held(client, wanted))
        return Found(external=False)
    try:
        # Fetched and verified against its digest by this client.
        manifest = fetch_manifest(client, wanted)
    except NotFound:
        raise FailedPrecondition(
            f"dataset {wanted} is pinned but its content is not in the store"
        ) from None
    except InvalidArgument as exc:
        raise FailedPrecondition(f"dataset {wanted} is not a dataset manifest: {exc}") from None
    missing = set(find_missing(client, sorted({f.sha256 for f in manifest.files})))
    if missing:
        first = next(f.path for f in manifest.files if f.sha256 in missing)
        raise FailedPrecondition(
            f"dataset {wanted} is missing {len(missing)} of its {len(manifest.files)} files' "
            f"content (first: {first})"
        )
    return Found(external=False)


def _check_image_held(client: VaultClient, digest: str) -> int:
    """Refuse an image pinned as an OCI manifest or index whose every blob the store does not
    hold (vault.store.image); returns how many it names. One pinned as a single file passes."""

    def manifest(wanted: str) -> bytes | None:
        reader = client.open(wanted)
        if reader.info.size > MAX_IMAGE_MANIFEST:
            return None
        # Verified against its digest by this client as it is read.
        return b"".join(bytes(c) for c in reader.chunks())

    def listed(wanted: str) -> bytes:
        body = manifest(wanted)
        if body is None:
            raise FailedPrecondition(
                f"{wanted}, listed as an image manifest, is more than a manifest may be "
                f"({MAX_IMAGE_MANIFEST} bytes)"
            )
        return body

    def lacking(blobs: Sequence[Named]) -> set[str]:
        return set(find_missing(client, sorted({b.digest for b in blobs})))

    body = manifest(digest)
    return 0 if body is None else check_image_held(digest, body, listed, lacking)
