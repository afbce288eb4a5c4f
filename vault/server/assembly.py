"""The content store a vault runs on, put together from the config: the hot tier alone, or the
hot tier, the warm tier and the mirrors under one tier manager, with every put queued for its
mirror copies and the replication worker running beside it; and the placement record they all
write: a SQLite file in the data folder on one host, the ledger's database when it is a
database server several vault servers may share."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

from tiers.placements import JOURNAL_FILE_NAME
from vault.config import Config
from vault.errors import InvalidArgument, is_disk_full
from vault.files import fsync_dir
from vault.store.protocol import BlobStore, Closing

# The tier and mirror modules (and botocore under them) load only when a store needs them: a
# host command that opens no mirror starts without them.
if TYPE_CHECKING:
    from mirror.mirrors import MirrorSet
    from mirror.queue import ReplicationQueue
    from mirror.store import ReplicatingStore
    from tiers.hot import HotTier
    from tiers.manager import TierManager
    from tiers.placements import Journal

log = logging.getLogger("pinvault")

# `vault mirror status` must answer promptly even when a mirror hangs.
_PROBE_TIMEOUT: Final = 5.0
# The data folder's name for its host in a placement record several servers share.
HOST_FILE_NAME: Final = "host"
# What a placement record file of this host's alone is renamed to once carried into the shared
# record (kept, not deleted: it is the operator's to remove).
CARRIED_SUFFIX: Final = ".carried"


def host_name(config: Config) -> str:
    """The name this data folder's tiers go by in a shared placement record: made once (the
    host's name and a random part, as two servers may share a host) and kept in the folder."""
    path = config.data_path / HOST_FILE_NAME
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    name = f"{socket.gethostname().split('.')[0]}-{secrets.token_hex(3)}"
    config.data_path.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{HOST_FILE_NAME}.{secrets.token_hex(4)}")
    with open(partial, "w") as file:
        file.write(name + "\n")
        file.flush()
        os.fsync(file.fileno())
    try:
        # Two processes starting at once keep whichever name was linked first.
        os.link(partial, path)
    except FileExistsError:
        pass
    finally:
        partial.unlink()
    fsync_dir(config.data_path)
    return path.read_text().strip()


def record_where(config: Config) -> tuple[Path | str, str]:
    """Where the placement record is (a SQLite file, or the ledger's database URL) and the
    name this server's own tiers have in it."""
    if not config.shared:
        return config.data_path / JOURNAL_FILE_NAME, ""
    return config.database_url, host_name(config)


def open_placement_record(config: Config) -> Journal:
    """The placement record, with the damage journal and the replication queue beside it. A
    vault moving onto a shared database has its own record file carried into it first."""
    from tiers.placements import Journal

    where, host = record_where(config)
    record = Journal(where, host=host)
    local = config.data_path / JOURNAL_FILE_NAME
    if host and local.exists():
        try:
            own = Journal(local)
            try:
                carried = record.adopt(own)
            finally:
                own.close()
            with contextlib.suppress(FileNotFoundError):  # carried by another process
                local.rename(local.with_name(local.name + CARRIED_SUFFIX))
            for suffix in ("-wal", "-shm"):
                local.with_name(local.name + suffix).unlink(missing_ok=True)
            fsync_dir(config.data_path)
        except BaseException:
            record.close()
            raise
        log.info(
            "placement record: %d copies carried from %s into the shared record", carried, local
        )
    return record


def warm_configured(config: Config) -> bool:
    return bool(config.store.warm_dir.strip())


def warm_path(config: Config) -> Path:
    return Path(config.store.warm_dir).expanduser()


def mirrors_configured(config: Config) -> bool:
    return bool(config.mirrors.endpoints.strip())


def hot_capacity(config: Config) -> Callable[[], int]:
    """policy.hot_capacity_bytes, or the size of the file system the hot tier is on."""

    def capacity() -> int:
        return config.policy.hot_capacity_bytes or shutil.disk_usage(config.hot_path).total

    return capacity


def open_hot_tier(config: Config) -> HotTier:
    from tiers.hot import HotTier

    try:
        return HotTier(config.hot_path)
    except OSError as exc:
        # Asking whether the folder takes direct writes costs a block, which a full disk
        # lacks; the vault still starts, to serve reads, and writes through the page cache.
        if not is_disk_full(exc):
            raise
        log.warning(
            "the disk holding %s is full: no direct I/O for the hot tier until a restart",
            config.hot_path,
        )
        return HotTier(config.hot_path, direct_io=False)


