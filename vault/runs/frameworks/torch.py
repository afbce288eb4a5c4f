"""PyTorch training state as run checkpoints (`pip install 'pinvault[torch]'`): state dicts
through `StateDictCheckpoints` (`save({"model": model, "optim": optimizer}, step)`, `latest()`,
`restore(target)`), and `torch.distributed.checkpoint` through `VaultStorageWriter` and
`VaultStorageReader`. Each tensor (each chunk DCP writes) is stored as its raw bytes, one blob
per tensor named by its digest, so a tensor unchanged since an earlier checkpoint is not sent
again; the checkpoint is committed through the run, its manifest pinned last.

Tensors are stored C-ordered and little-endian (the byte order of every platform PyTorch
ships wheels for), so the same tensor saved by either path, or by the JAX adapter as an
array of the same dtype, is the same blob.
"""

from __future__ import annotations

import io
import pickle
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from vault.errors import FailedPrecondition, IntegrityError, InvalidArgument
from vault.runs.frameworks.arrays import (
    ArrayRecord,
    CheckpointFiles,
    latest_or_given,
    read_array,
    read_tree,
)
from vault.runs.run import Checkpoint, Run

FRAMEWORK: Final = "torch"
DCP_FRAMEWORK: Final = "torch.distributed.checkpoint"
# DCP's own metadata (the state dict's layout, and where each item's bytes are), pickled as
# DCP's file-system storage keeps it; read back only from a checkpoint whose digest matched an
# entry the run's own team pinned.
DCP_METADATA: Final = "dcp.metadata"
_INTEGER: Final = re.compile(r"-?(0|[1-9][0-9]*)")


class StateDictCheckpoints:
    """A run's checkpoints of PyTorch state: a mapping of names to modules, optimizers, LR
    schedulers (anything with `state_dict()` and `load_state_dict()`) or state dicts."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def save(self, state: Mapping[str, Any], step: int) -> Checkpoint:
        """Commit `state` as the run's checkpoint of `step`: each object's `state_dict()` (or
        the value itself), every tensor a blob of its own, sent only if the vault lacks it
        (`checkpoint.sent`), and the other values (numbers, strings, lists, `None`) exactly,
        in the tree document. InvalidArgument, naming where, for a value of another kind."""
        if not isinstance(state, Mapping):
            raise InvalidArgument(f"expected a mapping of names to state, given {type(state)}")
        values = {
            name: value.state_dict() if _stateful(value) else value for name, value in state.items()
        }
        files = CheckpointFiles()
        body = {"state": _encode(values, files, "state")}
        return files.commit(self.run, step, FRAMEWORK, body)

    def latest(self) -> Checkpoint | None:
        """The run's newest committed checkpoint, or None (`Run.latest()`)."""
        return self.run.latest()

    def restore(
        self, target: Mapping[str, Any] | None = None, checkpoint: Checkpoint | None = None
    ) -> dict[str, Any]:
        """The state saved in `checkpoint` (default: the latest), tensors on the CPU, each
        verified against its digest. Every value of `target` (a module, an optimizer... anything
        with `load_state_dict`) is loaded with the state saved under its name. InvalidArgument
        for a name the checkpoint lacks or a value that cannot load; IntegrityError if a blob's
        bytes do not match; NotFound if the run has no checkpoint."""
        wanted = dict(target or {})
        for name, value in wanted.items():
            if not _stateful(value):
                # Loading into a plain state dict in place is what dcp.load does; here it would
                # silently do nothing, so it is refused.
                raise InvalidArgument(
                    f"target {name!r} is a {type(value).__name__}, which has no load_state_dict: "
                    "give the module or optimizer itself, or read the returned state"
                )
        found = latest_or_given(self.run, checkpoint)
        document = read_tree(found, FRAMEWORK, {"state"})
        restored = _decode(document["state"], found, "state")
        if not isinstance(restored, dict):
            raise InvalidArgument(f"checkpoint {found.digest}: its state is not a mapping")
        missing = [name for name in wanted if name not in restored]
        if missing:  # checked before anything is loaded, so a refusal changes nothing
            raise InvalidArgument(
                f"checkpoint of step {found.step} has no state {missing[0]!r} "
                f"(it has {', '.join(map(repr, restored)) or 'none'})"
            )
        for name, value in wanted.items():
            value.load_state_dict(restored[name])
        return restored


