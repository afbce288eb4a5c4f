"""A sealed run as an MLflow run, so that a lab that browses its runs in MLflow sees its pinned runs
there (docs/mlflow-export.md): one MLflow run per run manifest, in an experiment named after the
run's team, with the run's inputs as params, its metrics, tags that tie it to the vault, and its
outputs listed by digest in an artifact (their bytes stay in the vault). Written through MLflow's
own client (the `mlflow` extra) to a tracking server over HTTP(S); a run exported before is
found by its tag and not written twice."""

from __future__ import annotations

import contextlib
import http.client
import importlib
import io
import json
import os
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any, Final

from vault.config import ENV_SCRIPT
from vault.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unavailable
from vault.runs.manifest import RECORDED_VARIABLES, RunManifest
from vault.runs.metrics import RunMetrics
from vault.runs.sealed import SealedRun

OUTPUTS_ARTIFACT: Final = "pinvault/outputs.json"
MANIFEST_ARTIFACT: Final = "pinvault/run-manifest.json"
OUTPUTS_TYPE: Final = "pinvault.mlflow-outputs"
TAG_RUN_ID: Final = "pinvault.run_id"
TAG_MANIFEST: Final = "pinvault.manifest"
TAG_VAULT: Final = "pinvault.vault"
TAG_TEAM: Final = "pinvault.team"
TAG_REPLAY: Final = "pinvault.replay"
TAG_REPLAY_OF: Final = "pinvault.replay_of"
TAG_ENVIRONMENT: Final = "pinvault.env."
# MLflow refuses longer tag values (8000 characters); a manifest bounds none of its host,
# Python and platform strings.
MAX_TAG_VALUE: Final = 5000
# MLflow takes at most this many metric values in one log_batch request.
METRICS_PER_BATCH: Final = 1000
# How long the first request may take to be answered before the server is called unreachable.
REACH_TIMEOUT: Final = 10.0
# Set for MLflow's client unless the environment says otherwise: it would otherwise send usage
# telemetry to MLflow's makers, and retry a refused connection for minutes.
MLFLOW_DEFAULTS: Final = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",
}
_FINISHED: Final = "FINISHED"


def install_hint(extra: str, prefix: Path | None = None) -> str:
    """How to add pinvault's `extra` where this interpreter's environment (`prefix`) came from:
    a `uv tool install` (its receipt beside the environment) or pipx is installed again with
    the extra, since a pip install into either is undone by their next upgrade."""
    where = Path(sys.prefix) if prefix is None else prefix
    if (where / "uv-receipt.toml").is_file():
        return f"uv tool install 'pinvault[{extra}]' (this vault was installed with uv tool)"
    if (where / "pipx_metadata.json").is_file():
        return f"pipx install --force 'pinvault[{extra}]' (this vault was installed with pipx)"
    return f"pip install 'pinvault[{extra}]'"


@dataclass(frozen=True, slots=True)
class Exported:
    """Where a sealed run is in MLflow. `created` is False when an earlier export was found;
    `replaced` names the MLflow runs of exports cut short, deleted before this one."""

    tracking_uri: str
    experiment: str
    experiment_id: str
    run_id: str
    created: bool
    replaced: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        """The run's page in the tracking server's web interface."""
        base = self.tracking_uri.rstrip("/")
        return f"{base}/#/experiments/{self.experiment_id}/runs/{self.run_id}"


# ---------------------------------------------------------------------- what is written


def run_params(manifest: RunManifest) -> dict[str, str]:
    """The run's inputs, as MLflow params: the seed and the digests of the image, the dataset
    manifest, the config and the batch script (the last two when the run has them)."""
    inputs = manifest.inputs
    params = {"seed": str(inputs.seed), "image": inputs.image, "dataset": inputs.dataset}
    if inputs.config:
        params["config"] = inputs.config
    script = manifest.environment.variables.get(ENV_SCRIPT, "")
    if script:
        params["batch_script"] = script
    return params


