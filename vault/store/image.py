"""The blobs an image needs held: what an OCI image manifest or index names.

An image pinned as one file (an Apptainer SIF, a tarball) is all there is to it; one pinned as an
OCI manifest is held only when its config and every layer are, and one pinned as an OCI index
only when every manifest it lists is held, whole. Admission (in the vault) and the client's
check before a job is submitted read manifests through this one reader, so that both say the
same about an image."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from vault.errors import FailedPrecondition

# A manifest or index larger than this is not read as one (registries refuse over 4 MiB).
MAX_IMAGE_MANIFEST: Final = 4 * 1024 * 1024
# Indexes may list indexes; past this depth the image is refused rather than followed.
MAX_DEPTH: Final = 4
# The manifests one image's indexes may list, all told: a bound on what checking one image reads.
MAX_LISTED_MANIFESTS: Final = 256
_SHA256: Final = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class Named:
    """A blob a manifest names: its digest, size and role (`config`, `layer` or `manifest`,
    the last a manifest an index lists, itself to be read)."""

    digest: str
    size: int
    role: str


def image_blobs(body: bytes) -> list[Named] | None:
    """The blobs the OCI image manifest or index `body` names, config first; None when `body`
    is not one (the image is then the one file)."""
    if len(body) > MAX_IMAGE_MANIFEST or not body.lstrip().startswith(b"{"):
        return None
    try:
        document = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("schemaVersion") != 2:
        return None
    if isinstance(document.get("manifests"), list):
        return [_named(d, "manifest") for d in document["manifests"]]
    if isinstance(document.get("layers"), list) and "config" in document:
        return [_named(document["config"], "config")] + [
            _named(d, "layer") for d in document["layers"]
        ]
    return None


def _named(descriptor: Any, role: str) -> Named:
    if not isinstance(descriptor, dict):
        raise ValueError(f"a {role} descriptor is not a JSON object")
    digest, size = descriptor.get("digest"), descriptor.get("size")
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise ValueError(f"a {role} descriptor has no sha256 digest")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"{role} {digest} has no size")
    return Named(digest, size, role)


def check_image_held(
    digest: str,
    body: bytes,
    read: Callable[[str], bytes],
    lacking: Callable[[Sequence[Named]], set[str]],
) -> int:
    """How many blobs the image `digest` (whose stored bytes are `body`) names, once every one
    is held: FailedPrecondition naming the first that is not. `read(digest)`: a listed
    manifest's bytes, verified, at most MAX_IMAGE_MANIFEST of them; `lacking(blobs)`: the
    digests of those not held (at their size, where the caller can tell)."""
    try:
        named = image_blobs(body)
    except ValueError as exc:
        raise FailedPrecondition(f"image {digest} is not a valid OCI manifest: {exc}") from None
    if named is None:
        return 0
    held = 0
    pending = [(digest, named, 1)]
    read_already: set[str] = set()
    while pending:
        where, blobs, depth = pending.pop()
        missing = lacking(blobs)
        if missing:
            first = next(b for b in blobs if b.digest in missing)
            raise FailedPrecondition(
                f"image {digest} is not held whole: {len(missing)} of the {len(blobs)} blobs "
                f"{where} names are not in the store (first: {first.role} {first.digest}, "
                f"{first.size} bytes)"
            )
        held += len(blobs)
        for blob in blobs:
            if blob.role != "manifest" or blob.digest in read_already:
                continue
            read_already.add(blob.digest)
            if len(read_already) > MAX_LISTED_MANIFESTS:
                raise FailedPrecondition(
                    f"image {digest} lists more than {MAX_LISTED_MANIFESTS} manifests: refused"
                )
            if depth >= MAX_DEPTH:
                raise FailedPrecondition(
                    f"image {digest} nests indexes more than {MAX_DEPTH} deep: refused"
                )
            try:
                listed = image_blobs(read(blob.digest))
            except ValueError as exc:
                raise FailedPrecondition(
                    f"image {digest}: manifest {blob.digest} is not valid: {exc}"
                ) from None
            if listed is None:
                raise FailedPrecondition(
                    f"image {digest}: {blob.digest}, which it lists as a manifest, is not one"
                )
            pending.append((blob.digest, listed, depth + 1))
    return held
