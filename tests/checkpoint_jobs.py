"""What the framework checkpoint tests share: a run admitted on a real `vault serve`, the job
environment the scheduler would give it, and a training script driven step by step in its own
process, so that a test can SIGKILL it mid-training and start it again as a preempted job is."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import pytest

from tests.services.vault_server import REPO_ROOT, VaultServer, command_env

# What `vault run` gives a job: the run library tests' own, so that both say the same.
from tests.test_run_library import job_env as job_env
from vault.client import Admission, VaultClient
from vault.runs.dataset import add_dataset

# How a training script starts its run: as a job preempted (SIGKILL) inside the commit of step
# $KILL_IN_COMMIT_OF_STEP, after its blobs were stored and before its manifest is pinned.
START_RUN = """\
run = vault.runs.start()
kill_at = os.environ.get("KILL_IN_COMMIT_OF_STEP")
real_pin = run.client.pin


def pin(kind, subjects, meta=None, **options):
    if kind == "checkpoint" and meta and meta.get("step") == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)  # preempted after the puts, before the pin
    return real_pin(kind, subjects, meta=meta, **options)


run.client.pin = pin"""


def admit_run(server: VaultServer, client: VaultClient, folder: Path, **options: str) -> Admission:
    """A fresh run: an image and a dataset stored and pinned, and the run admitted on them."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.csv").write_bytes(b"x,y\n1,2\n")
    image = str(client.put(b"an image for the framework checkpoint tests").blob.sha256)
    client.pin("image", image, meta={"name": "trainer"})
    dataset = add_dataset(client, folder, name="tiny").digest
    return client.admit(image=image, dataset=dataset, seed=random.getrandbits(32), **options)


class Trainer:
    """A training script in a process of its own. Started with `paced`, it waits for a line on
    its standard input before each step and prints one JSON line after each checkpoint."""

    def __init__(self, script: Path, env: dict[str, str], cwd: Path, *args: str) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [sys.executable, str(script), *args],
            env=command_env(extra={**env, "PYTHONPATH": str(REPO_ROOT)}),
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def step(self) -> dict[str, Any]:
        """Let the script take one step, and return what it printed once it had saved it."""
        stdin, stdout = self._pipes()
        stdin.write("go\n")
        stdin.flush()
        line = stdout.readline()
        if not line:
            raise AssertionError(f"the trainer stopped: {self.finish()[1]}")
        report: dict[str, Any] = json.loads(line)
        return report

    def kill(self) -> int:
        """SIGKILL the script, as a preemption does, and return its exit status."""
        self.process.send_signal(signal.SIGKILL)
        self.process.communicate(timeout=60)  # and close the pipes
        return self.process.returncode

    def finish(self) -> tuple[int, str, str]:
        """Close its input (no more pacing), wait for it, and return status, output, errors."""
        out, err = self.process.communicate(timeout=240)
        return self.process.returncode, out, err

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        assert self.process.stdin is not None and self.process.stdout is not None
        return self.process.stdin, self.process.stdout


def spy_on_puts(client: VaultClient, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every blob `client` sends from now on (by put or put_many), in order."""
    sent: list[int] = []
    put, put_many = client.put, client.put_many

    def size(source: Any) -> int:
        return len(source) if isinstance(source, bytes) else Path(source).stat().st_size

    def counting_put(source: Any, **options: Any) -> Any:
        sent.append(size(source))
        return put(source, **options)

    def counting_put_many(sources: Any, **options: Any) -> Any:
        sent.extend(size(s) for s in sources)
        return put_many(sources, **options)

    monkeypatch.setattr(client, "put", counting_put)
    monkeypatch.setattr(client, "put_many", counting_put_many)
    return sent


def reports(output: str) -> list[dict[str, Any]]:
    """Every JSON line a trainer printed."""
    return [json.loads(line) for line in output.splitlines() if line.strip()]
