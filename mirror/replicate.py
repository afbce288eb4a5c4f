"""Replication: the worker threads that empty the queue, one per mirror so that a mirror that is
down or hangs holds up only its own copies, each copy verified before it is recorded as a
placement (tier `mirror-<name>`) in the placement record, where scrub and repair find it."""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from mirror.mirrors import Mirror, MirrorSet
from mirror.queue import LEASE_SECONDS, Pending, ReplicationQueue
from mirror.uploads import Issued, IssuedUploads
from tiers.cold import DIRECT_PUT_MAX, CheckedUpload
from vault.digest import Digest
from vault.errors import IntegrityError, NotFound, Unavailable, VaultError
from vault.presigned import put
from vault.store.protocol import BlobStore, copy_blob

log = logging.getLogger("pinvault.mirror")

# When idle, a worker still looks at the queue this often: another process (`vault mirror
# sync`) may have queued copies without waking it.
IDLE_POLL: Final = 5.0
# How often a worker deletes its mirror's uploads left unfinished or refused (a client that
# gave up on a direct put, a put cut short, bytes the vault would not adopt) and aborts its
# uploads in parts left so, and how old one must be: older than any upload still being sent or
# resumed. S3 keeps, and bills, them until then; MinIO refuses the lifecycle rule
# (AbortIncompleteMultipartUpload) that would do part of it. A shorter age sweeps more often.
SWEEP_INTERVAL: Final = 3600.0
UNFINISHED_UPLOAD_SECONDS: Final = 2 * 24 * 3600.0
_BATCH: Final = 32
# How long the request a copy between mirrors is streamed with stays valid.
RAW_COPY_EXPIRES: Final = 3600


def copy_to_mirror(
    source: BlobStore, mirror: Mirror, digest: Digest, size: int | None = None
) -> int:
    """Make sure `mirror` holds a verified copy of `digest`, read (verified) from `source`;
    returns the blob's size.

    A copy already there counts only once read back whole and found intact; a damaged one is
    replaced. A new copy is checked as it is written: every byte read from `source` is checked
    against its chunk list, the whole against the digest, and the endpoint must echo the
    SHA-256 of every part it received (else the cold tier reads it back). A blob known to be
    small (`size`) is written without looking first: its one conditional PUT finds a copy
    already there as cheaply as a look-up would.
    """
    tier = mirror.tier
    small = size is not None and size <= tier.inline_limit
    if not small and not tier.find_missing([digest]):
        try:
            return tier.verify(digest).size
        except IntegrityError as damage:
            log.warning("mirror %s: replacing a damaged copy: %s", mirror.name, damage)
            tier.delete(digest)
        except NotFound:
            pass  # deleted since: write it
    info, created = copy_blob(source, tier, digest)
    if not created:
        # Another process wrote it between the look-up and the commit: check its copy.
        return tier.verify(digest).size
    return info.size


def copy_stored(
    source: Mirror, target: Mirror, digest: Digest, uploads: IssuedUploads
) -> int | None:
    """Copy the blob from mirror `source` to `target` as its bytes are, when `source` keeps
    them so (a client's direct upload): streamed from the one to a presigned PUT that the
    other's store takes only with the blob's SHA-256, each chunk checked against the chunk
    list on the way, then `target`'s index written. Nothing is hashed whole here: the store
    checks the SHA-256, this process only the chunks' BLAKE3. Returns the blob's size, or
    None when `source` keeps it otherwise (inline, compressed) or too large for one PUT, or
    not at all, or when either mirror is encrypted (the stream would carry ciphertext one way or
    clear bytes the other): the copy is then made through the vault. A damaged source raises
    IntegrityError, an unreachable mirror Unavailable."""
    if source.encrypted or target.encrypted:
        return None
    try:
        layout = source.tier.layout(digest)
    except NotFound:
        return None
    size = layout.chunks.size
    if not layout.raw or size > DIRECT_PUT_MAX:
        return None
    upload = target.tier.presign_upload(digest, size, RAW_COPY_EXPIRES)
    # Recorded first, like an upload handed to a client: a copy cut short is collected.
    uploads.issued([Issued(target.name, upload.key, digest)])
    chunks = (chunk.data for chunk in source.tier.read(digest))
    put(upload.url, upload.headers, chunks, size)
    checked = CheckedUpload(layout.chunks, ((digest.raw, size),))
    target.tier.check_copy(checked, upload.key)
    target.tier.install_upload(checked, upload.key)
    uploads.adopted([(target.name, upload.key)])
    return size


