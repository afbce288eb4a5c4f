"""The one HTTP/1.1 server under every HTTP edge of pinvault (the tiles, metrics and explorer
endpoints, the Kubernetes webhook and the OCI registry), bounded against slow and hostile
callers.

Every request has a total deadline for its head (the TLS handshake included), its body and the
writing of its answer; connections are capped per client address and in all, and a new one at
its address's cap closes that address's oldest connection still waiting for a request head (an
idle keep-alive one counts as waiting), so callers that drip bytes can never lock out genuine
ones, even from the same address. Blocking work (database queries, file reads, calls to the
vault) runs on a fixed pool of threads made once for the life of the edge, behind a bounded
queue (beyond it: 503 with Retry-After), so no request costs a thread of its own.

Why not aiohttp or uvicorn: they bound an idle keep-alive connection and each read, not the
total time of a request head, so a caller sending one byte every few seconds still holds them.
Here a connection costs a coroutine, not a thread, and h11 parses HTTP/1.1 without doing any I/O,
so the deadlines are ours.

A handler that takes a body answers its head with a `Sink` rather than a `Response`, and the
edge hands the sink the body piece by piece (`write`, then `finish` for the answer, or `abort`
when the body fails or its caller goes), each call on a worker thread: a thread is taken only
while there are bytes to process, never while a caller is slow to send them. An edge whose
`Limits.min_body_rate` is set (an OCI registry's blob uploads) reads such a body on the event
loop as it comes, in pieces of at most 1 MiB, one in flight per request, so memory stays
bounded whatever the size; the body's deadline grows with what has arrived (`body_seconds` plus
one second for every `min_body_rate` bytes). Without it a body is read whole, within
`body_seconds`, before the handler runs. An answer may be a stream too (`Response.stream`),
pulled one piece at a time on a worker thread, each piece written within `write_seconds`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, ParamSpec, Protocol, Self, TypeVar

import h11

from vault.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_P = ParamSpec("_P")

TEXT: Final = "text/plain; charset=utf-8"
NOT_CACHED: Final = "no-store"
_READ_SIZE: Final = 64 * 1024
# The most of a streamed body handed to its handler in one piece (fewer hops between threads).
_STREAM_PIECE: Final = 1024 * 1024
# What a caller turned away at the caps is given, from the event loop, without waiting on it.
_BUSY: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 5\r\nConnection: close\r\n\r\nbusy\n"
)


@dataclass(frozen=True, slots=True)
class Limits:
    """What one caller may hold of an edge, and for how long."""

    # From a connection's opening (or the end of its last answer, kept alive) to the last byte
    # of a request head, the TLS handshake included.
    head_seconds: float = 10.0
    # From the end of the head to the end of the body.
    body_seconds: float = 10.0
    # Writing one answer.
    write_seconds: float = 30.0
    # The blocking work of one request; then the caller gets 503 (the thread finishes it).
    work_seconds: float = 60.0
    max_head_bytes: int = 16 * 1024
    # A larger body is refused with 413 before it is read; 0: requests carry no body.
    max_body_bytes: int = 0
    per_address: int = 16
    connections: int = 256
    # Threads for blocking work, made when the edge starts and kept until it stops.
    workers: int = 4
    # Requests waiting for a worker; one more is answered 503 at once.
    queue: int = 32
    methods: frozenset[str] = frozenset({"GET", "HEAD"})
    # Bytes a second a streamed body must average; 0: bodies are read whole before the handler
    # runs, within body_seconds. When set, max_body_bytes bounds a streamed body.
    min_body_rate: int = 0

    def __post_init__(self) -> None:
        for name in ("head_seconds", "body_seconds", "write_seconds", "work_seconds"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} is a positive number, not {getattr(self, name)}")
        for name in ("max_head_bytes", "per_address", "connections", "workers"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} is at least 1, not {getattr(self, name)}")
        if self.max_body_bytes < 0 or self.queue < 0 or self.min_body_rate < 0:
            raise InvalidArgument("max_body_bytes, queue and min_body_rate are 0 or more")


@dataclass(frozen=True, slots=True)
class Request:
    """One request as the caller sent it: the target exactly as sent (nothing decoded or
    normalised), header names in lower case, and the caller's IP address."""

    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    # The whole body; empty with Limits.min_body_rate, where a handler that takes one returns
    # a Sink and is given it piece by piece.
    body: bytes
    peer: str

    def header(self, name: str) -> list[str]:
        """Every value of the header `name` (any case), in the order sent."""
        wanted = name.lower()
        return [value for key, value in self.headers if key == wanted]


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = TEXT
    cache: str = NOT_CACHED
    headers: tuple[tuple[str, str], ...] = ()
    # End the connection after this answer.
    close: bool = False
    # An answer too large to hold: its pieces, pulled on a worker thread, and their total
    # length, sent as Content-Length (`body` is then unused). A piece that fails ends the
    # connection before the announced length is reached, so no client takes it for whole.
    stream: Iterator[bytes] | None = None
    length: int = 0

    @classmethod
    def text(
        cls,
        status: int,
        message: str,
        *,
        headers: tuple[tuple[str, str], ...] = (),
        close: bool = False,
    ) -> Response:
        """A one-line plain-text answer."""
        line = " ".join(message.split()) + "\n"
        return cls(status, line.encode(), headers=headers, close=close)


