"""Single puts into the hot tier: the caller's bytes copied into a ring of aligned slots, from
which threads hash them and write them to a temp file in tmp/, for the tier to link into place."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from tiers.hot._direct import ALIGN, O_DIRECT
from vault.digest import Digest
from vault.store.chunks import CHUNK_SIZE, BlobInfo, ChunkHasher, ChunkList, check_expected
from vault.store.protocol import BlobWriter

if TYPE_CHECKING:
    from tiers.hot._tier import HotTier

# A put copies the bytes it is handed into a ring of page-aligned slots, and threads take each
# full slot from there: one hashes SHA-256, one BLAKE3 and the chunk hashes, two write it out
# (two writes in flight keep an NVMe device busy). The caller only copies, so a server's
# thread goes straight back to receiving; the ring bounds the memory a put holds, and since
# the caller's buffers are released at once the allocator reuses them instead of faulting in
# new pages.
SLOT: Final = 2 * CHUNK_SIZE
SLOTS: Final = 8
WRITE_THREADS: Final = 2
# Without direct I/O the bytes pile up in the page cache; syncing every so many bytes in the
# background keeps the final sync, which the caller waits for, short.
SYNC_EVERY: Final = 64 << 20


class HotWriter(BlobWriter):
    """One put into the hot tier; see Pipeline for how the work is shared out."""

    def __init__(self, tier: HotTier) -> None:
        self._tier = tier
        self._pipeline = Pipeline(tier)
        self._open = True

    def write(self, data: bytes | memoryview) -> None:
        if not self._open:
            raise ValueError("write to a blob writer that was committed or aborted")
        try:
            self._pipeline.write(data)
        except BaseException:
            self.abort()
            raise

    def commit(self, expected: Digest | None = None) -> tuple[BlobInfo, bool]:
        if not self._open:
            raise ValueError("commit of a blob writer that was committed or aborted")
        try:
            chunks = self._pipeline.finish()
            if expected is not None:
                check_expected(expected, chunks.info)
            created = self._tier._install(self._pipeline, chunks)
        finally:
            self.abort()
        return chunks.info, created

    def abort(self) -> None:
        if self._open:
            self._open = False
            self._pipeline.discard()


class Pipeline:
    """A blob's bytes on their way into a temp file in tmp/, hashed on the way.

    The caller copies bytes into a ring of SLOTS page-aligned slots. Each full slot goes to
    three stages at once, each on its own thread(s): SHA-256, BLAKE3 with the chunk hashes,
    and writing it to the temp file (O_DIRECT when the tier allows it). A slot is free again
    when all three are done with it; the caller waits for a free slot, which is what bounds
    memory. None of the stages holds the GIL while it works. A blob smaller than one slot is
    done on the caller's thread at the end, without starting any thread.
    """

    def __init__(self, tier: HotTier) -> None:
        self.direct = tier.direct_io
        self.fd, self.path = tier._temp_file(".blob", O_DIRECT if self.direct else 0)
        self._map: mmap.mmap | None = None
        self._slots: list[memoryview] = []
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._users = [0] * SLOTS
        self._lock = threading.Lock()
        self._sha = hashlib.sha256()
        self._chunks = ChunkHasher()
        self._sha_jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._chunk_jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._write_jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._current: int | None = None
        self._filled = 0
        self._offset = 0
        self._unsynced = 0
        self._error: BaseException | None = None

    def write(self, data: bytes | memoryview) -> None:
        self._raise_error()
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        position, total = 0, len(view)
        while position < total:
            if self._current is None:
                self._current = self._take_slot()
                self._filled = 0
            take = min(total - position, SLOT - self._filled)
            slot = self._slots[self._current]
            slot[self._filled : self._filled + take] = view[position : position + take]
            self._filled += take
            position += take
            if self._filled == SLOT:
                self._dispatch()

    def finish(self) -> ChunkList:
        """Wait for every stage and return the blob's chunk list."""
        if self._current is not None:
            if self._threads:
                self._dispatch()
            else:
                job = (self._current, self._filled, self._offset)
                self._hash_sha(job)
                self._hash_chunks(job)
                self._write(job)
        self._stop()
        self._raise_error()
        return self._chunks.chunk_list(Digest.sha256(self._sha.digest()))

    def make_durable(self, size: int) -> None:
        # Direct writes went out in whole aligned blocks; the padding is cut off here.
        os.ftruncate(self.fd, size)
        os.fdatasync(self.fd)

    def discard(self) -> None:
        """Stop the stages and remove the temp file; the end of every Pipeline."""
        self._error = self._error or _Discarded()
        try:
            self._stop()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        finally:
            os.close(self.fd)
            # A failed stage's traceback may still hold a slice of a slot; the map is then
            # freed with it instead.
            with contextlib.suppress(BufferError):
                for slot in self._slots:
                    slot.release()
                if self._map is not None:
                    self._map.close()
            self._slots.clear()

    # -- the caller's side -------------------------------------------------------------------

    def _take_slot(self) -> int:
        if self._map is None:
            # Pages are only touched as they fill, so a small blob costs little of this.
            self._map = mmap.mmap(-1, SLOT * SLOTS)
            ring = memoryview(self._map)
            self._slots = [ring[index * SLOT : (index + 1) * SLOT] for index in range(SLOTS)]
            ring.release()
            for index in range(SLOTS):
                self._free.put(index)
        index = self._free.get()
        self._raise_error()
        return index

    def _dispatch(self) -> None:
        assert self._current is not None
        if not self._threads:
            self._start()
        job = (self._current, self._filled, self._offset)
        with self._lock:
            self._users[self._current] = _STAGES
        self._sha_jobs.put(job)
        self._chunk_jobs.put(job)
        self._write_jobs.put(job)
        self._offset += self._filled
        self._current = None
        self._filled = 0

    def _start(self) -> None:
        stages = [
            ("sha256", self._sha_jobs, self._hash_sha),
            ("blake3", self._chunk_jobs, self._hash_chunks),
        ] + [(f"write-{n}", self._write_jobs, self._write) for n in range(WRITE_THREADS)]
        for name, jobs, work in stages:
            thread = threading.Thread(
                target=self._run, args=(jobs, work), name=f"pinvault-{name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _stop(self) -> None:
        if not self._threads:
            return
        for jobs, count in (
            (self._sha_jobs, 1),
            (self._chunk_jobs, 1),
            (self._write_jobs, WRITE_THREADS),
        ):
            for _ in range(count):
                jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    # -- the stages --------------------------------------------------------------------------

    def _run(self, jobs: queue.SimpleQueue[_Job | None], work: Callable[[_Job], None]) -> None:
        while (job := jobs.get()) is not None:
            try:
                if self._error is None:
                    work(job)
            except BaseException as error:
                self._error = self._error or error
            finally:
                self._release(job[0])

    def _release(self, index: int) -> None:
        with self._lock:
            self._users[index] -= 1
            free = self._users[index] == 0
        if free:
            self._free.put(index)

    def _hash_sha(self, job: _Job) -> None:
        index, length, _ = job
        self._sha.update(self._slots[index][:length])

    def _hash_chunks(self, job: _Job) -> None:
        index, length, _ = job
        self._chunks.update(self._slots[index][:length])

    def _write(self, job: _Job) -> None:
        index, length, offset = job
        padded = -(-length // ALIGN) * ALIGN if self.direct else length
        view = self._slots[index][:padded]
        written = 0
        while written < padded:
            written += os.pwrite(self.fd, view[written:], offset + written)
        if not self.direct:
            with self._lock:
                self._unsynced += length
                due = self._unsynced >= SYNC_EVERY
                if due:
                    self._unsynced = 0
            if due:
                os.fdatasync(self.fd)


# A slot's number, how many bytes it holds, and where they go in the blob.
_Job = tuple[int, int, int]
# Each slot is seen by the SHA-256 stage, the BLAKE3 stage and one writer.
_STAGES: Final = 3


class _Discarded(Exception):
    """Tells the stages that the put was given up."""
