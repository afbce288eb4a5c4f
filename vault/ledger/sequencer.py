"""The ledger's sequencer: the one writer that assigns indexes and group-commits appends, and the
link by which a server hands its appends to a sequencer in a process of its own, so that
sequencing and the database writes do not share an interpreter lock with the gRPC event loop.

The link is a connected stream socket (an anonymous socket pair the server makes for its own
child: no address anyone else can reach) carrying length-prefixed `marshal` frames; both ends
are this program, so no frame from anyone else is ever decoded. Each request frame is one
append (a list of pins); each reply frame answers, in order, the appends of one commit, sent
only once that commit is durable."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import marshal
import queue
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Final

from vault import errors
from vault.digest import digest_key
from vault.errors import ResourceExhausted, Unavailable, VaultError, VerificationError
from vault.ledger.db import LEDGER_RESERVE, Database, Transaction, Writer
from vault.ledger.entry import INDEX, encode_fields, now
from vault.ledger.merkle import leaf_hash
from vault.ledger.records import PinSpec, StoredEntry
from vault.ledger.subject_index import FOLD_ROWS
from vault.ledger.subject_map_store import AUTHOR as MAP_AUTHOR
from vault.ledger.subject_map_store import MapWriter

log = logging.getLogger(__name__)

MAX_BATCH: Final = 10_000
# A commit of this many entries does not wait for more to share its sync (see `gather`).
LINGER_BELOW: Final = 256
# A pin as it crosses the link: kind, subjects, author, meta, external.
PinFields = tuple[str, tuple[str, ...], str, Mapping[str, str], bool]

ENTRY_COLUMNS: Final = ("idx", "body", "leaf_hash", "kind", "author", "time", "external")
SUBJECT_COLUMNS: Final = ("digest", "idx")
HEAD: Final = "SELECT size, last_leaf FROM ledger_head WHERE id = 1"
_LEAF: Final = "SELECT leaf_hash FROM entries WHERE idx = ?"
_LENGTH: Final = struct.Struct(">I")
# Far above any append (MAX_BATCH pins of bounded size): a longer frame is a broken stream.
MAX_FRAME: Final = 1 << 30
_READ_SIZE: Final = 1 << 20


def fields(pin: PinSpec) -> PinFields:
    meta = pin.meta if type(pin.meta) is dict else dict(pin.meta)  # marshal takes dicts only
    return (pin.kind, tuple(pin.subjects), pin.author, meta, pin.external)


def gather(
    source: queue.SimpleQueue[Any],
    first: Any,
    size: Callable[[Any], int],
    stop: object,
    window: float,
) -> tuple[list[Any], bool]:
    """`first` and the appends that join its commit: those already queued and, while the commit
    is smaller than LINGER_BELOW entries, those that come within `window` seconds (so that
    concurrent appenders share one sync; a commit that large already shares it widely, and
    waiting would only leave the writer idle). Also whether `stop` came, which ends the
    gathering and the writer."""
    batch = [first]
    count = size(first)
    deadline = time.monotonic() + window
    while count < MAX_BATCH:
        wait = deadline - time.monotonic() if count < LINGER_BELOW else 0.0
        try:
            more = source.get(timeout=max(wait, 0.0))
        except queue.Empty:
            return batch, False
        if more is stop:
            return batch, True
        batch.append(more)
        count += size(more)
    return batch, False


def commits(
    source: queue.SimpleQueue[Any], size: Callable[[Any], int], stop: object, window: float
) -> Iterator[list[Any]]:
    """A writer's commits, each the appends that join it (`gather`), until `stop` comes: a
    commit lingers for `window` only after one that had company (a lone appender never waits)."""
    concurrent = False
    while (first := source.get()) is not stop:
        batch, stopped = gather(source, first, size, stop, window if concurrent else 0.0)
        concurrent = len(batch) > 1
        yield batch
        if stopped:
            return


def write_entries(
    tx: Transaction, groups: Sequence[Sequence[PinFields]], size: int, prev: bytes
) -> tuple[list[bytes], list[bytes]]:
    """Encode and insert the entries of `groups`, in order, from index `size` after the leaf
    `prev`, in the open transaction `tx`, and move the head past them: every entry's body and
    leaf hash, in order."""
    stamp = now()
    rows: list[tuple[object, ...]] = []
    subject_rows: list[tuple[bytes, int]] = []
    bodies: list[bytes] = []
    leaves: list[bytes] = []
    for group in groups:
        for kind, subjects, author, meta, external in group:
            body = encode_fields(size, kind, subjects, author, stamp, prev, meta, external)
            prev = leaf_hash(body)
            rows.append((size, body, prev, kind, author, stamp, external))
            subject_rows += [(digest_key(s), size) for s in subjects]
            bodies.append(body)
            leaves.append(prev)
            size += 1
    tx.insert("entries", ENTRY_COLUMNS, rows)
    tx.insert("entry_subjects", SUBJECT_COLUMNS, subject_rows)
    if tx.sqlite:  # the subject index's newest rows (vault.ledger.subject_index)
        tx.insert("subject_recent", SUBJECT_COLUMNS, subject_rows)
    tx.run("UPDATE ledger_head SET size = ?, last_leaf = ? WHERE id = 1", (size, prev))
    return bodies, leaves


def write_commit(
    tx: Transaction,
    groups: Sequence[Sequence[PinFields]],
    size: int,
    prev: bytes,
    subject_map: MapWriter,
) -> tuple[list[bytes], list[bytes]]:
    """`write_entries`, then, when the subject map is due, its rows brought up to the new head
    and the `index` entry committing its root appended after the commit's own entries (no
    appender waits for it: it is the last body and leaf returned, which no request counts)."""
    bodies, leaves = write_entries(tx, groups, size, prev)
    end = size + len(leaves)
    # An append of no entries is a look-up's request for an `index` entry
    # (`Ledger.index_tick_async`).
    if subject_map.due(end) or not leaves:
        meta = subject_map.step(tx, end)
        if meta is not None:
            last = leaves[-1] if leaves else prev
            more, more_leaves = write_entries(
                tx, [[(INDEX, (), MAP_AUTHOR, meta, False)]], end, last
            )
            bodies += more
            leaves += more_leaves
    return bodies, leaves


def _frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def read_frames(sock: socket.socket) -> Iterator[bytes]:
    """The frames arriving on `sock`, until the other end closes it."""
    buffer = bytearray()
    while True:
        chunk = sock.recv(_READ_SIZE)
        if not chunk:
            return
        buffer += chunk
        start = 0
        while len(buffer) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buffer, start)
            if length > MAX_FRAME:
                raise ConnectionError(f"a sequencer frame of {length} bytes: the link is broken")
            end = start + _LENGTH.size + length
            if end > len(buffer):
                break
            yield bytes(buffer[start + _LENGTH.size : end])
            start = end
        del buffer[:start]


def send(sock: socket.socket, message: Any) -> None:
    sock.sendall(_frame(marshal.dumps(message)))


def receive(sock: socket.socket, timeout: float | None) -> Any:
    """One whole frame, for the start of the link (before either side streams); `timeout`
    None waits as long as the link is open."""
    sock.settimeout(timeout)
    try:
        header = _receive_exactly(sock, _LENGTH.size)
        (length,) = _LENGTH.unpack(header)
        return marshal.loads(_receive_exactly(sock, length))
    finally:
        sock.settimeout(None)


def _receive_exactly(sock: socket.socket, count: int) -> bytes:
    parts = bytearray()
    while len(parts) < count:
        chunk = sock.recv(count - len(parts))
        if not chunk:
            raise ConnectionError("the sequencer's link closed")
        parts += chunk
    return bytes(parts)


# ---------------------------------------------------------------------- the sequencer's side


class Sequencer:
    """The single writer, in the sequencer process: reads appends from the link (a thread that
    only receives, so a server's sends never wait on a commit), commits whatever has queued up
    in one transaction, and answers each commit's appends once it is durable."""

    def __init__(
        self,
        db: Database,
        sock: socket.socket,
        *,
        commit_window: float,
        fold_rows: int = FOLD_ROWS,
    ) -> None:
        self.db = db
        self.sock = sock
        self.commit_window = commit_window
        self._writer = Writer(
            db, checkpoints_aside=True, reserve=LEDGER_RESERVE, fold_rows=fold_rows
        )
        self._queue: queue.SimpleQueue[list[PinFields] | None] = queue.SimpleQueue()
        self._map = MapWriter()
        # The head this sequencer last wrote: a head found otherwise at the next commit was
        # moved by another server (PostgreSQL), which left a chain that must still join up.
        ((size, last),) = db.fetch(HEAD)
        self._known = (int(size), bytes(last))

    def run(self) -> None:
        """Serve the link until the server closes it; appends received but not yet committed
        then are dropped (no one is left to acknowledge them)."""
        reader = threading.Thread(target=self._receive, name="sequencer-reader", daemon=True)
        reader.start()
        try:
            self._commit_loop()
        finally:
            self._writer.close()

    def _receive(self) -> None:
        try:
            for frame in read_frames(self.sock):
                self._queue.put(marshal.loads(frame))
        except (OSError, ValueError, EOFError) as exc:
            log.error("the sequencer's link broke: %s", exc)
        finally:
            self._queue.put(None)

    def _commit_loop(self) -> None:
        for batch in commits(self._queue, len, None, self.commit_window):
            reply: tuple[object, ...]
            try:
                first_index, bodies, leaves = self._commit(batch)
                reply = (len(batch), first_index, bodies, b"".join(leaves))
            except Exception as exc:  # every waiter must hear of the failure
                if isinstance(exc, ResourceExhausted):  # a full disk: no fault of the code
                    log.warning("ledger append refused: %s", exc)
                elif not isinstance(exc, VaultError):
                    log.exception("ledger append failed")
                reply = (len(batch), type(exc).__name__, _message(exc))
            try:
                send(self.sock, reply)
            except OSError:
                return  # the server is gone

    def _commit(self, batch: Sequence[Sequence[PinFields]]) -> tuple[int, list[bytes], list[bytes]]:
        try:
            with self._writer.begin() as tx:
                ((size, last),) = tx.all(HEAD + ("" if self.db.is_sqlite else " FOR UPDATE"))
                size, last = int(size), bytes(last)
                if (size, last) != self._known:
                    self._check_join(tx, size, last)
                bodies, leaves = write_commit(tx, batch, size, last, self._map)
        except BaseException:
            self._map.failed()
            raise
        self._map.committed()
        self._known = (size + len(leaves), leaves[-1] if leaves else last)
        return size, bodies, leaves

    def _check_join(self, tx: Transaction, size: int, last: bytes) -> None:
        """Another writer moved the head: it must have grown from the head this one left, and
        still end in its own last leaf."""
        known_size, known_last = self._known
        if size < known_size:
            raise VerificationError(
                f"ledger head says size {size} but this server already wrote size {known_size}",
                index=size,
            )
        for index, leaf in ((known_size - 1, known_last), (size - 1, last)):
            if index < 0:
                continue
            rows = tx.all(_LEAF, (index,))
            if not rows or bytes(rows[0][0]) != leaf:
                raise VerificationError(
                    f"ledger head's last leaf does not match entry {index}", index=index
                )


def _message(exc: BaseException) -> str:
    text = str(exc)
    return text if isinstance(exc, VaultError) else f"ledger append failed: {text}"


# ---------------------------------------------------------------------- the server's side


class Waiting:
    """One append waiting for its commit, and who waits for it: a thread (a concurrent Future)
    or an event loop (an asyncio Future, settled on its loop, all of one commit's in one
    wake-up)."""

    __slots__ = ("count", "pins", "waiter")

    def __init__(
        self,
        pins: Sequence[PinSpec],
        waiter: asyncio.Future[list[StoredEntry]] | Future[list[StoredEntry]],
    ) -> None:
        self.pins = pins
        self.count = len(pins)
        self.waiter = waiter

    def settle_later(
        self, outcome: list[StoredEntry] | BaseException, loops: dict[Any, list[Any]]
    ) -> None:
        waiter = self.waiter
        if isinstance(waiter, asyncio.Future):
            loops.setdefault(waiter.get_loop(), []).append((waiter, outcome))
        elif isinstance(outcome, BaseException):
            waiter.set_exception(outcome)
        else:
            waiter.set_result(outcome)


def _settle(settled: list[tuple[asyncio.Future[list[StoredEntry]], Any]]) -> None:
    for waiter, outcome in settled:
        _resolve(waiter, outcome)


def _resolve(
    waiter: asyncio.Future[list[StoredEntry]], outcome: list[StoredEntry] | BaseException
) -> None:
    """Settle an append awaited on an event loop (its own), unless its caller gave up."""
    if waiter.done():
        return
    if isinstance(outcome, BaseException):
        waiter.set_exception(outcome)
    else:
        waiter.set_result(outcome)


def settle_all(outcomes: Iterator[tuple[Waiting, list[StoredEntry] | BaseException]]) -> None:
    """Settle each waiting append with its outcome: threads at once, each event loop in one
    wake-up."""
    loops: dict[Any, list[Any]] = {}
    for request, outcome in outcomes:
        request.settle_later(outcome, loops)
    for loop, settled in loops.items():
        with contextlib.suppress(RuntimeError):  # that loop has closed
            loop.call_soon_threadsafe(_settle, settled)


# What a sequencer's error becomes in the server: the same type where one can be made from the
# message alone, else the nearest one that can (DiskFull names its folder in the message).
_RAISED: Final = {
    name: getattr(errors, name)
    for name in (
        "VerificationError",
        "IntegrityError",
        "InvalidArgument",
        "ResourceExhausted",
        "Unavailable",
        "FailedPrecondition",
    )
}
_RAISED["DiskFull"] = ResourceExhausted


def _error(name: str, message: str) -> VaultError:
    made: VaultError = _RAISED.get(name, Unavailable)(message)
    return made


Connect = Callable[[], socket.socket]
# Told the first index and the leaf hashes of each commit, in commit order, on the event loop.
Committed = Callable[[int, list[bytes]], None]
_RETRY_MIN: Final = 0.1
_RETRY_MAX: Final = 5.0


class SequencerLink:
    """The server's end of the link to its sequencer process, run by the server's event loop
    itself: the appends of one turn of the loop leave in one write, and each reply (one a
    commit) is read and settled there, with no thread between the loop and the socket to
    trade the interpreter lock with. An append is acknowledged only when the sequencer's reply
    says its commit is durable. A sequencer that stops fails every append in flight with
    UNAVAILABLE (whether its commit happened is unknown, so none is acknowledged), and
    `connect` starts another."""

    def __init__(
        self, connect: Connect, committed: Committed, loop: asyncio.AbstractEventLoop
    ) -> None:
        self._connect = connect
        self._committed = committed
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._pending: deque[Waiting] = deque()
        self._incoming = bytearray()
        self._outgoing = bytearray()
        self._flush_due = False
        self._writing = False
        self._sock: socket.socket | None = None
        self._closed = False
        self._restart: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, connect: Connect, committed: Committed) -> SequencerLink:
        """A link on the running loop, to a sequencer `connect` starts (off the loop)."""
        loop = asyncio.get_running_loop()
        link = cls(connect, committed, loop)
        link._attach(await loop.run_in_executor(None, connect))
        return link

    def _attach(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._loop.add_reader(sock.fileno(), self._readable)

    def submit(self, pins: Sequence[PinSpec]) -> Future[list[StoredEntry]]:
        """`append` for a thread other than the loop's."""
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("the event loop's own thread appends with `append`")
        return asyncio.run_coroutine_threadsafe(self.append(pins), self._loop)

    async def append(self, pins: Sequence[PinSpec]) -> list[StoredEntry]:
        if self._sock is None or self._closed:
            raise Unavailable(
                "the ledger's sequencer is not running (it is being started again): retry"
            )
        waiter: asyncio.Future[list[StoredEntry]] = self._loop.create_future()
        frame = _frame(marshal.dumps([fields(p) for p in pins]))
        self._pending.append(Waiting(pins, waiter))
        self._outgoing += frame
        if not self._flush_due:
            self._flush_due = True
            self._loop.call_soon(self._flush)
        return await waiter

    def _flush(self) -> None:
        self._flush_due = False
        sock = self._sock
        if sock is None or not self._outgoing:
            return
        try:
            sent = sock.send(self._outgoing)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._broken(sock, exc)
            return
        del self._outgoing[:sent]
        if self._outgoing and not self._writing:
            self._writing = True
            self._loop.add_writer(sock.fileno(), self._flush)
        elif not self._outgoing and self._writing:
            self._writing = False
            self._loop.remove_writer(sock.fileno())

    def _readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            chunk = sock.recv(_READ_SIZE)
        except BlockingIOError:
            return
        except OSError as exc:
            self._broken(sock, exc)
            return
        if not chunk:
            self._broken(sock, None)
            return
        incoming = self._incoming
        incoming += chunk
        start = 0
        try:
            while len(incoming) - start >= _LENGTH.size:
                (length,) = _LENGTH.unpack_from(incoming, start)
                end = start + _LENGTH.size + length
                if end > len(incoming):
                    break
                self._answer(marshal.loads(incoming[start + _LENGTH.size : end]))
                start = end
        except (ValueError, EOFError, IndexError, TypeError) as exc:
            self._broken(sock, exc)
            return
        del incoming[:start]

    def _answer(self, reply: tuple[Any, ...]) -> None:
        pending = self._pending
        requests = [pending.popleft() for _ in range(reply[0])]
        if isinstance(reply[1], str):
            error = _error(reply[1], reply[2])
            for request in requests:
                _settle_one(request, error)
            return
        first, bodies, joined = reply[1], reply[2], reply[3]
        # The tree learns the new leaves before any caller hears of them.
        self._committed(first, [joined[i : i + 32] for i in range(0, len(joined), 32)])
        index = first
        for request in requests:
            end = index + request.count
            _settle_one(request, [StoredEntry(i, bodies[i - first]) for i in range(index, end)])
            index = end

    def _broken(self, sock: socket.socket, reason: BaseException | None) -> None:
        if not self._closed:
            log.error("the ledger's sequencer stopped%s", "" if reason is None else f": {reason}")
        self._loop.remove_reader(sock.fileno())
        if self._writing:
            self._loop.remove_writer(sock.fileno())
            self._writing = False
        with contextlib.suppress(OSError):
            sock.close()
        self._sock = None
        self._incoming.clear()
        self._outgoing.clear()
        pending = list(self._pending)
        self._pending.clear()
        error = Unavailable(
            "the ledger's sequencer stopped before it acknowledged the append: it is not "
            "acknowledged (it may or may not be in the ledger); retry"
        )
        for request in pending:
            _settle_one(request, error)
        if not self._closed:
            self._restart = self._loop.create_task(self._start_again())

    async def _start_again(self) -> None:
        delay = _RETRY_MIN
        while not self._closed:
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX)
            try:
                sock = await self._loop.run_in_executor(None, self._connect)
            except Exception as exc:
                log.error("the ledger's sequencer did not start again: %s", exc)
                continue
            if self._closed:
                sock.close()
                return
            self._attach(sock)
            log.warning("the ledger's sequencer started again")
            return

    async def close(self, timeout: float = 30.0) -> None:
        """Take no more appends; wait for the answers to those in flight, then close the link
        (the sequencer then exits)."""
        self._closed = True
        deadline = self._loop.time() + timeout
        while self._pending and self._sock is not None and self._loop.time() < deadline:
            await asyncio.sleep(0.01)
        if self._restart is not None:
            self._restart.cancel()
        sock = self._sock
        if sock is not None:
            self._broken(sock, None)


def _settle_one(request: Waiting, outcome: list[StoredEntry] | BaseException) -> None:
    assert isinstance(request.waiter, asyncio.Future)
    _resolve(request.waiter, outcome)
