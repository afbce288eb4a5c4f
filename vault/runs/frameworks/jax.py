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
            entry: dict[str, Any] = {"path": name}
            if _is_key(leaf):
                # A typed PRNG key is stored as its key data, with the implementation's name.
                entry["key"] = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
            array = _host_array(name, leaf)
            record = files.add(array.tobytes(), array.dtype.name, array.shape, array.itemsize)
            records.append({**entry, "array": record.as_json()})
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
        saved, keys = _saved_leaves(found, document["leaves"])
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
            _restored(found, name, saved[name], leaf, keys.get(name))
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


def _is_key(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _saved_leaves(
    found: Checkpoint, value: object
) -> tuple[dict[str, ArrayRecord], dict[str, str]]:
    """Each saved leaf's array by path, and the PRNG implementation of those that are keys."""
    what = f"tree document of checkpoint {found.digest}"
    if not isinstance(value, list):
        raise InvalidArgument(f"{what}: leaves is not a list")
    saved: dict[str, ArrayRecord] = {}
    keys: dict[str, str] = {}
    for n, item in enumerate(value):
        if not isinstance(item, dict) or not {"path", "array"} <= set(item) <= {
            "path",
            "array",
            "key",
        }:
            raise InvalidArgument(f"{what}: leaf {n} is not an object of path, array (and key)")
        path = item["path"]
        if not isinstance(path, str) or path in saved:
            raise InvalidArgument(f"{what}: leaf {n} has a bad or repeated path")
        saved[path] = ArrayRecord.decode(what, item["array"])
        if "key" in item:
            if not isinstance(item["key"], str):
                raise InvalidArgument(f"{what}: leaf {n} has a bad key implementation")
            keys[path] = item["key"]
    return saved, keys


def _restored(found: Checkpoint, name: str, record: ArrayRecord, want: Any, key: str | None) -> Any:
    if key is not None or _is_key(want):
        return _restored_key(found, name, record, want, key)
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


def _restored_key(
    found: Checkpoint, name: str, record: ArrayRecord, want: Any, key: str | None
) -> Any:
    """A typed PRNG key leaf: its key data, wrapped with the implementation it was saved with,
    which must be the target's."""
    if key is None or not _is_key(want):
        saved = f"a PRNG key of {key}" if key is not None else "an array"
        target = "a PRNG key" if _is_key(want) else "not one"
        raise InvalidArgument(
            f"checkpoint of step {found.step}: leaf {name} is {saved}, the target's is {target}"
        )
    impl = str(jax.random.key_impl(want)) if isinstance(want, jax.Array) else None
    data_shape = jax.eval_shape(jax.random.key_data, want).shape
    if tuple(data_shape) != record.shape or (impl is not None and impl != key):
        raise InvalidArgument(
            f"checkpoint of step {found.step}: leaf {name} is a {key} key of data shape "
            f"{list(record.shape)}, the target's {impl or 'key'} has {list(data_shape)}"
        )
    dtype = jnp.dtype(record.dtype)
    data = np.frombuffer(read_array(found, record, dtype.itemsize), dtype=dtype)
    restored = jax.random.wrap_key_data(jnp.asarray(data.reshape(record.shape)), impl=key)
    sharding = getattr(want, "sharding", None)
    return jax.device_put(restored, sharding) if sharding is not None else restored
