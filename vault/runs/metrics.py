"""A run's metrics, where it has them: the output `metrics.json` its manifest lists, fetched
verified against its digest. It is one JSON object whose every value is a number (the metric's
value) or a list of numbers (its value at steps 0, 1, 2, ...), named as MLflow and TensorBoard
accept: letters, digits, `_ - . / :` and spaces, at most 250 characters, not a path that
normalises to another name."""

from __future__ import annotations

import math
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from vault.canonical import load_json_object
from vault.client import VaultClient
from vault.errors import InvalidArgument, NotFound
from vault.runs.manifest import RunManifest, read_bounded

METRICS_FILE: Final = "metrics.json"
MAX_METRICS_BYTES: Final = 4 * 1024 * 1024
MAX_METRIC_VALUES: Final = 100_000
MAX_METRIC_NAME: Final = 250
_NAME: Final = re.compile(r"[\w./\- :]+")


@dataclass(frozen=True, slots=True)
class RunMetrics:
    """Each metric's values in step order; `skipped` says why a `metrics.json` the run has was
    not read ("" when it was, or when the run has none)."""

    values: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    skipped: str = ""


def read_metrics(client: VaultClient, manifest: RunManifest) -> RunMetrics:
    """The metrics of a run's `metrics.json` output. A file that is too large, not in the store,
    or not in the form above is skipped, saying why: the run is sealed and its other records
    stand. Bytes that fail their digest raise, as every verified read does."""
    record = next((f for f in manifest.outputs if f.path == METRICS_FILE), None)
    if record is None:
        return RunMetrics()
    if record.size > MAX_METRICS_BYTES:
        return RunMetrics(
            skipped=f"{METRICS_FILE} is {record.size} bytes (at most {MAX_METRICS_BYTES})"
        )
    try:
        data = read_bounded(client, record.sha256, METRICS_FILE, MAX_METRICS_BYTES)
        return RunMetrics(decode_metrics(data))
    except NotFound:
        return RunMetrics(skipped=f"{METRICS_FILE} {record.sha256} is not in the store")
    except InvalidArgument as exc:
        return RunMetrics(skipped=str(exc))


def decode_metrics(data: bytes) -> dict[str, tuple[float, ...]]:
    """Parse a `metrics.json`; InvalidArgument naming the first thing that is not as above."""
    obj = load_json_object(METRICS_FILE, data, MAX_METRICS_BYTES)
    metrics: dict[str, tuple[float, ...]] = {}
    count = 0
    for name, value in obj.items():
        _check_name(name)
        values = tuple(value) if isinstance(value, list) else (value,)
        if not all(_is_number(v) for v in values):
            raise InvalidArgument(
                f"{METRICS_FILE}: {name[:80]!r} is not a number or a list of numbers"
            )
        try:
            floats = tuple(float(v) for v in values)
        except OverflowError:
            floats = (math.inf,)
        if not all(math.isfinite(v) for v in floats):
            raise InvalidArgument(f"{METRICS_FILE}: {name[:80]!r} has a value out of range")
        count += len(floats)
        if count > MAX_METRIC_VALUES:
            raise InvalidArgument(f"{METRICS_FILE} holds more than {MAX_METRIC_VALUES} values")
        metrics[name] = floats
    return metrics


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_name(name: str) -> None:
    normal = posixpath.normpath(name)
    if (
        len(name) > MAX_METRIC_NAME
        or not _NAME.fullmatch(name)
        or normal != name
        or normal.startswith(("/", ".."))
        or normal == "."
    ):
        raise InvalidArgument(
            f"{METRICS_FILE}: bad metric name {name[:80]!r}: expected at most "
            f"{MAX_METRIC_NAME} letters, digits, spaces and '_-./:', not a path that "
            "normalises to another name"
        )
