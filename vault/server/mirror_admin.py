"""What `vault mirror add|status|sync|repair` do on the vault's host: a mirror checked and
written into its config file, and the mirrors and the replication queue opened from its config
(the queue is a SQLite file in the data folder, safe to share with a running `vault serve`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vault.config import ENV_PREFIX, Config, updating
from vault.digest import Digest
from vault.errors import ConfigError, InvalidArgument
from vault.server.assembly import open_hot_tier, open_mirror_set, open_replication_queue

if TYPE_CHECKING:
    from mirror.mirrors import MirrorLocation
    from mirror.repair import RepairReport
    from mirror.replicate import DrainReport
    from mirror.status import MirrorStatus


@dataclass(frozen=True, slots=True)
class MirrorAdded:
    """A mirror checked and written into the config file: where it is, the variables its keys
    come from, whether its bucket was created, and the mirrors and replicas configured now."""

    location: MirrorLocation
    credentials: tuple[str, str]
    bucket_created: bool
    config_file: Path
    mirrors: list[str]
    replicas: int


def add(
    config: Config,
    config_file: Path | None,
    *,
    name: str,
    url: str,
    bucket: str,
    prefix: str = "",
    create_bucket: bool = False,
    replicas: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> MirrorAdded:
    """Check a new mirror with the keys `vault serve` will use (its bucket answers, or is
    created if `create_bucket`; an object can be written, read back and deleted under its
    prefix), then add it to `mirrors.endpoints` (and set `mirrors.replicas` if given) in the
    config file. Nothing is written unless every check passes; no secret is written."""
    from mirror.check import check_endpoint
    from mirror.mirrors import credential_variables, new_location, parse_endpoints, parse_locations

    env = os.environ if environ is None else environ
    if config_file is None:
        raise ConfigError(
            "no config file to add the mirror to: pass --config FILE or set PINVAULT_CONFIG "
            "to the file `vault serve` reads (an empty file will do)"
        )
    settings = config.mirrors
    written = ["endpoints"] + ([] if replicas is None else ["replicas"])
    for variable in (f"{ENV_PREFIX}MIRRORS_{key.upper()}" for key in written):
        if variable in env:
            raise ConfigError(
                f"{variable} is set and overrides what would be written in {config_file}: "
                "unset it first"
            )
    location = new_location(name, url, bucket, prefix)
    configured = parse_locations(settings.endpoints)
    for other in configured:
        if other.name == location.name:
            raise InvalidArgument(
                f"mirror {name} is already configured in {config_file} ({other.item})"
            )
    count = len(configured) + 1
    if replicas is not None and not 1 <= replicas <= count:
        raise InvalidArgument(
            f"replicas {replicas}: expected 1 to the {count} mirrors configured with this one "
            "(each copy goes to a different mirror)"
        )
    credentials = credential_variables(settings.credentials_prefix, name)
    (endpoint,) = parse_endpoints(
        location.item,
        environ=env,
        credentials_prefix=settings.credentials_prefix,
        region=settings.region,
    )
    with updating(config_file, "mirrors") as changes:
        checked = check_endpoint(
            endpoint,
            credentials=credentials,
            create_bucket=create_bucket,
            connect_timeout=settings.connect_timeout,
            read_timeout=settings.read_timeout,
        )
        changes["endpoints"] = f"{settings.endpoints.strip()} {location.item}".strip()
        if replicas is not None:
            changes["replicas"] = replicas
    return MirrorAdded(
        location=location,
        credentials=credentials,
        bucket_created=checked.bucket_created,
        config_file=config_file,
        mirrors=[other.name for other in configured] + [name],
        replicas=settings.replicas if replicas is None else replicas,
    )


def status(config: Config) -> list[MirrorStatus]:
    """Per mirror: whether it answers now (asked with short timeouts), the verified copies it
    holds, and the copies still queued for it."""
    from mirror.status import mirror_status

    with open_mirror_set(config, probe=True) as mirrors:
        queue = open_replication_queue(config)
        try:
            return mirror_status(mirrors, queue)
        finally:
            queue.close()


@dataclass(frozen=True, slots=True)
class MirrorSync:
    """How many copies were queued; per mirror, what draining its queue copied; and the copies
    each still has queued."""

    queued: int
    drained: dict[str, DrainReport]
    left: dict[str, int]


def sync(config: Config, *, queue_only: bool) -> MirrorSync:
    """Queue every copy a local blob lacks on its mirrors, then, unless `queue_only`, copy (and
    verify) everything queued, retrying what was waiting for a later attempt."""
    from mirror.repair import queue_missing
    from mirror.replicate import Replicator

    hot = open_hot_tier(config)
    with open_mirror_set(config) as mirrors:
        queue = open_replication_queue(config)
        try:
            queued = queue_missing(hot, mirrors, queue)
            drained: dict[str, DrainReport] = {}
            if not queue_only:
                queue.retry_now()
                replicator = Replicator(hot, mirrors, queue)
                drained = {mirror.name: replicator.drain(mirror) for mirror in mirrors}
            left = {name: counts.queued for name, counts in queue.counts().items()}
        finally:
            queue.close()
    return MirrorSync(queued, drained, left)


def repair(config: Config, *, progress: Callable[[Digest], None] | None = None) -> RepairReport:
    """Read back every copy on every mirror (and the local one), and rewrite each damaged or
    missing copy from one that verifies; `progress` is told each blob once its copies are
    checked."""
    from mirror.repair import repair as repair_copies

    hot = open_hot_tier(config)
    with open_mirror_set(config) as mirrors:
        queue = open_replication_queue(config)
        try:
            return repair_copies(hot, mirrors, queue, progress=progress)
        finally:
            queue.close()
