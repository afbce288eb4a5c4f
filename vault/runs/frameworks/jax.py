"""JAX pytrees as run checkpoints (`pip install 'pinvault[jax]'`): `save(state, step)`,
`latest()`, `restore(target)`, each leaf a blob of its own named by its digest.

Why not an Orbax storage backend: Orbax writes a checkpoint as a directory tree through
TensorStore's key-value drivers (a local or cloud file system) and commits it by renaming the
step's directory (or by a commit-marker file), and `CheckpointManager` finds steps by listing
directories. The vault is neither a file system nor a key-value store of names: it holds blobs
by digest, and a checkpoint exists when the ledger pins its manifest. Backing Orbax's storage
with it would make a second notion of a committed checkpoint beside the run's. So the pytree is
flattened here with `jax.tree_util` (its key paths name the leaves), each leaf's bytes stored as
one file of the run's checkpoint, and the checkpoint committed by `Run.checkpoint`, manifest
last. Orbax's own arguments are taken where they fit: `save` accepts `ocp.args.StandardSave`
and `restore` `ocp.args.StandardRestore`, whose `item` is the pytree or its abstract form
(`jax.ShapeDtypeStruct` leaves), as `CheckpointManager.save`/`restore` take them.
"""

from __future__ import annotations

import sys
from typing import Any, Final

import jax
import jax.numpy as jnp
import numpy as np

from vault.errors import InvalidArgument
from vault.runs.frameworks.arrays import (
    ArrayRecord,
    CheckpointFiles,
    latest_or_given,
    read_array,
    read_tree,
)
from vault.runs.run import Checkpoint, Run

FRAMEWORK: Final = "jax"


class PytreeCheckpoints:
    """A run's checkpoints of a JAX pytree (the parameters and optimizer state of a training
    loop). `latest()` is the run's latest checkpoint, as `Run.latest()` finds it after a
    preemption; `restore(target)` gives it back in the target's structure."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def save(self, state: Any, step: int) -> Checkpoint:
        """Commit `state` (a pytree, or `ocp.args.StandardSave(pytree)`) as the run's checkpoint
        of `step`. Every leaf is stored as its raw bytes, one blob per leaf, sent only if the
        vault lacks it (`checkpoint.sent` lists what was sent); the checkpoint exists once its
        manifest is pinned, after everything else was stored."""
        tree = _orbax_item(state, "StandardSave")
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        files = CheckpointFiles()
        records: list[dict[str, Any]] = []
        seen: set[str] = set()
        for path, leaf in leaves:
            name = jax.tree_util.keystr(path)
            if name in seen:
                raise InvalidArgument(f"two leaves of the pytree have the path {name}")
            seen.add(name)
            array = _host_array(name, leaf)
            record = files.add(array.tobytes(), array.dtype.name, array.shape, array.itemsize)
            records.append({"path": name, "array": record.as_json()})
        body = {"treedef": str(treedef), "leaves": records}
        return files.commit(self.run, step, FRAMEWORK, body)

    def latest(self) -> Checkpoint | None:
        """The run's newest committed checkpoint, or None (`Run.latest()`)."""
        return self.run.latest()

    def latest_step(self) -> int | None:
        """The step of the newest committed checkpoint, or None, as Orbax's manager says it."""
        found = self.run.latest()
        return None if found is None else found.step

    def restore(self, target: Any, checkpoint: Checkpoint | None = None) -> Any:
        """The pytree saved in `checkpoint` (default: the latest), in the structure of `target`
        (a pytree of arrays, or of `jax.ShapeDtypeStruct`, or `ocp.args.StandardRestore` of
        either). Each leaf takes its saved bytes, verified against their digest, and the
        target leaf's kind: a `jax.Array` on the target's sharding, a NumPy array, or a Python
        scalar. InvalidArgument, naming the leaf, if the paths, shapes or dtypes differ;
        IntegrityError if a blob's bytes do not match; NotFound if there is no checkpoint."""
        tree = _orbax_item(target, "StandardRestore")
        found = latest_or_given(self.run, checkpoint)
        document = read_tree(found, FRAMEWORK, {"treedef", "leaves"})
        saved = _saved_leaves(found, document["leaves"])
        wanted, treedef = jax.tree_util.tree_flatten_with_path(tree)
        names = [jax.tree_util.keystr(path) for path, _ in wanted]
        missing = [n for n in names if n not in saved]
        if missing:
            raise InvalidArgument(
                f"checkpoint of step {found.step} has no leaf {missing[0]} of the target "
                f"({len(missing)} missing)"
            )
        extra = sorted(set(saved) - set(names))
        if extra:
            raise InvalidArgument(
                f"checkpoint of step {found.step} has leaf {extra[0]}, which the target lacks "
                f"({len(extra)} more than the target)"
            )
        values = [
            _restored(found, name, saved[name], leaf)
            for name, (_, leaf) in zip(names, wanted, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, values)


def _orbax_item(value: Any, kind: str) -> Any:
    """The pytree of an Orbax `StandardSave` or `StandardRestore`, or `value` itself. Orbax is
    looked at only if the caller has imported it, since it is not needed otherwise."""
    ocp = sys.modules.get("orbax.checkpoint")
    if ocp is None or not isinstance(value, ocp.args.CheckpointArgs):
        return value
    wanted = getattr(ocp.args, kind)
    if not isinstance(value, wanted):
        raise InvalidArgument(f"expected ocp.args.{kind}, given {type(value).__name__}")
    if kind == "StandardSave":
        if value.save_args is not None:
            raise InvalidArgument("StandardSave's save_args are not supported: leave them unset")
    elif value.item is None:
        raise InvalidArgument("StandardRestore needs the target pytree (its item) to restore")
    elif not value.strict or value.support_layout or value.fallback_sharding is not None:
        raise InvalidArgument(
            "StandardRestore's strict, support_layout and fallback_sharding are not supported: "
            "leave them at their defaults"
        )
    return value.item


def _host_array(name: str, leaf: Any) -> np.ndarray[Any, Any]:
    """A leaf as a little-endian NumPy array on the host."""
    if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        raise InvalidArgument(
            f"leaf {name} is a typed PRNG key: save jax.random.key_data(key) instead"
        )
    try:
        array = np.asarray(leaf)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"leaf {name} is not an array: {exc}") from None
    # NumPy's numeric kinds, and the ml_dtypes ones JAX adds (bfloat16, float8_*, int4...),
    # which NumPy sees as opaque ("V") but names; plain or structured voids are not arrays.
    kind = array.dtype.kind
    if kind not in "biufc" and (kind != "V" or array.dtype.name.startswith("void")):
        raise InvalidArgument(f"leaf {name} has dtype {array.dtype}, which is not numeric")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    # tobytes() gives C order whatever the layout (np.ascontiguousarray would make a 0-d leaf 1-d)
    return array