class BodyError(Exception):
    """A streamed body that cannot be read to its end (too slow, too large, cut off, the edge
    stopping): given to the sink's `abort`, and answered `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Sink(Protocol):
    """Where a handler takes a request's body: the edge calls `write` with each piece as it
    comes, then exactly one of `finish` (the whole body is in) or `abort` (it never will be, or a
    `write` failed), unless a `write` answers first. Every call runs on a worker thread, one at a
    time."""

    def write(self, piece: bytes) -> Response | None:
        """Keep `piece`; an answer ends the request there, the rest of the body unread (the sink
        has then let go of what it kept, and neither `finish` nor `abort` follows)."""
        ...

    def finish(self) -> Response:
        """The answer, once the body has all come."""
        ...

    def abort(self, error: BodyError) -> Response:
        """Let go of what was kept; the answer is sent if the caller is still there."""
        ...


# A handler answers a request, or, to take its body, gives the sink that will.
Handler = Callable[[Request], Response | Sink]


class _Body:
    """A request body read on the event loop as the caller sends it, one piece at a time."""

    def __init__(self, http: h11.Connection, reader: asyncio.StreamReader, limits: Limits) -> None:
        self._http = http
        self._reader = reader
        self._limits = limits
        self._began = asyncio.get_running_loop().time()
        self.received = 0
        self.ended = False
        # What h11 already holds, read without waiting: all of a body that is empty.
        self._held = b""
        held = http.next_event()
        if isinstance(held, h11.EndOfMessage):
            self.ended = True
        elif isinstance(held, h11.Data):
            self._held = bytes(held.data)
            self.received = len(self._held)

    def _deadline(self) -> float:
        limits = self._limits
        return self._began + limits.body_seconds + self.received / limits.min_body_rate

    async def next(self) -> bytes:
        """Up to _STREAM_PIECE bytes of the body, as soon as that much has come or it ends;
        b"" once it has all come. BodyError if it cannot."""
        pieces = [self._held] if self._held else []
        size = len(self._held)
        self._held = b""
        while size < _STREAM_PIECE and not self.ended:
            try:
                async with asyncio.timeout_at(self._deadline()):
                    part = await _next_event(self._http, self._reader, _STREAM_PIECE)
            except TimeoutError:
                raise BodyError(408, "the request's body came too slowly") from None
            except h11.RemoteProtocolError as exc:
                raise BodyError(exc.error_status_hint, f"bad request: {exc}") from None
            if isinstance(part, h11.EndOfMessage):
                self.ended = True
                break
            if not isinstance(part, h11.Data):
                raise BodyError(400, "the request's body was cut off")
            self.received += len(part.data)
            if self.received > self._limits.max_body_bytes:
                raise BodyError(413, f"the body is more than {self._limits.max_body_bytes} bytes")
            pieces.append(bytes(part.data))
            size += len(part.data)
        return b"".join(pieces)


@dataclass(eq=False, slots=True)
class _Connection:
    peer: str
    task: asyncio.Task[None]
    transport: asyncio.WriteTransport
    # Waiting for a request head (a new or an idle keep-alive connection): may be evicted.
    waiting: bool = True
    evicted: bool = field(default=False)


class Edge:
    """An HTTP/1.1 server on `host`:`port` (port 0: one the system picks, read back in `port`
    once started) answering each request with `handler(request)`, run on the edge's worker
    threads; `what` names it in messages. With `tls`, HTTPS."""

    def __init__(
        self,
        what: str,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: Limits = Limits(),
        tls: ssl.SSLContext | None = None,
        server: str = "",
    ) -> None:
        self.what = what
        self.host = host
        self.limits = limits
        self._handler = handler
        self._requested_port = port
        self._tls = tls
        self._server_name = server or f"pinvault-{what}"
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._pool: ThreadPoolExecutor | None = None
        # Only the event loop's thread reads or changes these.
        self._by_address: dict[str, list[_Connection]] = {}
        self._open = 0
        self._pending = 0

    @property
    def port(self) -> int:
        if self._socket is None:
            raise RuntimeError(f"the {self.what} server is not started")
        return int(self._socket.getsockname()[1])

    def start(self) -> Self:
        if self._socket is not None:
            raise RuntimeError(f"the {self.what} server is already started")
        if not 0 <= self._requested_port <= 65535:
            raise InvalidArgument(f"a {self.what} port is 0 to 65535, not {self._requested_port}")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            listening = socket.create_server(
                (self.host, self._requested_port), family=family, backlog=128
            )
        except OSError as exc:
            raise Unavailable(
                f"cannot serve {self.what} on {self.host}:{self._requested_port}: "
                f"{exc.strerror or exc}"
            ) from None
        self._socket = listening
        self._pool = _started_pool(self.what, self.limits.workers)
        ready = threading.Event()
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._main(listening, ready),), name=f"{self.what}-http"
        )
        self._thread.start()
        ready.wait()
        if self._stopping is None:
            self.stop()
            raise Unavailable(f"the {self.what} server did not start: see its log")
        return self

    def stop(self) -> None:
        """Close every connection and the listening socket, and join every thread."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._loop is not None and self._stopping is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already ended
                self._loop.call_soon_threadsafe(self._stopping.set)
        thread.join()
        self._loop = self._stopping = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()

    # -- the event loop's side

    async def _main(self, listening: socket.socket, ready: threading.Event) -> None:
        try:
            # A streamed body is read in larger pieces, which the stream buffers before its
            # transport pauses.
            limit = _STREAM_PIECE if self.limits.min_body_rate else _READ_SIZE
            server = await asyncio.start_server(self._connected, sock=listening, limit=limit)
            self._loop = asyncio.get_running_loop()
            self._stopping = asyncio.Event()
        except Exception:
            log.exception("the %s server did not start", self.what)
            return
        finally:
            ready.set()
        async with server:
            await self._stopping.wait()
            server.close()
            tasks = [c.task for mine in self._by_address.values() for c in mine]
            for connection in [c for mine in self._by_address.values() for c in mine]:
                self._evict(connection)
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) else ""
        task = asyncio.current_task()
        assert task is not None
        connection = _Connection(peer, task, writer.transport)
        if not self._admit(connection):
            # Plain bytes, never waited on: a TLS caller cannot read them, and is closed all
            # the same.
            if self._tls is None:
                writer.write(_BUSY)
                writer.close()
            else:
                writer.transport.abort()
            return
        try:
            await self._converse(connection, reader, writer)
        except (OSError, TimeoutError, ssl.SSLError, h11.LocalProtocolError) as exc:
            log.debug("%s connection from %s ended: %r", self.what, peer, exc)
        except asyncio.CancelledError:
            # Evicted (or the edge stopping): the task ends as a normal one would, since
            # asyncio's stream callback takes a cancelled connection task for a failure.
            if not connection.evicted:
                raise
        except Exception:
            # A fault of this server's, not the caller's: one record, and the connection ends.
            log.exception("%s connection from %s failed", self.what, peer)
        finally:
            self._forget(connection)
            if not connection.evicted:
                # What was written goes out (through TLS too) before the socket closes.
                writer.close()
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await writer.wait_closed()
            writer.transport.abort()

    def _admit(self, connection: _Connection) -> bool:
        """Whether `connection` may be served, after evicting a waiting one if a cap is full."""
        mine = self._by_address.setdefault(connection.peer, [])
        if len(mine) >= self.limits.per_address:
            victim = next((c for c in mine if c.waiting), None)
            if victim is None:
                if not mine:
                    del self._by_address[connection.peer]
                return False
            self._evict(victim)
        if self._open >= self.limits.connections:
            # From the address holding the most: a crowd from one place goes first.
            crowded = sorted(self._by_address.values(), key=len, reverse=True)
            victim = next((c for group in crowded for c in group if c.waiting), None)
            if victim is None:
                if not mine:
                    del self._by_address[connection.peer]
                return False
            self._evict(victim)
        self._by_address.setdefault(connection.peer, []).append(connection)
        self._open += 1
        return True

    def _evict(self, connection: _Connection) -> None:
        self._forget(connection)
        connection.evicted = True
        connection.transport.abort()
        connection.task.cancel()

    def _forget(self, connection: _Connection) -> None:
        mine = self._by_address.get(connection.peer)
        if mine is None or connection not in mine:
            return
        mine.remove(connection)
        self._open -= 1
        if not mine:
            del self._by_address[connection.peer]

    async def _converse(
        self, connection: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        limits = self.limits
        http = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
        handshake = self._tls is not None
        while True:
            connection.waiting = True
            try:
                async with asyncio.timeout(limits.head_seconds):
                    if handshake:
                        await writer.start_tls(self._tls)  # type: ignore[arg-type]
                        handshake = False
                    event = await _next_event(http, reader)
            except TimeoutError:
                return
            except h11.RemoteProtocolError as exc:
                await self._refuse(http, writer, exc.error_status_hint, f"bad request: {exc}")
                return
            if not isinstance(event, h11.Request):
                return
            connection.waiting = False
            taken = await self._request(http, reader, writer, event, connection.peer)
            if taken is None:
                return
            request, body = taken
            response = await self._respond(http, writer, request, body)
            await self._answer(http, writer, response, head=request.method == "HEAD")
            if http.our_state is not h11.DONE or http.their_state is not h11.DONE:
                return
            http.start_next_cycle()

    async def _request(
        self,
        http: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        event: h11.Request,
        peer: str,
    ) -> tuple[Request, _Body | None] | None:
        """The request `event` opens, with its body still to read if it is streamed, or None
        once it is refused."""
        limits = self.limits
        method = event.method.decode("ascii", "replace")
        headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers)
        if method not in limits.methods:
            allowed = ", ".join(sorted(limits.methods))
            await self._refuse(
                http, writer, 405, "method not allowed", headers=(("Allow", allowed),)
            )
            return None
        announced = [int(v) for k, v in headers if k == "content-length"]
        if announced and announced[0] > limits.max_body_bytes:
            await self._refuse(
                http,
                writer,
                413,
                f"the request is {announced[0]} bytes, more than {limits.max_body_bytes}",
            )
            return None
        target = event.target.decode("latin-1")
        if limits.min_body_rate:
            return Request(method, target, headers, b"", peer), _Body(http, reader, limits)
        body = bytearray()
        try:
            async with asyncio.timeout(limits.body_seconds):
                if http.client_is_waiting_for_100_continue:
                    await self._write(
                        writer, _sent(http, h11.InformationalResponse(status_code=100, headers=[]))
                    )
                while not isinstance(part := await _next_event(http, reader), h11.EndOfMessage):
                    if not isinstance(part, h11.Data):
                        return None
                    body += part.data
                    if len(body) > limits.max_body_bytes:
                        await self._refuse(
                            http,
                            writer,
                            413,
                            f"the body is more than {limits.max_body_bytes} bytes",
                        )
                        return None
        except TimeoutError:
            await self._refuse(http, writer, 408, "the request's body came too slowly")
            return None
        except h11.RemoteProtocolError as exc:
            await self._refuse(http, writer, exc.error_status_hint, f"bad request: {exc}")
            return None
        return Request(method, target, headers, bytes(body), peer), None

    async def _respond(
        self,
        http: h11.Connection,
        writer: asyncio.StreamWriter,
        request: Request,
        body: _Body | None,
    ) -> Response:
        """The handler's answer to `request`; `body`: its body, still to read (streamed)."""
        limits = self.limits
        if self._pending >= limits.workers + limits.queue:
            return _busy(f"the {self.what} server is busy")
        handling = self._submit(self._handle, request)
        try:
            outcome = await self._wait(handling)
        except _TooLong as late:
            # A sink the handler gives after all is told at once that no body will come.
            handling.add_done_callback(_abort_any)
            return late.response
        if not isinstance(outcome, Response):
            return await self._feed(http, writer, request, body, outcome)
        if body is not None and not body.ended:
            # The handler left the body unread: the connection cannot be reused.
            return dataclasses.replace(outcome, close=True)
        return outcome

    async def _feed(
        self,
        http: h11.Connection,
        writer: asyncio.StreamWriter,
        request: Request,
        body: _Body | None,
        sink: Sink,
    ) -> Response:
        """The answer of `sink`, given the request's body piece by piece: each piece is read
        here, on the event loop, and only then handed to a worker thread, so a slow caller costs
        this coroutine and no thread while it sends."""
        whole = request.body
        inflight: Future[Any] | None = None
        settled = False
        try:
            if body is not None and http.client_is_waiting_for_100_continue:
                await self._write(
                    writer, _sent(http, h11.InformationalResponse(status_code=100, headers=[]))
                )
            while True:
                if body is None:
                    piece, whole = whole, b""
                else:
                    piece = await body.next()
                if not piece:
                    break
                inflight = writing = self._submit(_faulting(sink.write), piece)
                early = await self._wait(writing)
                if early is not None:
                    settled = True
                    if body is not None and not body.ended:
                        return dataclasses.replace(early, close=True)
                    return early
            # Once finishing, the sink lets go of what it kept itself, whatever comes of it.
            settled = True
            return await self._wait(self._submit(_faulting(sink.finish)))
        except BodyError as error:
            aborting = self._submit(_faulting(sink.abort), error)
            settled = True
            try:
                answer = await self._wait(aborting)
            except (_TooLong, _SinkFault) as failed:
                return self._failed(request, failed)
            return dataclasses.replace(answer, close=True)
        except (_TooLong, _SinkFault) as failed:
            return self._failed(request, failed)
        finally:
            if not settled:
                self._abort_later(sink, inflight, BodyError(408, "the request was cut off"))

    def _submit(self, work: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        """`work(*args)` on a worker thread, counted in the edge's pending work."""
        assert self._pool is not None
        self._pending += 1
        future = self._pool.submit(work, *args, **kwargs)
        asyncio.wrap_future(future).add_done_callback(self._finished)
        return future

    def _finished(self, _: object) -> None:
        self._pending -= 1

    async def _wait(self, future: Future[_T]) -> _T:
        """What `future` returns, within work_seconds; _TooLong past them (its thread goes on,
        and nothing the caller is waiting for comes of it)."""
        try:
            async with asyncio.timeout(self.limits.work_seconds):
                return await asyncio.shield(asyncio.wrap_future(future))
        except TimeoutError:
            raise _TooLong(_busy(f"the {self.what} server took too long")) from None

    def _abort_later(self, sink: Sink, inflight: Future[Any] | None, error: BodyError) -> None:
        """`sink.abort(error)` on a worker thread once the call it is in (if any) has ended; its
        answer goes nowhere."""
        pool = self._pool

        def abort(_: object = None) -> None:
            if pool is None:
                return
            with contextlib.suppress(RuntimeError):  # the pool has shut down with the edge
                pool.submit(_aborted, sink, error)

        if inflight is None or inflight.done():
            abort()
        else:
            inflight.add_done_callback(abort)

    def _failed(self, request: Request, failed: _TooLong | _SinkFault) -> Response:
        if isinstance(failed, _TooLong):
            return failed.response
        # A fault of the handler's sink: one record, and the connection ends.
        log.error(
            "%s request %s %s failed",
            self.what,
            request.method,
            request.target,
            exc_info=failed.__cause__,
        )
        return Response.text(500, f"the {self.what} server failed; see its log", close=True)

    def _handle(self, request: Request) -> Response | Sink:
        try:
            return self._handler(request)
        except Exception:
            log.exception("%s request %s %s failed", self.what, request.method, request.target)
            return Response.text(500, f"the {self.what} server failed; see its log", close=True)

    async def _answer(
        self, http: h11.Connection, writer: asyncio.StreamWriter, response: Response, *, head: bool
    ) -> None:
        length = len(response.body) if response.stream is None else response.length
        headers = [
            ("Content-Type", response.content_type),
            ("Content-Length", str(length)),
            ("Cache-Control", response.cache),
            ("X-Content-Type-Options", "nosniff"),
            ("Server", self._server_name),
            *response.headers,
        ]
        if response.close:
            headers.append(("Connection", "close"))
        data = _sent(http, h11.Response(status_code=response.status, headers=headers))
        if response.stream is not None:
            await self._write(writer, data)
            await self._answer_stream(http, writer, response.stream, head=head)
            return
        if not head and response.body:
            data += _sent(http, h11.Data(data=response.body))
        data += _sent(http, h11.EndOfMessage())
        await self._write(writer, data)

    async def _answer_stream(
        self,
        http: h11.Connection,
        writer: asyncio.StreamWriter,
        pieces: Iterator[bytes],
        *,
        head: bool,
    ) -> None:
        assert self._loop is not None and self._pool is not None
        try:
            while not head:
                piece = await self._loop.run_in_executor(self._pool, next, pieces, None)
                if piece is None:
                    break
                if piece:
                    await self._write(writer, _sent(http, h11.Data(data=piece)))
            await self._write(writer, _sent(http, h11.EndOfMessage()))
        except (OSError, TimeoutError, h11.LocalProtocolError):
            raise
        except Exception as exc:
            # A piece that failed (its check, its read): the connection ends short of the
            # announced length, which the client sees as a failed transfer.
            log.warning("%s answer ended early: %s", self.what, exc)
            raise OSError(f"the answer's bytes failed: {exc}") from None
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                await self._loop.run_in_executor(self._pool, close)

    async def _refuse(
        self,
        http: h11.Connection,
        writer: asyncio.StreamWriter,
        status: int,
        message: str,
        *,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        if http.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        response = Response.text(status, message, headers=headers, close=True)
        with contextlib.suppress(OSError, TimeoutError, h11.LocalProtocolError):
            await self._answer(http, writer, response, head=False)

    async def _write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        if not data:
            return
        async with asyncio.timeout(self.limits.write_seconds):
            writer.write(data)
            await writer.drain()


async def _next_event(
    http: h11.Connection, reader: asyncio.StreamReader, size: int = _READ_SIZE
) -> object:
    """h11's next event, reading at most `size` bytes from `reader` at a time as it needs (end
    of stream: ConnectionClosed)."""
    while True:
        event = http.next_event()
        if event is not h11.NEED_DATA:
            return event
        http.receive_data(await reader.read(size))


def _busy(message: str) -> Response:
    return Response.text(503, message, headers=(("Retry-After", "1"),))


class _TooLong(Exception):
    """Work that outran its deadline, and the answer the caller gets for it."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.body.decode())
        self.response = response


class _SinkFault(Exception):
    """What a sink's call raised (its cause), told apart from the connection's own failures."""


def _faulting(call: Callable[_P, _T]) -> Callable[_P, _T]:
    """`call`, raising _SinkFault for whatever it raises."""

    def called(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            raise _SinkFault(str(exc)) from exc

    return called


def _abort_any(handled: Future[Response | Sink]) -> None:
    outcome = None if handled.cancelled() or handled.exception() else handled.result()
    if outcome is not None and not isinstance(outcome, Response):
        _aborted(outcome, BodyError(503, "the request took too long"))


def _aborted(sink: Sink, error: BodyError) -> None:
    try:
        sink.abort(error)
    except Exception:
        log.exception("a request body's sink failed to let go of it")


def _sent(http: h11.Connection, event: h11.Event) -> bytes:
    return http.send(event) or b""


def _started_pool(what: str, workers: int) -> ThreadPoolExecutor:
    """A pool whose `workers` threads are all running before it is used: no request ever
    waits for a thread to be made, and none is made later."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{what}-worker")
    gathered = threading.Barrier(workers)
    for _ in range(workers):
        pool.submit(gathered.wait, 10.0)
    return pool
