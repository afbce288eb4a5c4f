"""`vault admit` and `vault run`: the scheduler's side. `admit` asks the vault whether a job on
these pins may run (the Slurm plugin calls it); `run` checks, pins and submits through `sbatch`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Final, NoReturn

from cli.commands import add_command
from cli.output import print_json, shown

# The client, the run library and what only a submission needs load when a command here runs,
# not for `vault --help`.
if TYPE_CHECKING:
    from pathlib import Path

    from vault.client import Admission, VaultClient
    from vault.config import Config
    from vault.errors import VaultError
    from vault.runs.mlflow_export import Exported
    from vault.runs.sealed import SealedRun

    Connect = Callable[[Config], VaultClient]

# The Slurm plugin (slurm/job_submit.lua) refuses a job that carries no pins with this, before it
# asks the vault and before Slurm checks anything else of the job.
_PLUGIN_WANTS_PINS = "pinvault: job refused: the job carries no pins"
# A run whose job sbatch refused after its admission entry was appended is recorded with a `run`
# entry of this stage, so that the admission does not read as a run that ran.
NOT_SUBMITTED = "not-submitted"
# The most of sbatch's reason such a record keeps (an entry's metadata value holds 4096 bytes).
_REASON_CHARS = 1000
# The inputs `vault run` requires (its parser cannot: `vault run export` takes none of them).
_INPUTS: Final = ("image", "dataset", "seed")


def add_run_commands(sub: Any, connect: Connect) -> None:
    add_command(
        sub,
        "admit",
        partial(_admit_arguments, connect=connect),
        help="ask the vault to admit a job on pinned inputs; prints its run id",
    )
    add_command(
        sub,
        "run",
        partial(_run_arguments, connect=connect),
        help="check a job's pins, pin the run and submit it with sbatch; or export a sealed run",
        usage="vault run --image DIGEST --dataset DIGEST [--config FILE] --seed SEED "
        "[--team TEAM] -- SBATCH_ARGS...\n       vault run export RUN --mlflow URI "
        "[--experiment NAME] [--json]",
        description="Everything after -- goes to sbatch (options, then the batch script).",
    )
    add_command(
        sub,
        "replay",
        partial(_replay_arguments, connect=connect),
        help="resubmit a published run with its recorded inputs and seed",
        usage="vault replay MANIFEST_DIGEST [--team TEAM] [-- SBATCH_ARGS...]\n"
        "       vault replay --check RUN [--json] [-- SBATCH_ARGS...]",
        description="Everything after -- goes to sbatch (options, then the batch script); "
        "a team runs a limited number of replays at once. With --check, every pinned input "
        "and output of the run is fetched and verified and what a replay would submit is "
        "printed; nothing is submitted or appended, and no Slurm is needed.",
    )


def _admit_arguments(p: argparse.ArgumentParser, *, connect: Connect) -> None:
    _input_arguments(p, config_help="the config's digest")
    p.add_argument("--run-id", default="", help="refuse unless the inputs make this run id")
    p.add_argument("--replay-of", default="", metavar="MANIFEST", help=argparse.SUPPRESS)
    output = p.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true")
    output.add_argument(
        "--porcelain",
        action="store_true",
        help="two lines: run_id=DIGEST seed=DECIMAL, then image_blobs=COUNT "
        "image_external=true|false",
    )
    p.set_defaults(func=partial(_admit, connect=connect))


def _run_arguments(p: argparse.ArgumentParser, *, connect: Connect) -> None:
    # Not required here, so that `vault run export` need not give them; `_run` requires them.
    _input_arguments(
        p, config_help="the config file (stored and pinned) or its digest", required=False
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON object at the end instead of the steps"
    )
    # What follows `--` is sbatch's (the command splits it off before parsing).
    p.set_defaults(
        func=partial(_run, connect=connect, usage=p.error), sbatch_args=[], moves_blobs=True
    )
    actions = p.add_subparsers(dest="run_action", metavar="export", prog="vault run")
    q = actions.add_parser(
        "export",
        help="record a sealed run as an MLflow run (params, metrics, outputs by digest)",
        description="Writes one MLflow run for the run's manifest through MLflow's client "
        "(pinvault's `mlflow` extra); a run exported before is found by its tag, not written "
        "again.",
    )
    q.add_argument("run", metavar="RUN", help="the run id, or the digest of its run manifest")
    q.add_argument(
        "--mlflow", required=True, metavar="URI", help="the tracking server: http(s)://HOST:PORT"
    )
    q.add_argument("--experiment", default="", help="default: the run's team")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=partial(_export, connect=connect, usage=q.error))


def _replay_arguments(p: argparse.ArgumentParser, *, connect: Connect) -> None:
    p.add_argument(
        "manifest", metavar="MANIFEST_DIGEST", help="the run manifest's digest, or the run id"
    )
    p.add_argument("--team", default="", help="default: client.team, or your credential's team")
    p.add_argument(
        "--check",
        action="store_true",
        help="verify every pinned input and output of the run and print what would be "
        "submitted; submit nothing",
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON object at the end instead of the steps"
    )
    p.set_defaults(func=partial(_replay, connect=connect), sbatch_args=[], moves_blobs=True)


def _input_arguments(
    p: argparse.ArgumentParser, *, config_help: str, required: bool = True
) -> None:
    p.add_argument("--image", required=required, metavar="DIGEST", help="the container image")
    p.add_argument(
        "--dataset",
        required=required,
        metavar="DIGEST|NAME[@TAG]",
        help="the dataset manifest, by digest or by name (resolved, verified, and the job "
        "pinned by the digest)",
    )
    p.add_argument("--config", dest="run_config", default="", help=config_help)
    p.add_argument("--seed", required=required, help="decimal or 0x-hex")
    p.add_argument("--team", default="", help="default: client.team, or your credential's team")


def _admit(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    from vault.runs.names import resolve_input

    with connect(config) as client:
        args.dataset = resolve_input(client, args.dataset)
        admission = client.admit(
            image=args.image,
            dataset=args.dataset,
            config=args.run_config,
            seed=args.seed,
            team=args.team,
            run_id=args.run_id,
            replay_of=args.replay_of,
        )
        external = image_external(client, admission)
    if args.porcelain:
        # What was checked of the image on a line of its own: a plugin that reads the first
        # line alone (an earlier job_submit.lua) still understands the answer.
        print(f"run_id={admission.run_id} seed={admission.seed}")
        print(f"image_blobs={admission.image_blobs} image_external={str(external).lower()}")
    elif args.json:
        print_json(_admission_dict(admission, external))
    else:
        state = "new run" if admission.new else "admitted before: the same experiment"
        print(f"admitted  run {admission.run_id}  ({state})")
        print(f"  seed {admission.seed}  entry {admission.entry.entry.index}")
    return 0


def image_external(client: VaultClient, admission: Admission) -> bool:
    """Whether the admitted job's image is pinned only as external content: recorded, not held,
    so that nothing of it was checked. The run's pin, which the client verified, is external
    only if some input was pinned only as external content when the run was first admitted, and
    pins are never taken back: only then is the image's own pin looked up (and proved)."""
    from vault.runs.pins import require_pin

    if admission.image_blobs or not admission.entry.entry.external:
        return False
    return all(p.entry.external for p in require_pin(client, "image", admission.inputs.image))


