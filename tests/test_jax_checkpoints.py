"""JAX pytrees as run checkpoints (`vault.runs.frameworks.jax`), with the real JAX on CPU and a
real `vault serve`: a tiny model trained in its own process, killed mid-training and started
again, ends bit for bit where an uninterrupted run ends; an unchanged leaf is not sent twice; a
checkpoint cut short before its manifest's pin is not the latest; altered bytes are refused."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.checkpoint_jobs import START_RUN, Trainer, admit_run, job_env, reports, spy_on_puts
from tests.services.tampering_proxy import TamperingProxy, flip_chunk
from tests.services.vault_server import REPO_ROOT, VaultServer, command_env
from vault.client import VaultClient
from vault.errors import FailedPrecondition, IntegrityError, InvalidArgument, NotFound
from vault.runs import Run, start
from vault.runs.frameworks.jax import PytreeCheckpoints

STEPS = 8

TRAINER = textwrap.dedent(
    """
    import json, os, signal, sys
    from typing import NamedTuple

    import jax, jax.numpy as jnp, numpy as np

    import vault.runs
    from vault.runs.frameworks.jax import PytreeCheckpoints

    STEPS = %(steps)d


    class Adam(NamedTuple):
        count: jax.Array
        mu: dict
        nu: dict


    def init(seed):
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
        params = {
            "w1": jax.random.normal(k1, (8, 16)) * 0.3,
            "b1": jnp.zeros(16),
            "w2": jax.random.normal(k2, (16, 1)) * 0.3,
            "b2": jnp.zeros(1),
        }
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return {
            "params": params,
            "frozen": jax.random.normal(k3, (4, 8)).astype(jnp.bfloat16),
            "opt": Adam(jnp.zeros((), jnp.int32), zeros, zeros),
            "step": 0,
        }


    def batch(seed, step):
        rng = np.random.default_rng([seed, step])
        x = rng.standard_normal((32, 8)).astype(np.float32)
        return jnp.asarray(x), jnp.asarray(np.sin(x.sum(axis=1, keepdims=True)))


    def loss(params, frozen, x, y):
        h = jnp.tanh((x + frozen[0].astype(jnp.float32)) @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


    @jax.jit
    def update(params, opt, frozen, x, y):
        grads = jax.grad(loss)(params, frozen, x, y)
        count = opt.count + 1
        mu = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, opt.mu, grads)
        nu = jax.tree_util.tree_map(lambda v, g: 0.999 * v + 0.001 * g * g, opt.nu, grads)
        c = count.astype(jnp.float32)
        params = jax.tree_util.tree_map(
            lambda p, m, v: p - 0.01 * (m / (1 - 0.9**c)) / (jnp.sqrt(v / (1 - 0.999**c)) + 1e-8),
            params, mu, nu,
        )
        return params, Adam(count, mu, nu)


    def train(state, seed, step):
        x, y = batch(seed, step)
        params, opt = update(state["params"], state["opt"], state["frozen"], x, y)
        return {**state, "params": params, "opt": opt, "step": step + 1}


    def dump(state, out):
        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        arrays = {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}
        np.savez(out, **arrays)


    mode, out = sys.argv[1], sys.argv[2]
    if mode == "reference":
        seed = int(sys.argv[3])
        state = init(seed)
        for step in range(STEPS):
            state = train(state, seed, step)
        dump(state, out)
        sys.exit()

    %(start_run)s
    checkpoints = PytreeCheckpoints(run)
    state = init(run.seed)
    latest = checkpoints.latest()
    resumed = None
    if latest is not None:
        state = checkpoints.restore(state, latest)
        resumed = latest.step
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    for step in range(state["step"], STEPS):
        sys.stdin.readline()  # paced by the test while it sends lines; free once it closes
        state = train(state, run.seed, step)
        saved = checkpoints.save(state, step)
        files = {f.path: f.sha256 for f in saved.manifest.files}
        sent = [n for i, n in enumerate(names) if files[f"arrays/{i}"] in saved.sent]
        print(json.dumps({"step": step, "resumed": resumed, "sent": sent}), flush=True)
    dump(state, out)
    run.finish()
    """
)


@pytest.fixture
def client(vault_server: VaultServer) -> Iterator[VaultClient]:
    with vault_server.client() as c:
        yield c


def trainer_script(folder: Path) -> Path:
    script = folder / "train_jax.py"
    script.write_text(TRAINER % {"steps": STEPS, "start_run": START_RUN})
    return script


def same_bits(found: Path, expected: Path) -> None:
    with np.load(found) as a, np.load(expected) as b:
        assert sorted(a.files) == sorted(b.files)
        for name in a.files:
            assert a[name].dtype == b[name].dtype, name
            assert a[name].shape == b[name].shape, name
            assert a[name].tobytes() == b[name].tobytes(), f"{name} differs"


def test_training_killed_and_resumed_ends_bit_identical_to_an_uninterrupted_run(
    vault_server: VaultServer, client: VaultClient, tmp_path: Path
) -> None:
    admission = admit_run(vault_server, client, tmp_path / "dataset")
    env = job_env(vault_server, admission, tmp_path)
    script = trainer_script(tmp_path)

    out = str(tmp_path / "reference.npz")
    reference = subprocess.run(
        [sys.executable, str(script), "reference", out, str(admission.seed)],
        env=command_env(extra={"PYTHONPATH": str(REPO_ROOT)}),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert reference.returncode == 0, reference.stderr

    # First attempt: three steps, each checkpointed, then SIGKILL while it waits for the next.
    first = Trainer(script, env, tmp_path / "job", "train", str(tmp_path / "resumed.npz"))
    done = [first.step() for _ in range(3)]
    assert first.kill() == -9
    assert [(r["step"], r["resumed"]) for r in done] == [(0, None), (1, None), (2, None)]
    everything = set(done[0]["sent"])
    assert {"['frozen']", "['params']['w1']", "['opt'].mu['w1']", "['step']"} <= everything
    # The frozen leaf never changes: the vault got its bytes once, at step 0.
    assert "['frozen']" not in done[1]["sent"] and "['frozen']" not in done[2]["sent"]
    assert "['params']['w1']" in done[1]["sent"] and "['opt'].count" in done[2]["sent"]

    with start(client, environ=env, output_dir=tmp_path) as run:
        latest = run.latest()
        assert latest is not None and latest.step == 2
        # Second attempt: resumes from step 2, commits step 3, and is killed inside the commit
        # of step 4, after its arrays were stored but before its manifest was pinned.
        second = Trainer(
            script,
            {**env, "KILL_IN_COMMIT_OF_STEP": "4"},
            tmp_path / "job",
            "train",
            str(tmp_path / "resumed.npz"),
        )
        status, out, err = second.finish()
        assert status == -9, err
        assert [(r["step"], r["resumed"]) for r in reports(out)] == [(3, 2)]
        latest = run.latest()
        assert latest is not None and latest.step == 3

        # Third attempt: resumes from step 3 (not the uncommitted 4) and trains to the end.
        third = Trainer(script, env, tmp_path / "job", "train", str(tmp_path / "resumed.npz"))
        status, out, err = third.finish()
        assert status == 0, err
        assert [(r["step"], r["resumed"]) for r in reports(out)] == [
            (step, 3) for step in range(4, STEPS)
        ]
        run.close()
    same_bits(tmp_path / "resumed.npz", tmp_path / "reference.npz")


def state(salt: int = 0) -> dict[str, Any]:
    """A small pytree; tests share one vault, so each salts its arrays to be sure which blobs
    it stored itself."""
    return {
        "params": {
            "w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) + salt,
            "b": jnp.ones(4) + salt,
        },
        "embed": jnp.full((64, 32), 0.5 + salt, dtype=jnp.bfloat16),
        "count": np.int64(7_000_000 + salt),
        "lr": 0.125 + salt,
    }


def a_run(server: VaultServer, client: VaultClient, folder: Path) -> Run:
    admission = admit_run(server, client, folder / "dataset")
    return start(client, environ=job_env(server, admission, folder), output_dir=folder)


def test_an_unchanged_leaf_is_not_stored_twice(
    vault_server: VaultServer,
    client: VaultClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = a_run(vault_server, client, tmp_path)
    checkpoints = PytreeCheckpoints(run)
    sent = spy_on_puts(client, monkeypatch)
    first = checkpoints.save(state(1), 0)
    arrays = {f.path: f for f in first.manifest.files if f.path.startswith("arrays/")}
    assert len(arrays) == 5 and {f.sha256 for f in arrays.values()} <= first.sent
    first_bytes = sum(sent)
    assert first_bytes > 64 * 32 * 2  # the embedding went, with the rest and the manifest

    sent.clear()
    second = checkpoints.save(state(1), 1)
    # Nothing changed: no array and no tree document went again, only the new manifest.
    assert second.sent == frozenset()
    assert len(sent) == 1 and sent[0] < 1024

    sent.clear()
    changed = state(1)
    changed["params"]["b"] = changed["params"]["b"] * 2
    third = checkpoints.save(changed, 2)
    before = {f.sha256 for f in arrays.values()}
    after = {f.sha256 for f in third.manifest.files if f.path.startswith("arrays/")}
    # Only the changed leaf went: the tree document names files, not digests, so it is the same.
    assert len(after - before) == 1 and third.sent == after - before
    assert sum(sent) < first_bytes / 4

    restored = checkpoints.restore(state())
    assert float(restored["params"]["b"][0]) == 4.0
    run.close()


def test_restore_gives_the_targets_kinds_and_refuses_a_mismatched_target(
    vault_server: VaultServer, client: VaultClient, tmp_path: Path
) -> None:
    run = a_run(vault_server, client, tmp_path)
    checkpoints = PytreeCheckpoints(run)
    with pytest.raises(NotFound, match="has no committed checkpoint"):
        checkpoints.restore(state())
    assert checkpoints.latest_step() is None
    saved = state()
    checkpoints.save(ocp.args.StandardSave(saved), 5)
    assert checkpoints.latest_step() == 5

    # As Orbax restores: the arrays given by shape and dtype alone (other leaves as they are).
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x,
        saved,
    )
    restored = checkpoints.restore(ocp.args.StandardRestore(abstract))
    assert isinstance(restored["params"]["w"], jax.Array)
    assert restored["embed"].dtype == jnp.bfloat16
    assert restored["lr"] == 0.125 and isinstance(restored["lr"], float)
    assert restored["count"] == 7_000_000 and isinstance(restored["count"], np.int64)
    for a, b in zip(
        jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(saved), strict=True
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    as_numpy = checkpoints.restore(jax.tree_util.tree_map(np.asarray, saved))
    assert isinstance(as_numpy["params"]["w"], np.ndarray)

    wrong_shape = state()
    wrong_shape["params"]["w"] = jnp.zeros((4, 3))
    with pytest.raises(InvalidArgument, match=r"leaf \['params'\]\['w'\] has shape \[3, 4\]"):
        checkpoints.restore(wrong_shape)
    wrong_dtype = state()
    wrong_dtype["embed"] = jnp.zeros((64, 32), jnp.float32)
    with pytest.raises(InvalidArgument, match=r"leaf \['embed'\] has dtype bfloat16"):
        checkpoints.restore(wrong_dtype)
    fewer = state()
    del fewer["lr"]
    with pytest.raises(InvalidArgument, match=r"has leaf \['lr'\], which the target lacks"):
        checkpoints.restore(fewer)
    more = {**state(), "extra": jnp.zeros(1)}
    with pytest.raises(InvalidArgument, match=r"has no leaf \['extra'\] of the target"):
        checkpoints.restore(more)

    # A typed PRNG key comes back as the same key, of the same implementation.
    keys = {"key": jax.random.split(jax.random.key(3), 4), "raw": jax.random.PRNGKey(3)}
    checkpoints.save(keys, 6)
    back = checkpoints.restore(
        {
            "key": jax.random.split(jax.random.key(0, impl="threefry2x32"), 4),
            "raw": jax.random.PRNGKey(0),
        }
    )
    assert back["key"].dtype == keys["key"].dtype
    assert (jax.random.key_data(back["key"]) == jax.random.key_data(keys["key"])).all()
    assert (jax.random.uniform(back["key"][1]) == jax.random.uniform(keys["key"][1])).all()
    assert back["raw"].dtype == jnp.uint32
    with pytest.raises(InvalidArgument, match=r"leaf \['key'\] is a PRNG key of threefry2x32"):
        checkpoints.restore({"key": jnp.zeros((4, 2), jnp.uint32), "raw": keys["raw"]})
    with pytest.raises(InvalidArgument, match=r"leaf \['key'\] is a threefry2x32 key of data"):
        checkpoints.restore(
            {"key": jax.random.split(jax.random.key(0, impl="rbg"), 4), "raw": keys["raw"]}
        )

    # A checkpoint of plain files is the run's latest, but not a pytree.
    run.checkpoint(7, {"notes.txt": b"not a pytree"})
    with pytest.raises(FailedPrecondition, match="was not saved by a framework adapter"):
        checkpoints.restore(state())
    run.close()


def test_restore_refuses_a_leaf_whose_bytes_do_not_match(
    vault_server: VaultServer, client: VaultClient, tmp_path: Path
) -> None:
    admission = admit_run(vault_server, client, tmp_path / "dataset")
    env = job_env(vault_server, admission, tmp_path)
    run = start(client, environ=env, output_dir=tmp_path)
    saved = PytreeCheckpoints(run).save(state(2), 1)
    embed = next(f.sha256 for f in saved.manifest.files if f.size == 64 * 32 * 2)

    # Between the vault and the job, the embedding's bytes are altered on the wire, with a
    # chunk hash to match: the client checks the whole digest and refuses them.
    with TamperingProxy(vault_server.address) as proxy, VaultClient(proxy.address) as hostile:
        proxy.tamper("Store/Get", flip_chunk(digest=embed))
        through = start(hostile, environ=env, output_dir=tmp_path)
        with pytest.raises(IntegrityError, match=embed):
            PytreeCheckpoints(through).restore(state())
        proxy.clear("Store/Get")
        restored = PytreeCheckpoints(through).restore(state())
        assert np.asarray(restored["embed"]).tobytes() == np.asarray(state(2)["embed"]).tobytes()

    # The blob rotted in the vault's own store: the vault refuses to serve it.
    stored = vault_server.blob_path(embed)
    blob = bytearray(stored.read_bytes())
    blob[100] ^= 0xFF
    stored.chmod(0o644)
    stored.write_bytes(bytes(blob))
    with pytest.raises(IntegrityError):
        PytreeCheckpoints(run).restore(state())
    run.close()


def test_importing_the_run_library_loads_no_framework() -> None:
    probe = (
        "import sys, vault.runs, vault.runs.frameworks\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('jax', 'jaxlib', 'torch', 'numpy', 'orbax'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""