def run_tags(sealed: SealedRun, vault: str) -> dict[str, str]:
    """Tags that tie the MLflow run to the vault: the run id, the manifest's digest (which finds
    an export again), the vault's address, the team, where the run ran, and a description."""
    manifest = sealed.manifest
    environment = manifest.environment
    tags = {
        TAG_RUN_ID: sealed.run_id,
        TAG_MANIFEST: sealed.digest,
        TAG_VAULT: vault,
        TAG_TEAM: sealed.team,
        TAG_REPLAY: f"vault replay {sealed.digest}",
        f"{TAG_ENVIRONMENT}host": environment.host,
        f"{TAG_ENVIRONMENT}python": environment.python,
        f"{TAG_ENVIRONMENT}platform": environment.platform,
        "mlflow.user": sealed.sealed.author,
        "mlflow.note.content": _description(sealed, vault),
    }
    replay_of = sealed.sealed.meta.get("replay-of", "")
    if replay_of:
        tags[TAG_REPLAY_OF] = replay_of
    for name in RECORDED_VARIABLES:
        if name in environment.variables and name != ENV_SCRIPT:
            tags[f"{TAG_ENVIRONMENT}{name}"] = environment.variables[name]
    return {key: _cut(value) for key, value in tags.items()}


def outputs_listing(sealed: SealedRun, vault: str) -> str:
    """The artifact that lists the run's outputs and checkpoints by digest, each with the
    `vault://` URI that reads it (verified) through the vault's fsspec file system."""
    manifest = sealed.manifest
    listing = {
        "type": OUTPUTS_TYPE,
        "v": 1,
        "vault": vault,
        "run": sealed.run_id,
        "manifest": sealed.digest,
        "outputs": [
            {"path": f.path, "size": f.size, "sha256": f.sha256, "uri": f"vault://{f.sha256}"}
            for f in manifest.outputs
        ],
        "checkpoints": [
            {"step": c.step, "manifest": c.manifest, "uri": f"vault://{c.manifest}"}
            for c in manifest.checkpoints
        ],
    }
    return json.dumps(listing, indent=2, ensure_ascii=False) + "\n"


def _description(sealed: SealedRun, vault: str) -> str:
    return (
        f"Pinned run `{sealed.run_id}` of team {sealed.team}, sealed in the pinvault ledger of "
        f"{vault} by run manifest `{sealed.digest}` (entry {sealed.sealed.index}).\n\n"
        f"Its {len(sealed.manifest.outputs)} outputs and {len(sealed.manifest.checkpoints)} "
        f"checkpoints are listed by digest in `{OUTPUTS_ARTIFACT}`, and stay in the vault. "
        f"Replay it with `vault replay {sealed.digest}`."
    )


def _cut(value: str) -> str:
    return value if len(value) <= MAX_TAG_VALUE else value[: MAX_TAG_VALUE - 1] + "…"


def _millis(time: str) -> int | None:
    """An entry's RFC 3339 time in milliseconds since the epoch, as MLflow keeps times."""
    try:
        return int(datetime.fromisoformat(time).timestamp() * 1000)
    except ValueError:
        return None


# ---------------------------------------------------------------------- the tracking server


def check_tracking_uri(tracking_uri: str) -> str:
    """The tracking server's address; InvalidArgument unless it is an http(s) URL."""
    parts = urllib.parse.urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(
            f"MLflow tracking URI {tracking_uri[:200]!r} is not the http:// or https:// "
            "address of a tracking server"
        )
    return tracking_uri