def image_checked(image_blobs: int, external: bool) -> str:
    """What admission checked of a job's image, in one line (the Slurm plugin says the same)."""
    if external:
        return "image recorded, not fetched (external)"
    return f"image held: {held_words(image_blobs)}"


def held_words(image_blobs: int) -> str:
    """An image found held: the blobs its OCI manifest or index names, counted (the vault
    verified each as it stored it, and checks every read), or its one file."""
    if image_blobs == 1:
        return "1 blob, verified when stored"
    if image_blobs:
        return f"{image_blobs} blobs, each verified when stored"
    return "one file, verified when stored"


def _admission_dict(admission: Admission, image_external: bool) -> dict[str, Any]:
    return {
        "run_id": admission.run_id,
        "seed": str(admission.seed),
        "inputs": admission.inputs.as_json(),
        "entry": admission.entry.entry.index,
        "new": admission.new,
        # A replay's slot in its team's quota; empty for a job that is not a replay.
        "lease": admission.lease,
        # The blobs of the image found held (0: external, or not an OCI image).
        "image_blobs": admission.image_blobs,
        # Pinned only as external content: recorded, not fetched, so nothing of it checked.
        "image_external": image_external,
    }


# ---------------------------------------------------------------------- vault run


def _short(digest: str) -> str:
    return digest.partition(":")[2][:8] + "…"