class VaultStorageWriter(StorageWriter):
    """`torch.distributed.checkpoint` storage that writes the run's checkpoint of `step`:
    `dcp.save(state_dict, storage_writer=VaultStorageWriter(run, step))`. Every item DCP
    writes is a blob of its own; `finish` commits the checkpoint (then in `checkpoint`).
    One process writes the whole checkpoint (no process group, or a group of one)."""

    def __init__(self, run: Run, step: int) -> None:
        super().__init__()
        self.run = run
        self.step = step
        self.checkpoint: Checkpoint | None = None
        self._files = CheckpointFiles()

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            raise InvalidArgument("the run and step name the checkpoint: pass no checkpoint_id")
        self._files = CheckpointFiles()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not is_coordinator:
            raise FailedPrecondition("a vault checkpoint is written by one process, rank 0")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                record = self._files.add(raw, "uint8", (len(raw),), 1)
            else:
                raw, dtype, shape, itemsize = _tensor_bytes(data, item.index.fqn)
                record = self._files.add(raw, dtype, shape, itemsize)
            results.append(WriteResult(item.index, len(raw), record.as_json()))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        self._files.files[DCP_METADATA] = pickle.dumps(metadata)
        self.checkpoint = self._files.commit(self.run, self.step, DCP_FRAMEWORK, {})

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class VaultStorageReader(StorageReader):
    """`torch.distributed.checkpoint` storage that reads a run's checkpoint (default: the
    latest): `dcp.load(state_dict, storage_reader=VaultStorageReader(run))` loads it into the
    tensors of `state_dict` in place, every byte verified against its digest."""

    def __init__(self, run: Run, checkpoint: Checkpoint | None = None) -> None:
        super().__init__()
        self.run = run
        self.checkpoint = checkpoint
        self._items: dict[Any, Any] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            raise InvalidArgument("the run names the checkpoint: pass no checkpoint_id")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        found = self.checkpoint = latest_or_given(self.run, self.checkpoint)
        read_tree(found, DCP_FRAMEWORK, set())
        metadata = pickle.loads(found.read(DCP_METADATA))
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise IntegrityError(f"checkpoint {found.digest}: {DCP_METADATA} is not DCP metadata")
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._items = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        found = self.checkpoint
        assert found is not None, "read_metadata comes first"
        what = f"DCP metadata of checkpoint {found.digest}"
        for item in plan.items:
            if item.storage_index not in self._items:
                raise IntegrityError(f"{what}: no record of {item.storage_index.fqn}")
            record = ArrayRecord.decode(what, self._items[item.storage_index])
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(read_array(found, record, 1)))
                continue
            tensor = _tensor(found, record)
            for dim, (offset, length) in enumerate(
                zip(item.storage_offsets, item.lengths, strict=True)
            ):
                tensor = tensor.narrow(dim, offset, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != tensor.size():
                raise IntegrityError(
                    f"{what}: {item.storage_index.fqn} is {list(tensor.size())}, "
                    f"the state dict's tensor {list(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


# ---------------------------------------------------------------------- tensors


def _stateful(value: object) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"dtype {name!r} is not one this PyTorch knows")
    return dtype


def _tensor_bytes(tensor: object, where: str) -> tuple[bytes, str, tuple[int, ...], int]:
    """A tensor's bytes in C order, its dtype's name, shape and element size."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgument(f"{where} is a {type(tensor).__name__}, expected a tensor")
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise InvalidArgument(f"{where} is a {tensor.layout} tensor: only dense ones are stored")
    t = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return data, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.element_size()


def _tensor(found: Checkpoint, record: ArrayRecord) -> torch.Tensor:
    dtype = _dtype(record.dtype)
    data = read_array(found, record, dtype.itemsize)
    if not data:
        return torch.empty(record.shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(dtype).reshape(record.shape)


# ---------------------------------------------------------------------- the tree document


def _encode(value: object, files: CheckpointFiles, where: str) -> dict[str, Any]:
    """A value of a state dict as a node of the tree document; tensors go into `files`."""
    if isinstance(value, torch.Tensor):
        data, dtype, shape, itemsize = _tensor_bytes(value, where)
        return {"tensor": files.add(data, dtype, shape, itemsize).as_json()}
    if value is None:
        return {"none": None}
    if isinstance(value, bool):  # before int, of which bool is a subclass
        return {"bool": value}
    if isinstance(value, int):
        return {"int": str(value)}
    if isinstance(value, float):
        return {"float": value.hex()}  # exact, and NaN and infinities too, which JSON lacks
    if isinstance(value, str):
        return {"str": value}
    if isinstance(value, Mapping):
        node: dict[str, Any] = {
            "dict": [
                [_encode_key(k, where), _encode(v, files, f"{where}[{k!r}]")]
                for k, v in value.items()
            ]
        }
        # A module's state dict carries each submodule's version here, which loading reads.
        metadata = getattr(value, "_metadata", None)
        if isinstance(metadata, Mapping):
            node["metadata"] = _encode(metadata, files, f"{where}._metadata")
        return node
    if isinstance(value, tuple | list):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return {kind: [_encode(v, files, f"{where}[{n}]") for n, v in enumerate(value)]}
    raise InvalidArgument(
        f"{where} is a {type(value).__name__}: a checkpoint holds tensors, numbers, strings, "
        "None, and dicts, lists and tuples of them"
    )


def _encode_key(key: object, where: str) -> dict[str, Any]:
    if isinstance(key, str | int | float | bool) or key is None:
        return _encode(key, CheckpointFiles(), where)
    raise InvalidArgument(f"{where} has a key of type {type(key).__name__}")


def _decode(node: object, found: Checkpoint, where: str) -> Any:
    what = f"tree document of checkpoint {found.digest}: {where}"
    if not isinstance(node, dict) or not node:
        raise InvalidArgument(f"{what} is not a node")
    kind = next(iter(node))
    value = node[kind]
    if set(node) - ({"dict", "metadata"} if kind == "dict" else {kind}):
        raise InvalidArgument(f"{what} has unknown fields {sorted(node)}")
    if kind == "tensor":
        return _tensor(found, ArrayRecord.decode(what, value))
    if kind == "none" and value is None:
        return None
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "int" and isinstance(value, str) and _INTEGER.fullmatch(value):
        return int(value)
    if kind == "float" and isinstance(value, str):
        try:
            return float.fromhex(value)
        except ValueError:
            raise InvalidArgument(f"{what} is not a float: {value[:40]!r}") from None
    if kind == "str" and isinstance(value, str):
        return value
    if kind in ("list", "tuple") and isinstance(value, list):
        items = [_decode(v, found, f"{where}[{n}]") for n, v in enumerate(value)]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict" and isinstance(value, list):
        result: dict[Any, Any] = OrderedDict()
        for n, pair in enumerate(value):
            if not isinstance(pair, list) or len(pair) != 2:
                raise InvalidArgument(f"{what} item {n} is not a [key, value] pair")
            key = _decode(pair[0], found, f"{where} key {n}")
            result[key] = _decode(pair[1], found, f"{where}[{key!r}]")
        if "metadata" in node:
            result._metadata = _decode(node["metadata"], found, f"{where}._metadata")  # type: ignore[attr-defined]
        return result
    raise InvalidArgument(f"{what}: bad {kind!r} node")