class MlflowTarget:
    """An MLflow tracking server, written to through MLflow's client. Constructing one checks
    the address and that the client is installed, sets MLFLOW_DEFAULTS for the client where the
    environment has no value of its own, and connects to nothing."""

    def __init__(self, tracking_uri: str) -> None:
        self.uri = check_tracking_uri(tracking_uri)
        for name, value in MLFLOW_DEFAULTS.items():
            os.environ.setdefault(name, value)
        try:
            # Imported when used: the extra is optional, and MLflow's import is slow.
            self._entities = importlib.import_module("mlflow.entities")
            self._exceptions = importlib.import_module("mlflow.exceptions")
            self._requests = importlib.import_module("requests.exceptions")
            tracking: ModuleType = importlib.import_module("mlflow.tracking")
        except ImportError as exc:
            raise FailedPrecondition(
                f"exporting to MLflow needs MLflow's client ({exc}): {install_hint('mlflow')}"
            ) from None
        self._client: Any = tracking.MlflowClient(tracking_uri=tracking_uri)

    def check_reachable(self) -> None:
        """Unavailable, naming the address, if no server answers there; MLflow's client would
        retry for a long time first."""
        try:
            with urllib.request.urlopen(f"{self.uri.rstrip('/')}/health", timeout=REACH_TIMEOUT):
                pass
        except urllib.error.HTTPError:
            return  # it answered; a refusal comes back from the request it concerns
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ssl.SSLError):
                return  # MLflow's client has its own TLS settings (MLFLOW_TRACKING_*)
            raise self._unreachable(exc.reason) from None
        except (OSError, http.client.HTTPException) as exc:
            raise self._unreachable(exc) from None

    def export(
        self, sealed: SealedRun, metrics: RunMetrics, *, vault: str, experiment: str = ""
    ) -> Exported:
        """Record `sealed` as one finished MLflow run in `experiment` (default: the run's team),
        unless an earlier export of the same manifest is there already. An export that fails
        deletes the MLflow run it began, and one left unfinished (its process killed) is
        deleted by the next."""
        name = experiment or sealed.team
        if not name:
            raise InvalidArgument(
                f"run {sealed.run_id} records no team: name the MLflow experiment to export to"
            )
        with self._errors():
            experiment_id = self._experiment(name)
            found = self._client.search_runs(
                [experiment_id],
                filter_string=f"tags.`{TAG_MANIFEST}` = '{sealed.digest}'",
                max_results=100,
            )
            done = [r.info.run_id for r in found if r.info.status == _FINISHED]
            if done:
                return Exported(self.uri, name, experiment_id, done[0], created=False)
            unfinished = tuple(r.info.run_id for r in found)
            for run_id in unfinished:
                self._client.delete_run(run_id)
            run_id = self._write(experiment_id, sealed, metrics, vault)
        return Exported(self.uri, name, experiment_id, run_id, created=True, replaced=unfinished)

    def _experiment(self, name: str) -> str:
        found = self._client.get_experiment_by_name(name)
        if found is None:
            try:
                return str(self._client.create_experiment(name))
            except self._exceptions.RestException as exc:
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
            found = self._client.get_experiment_by_name(name)  # another exporter made it
        if found.lifecycle_stage != "active":
            raise FailedPrecondition(
                f"MLflow experiment {name!r} at {self.uri} is deleted: restore it, or name "
                "another experiment"
            )
        return str(found.experiment_id)

    def _write(self, experiment_id: str, sealed: SealedRun, metrics: RunMetrics, vault: str) -> str:
        entities, client = self._entities, self._client
        run = client.create_run(
            experiment_id,
            start_time=_millis(sealed.admitted.time),
            tags=run_tags(sealed, vault),
            run_name=sealed.run_id,
        )
        run_id: str = run.info.run_id
        sealed_at = _millis(sealed.sealed.time)
        try:
            params = [entities.Param(k, v) for k, v in run_params(sealed.manifest).items()]
            client.log_batch(run_id, params=params)
            values = [
                entities.Metric(name, value, sealed_at or 0, step)
                for name, series in metrics.values.items()
                for step, value in enumerate(series)
            ]
            for start in range(0, len(values), METRICS_PER_BATCH):
                client.log_batch(run_id, metrics=values[start : start + METRICS_PER_BATCH])
            client.log_text(run_id, outputs_listing(sealed, vault), OUTPUTS_ARTIFACT)
            # The manifest's own canonical bytes: `sha256sum` of the artifact is its digest.
            client.log_text(run_id, sealed.manifest.encode().decode("utf-8"), MANIFEST_ARTIFACT)
            # MLflow's client prints the run's address here; the command prints its own.
            with contextlib.redirect_stdout(io.StringIO()):
                client.set_terminated(run_id, _FINISHED, end_time=sealed_at)
        except BaseException:
            with contextlib.suppress(Exception):
                client.delete_run(run_id)
            raise
        return run_id

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """MLflow's errors as the project's, each naming the tracking server."""
        requests = self._requests
        try:
            yield
        except self._exceptions.RestException as exc:
            refused = exc.error_code in ("PERMISSION_DENIED", "UNAUTHENTICATED")
            error = PermissionDenied if refused else FailedPrecondition
            raise error(f"MLflow at {self.uri} refused the export: {_brief(exc.message)}") from None
        except self._exceptions.MlflowException as exc:
            if isinstance(exc.__context__, requests.ConnectionError | requests.Timeout):
                raise self._unreachable(exc.__context__) from None
            raise FailedPrecondition(f"MLflow at {self.uri}: {_brief(exc.message)}") from None
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise self._unreachable(exc) from None
        except requests.RequestException as exc:
            raise FailedPrecondition(f"MLflow at {self.uri}: {_brief(str(exc))}") from None

    def _unreachable(self, reason: object) -> Unavailable:
        detail = reason.strerror if isinstance(reason, OSError) and reason.strerror else reason
        return Unavailable(
            f"MLflow tracking server {self.uri} is unreachable: {_brief(str(detail))}"
        )


def _brief(text: object) -> str:
    return " ".join(str(text).split())[:400]