@dataclass(slots=True)
class DrainReport:
    """One pass over a mirror's queue."""

    copied: int = 0
    copied_bytes: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)


class Replicator:
    """Background threads, one per mirror, that copy queued blobs from `source` to the mirrors
    and record each verified copy as a placement, through the queue, in the placement record
    it shares with `source` (the tier manager) when the vault runs.

    Several replicators (one a server of the same vault) share one queue: each claims its
    copies with a lease in its `owner`'s name, and a copy whose claimant died is claimed again
    once the lease runs out.

    A copy that fails is retried with exponential backoff (retry_min doubling to retry_max,
    with jitter so that mirrors coming back are not hit all at once). A mirror that cannot be
    reached pauses its own worker until the next retry time; the queue keeps the copies, so
    nothing waits in memory only.
    """

    def __init__(
        self,
        source: BlobStore,
        mirrors: MirrorSet,
        queue: ReplicationQueue,
        *,
        retry_min: float = 1.0,
        retry_max: float = 60.0,
        idle_poll: float = IDLE_POLL,
        owner: str = "",
        lease: float = LEASE_SECONDS,
        abandoned_after: float = UNFINISHED_UPLOAD_SECONDS,
    ) -> None:
        self.source = source
        self.abandoned_after = abandoned_after
        # The name its claims on the queue are leased under.
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}"
        self.lease = lease
        self.mirrors = mirrors
        self.queue = queue
        self.retry_min = retry_min
        self.retry_max = max(retry_max, retry_min)
        self.idle_poll = idle_poll
        self._stop = threading.Event()
        self._wake = {mirror.name: threading.Event() for mirror in mirrors}
        self._threads: list[threading.Thread] = []

    # -- life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        for mirror in self.mirrors:
            thread = threading.Thread(
                target=self._run, args=(mirror,), name=f"mirror-{mirror.name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def notify(self, mirrors: list[str] | None = None) -> None:
        """New copies are queued: wake the workers (all of them, or those named)."""
        for name in self._wake if mirrors is None else mirrors:
            self._wake[name].set()

    def close(self, timeout: float = 10.0) -> list[str]:
        """Stop the workers; returns the mirrors whose worker was still inside a request at
        the deadline (it is left to the process's exit: its copy stays queued)."""
        self._stop.set()
        self.notify()
        deadline = time.monotonic() + timeout
        stuck: list[str] = []
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                stuck.append(thread.name.removeprefix("mirror-"))
        self._threads.clear()
        return stuck

    # -- the work ----------------------------------------------------------------------------

    def drain(self, mirror: Mirror, *, stop: Callable[[], bool] = lambda: False) -> DrainReport:
        """Copy every copy queued for `mirror` that is due now; stop at the first sign that the
        mirror is unreachable (the rest stay queued)."""
        report = DrainReport()
        while not stop():
            batch = self.queue.claim(mirror.name, self.owner, limit=_BATCH, lease=self.lease)
            if not batch:
                break
            # The copies made are recorded once a batch, in one commit.
            made: list[tuple[Digest, str, int]] = []
            worked = 0
            try:
                for item in batch:
                    if stop():
                        return report
                    worked += 1
                    if not self._replicate(mirror, item, report, made):
                        return report
            finally:
                if made:
                    self.queue.done_many(made)
                self.queue.unclaim(self.owner, batch[worked:])
        return report

    def sweep(self, mirror: Mirror, older_than: float | None = None) -> int:
        """Delete the uploads to the mirror handed out more than `older_than` seconds ago
        (default: `abandoned_after`) and never adopted, then abort any upload in parts begun
        as long ago (one handed out before uploads were recorded); how many. A failure is
        logged: the next sweep tries again."""
        age = self.abandoned_after if older_than is None else older_than
        dropped = 0
        try:
            abandoned = self.queue.uploads.abandoned(mirror.name, age)
            done: list[tuple[str, str]] = []
            for upload in abandoned:
                try:
                    if mirror.tier.drop_abandoned_upload(
                        upload.digest, upload.key, upload.upload_id
                    ):
                        dropped += 1
                except IntegrityError as error:
                    # The blob's index there is damaged and may name it: kept until repaired.
                    log.warning("mirror %s: keeping %s: %s", mirror.name, upload.key, error)
                    continue
                done.append((upload.mirror, upload.key))
            self.queue.uploads.adopted(done)
            dropped += mirror.tier.abort_unfinished_uploads(age)
        except VaultError as error:
            log.warning("mirror %s: collecting abandoned uploads: %s", mirror.name, error)
        if dropped:
            log.info("mirror %s: collected %d abandoned uploads", mirror.name, dropped)
        return dropped

    def _run(self, mirror: Mirror) -> None:
        wake = self._wake[mirror.name]
        next_sweep = time.monotonic()
        while not self._stop.is_set():
            wake.clear()
            if time.monotonic() >= next_sweep:
                self.sweep(mirror)
                next_sweep = time.monotonic() + min(SWEEP_INTERVAL, self.abandoned_after / 4)
            try:
                self.drain(mirror, stop=self._stop.is_set)
                next_try = self.queue.next_try(mirror.name)
            except VaultError as error:  # the queue's file itself: retry, never die
                log.error("mirror %s: replication queue: %s", mirror.name, error)
                next_try = None
            now = time.time()
            pause = self.idle_poll if next_try is None else min(self.idle_poll, next_try - now)
            if pause > 0:
                wake.wait(pause)

    def _replicate(
        self,
        mirror: Mirror,
        item: Pending,
        report: DrainReport,
        made: list[tuple[Digest, str, int]],
    ) -> bool:
        """One queued copy, added to `made` once verified; False if the mirror turned out
        unreachable."""
        try:
            size = self._copy_stored(mirror, item)
            if size is None:
                size = copy_to_mirror(self.source, mirror, item.digest, item.size)
        except NotFound as error:
            if self.source.info(item.digest) is None and not self.queue.placements.placed(
                item.digest
            ):
                # The blob was deleted: no copy of it is left anywhere to copy from. (One
                # another server holds on its own disk waits for that server.)
                self.queue.drop(item.digest, mirror.name)
                return True
            self._failed(mirror, item, report, str(error))
            return True
        except Unavailable as error:
            mirror.seen_down(str(error))
            self._failed(mirror, item, report, str(error))
            return False
        except VaultError as error:
            self._failed(mirror, item, report, str(error))
            return True
        except Exception as error:  # botocore or the OS outside the tier's mapping
            log.exception("mirror %s: copying %s failed", mirror.name, item.digest)
            self._failed(mirror, item, report, f"{type(error).__name__}: {error}")
            return True
        mirror.seen_up()
        made.append((item.digest, mirror.name, size))
        report.copied += 1
        report.copied_bytes += size
        return True

    def _copy_stored(self, mirror: Mirror, item: Pending) -> int | None:
        """The copy streamed from another mirror that keeps the blob's bytes as they are
        (copy_stored), if one does and answers; else None, and the usual copy is made."""
        if item.size <= mirror.tier.inline_limit:
            return None
        held = self.queue.copies(item.digest)
        for source in self.mirrors:
            if source is mirror or source.name not in held:
                continue
            try:
                return copy_stored(source, mirror, item.digest, self.queue.uploads)
            except (IntegrityError, NotFound, Unavailable) as error:
                # The source's copy is damaged or gone (scrub and repair see to it), or one of
                # the two cannot be reached: the usual copy finds out which.
                log.warning(
                    "mirror %s: streaming %s from %s: %s",
                    mirror.name,
                    item.digest,
                    source.name,
                    error,
                )
                return None
        return None

    def _failed(self, mirror: Mirror, item: Pending, report: DrainReport, error: str) -> None:
        delay = min(self.retry_max, self.retry_min * 2 ** min(item.attempts, 30))
        delay *= random.uniform(0.75, 1.0)
        log.warning(
            "mirror %s: copy of %s failed (attempt %d, next in %.1fs): %s",
            mirror.name,
            item.digest,
            item.attempts + 1,
            delay,
            error,
        )
        self.queue.failed(item.digest, mirror.name, error, time.time() + delay)
        report.failed += 1
        report.errors.append(f"{item.digest}: {error}")
