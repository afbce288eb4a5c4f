"""What the framework adapters share: an array stored as its raw bytes (a file of the
checkpoint, so a blob named by its digest), the record that gives its dtype and shape, and the
tree document (`tree.json`) that says where each array sits in the saved state."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from vault.canonical import canonical_json, expect_fields, load_json_object
from vault.errors import FailedPrecondition, IntegrityError, InvalidArgument, NotFound

if TYPE_CHECKING:
    from vault.runs.run import Checkpoint, Run

TREE_DOCUMENT: Final = "tree.json"
TREE_TYPE: Final = "pinvault.array-tree"
TREE_VERSION: Final = 1
ARRAY_FOLDER: Final = "arrays"
# A tree document lists every array of the state; bounded like a checkpoint manifest.
MAX_TREE_BYTES: Final = 64 * 1024 * 1024
_MAX_INTEGER: Final = 2**53 - 1


@dataclass(frozen=True, slots=True)
class ArrayRecord:
    """One array of a checkpoint: the file holding its bytes (C order, little-endian), its dtype
    by name (`float32`, `bfloat16`, `int64`, `bool`, ... as NumPy and PyTorch both spell them)
    and its shape."""

    file: str
    dtype: str
    shape: tuple[int, ...]

    def nbytes(self, itemsize: int) -> int:
        return itemsize * math.prod(self.shape)

    def as_json(self) -> dict[str, Any]:
        return {"file": self.file, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def decode(cls, what: str, value: object) -> ArrayRecord:
        """A record from the tree document; InvalidArgument for anything malformed."""
        if not isinstance(value, dict):
            raise InvalidArgument(f"{what}: an array record is not an object")
        expect_fields(what, value, {"file", "dtype", "shape"})
        file, dtype, shape = value["file"], value["dtype"], value["shape"]
        if not isinstance(file, str) or not file.startswith(ARRAY_FOLDER + "/"):
            raise InvalidArgument(f"{what}: bad array file {str(file)[:80]!r}")
        if not isinstance(dtype, str) or not dtype.isidentifier():
            raise InvalidArgument(f"{what}: bad dtype {str(dtype)[:80]!r}")
        if not isinstance(shape, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= _MAX_INTEGER for n in shape
        ):
            raise InvalidArgument(f"{what}: bad shape {str(shape)[:80]!r} for {file}")
        return cls(file, dtype, tuple(shape))


class CheckpointFiles:
    """The files of one checkpoint being saved: each array's bytes as a file of its own, named
    by its position. The run's checkpoint commit hashes them and sends only the blobs the vault
    lacks, so an array unchanged since an earlier checkpoint costs no transfer and no storage."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def add(self, data: bytes, dtype: str, shape: Sequence[int], itemsize: int) -> ArrayRecord:
        record = ArrayRecord(f"{ARRAY_FOLDER}/{len(self.files)}", dtype, tuple(shape))
        if len(data) != record.nbytes(itemsize):
            raise InvalidArgument(
                f"an array of dtype {dtype} and shape {list(shape)} is "
                f"{record.nbytes(itemsize)} bytes, given {len(data)}"
            )
        self.files[record.file] = data
        return record

    def commit(self, run: Run, step: int, framework: str, body: Mapping[str, Any]) -> Checkpoint:
        """Commit the checkpoint through the run: the arrays and the tree document are stored,
        then the checkpoint manifest, which is pinned last."""
        document = {"type": TREE_TYPE, "v": TREE_VERSION, "framework": framework, **body}
        return run.checkpoint(step, {TREE_DOCUMENT: canonical_json(document), **self.files})


def read_tree(checkpoint: Checkpoint, framework: str, fields: set[str]) -> dict[str, Any]:
    """The tree document of a checkpoint saved by `framework`'s adapter, verified and decoded
    strictly; FailedPrecondition for a checkpoint that has none or was saved by another."""
    what = f"tree document of checkpoint {checkpoint.digest}"
    sizes = {f.path: f.size for f in checkpoint.manifest.files}
    if TREE_DOCUMENT not in sizes:
        raise FailedPrecondition(
            f"checkpoint {checkpoint.digest} (step {checkpoint.step}) was not saved by a "
            f"framework adapter: it has no {TREE_DOCUMENT}"
        )
    if sizes[TREE_DOCUMENT] > MAX_TREE_BYTES:
        raise InvalidArgument(f"{what} is {sizes[TREE_DOCUMENT]} bytes (at most {MAX_TREE_BYTES})")
    obj = load_json_object(what, checkpoint.read(TREE_DOCUMENT), MAX_TREE_BYTES)
    expect_fields(what, obj, {"type", "v", "framework", *fields})
    if obj["type"] != TREE_TYPE or obj["v"] != TREE_VERSION or isinstance(obj["v"], bool):
        raise InvalidArgument(
            f"{what}: type {str(obj['type'])[:80]!r} version {obj['v']!r}, "
            f"expected {TREE_TYPE!r} version {TREE_VERSION}"
        )
    if obj["framework"] != framework:
        raise FailedPrecondition(
            f"checkpoint {checkpoint.digest} (step {checkpoint.step}) was saved by the "
            f"{str(obj['framework'])[:40]} adapter, not {framework}"
        )
    return obj


def read_array(checkpoint: Checkpoint, record: ArrayRecord, itemsize: int) -> bytes:
    """An array's bytes, verified against their digest by the client and checked to be as many
    as its dtype and shape take (IntegrityError otherwise)."""
    try:
        data = checkpoint.read(record.file)
    except NotFound:
        raise IntegrityError(
            f"checkpoint {checkpoint.digest}: its tree document names {record.file}, "
            "which the checkpoint does not have"
        ) from None
    if len(data) != record.nbytes(itemsize):
        raise IntegrityError(
            f"checkpoint {checkpoint.digest}: {record.file} is {len(data)} bytes, but an array "
            f"of dtype {record.dtype} and shape {list(record.shape)} is {record.nbytes(itemsize)}"
        )
    return data


def latest_or_given(run: Run, checkpoint: Checkpoint | None) -> Checkpoint:
    """`checkpoint`, or the run's latest; NotFound when the run has none committed."""
    if checkpoint is not None:
        return checkpoint
    found = run.latest()
    if found is None:
        raise NotFound(f"run {run.run_id} has no committed checkpoint to restore")
    return found