def _saved_leaves(found: Checkpoint, value: object) -> dict[str, ArrayRecord]:
    what = f"tree document of checkpoint {found.digest}"
    if not isinstance(value, list):
        raise InvalidArgument(f"{what}: leaves is not a list")
    saved: dict[str, ArrayRecord] = {}
    for n, item in enumerate(value):
        if not isinstance(item, dict) or set(item) != {"path", "array"}:
            raise InvalidArgument(f"{what}: leaf {n} is not an object of path and array")
        path = item["path"]
        if not isinstance(path, str) or path in saved:
            raise InvalidArgument(f"{what}: leaf {n} has a bad or repeated path")
        saved[path] = ArrayRecord.decode(what, item["array"])
    return saved


def _restored(found: Checkpoint, name: str, record: ArrayRecord, want: Any) -> Any:
    try:
        dtype = jnp.dtype(record.dtype)
    except TypeError:
        raise InvalidArgument(
            f"checkpoint of step {found.step}: leaf {name} has dtype {record.dtype}, "
            "which this JAX does not know"
        ) from None
    shape, kind = getattr(want, "shape", None), getattr(want, "dtype", None)
    if isinstance(want, bool | int | float | complex):
        shape, kind = (), None
    if shape is not None and tuple(shape) != record.shape:
        raise InvalidArgument(
            f"checkpoint of step {found.step}: leaf {name} has shape {list(record.shape)}, "
            f"the target's is {list(shape)}"
        )
    if kind is not None and jnp.dtype(kind) != dtype:
        raise InvalidArgument(
            f"checkpoint of step {found.step}: leaf {name} has dtype {dtype}, "
            f"the target's is {jnp.dtype(kind)}"
        )
    data = read_array(found, record, dtype.itemsize)
    array = np.frombuffer(data, dtype=dtype).reshape(record.shape).copy()
    if isinstance(want, jax.Array | jax.ShapeDtypeStruct):
        sharding = getattr(want, "sharding", None)
        return jax.device_put(array, sharding) if sharding is not None else jnp.asarray(array)
    if isinstance(want, np.ndarray):
        return array
    if isinstance(want, np.generic):
        return array[()]
    if isinstance(want, bool | int | float | complex):
        return type(want)(array.item())
    return jnp.asarray(array)
