"""PyTorch state as run checkpoints (`vault.runs.frameworks.torch`), with the real PyTorch on
CPU and a real `vault serve`: a tiny model trained in its own process, through state dicts and
through `torch.distributed.checkpoint`, killed mid-training and started again, ends with
parameters and optimizer state bit for bit those of an uninterrupted run; an unchanged tensor
is not sent twice; a checkpoint cut short before its manifest's pin is not the latest; altered
bytes are refused."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.checkpoint_jobs import START_RUN, Trainer, admit_run, job_env, reports, spy_on_puts
from tests.services.tampering_proxy import TamperingProxy, flip_chunk
from tests.services.vault_server import REPO_ROOT, VaultServer, command_env
from vault.client import VaultClient
from vault.errors import FailedPrecondition, IntegrityError, InvalidArgument, NotFound
from vault.runs import Run, start
from vault.runs.frameworks.torch import (
    StateDictCheckpoints,
    VaultStorageReader,
    VaultStorageWriter,
)

STEPS = 8
SINGLE_PROCESS = "assuming the intent is to (save|load) in a single process"

TRAINER = textwrap.dedent(
    """
    import json, os, signal, sys, warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import vault.runs
    from vault.runs.frameworks.torch import (
        StateDictCheckpoints, VaultStorageReader, VaultStorageWriter,
    )

    STEPS = %(steps)d
    warnings.filterwarnings("ignore", message=".*single process")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)


    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )
            # Never trained: the same bytes at every step.
            self.register_buffer("frozen", torch.randn(4, 8).to(torch.bfloat16))

        def forward(self, x):
            return self.net(x + self.frozen[0].float())


    def setup(seed):
        torch.manual_seed(seed)
        model = Model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return model, optimizer, schedule


    def train(model, optimizer, schedule, seed, step):
        g = torch.Generator().manual_seed(seed * 1000 + step)
        x = torch.randn(32, 8, generator=g)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        schedule.step()


    def dump(model, optimizer, out):
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, out)


    mode, out = sys.argv[1], sys.argv[2]
    if mode == "reference":
        seed = int(sys.argv[3])
        model, optimizer, schedule = setup(seed)
        for step in range(STEPS):
            train(model, optimizer, schedule, seed, step)
        dump(model, optimizer, out)
        sys.exit()

    %(start_run)s
    seed = run.seed %% 2**31
    model, optimizer, schedule = setup(seed)
    checkpoints = StateDictCheckpoints(run)
    latest = checkpoints.latest()
    first, resumed = 0, None
    if latest is not None and mode == "state":
        restored = checkpoints.restore(
            {"model": model, "optim": optimizer, "schedule": schedule}, latest
        )
        first, resumed = restored["step"] + 1, latest.step
    elif latest is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "schedule": schedule.state_dict()}
        dcp.load(state, storage_reader=VaultStorageReader(run, latest))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        schedule.load_state_dict(state["schedule"])
        first, resumed = latest.step + 1, latest.step
    for step in range(first, STEPS):
        sys.stdin.readline()  # paced by the test while it sends lines; free once it closes
        train(model, optimizer, schedule, seed, step)
        if mode == "state":
            state = {"model": model, "optim": optimizer, "schedule": schedule, "step": step}
            saved = checkpoints.save(state, step)
        else:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state, "schedule": schedule.state_dict()}
            writer = VaultStorageWriter(run, step)
            dcp.save(state, storage_writer=writer)
            saved = writer.checkpoint
        print(json.dumps({"step": step, "resumed": resumed, "sent": len(saved.sent)}), flush=True)
    dump(model, optimizer, out)
    run.finish()
    """
)


@pytest.fixture
def client(vault_server: VaultServer) -> Iterator[VaultClient]:
    with vault_server.client() as c:
        yield c


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same_bits(found: Any, expected: Any, where: str = "state") -> None:
    """Equal structure and values, every tensor of the same dtype, shape and bytes."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(found, torch.Tensor), where
        assert (found.dtype, found.shape) == (expected.dtype, expected.shape), where
        assert bits(found) == bits(expected), f"{where} differs"
    elif isinstance(expected, dict):
        assert list(found) == list(expected), where
        for key in expected:
            same_bits(found[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert type(found) is type(expected) and len(found) == len(expected), where
        for n, (a, b) in enumerate(zip(found, expected, strict=True)):
            same_bits(a, b, f"{where}[{n}]")
    else:
        assert found == expected or (math.isnan(found) and math.isnan(expected)), where


@pytest.mark.parametrize("mode", ["state", "dcp"])
def test_training_killed_and_resumed_ends_bit_identical_to_an_uninterrupted_run(
    vault_server: VaultServer, client: VaultClient, tmp_path: Path, mode: str
) -> None:
    admission = admit_run(vault_server, client, tmp_path / "dataset")
    env = job_env(vault_server, admission, tmp_path)
    script = tmp_path / "train_torch.py"
    script.write_text(TRAINER % {"steps": STEPS, "start_run": START_RUN})
    out = str(tmp_path / "reference.pt")
    reference = subprocess.run(
        [sys.executable, str(script), "reference", out, str(admission.seed % 2**31)],
        env=command_env(extra={"PYTHONPATH": str(REPO_ROOT)}),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert reference.returncode == 0, reference.stderr
    resumed_out = str(tmp_path / "resumed.pt")

    # First attempt: three steps, each checkpointed, then SIGKILL while it waits for the next.
    first = Trainer(script, env, tmp_path / "job", mode, resumed_out)
    done = [first.step() for _ in range(3)]
    assert first.kill() == -9
    assert [(r["step"], r["resumed"]) for r in done] == [(0, None), (1, None), (2, None)]
    # The frozen buffer went once; from step 1 on, every blob sent is a changed tensor.
    assert done[1]["sent"] < done[0]["sent"]

    with start(client, environ=env, output_dir=tmp_path) as run:
        latest = run.latest()
        assert latest is not None and latest.step == 2
        # Second attempt: resumes from step 2, commits step 3, and is killed inside the commit
        # of step 4, after its tensors were stored but before its manifest was pinned.
        second = Trainer(
            script, {**env, "KILL_IN_COMMIT_OF_STEP": "4"}, tmp_path / "job", mode, resumed_out
        )
        status, output, err = second.finish()
        assert status == -9, err
        assert [(r["step"], r["resumed"]) for r in reports(output)] == [(3, 2)]
        latest = run.latest()
        assert latest is not None and latest.step == 3

        # Third attempt: resumes from step 3 (not the uncommitted 4) and trains to the end.
        third = Trainer(script, env, tmp_path / "job", mode, resumed_out)
        status, output, err = third.finish()
        assert status == 0, err
        assert [(r["step"], r["resumed"]) for r in reports(output)] == [
            (step, 3) for step in range(4, STEPS)
        ]
        run.close()
    found = torch.load(resumed_out, weights_only=True)
    expected = torch.load(out, weights_only=True)
    assert expected["optim"]["state"][0]["exp_avg"].abs().sum() > 0
    same_bits(found, expected)


def a_run(server: VaultServer, client: VaultClient, folder: Path) -> Run:
    admission = admit_run(server, client, folder / "dataset")
    return start(client, environ=job_env(server, admission, folder), output_dir=folder)


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    model.register_buffer("table", torch.randn(128, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_an_unchanged_tensor_is_not_stored_twice(
    vault_server: VaultServer,
    client: VaultClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = a_run(vault_server, client, tmp_path)
    checkpoints = StateDictCheckpoints(run)
    model, optimizer = model_and_optimizer(11)
    sent = spy_on_puts(client, monkeypatch)
    first = checkpoints.save({"model": model, "optim": optimizer}, 0)
    table = 128 * 64 * 4
    assert sum(sent) > table

    sent.clear()
    second = checkpoints.save({"model": model, "optim": optimizer}, 1)
    assert second.sent == frozenset() and len(sent) == 1  # the new manifest alone

    sent.clear()
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    third = checkpoints.save({"model": model, "optim": optimizer}, 2)
    # The parameters, Adam's moments and its step changed; the table did not, and its
    # 32 KiB were not sent again.
    stored_before = {f.sha256 for f in first.manifest.files}
    assert third.sent and third.sent.isdisjoint(stored_before)
    assert sum(sent) < sum(f.size for f in first.manifest.files) - table

    sent.clear()
    writer = VaultStorageWriter(run, 3)
    with pytest.warns(UserWarning, match=SINGLE_PROCESS):
        dcp.save({"model": model.state_dict()}, storage_writer=writer)
    assert writer.checkpoint is not None
    # The same tensors written through DCP are the same blobs: none went again.
    dcp_arrays = {f.sha256 for f in writer.checkpoint.manifest.files if "arrays/" in f.path}
    assert dcp_arrays and not dcp_arrays & writer.checkpoint.sent
    run.close()


def test_restore_loads_modules_and_optimizers_and_refuses_what_does_not_fit(
    vault_server: VaultServer, client: VaultClient, tmp_path: Path
) -> None:
    run = a_run(vault_server, client, tmp_path)
    checkpoints = StateDictCheckpoints(run)
    with pytest.raises(NotFound, match="has no committed checkpoint"):
        checkpoints.restore()
    model, optimizer = model_and_optimizer(12)
    extra = {"epoch": 3, "lr": 1e-3, "best": float("inf"), "name": "tiny", "none": None}
    half = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    checkpoints.save({"model": model, "optim": optimizer, "extra": extra, "half": half}, 4)

    fresh, fresh_optimizer = model_and_optimizer(13)
    restored = checkpoints.restore({"model": fresh, "optim": fresh_optimizer})
    same_bits(fresh.state_dict(), model.state_dict())
    same_bits(fresh_optimizer.state_dict(), optimizer.state_dict())
    assert restored["extra"] == extra and list(restored) == ["model", "optim", "extra", "half"]
    same_bits(restored["half"], half)

    with pytest.raises(InvalidArgument, match="target 'model' is a OrderedDict, which has no"):
        checkpoints.restore({"model": fresh.state_dict()})
    with pytest.raises(InvalidArgument, match="has no state 'scheduler'"):
        checkpoints.restore({"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)})
    with pytest.raises(InvalidArgument, match=r"state\['x'\] is a set"):
        checkpoints.save({"x": {1, 2}}, 5)
    with pytest.raises(InvalidArgument, match="sparse"):
        checkpoints.save({"x": torch.eye(3).to_sparse()}, 5)
    run.checkpoint(5, {"notes.txt": b"not a state dict"})
    with pytest.raises(FailedPrecondition, match="was not saved by a framework adapter"):
        checkpoints.restore()
    run.close()


def test_restore_refuses_a_tensor_whose_bytes_do_not_match(
    vault_server: VaultServer, client: VaultClient, tmp_path: Path
) -> None:
    admission = admit_run(vault_server, client, tmp_path / "dataset")
    env = job_env(vault_server, admission, tmp_path)
    run = start(client, environ=env, output_dir=tmp_path)
    model, _ = model_and_optimizer(14)
    saved = StateDictCheckpoints(run).save({"model": model}, 1)
    table = next(f.sha256 for f in saved.manifest.files if f.size == 128 * 64 * 4)

    # Between the vault and the job the table's bytes are altered on the wire, with a chunk
    # hash to match: the client checks the whole digest and refuses them, by either path.
    with TamperingProxy(vault_server.address) as proxy, VaultClient(proxy.address) as hostile:
        proxy.tamper("Store/Get", flip_chunk(digest=table))
        through = start(hostile, environ=env, output_dir=tmp_path)
        with pytest.raises(IntegrityError, match=table):
            StateDictCheckpoints(through).restore()

        with pytest.warns(UserWarning, match=SINGLE_PROCESS):
            dcp.save({"model": model.state_dict()}, storage_writer=VaultStorageWriter(run, 2))
        target = {"model": model_and_optimizer(15)[0].state_dict()}
        with pytest.raises(CheckpointException) as refused, pytest.warns(UserWarning):
            dcp.load(target, storage_reader=VaultStorageReader(through))
        # DCP gathers each rank's failure; this process's is the client's refusal.
        (failure,) = refused.value.failures.values()
        assert "IntegrityError" in str(failure) and table in str(failure)
        assert not torch.equal(target["model"]["table"], model.state_dict()["table"])

        proxy.clear("Store/Get")
        with pytest.warns(UserWarning, match=SINGLE_PROCESS):
            dcp.load(target, storage_reader=VaultStorageReader(through))
        same_bits(target["model"], model.state_dict())

    # The blob rotted in the vault's own store: the vault refuses to serve it.
    stored = vault_server.blob_path(table)
    blob = bytearray(stored.read_bytes())
    blob[100] ^= 0xFF
    stored.chmod(0o644)
    stored.write_bytes(bytes(blob))
    with pytest.raises(IntegrityError):
        StateDictCheckpoints(run).restore(checkpoint=saved)
    run.close()