def open_mirror_set(config: Config, *, probe: bool = False) -> MirrorSet:
    """The configured mirrors; with `probe`, with timeouts short enough for a status report."""
    from mirror.mirrors import open_mirrors, parse_endpoints

    settings = config.mirrors
    endpoints = parse_endpoints(
        settings.endpoints,
        environ=os.environ,
        credentials_prefix=settings.credentials_prefix,
        region=settings.region,
    )
    if not endpoints:
        raise InvalidArgument("no mirrors configured: set mirrors.endpoints")
    limit = _PROBE_TIMEOUT if probe else float("inf")
    return open_mirrors(
        endpoints,
        replicas=settings.replicas,
        connect_timeout=min(settings.connect_timeout, limit),
        read_timeout=min(settings.read_timeout, limit),
        attempts=1 if probe else settings.attempts,
        encrypted=settings.encrypted,
        encryption_keys=settings.encryption_keys,
    )


def queue_path(config: Config) -> Path:
    from mirror.queue import FILE_NAME

    return config.data_path / FILE_NAME


def open_replication_queue(config: Config) -> ReplicationQueue:
    """The durable queue of mirror copies still to make, beside the placement record; safe to
    share between running servers and a host command."""
    from mirror.queue import ReplicationQueue

    return ReplicationQueue(
        queue_path(config), placements=open_placement_record(config), owned=True
    )


def open_replicating_store(
    config: Config,
    hot: HotTier,
    *,
    extra_tiers: Sequence[tuple[str, BlobStore]] = (),
    promote: bool = False,
    owned: Sequence[Closing] = (),
) -> ReplicatingStore:
    """The hot tier first, then `extra_tiers` (the warm tier), then the mirrors, under one tier
    manager (so a read a copy fails is served and repaired from another), with every put
    queued for its mirror copies and the replication worker started. `owned` are closed with
    the manager."""
    from mirror.queue import ReplicationQueue
    from mirror.replicate import Replicator
    from mirror.store import MirrorReads, ReplicatingStore
    from tiers.manager import TierManager

    mirrors = open_mirror_set(config)
    manager = TierManager(
        [
            ("hot", hot),
            *extra_tiers,
            *((f"mirror-{m.name}", MirrorReads(m)) for m in mirrors),
        ],
        journal=open_placement_record(config),
        promote=promote,
        owned=list(owned),
    )
    # Replication records its copies in the manager's placement record, where scrub finds them.
    queue = ReplicationQueue(queue_path(config), placements=manager.journal)
    replicator = Replicator(
        manager,
        mirrors,
        queue,
        retry_min=config.mirrors.retry_min,
        retry_max=config.mirrors.retry_max,
        # The data folder's name: the same after a restart, which takes its claims back.
        owner=host_name(config),
        lease=config.mirrors.claim_lease,
        abandoned_after=config.mirrors.abandoned_uploads,
    )
    # What this server had claimed before it stopped is its to do again, now.
    queue.release(replicator.owner)
    replicator.start()
    # Copies queued before a restart are due at once: the mirror may well be back.
    queue.retry_now()
    replicator.notify()
    acknowledged = config.mirrors.acknowledged_copies
    if acknowledged < 0:
        acknowledged = 1 if config.shared else 0
    return ReplicatingStore(
        manager,
        mirrors,
        queue,
        replicator,
        acknowledged=acknowledged,
        presign_seconds=config.mirrors.presign_seconds,
    )


def open_tiered_store(config: Config, hot: HotTier) -> BlobStore:
    """Hot, warm, then the mirrors if configured, under one tier manager (with every put
    queued for its mirror copies, as `open_replicating_store` does)."""
    from tiers.manager import TierManager
    from tiers.warm import WarmTier

    warm = WarmTier(warm_path(config))
    promote = config.policy.promote_on_read
    if mirrors_configured(config):
        return open_replicating_store(
            config, hot, extra_tiers=[("warm", warm)], promote=promote, owned=[warm]
        )
    return TierManager(
        [("hot", hot), ("warm", warm)],
        journal=open_placement_record(config),
        promote=promote,
        owned=[warm],
    )


def open_content_store(config: Config) -> BlobStore:
    """The hot tier alone, or, with store.warm_dir or [mirrors] configured, the hot tier, the
    warm tier and the mirrors under the tier manager, with every put queued for replication
    when there are mirrors."""
    hot = open_hot_tier(config)
    if warm_configured(config):
        log.info("warm tier %s", config.store.warm_dir)
        return open_tiered_store(config, hot)
    if not mirrors_configured(config):
        if config.shared:
            log.warning(
                "the ledger is on a shared database but no mirrors are configured: this "
                "server's blobs are on its own disk only, which other vault servers cannot read"
            )
        # No tier manager journals its repairs: it does so itself.
        where, host = record_where(config)
        if host:
            open_placement_record(config).close()  # carries a record of its own over first
        hot.journal_repairs(where, host=host)
        return hot
    store = open_replicating_store(config, hot, promote=config.policy.promote_on_read)
    log.info(
        "mirrors %s, %d replicas of each blob",
        ", ".join(store.mirrors.names),
        store.mirrors.replicas,
    )
    return store


def manager_of(store: BlobStore) -> TierManager | None:
    """The tier manager under the store, if it has tiers to manage."""
    from tiers.manager import TierManager

    inner = getattr(store, "inner", store)
    return inner if isinstance(inner, TierManager) else None