def _step(mark: str, what: str, detail: str) -> None:
    # Details carry the vault's and writers' text (teams, authors, names, sbatch's words):
    # escaped here, once for every step, so that none passes for another line.
    print(f"{mark} {what:<33} {shown(detail)}", flush=True)


def _quiet(mark: str, what: str, detail: str) -> None:
    """A step under --json: the one object at the end says it all."""


def _config_digest(client: VaultClient, value: str) -> tuple[str, str]:
    """The config's digest (given as one, or the file's, stored), and the name to pin it as
    `config` under: "" when it is pinned already or was given as a digest (admission checks it)."""
    from pathlib import Path

    from vault.digest import Digest
    from vault.errors import InvalidArgument, NotFound

    if not value:
        return "", ""
    if ":" in value and not Path(value).exists():
        return str(Digest.parse(value)), ""
    path = Path(value)
    if not path.is_file():
        raise InvalidArgument(f"config {value}: no such file (or give the config's digest)")
    digest = str(client.put(path).blob.sha256)
    try:
        pinned = any(p.entry.kind == "config" for p in client.lookup(digest))
    except NotFound:
        pinned = False
    return digest, "" if pinned else path.name


def sbatch_command() -> str:
    import shutil

    from vault.errors import Unavailable

    command = shutil.which("sbatch")
    if command is None:
        raise Unavailable("sbatch is not on PATH: is this a Slurm submit host?")
    return command


# What the job_submit plugin (slurm/job_submit.lua) tells the submitter of a job it admitted.
_ADMITTED: Final = "pinvault: admitted as run "


def _sbatch(command: str, args: list[str], env: Mapping[str, str]) -> tuple[str, str]:
    """Run sbatch; its standard output and error, or raises with its reason."""
    import subprocess

    from vault.errors import FailedPrecondition, Unavailable

    try:
        done = subprocess.run(
            [command, *args], env=dict(env), capture_output=True, text=True, check=False
        )
    except OSError as exc:
        raise Unavailable(f"cannot run {command}: {exc.strerror}") from None
    if done.returncode != 0:
        # The job_submit plugin's word that the vault admitted the job comes before Slurm's
        # own refusal (an unknown partition, say): the reason is Slurm's.
        told = [line for line in done.stderr.splitlines() if _ADMITTED not in line]
        reason = " ".join(" ".join(told).split()) or f"exit status {done.returncode}"
        raise FailedPrecondition(f"sbatch refused the job: {reason}")
    return done.stdout, done.stderr


def check_submission(command: str, sbatch_args: list[str], env: Mapping[str, str]) -> None:
    """Ask sbatch whether it would take the job (`--test-only`, Slurm's own dry run) before
    anything is appended for it; raises with its reason if not. The job's pins are left out: a
    cluster that runs the pinvault plugin then refuses the job for that at once, without asking
    the vault (whose admission would append the run), once sbatch's own checks have passed."""
    from vault.config import JOB_VARIABLES
    from vault.errors import FailedPrecondition

    unpinned = {name: value for name, value in env.items() if name not in JOB_VARIABLES}
    try:
        _sbatch(command, ["--test-only", *sbatch_args], unpinned)
    except FailedPrecondition as exc:
        if _PLUGIN_WANTS_PINS not in str(exc):
            raise


