"""`vault verify`'s audit on several processes: the ledger up to the head's size is cut into
chunks at multiples of a power of two, each audited by a worker process (`audit_worker`) from
its own stream of the server's stored rows, and the `Auditor` joins their results in index
order, so the first break is named exactly whatever order the workers finish in."""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import grpc

from vault.client.audit_worker import read_frame, write_frame
from vault.errors import VaultError, VerificationError
from vault.ledger.audit import Auditor, ChunkResult
from vault.wire import pinvault_pb2 as pb

# Entries a chunk holds unless told otherwise: large enough that a worker's start, the
# streams and the joins cost little beside the audit, small enough to spread a ledger of a
# few hundred thousand entries over two processes.
CHUNK: Final = 1 << 16
_READ_ENTRIES: Final = "/pinvault.v1.Ledger/ReadEntries"
_ROOT: Final = str(Path(__file__).resolve().parent.parent.parent)
_WORKER: Final = str(Path(__file__).resolve().with_name("audit_worker.py"))
# The worker module loaded from its file alone: importing it as `vault.client.audit_worker`
# would load the whole client package (gRPC among it), 0.5 s and 25 MiB more a process.
_START: Final = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('vault_audit_worker', sys.argv[1])\n"
    "worker = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(worker)\n"
    "worker.serve(sys.stdin.buffer, sys.stdout.buffer)\n"
)


def default_workers() -> int:
    """One a core, up to three: each worker holds about 30 MiB and the command about 100, so
    that the audit stays under 200 MiB."""
    return max(1, min(3, len(os.sched_getaffinity(0))))


class _Worker:
    """One worker process and the pipes to it."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-c", _START, _WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )

    def audit(
        self,
        start: int,
        end: int,
        sizes: Sequence[int],
        messages: Iterator[bytes],
        subject_map: bool = False,
    ) -> Any:
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        try:
            header = {"start": start, "end": end, "sizes": list(sizes), "map": subject_map}
            write_frame(stdin, b"C", json.dumps(header).encode())
            for message in messages:
                write_frame(stdin, b"M", message)
            write_frame(stdin, b"E", b"")
            stdin.flush()
        except BrokenPipeError:
            raise self._died() from None
        frame = read_frame(stdout)
        if frame is None:
            raise self._died()
        kind, payload = frame
        if kind == b"X":
            raise VerificationError(payload.decode())
        return pickle.loads(payload)

    def _died(self) -> VaultError:
        self.process.kill()
        assert self.process.stderr is not None
        lines = self.process.stderr.read().decode(errors="replace").strip().splitlines()
        return VaultError("an audit worker process stopped" + (f": {lines[-1]}" if lines else ""))

    def close(self) -> None:
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


def audit_in_chunks(
    channel: grpc.Channel,
    auditor: Auditor,
    head: int,
    *,
    workers: int,
    chunk: int = CHUNK,
    progress: Callable[[int, int], None] | None = None,
    subject_map: bool = False,
) -> None:
    """Audit the stored entries [0, head) with `workers` processes, joining each chunk into
    `auditor` in index order. Rows past the head are the caller's, from the snapshot `head`
    was read in: the rows below it never change, so each chunk may come from its own."""
    if chunk < 1 or chunk & (chunk - 1):
        raise VaultError(f"a chunk of the audit is a power of two entries, not {chunk}")
    read = channel.unary_stream(
        _READ_ENTRIES,
        request_serializer=pb.ReadEntriesRequest.SerializeToString,
        response_deserializer=None,
    )
    sizes = auditor.checkpoint_sizes()
    count = -(-head // chunk)
    lock = threading.Condition()
    results: dict[int, ChunkResult] = {}
    state = {"next": 0, "joined": 0}
    errors: list[BaseException] = []

    def run(worker: _Worker) -> None:
        try:
            while True:
                with lock:
                    # Never more than two chunks a worker ahead of the join: results wait in
                    # memory until every chunk before them is joined.
                    lock.wait_for(lambda: errors or state["next"] < state["joined"] + 2 * workers)
                    k = state["next"]
                    if errors or k >= count:
                        return
                    state["next"] = k + 1
                start, end = k * chunk, min((k + 1) * chunk, head)
                inside = sizes[bisect.bisect_right(sizes, start) : bisect.bisect_right(sizes, end)]
                request = pb.ReadEntriesRequest(start=start, end=end, columns=True)
                result = worker.audit(start, end, inside, read(request), subject_map)
                with lock:
                    results[k] = result
                    lock.notify_all()
        except BaseException as exc:
            with lock:
                errors.append(exc)
                lock.notify_all()

    pool: list[_Worker] = []
    threads: list[threading.Thread] = []
    try:
        for _ in range(min(workers, count)):
            pool.append(_Worker())
        auditor.report.workers = len(pool)
        threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in pool]
        for thread in threads:
            thread.start()
        for k in range(count):
            with lock:
                lock.wait_for(lambda k=k: errors or k in results)  # type: ignore[misc]
                if errors:
                    raise errors[0]
                result = results.pop(k)
            auditor.absorb(result)
            with lock:
                state["joined"] = k + 1
                lock.notify_all()
            if progress:
                progress(auditor.report.entries, head)
    finally:
        with lock:
            if not errors:
                errors.append(VaultError("the audit stopped"))
            lock.notify_all()
        for worker in pool:
            if worker.process.poll() is None and any(t.is_alive() for t in threads):
                worker.process.kill()
        for thread in threads:
            thread.join()
        for worker in pool:
            worker.close()