def submit(
    sbatch_args: list[str], env: Mapping[str, str], sbatch: str | None = None
) -> tuple[str, str]:
    """Run sbatch; returns the job id and sbatch's message, or raises with sbatch's reason."""
    stdout, stderr = _sbatch(sbatch or sbatch_command(), ["--parsable", *sbatch_args], env)
    return stdout.strip().split(";")[0], stderr.strip()


def job_environment(
    config: Config, admission: Admission, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The submitting environment plus the job's pins and run, as the Slurm plugin and the run
    library read them (docs/run-manifest.md)."""
    from vault.config import ENV_CONFIG, ENV_DATASET, ENV_IMAGE, ENV_RUN_ID, ENV_SEED, ENV_TEAM

    inputs = admission.inputs
    env = dict(os.environ)
    env.update(
        {
            ENV_IMAGE: inputs.image,
            ENV_DATASET: inputs.dataset,
            ENV_SEED: str(inputs.seed),
            ENV_RUN_ID: admission.run_id,
            # The team the vault admitted the job for: with credentials, the credential's.
            ENV_TEAM: admission.team,
            "PINVAULT_CLIENT_SERVER": config.client.server,
        }
    )
    if inputs.config:
        env[ENV_CONFIG] = inputs.config
    env.update({name: value for name, value in (extra or {}).items() if value})
    return env


def _sbatch_args(args: argparse.Namespace) -> list[str]:
    from vault.errors import InvalidArgument

    sbatch_args = list(args.sbatch_args)
    if not sbatch_args:
        raise InvalidArgument("nothing to submit: give sbatch's arguments after --")
    return sbatch_args


def batch_script(sbatch_args: list[str]) -> Path | None:
    """The batch script among sbatch's arguments: the first that names an existing file
    (options come before it; their values are rarely existing files)."""
    from pathlib import Path

    for arg in sbatch_args:
        if not arg.startswith("-") and Path(arg).is_file():
            return Path(arg)
    return None


def _run(
    args: argparse.Namespace, config: Config, *, connect: Connect, usage: Callable[[str], NoReturn]
) -> int:
    from vault.config import ENV_SCRIPT
    from vault.errors import VaultError
    from vault.ledger.runid import parse_seed
    from vault.runs.names import resolve_input
    from vault.runs.pins import require_pin

    missing = [f"--{name}" for name in _INPUTS if getattr(args, name) is None]
    if missing:
        usage(f"the following arguments are required: {', '.join(missing)}")
    sbatch_args = _sbatch_args(args)
    parse_seed(args.seed)
    script = batch_script(sbatch_args)
    sbatch = sbatch_command()
    step = _quiet if args.json else _step
    checked: dict[str, dict[str, Any]] = {}
    with connect(config) as client:
        # Everything that can refuse the job is asked before the first append: the pins, then
        # sbatch; admission checks the inputs' content and appends only if it admits.
        named = args.dataset
        args.dataset = resolve_input(client, named)
        if args.dataset != named:
            step("✓", "dataset name resolved", f"{named} → {_short(args.dataset)}")
        # Each line says what this client checked: the pin's inclusion in a signed checkpoint.
        # The content is checked by the vault's admission below, except an external image's,
        # which the vault records but never holds.
        for kind in ("image", "dataset"):
            digest = getattr(args, kind)
            pins = require_pin(client, kind, digest)
            external = all(p.entry.external for p in pins)
            if external:
                what = f"{kind} pinned, external: recorded, not fetched"
            else:
                what = f"{kind} pinned, proof verified"
            step("✓", what, f"{_short(digest)}  entry {pins[0].entry.index}")
            checked[kind] = {
                "digest": digest,
                "entry": pins[0].entry.index,
                "proof_verified": True,
                "external": external,
            }
        config_digest, config_name = _config_digest(client, args.run_config)
        # Stored so that `vault replay` can submit the same script again.
        script_digest = str(client.put(script).blob.sha256) if script else ""
        check_submission(sbatch, sbatch_args, os.environ)
        if config_name:
            client.pin("config", config_digest, meta={"name": config_name})
        if config_digest:
            step("✓", "config pinned", _short(config_digest))
        admission = client.admit(
            image=args.image,
            dataset=args.dataset,
            config=config_digest,
            seed=args.seed,
            team=args.team,
        )
        if admission.image_blobs:
            step("✓", image_checked(admission.image_blobs, False), _short(args.image))
        created = "created" if admission.new else "found (same experiment)"
        step("✓", f"pin vault entry {created}", f"entry {admission.entry.entry.index}")
        extra = {ENV_SCRIPT: script_digest} if script_digest else {}
        try:
            job, _ = submit(sbatch_args, job_environment(config, admission, extra), sbatch)
        except VaultError as exc:
            if admission.new:
                raise _not_submitted(client, admission, exc) from None
            raise
    if args.json:
        print_json(
            {
                **_admission_dict(admission, checked["image"]["external"]),
                "job": job,
                "pins": checked,
                "dataset_name": named if named != args.dataset else "",
                "script": script_digest,
            }
        )
    else:
        _launched(job, admission)
    return 0


# ---------------------------------------------------------------------- vault run export


def _export(
    args: argparse.Namespace, config: Config, *, connect: Connect, usage: Callable[[str], NoReturn]
) -> int:
    from vault.runs.metrics import read_metrics
    from vault.runs.mlflow_export import (
        OUTPUTS_ARTIFACT,
        MlflowTarget,
        check_tracking_uri,
        run_params,
    )
    from vault.runs.sealed import find_sealed_run

    given = [f"--{name}" for name in (*_INPUTS, "team") if getattr(args, name)]
    if args.run_config:
        given.append("--config")
    if given:
        usage(f"{', '.join(given)}: options of `vault run`, not of `vault run export`")
    if args.sbatch_args:
        usage(f"unrecognized arguments: -- {' '.join(args.sbatch_args)}")
    check_tracking_uri(args.mlflow)
    with connect(config) as client:
        # The manifest its own team sealed, fetched verified; refused otherwise, naming why.
        sealed = find_sealed_run(client, args.run, purpose="export")
        metrics = read_metrics(client, sealed.manifest)
        vault = client.target
    target = MlflowTarget(args.mlflow)
    target.check_reachable()
    exported = target.export(sealed, metrics, vault=vault, experiment=args.experiment)
    values = sum(len(series) for series in metrics.values.values())
    if args.json:
        print_json(_exported_dict(exported, sealed, values, metrics.skipped))
        return 0
    _step(
        "✓",
        "run sealed",
        f"{_short(sealed.digest)}  run {_short(sealed.run_id)}  team {shown(sealed.team)}",
    )
    where = f"run {exported.run_id}  experiment {shown(exported.experiment)}"
    if not exported.created:
        _step("=", "already in MLflow", f"{where}  (exported before: nothing written)")
    else:
        for replaced in exported.replaced:
            _step("✓", "unfinished export deleted", f"run {replaced}")
        _step("✓", "exported to MLflow", where)
        params = len(run_params(sealed.manifest))
        outputs = len(sealed.manifest.outputs)
        _step(
            " ",
            "",
            f"params {params}  metrics {values}  outputs {outputs} by digest in {OUTPUTS_ARTIFACT}",
        )
        if metrics.skipped:
            _step("!", "metrics not exported", shown(metrics.skipped))
    _step("→", "MLflow run", exported.url)
    return 0


def _exported_dict(
    exported: Exported, sealed: SealedRun, metric_values: int, skipped: str
) -> dict[str, Any]:
    from vault.runs.mlflow_export import run_params

    return {
        "run": sealed.run_id,
        "manifest": sealed.digest,
        "team": sealed.team,
        "created": exported.created,
        "replaced": list(exported.replaced),
        "mlflow": {
            "tracking_uri": exported.tracking_uri,
            "experiment": exported.experiment,
            "experiment_id": exported.experiment_id,
            "run_id": exported.run_id,
            "url": exported.url,
        },
        "params": run_params(sealed.manifest),
        "metric_values": metric_values,
        "metrics_skipped": skipped,
        "outputs": len(sealed.manifest.outputs),
    }


def _not_submitted(client: VaultClient, admission: Admission, failure: VaultError) -> VaultError:
    """Record that the run this command admitted was never submitted (its admission entry is in
    the ledger for good): a `run` entry with stage=not-submitted and sbatch's reason. Returns
    the error to show, which says what was recorded."""
    from vault.errors import VaultError

    reason = shown(" ".join(str(failure).split()))[:_REASON_CHARS]
    try:
        proven = client.pin(
            "run", admission.run_id, meta={"stage": NOT_SUBMITTED, "reason": reason}
        )
    except VaultError as exc:
        return type(failure)(
            f"{failure}; run {admission.run_id} (entry {admission.entry.entry.index}) was "
            f"admitted but not submitted, and the vault did not record that: {exc}"
        )
    return type(failure)(
        f"{failure}; run {admission.run_id} is recorded as not submitted "
        f"(entry {proven.entry.index})"
    )


def _launched(job: str, admission: Admission) -> None:
    _step("→", "launching on cluster", f"job {job}")
    _step("→", "run id", admission.run_id)
    _step("→", "seed", f"{admission.seed:#x}")
    sys.stdout.flush()


def _replay_check(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    """`vault replay --check`: what a reviewer without a cluster can verify of a run."""
    import hashlib
    import shlex

    from vault.errors import InvalidArgument
    from vault.runs.check import MAX_SCRIPT_BYTES, Checked, check_run

    if args.team:
        raise InvalidArgument("--team is a replay's: a check admits nothing")
    sbatch_args = list(args.sbatch_args)
    given = batch_script(sbatch_args)
    script: tuple[str, bytes] | None = None
    if given is not None:
        # Hashed here, not stored: a check leaves the vault as it found it.
        with given.open("rb") as file:
            data = file.read(MAX_SCRIPT_BYTES + 1)
        if len(data) > MAX_SCRIPT_BYTES:
            raise InvalidArgument(f"batch script {given} is over {MAX_SCRIPT_BYTES} bytes")
        script = ("sha256:" + hashlib.sha256(data).hexdigest(), data)
    elif sbatch_args:
        raise InvalidArgument(
            "no batch script among sbatch's arguments after --: name an existing file, or "
            "give none to check the one the run manifest records"
        )

    def shown_step(item: Checked) -> None:
        _step("✓", item.what, f"{_short(item.digest)}  {item.detail}")

    with connect(config) as client:
        result = check_run(
            client,
            args.manifest,
            sbatch_args=sbatch_args,
            script=script,
            on_checked=None if args.json else shown_step,
        )
    command = ["sbatch", "--parsable", *result.sbatch_args]
    text = result.script_text.decode("utf-8", "replace")
    if args.json:
        print_json(
            {
                "run_id": result.sealed.run_id,
                "manifest": result.sealed.digest,
                "team": result.sealed.team,
                "checked": [
                    {"what": c.what, "digest": c.digest, "detail": c.detail} for c in result.checked
                ],
                "submitted": False,
                "sbatch": command,
                "environment": result.pins,
                "script": result.script,
                "script_text": text,
            }
        )
        return 0
    _step("→", "would submit", shlex.join(command))
    for name, value in result.pins.items():
        _step("→", "with", f"{name}={value}")
    _step("→", "and from the admission", "PINVAULT_RUN_ID, PINVAULT_TEAM, PINVAULT_REPLAY_LEASE")
    origin = "given" if script is not None else "replay.sbatch, recorded in the run manifest"
    print(f"--- batch script {result.script} ({shown(origin)}) ---")
    for line in text.splitlines():
        print(shown(line))
    print("--- end of batch script ---")
    print("nothing was submitted or appended: run ./replicate.sh (vault replay) to submit it")
    return 0


def _replay(args: argparse.Namespace, config: Config, *, connect: Connect) -> int:
    if args.check:
        return _replay_check(args, config, connect=connect)
    import tempfile
    from pathlib import Path

    from vault.config import ENV_REPLAY_LEASE, ENV_REPLAY_OF, ENV_SCRIPT
    from vault.digest import Digest
    from vault.errors import InvalidArgument
    from vault.runs.run import ENV_ARRAY_TASK
    from vault.runs.sealed import find_sealed_run

    sbatch_args = list(args.sbatch_args)
    manifest_digest = str(Digest.parse(args.manifest))
    with connect(config) as client, tempfile.TemporaryDirectory(prefix="pinvault-replay-") as tmp:
        # Refuses a manifest not sealed by the team its run was admitted for, naming who did;
        # who sealed it is shown as the vault's entry records it, never as the manifest says.
        sealed = find_sealed_run(client, manifest_digest, purpose="replay")
        manifest_digest, manifest = sealed.digest, sealed.manifest
        sealed_by = sealed.sealed.meta.get("team", "")
        recorded = manifest.environment.variables.get(ENV_SCRIPT, "")
        given = batch_script(sbatch_args)
        if given is None:
            if not recorded:
                raise InvalidArgument(
                    "the run manifest records no batch script: give sbatch's arguments, "
                    "with the script, after --"
                )
            script = Path(tmp) / "replay.sbatch"
            # Fetched verified: these are the bytes the digest shown below names.
            client.get(recorded, script)
            sbatch_args.append(str(script))
            script_line = f"{recorded}  (recorded in the manifest)"
        else:
            # Stored, so that this replay's own manifest records the script it really ran.
            recorded = str(client.put(given).blob.sha256)
            script_line = f"{recorded}  ({given})"
        task = manifest.environment.variables.get(ENV_ARRAY_TASK, "")
        if task.isdecimal() and not any(a.startswith(("--array", "-a")) for a in sbatch_args):
            # A task of a job array runs again as that task, with the same SLURM_ARRAY_TASK_ID.
            sbatch_args.insert(0, f"--array={task}")
        step = _quiet if args.json else _step
        step(
            "✓",
            "run manifest published",
            f"{_short(manifest_digest)}  run {_short(manifest.run_id)}  team {sealed_by}  "
            f"sealed by {sealed.sealed.author} (entry {sealed.sealed.index})",
        )
        inputs = manifest.inputs
        admission = client.admit(
            image=inputs.image,
            dataset=inputs.dataset,
            config=inputs.config,
            seed=inputs.seed,
            team=args.team,
            replay_of=manifest_digest,
        )
        step("✓", "inputs pinned and intact", f"replay slot taken for team {admission.team}")
        external = image_external(client, admission)
        step("→", "batch script", script_line)
        env = job_environment(
            config,
            admission,
            {
                ENV_REPLAY_OF: manifest_digest,
                ENV_REPLAY_LEASE: admission.lease,
                ENV_SCRIPT: recorded,
            },
        )
        try:
            job, _ = submit(sbatch_args, env)
        except BaseException:
            # Nothing will run, so the slot is given back now rather than when it expires.
            client.release_replay(admission.lease, team=admission.team)
            raise
    if args.json:
        print_json(
            {
                **_admission_dict(admission, external),
                "job": job,
                "replay_of": manifest_digest,
                "sealed_by": sealed_by,
                "sealed_by_author": sealed.sealed.author,
                "sealed_entry": sealed.sealed.index,
                "team": admission.team,
                "script": recorded,
            }
        )
    else:
        _launched(job, admission)
    return 0
