"""The transport edge: the services' plain methods run as asyncio gRPC handlers, and errors
become status codes here and nowhere else."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Final, NoReturn, TypeVar

import grpc

from vault.errors import (
    Unauthenticated,
    Unavailable,
    VaultError,
)
from vault.server.auth import Gate, caller
from vault.server.metrics import count_rpc

log = logging.getLogger(__name__)


class StreamIdle(Unavailable):
    """A stream's caller sent nothing, or read nothing, for longer than the vault waits."""

    status = "DEADLINE_EXCEEDED"


def status_for(error: VaultError) -> grpc.StatusCode:
    name = type(error).status
    return grpc.StatusCode.INTERNAL if name is None else grpc.StatusCode[name]


T = TypeVar("T")


async def abort(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException) -> NoReturn:
    if isinstance(exc, VaultError):
        await context.abort(status_for(exc), str(exc))
    log.error("unexpected error in a request", exc_info=exc)
    await context.abort(
        grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"
    )
    raise AssertionError("unreachable: context.abort raises")


class Service:
    """Runs the services' plain (blocking) methods from the asyncio server: inline when they
    are short (SQLite queries, in-memory proofs), on a worker thread when they may wait (a
    PostgreSQL round trip, disk reads, hashing)."""

    inline: bool
    # The service's name in the proto, as `Gate` names RPCs: "Store.Put".
    rpc_service: str = ""
    gate: Gate = Gate()

    def authorise(self, method: str, context: Any) -> None:
        """Refuse the call unless its caller may make it. The gatekeeper (gatekeeper.py) names
        the caller, `auth.caller()`, before the request is read; this checks it did."""
        if self.gate.mode != "local":
            identity = caller()
            if not identity.authenticated:
                raise Unauthenticated("the call passed no gate that names its caller")
            self.gate.permit(f"{self.rpc_service}.{method}", identity)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        if self.inline:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)


Handler = Callable[..., Awaitable[Any]]


def unary(method: Callable[..., Any]) -> Handler:
    """An asyncio unary handler from a plain method `(self, request) -> response`."""

    @functools.wraps(method)
    async def wrapper(self: Service, request: Any, context: Any) -> Any:
        try:
            self.authorise(method.__name__, context)
            return await self.call(method, self, request)
        except Exception as exc:
            await abort(context, exc)

    return wrapper


# Unary calls whose work moves a whole blob (reading an upload back takes as long as the blob
# is large) or costs as much (presigning a plan's parts): they run on the stream workers and
# count as one of their caller's streams, so that they cannot take the threads look-ups and
# other short calls are answered on.
TRANSFER_CALLS: Final = frozenset({"Store.DirectPut", "Store.FinishDirectPut"})


def transfer(method: Callable[..., Any]) -> Handler:
    """A unary handler of TRANSFER_CALLS: `unary`, on the stream workers."""

    @functools.wraps(method)
    async def wrapper(self: Service, request: Any, context: Any) -> Any:
        try:
            self.authorise(method.__name__, context)
            return await _in_thread(TRANSFERS.get(), lambda: method(self, request))
        except Exception as exc:
            await abort(context, exc)

    return wrapper


def unary_async(method: Callable[..., Awaitable[Any]]) -> Handler:
    """An asyncio unary handler from a coroutine method `(self, request) -> response`."""

    @functools.wraps(method)
    async def wrapper(self: Service, request: Any, context: Any) -> Any:
        try:
            self.authorise(method.__name__, context)
            return await method(self, request)
        except Exception as exc:
            await abort(context, exc)

    return wrapper


@dataclass(frozen=True, slots=True)
class Transfers:
    """Where a stream's blocking work runs (None: the loop's default executor) and how long it
    waits for its caller to send or to read (None: for ever); the gatekeeper sets it per
    stream."""

    executor: Executor | None = None
    idle_timeout: float | None = None


_UNLIMITED: Final = Transfers()
TRANSFERS: contextvars.ContextVar[Transfers] = contextvars.ContextVar(
    "transfers", default=_UNLIMITED
)


def _in_thread(transfers: Transfers, fn: Callable[[], T]) -> asyncio.Future[T]:
    """`fn` on the stream's executor, seeing this call's context (its caller)."""
    context = contextvars.copy_context()
    return asyncio.get_running_loop().run_in_executor(transfers.executor, context.run, fn)


_END = object()
_AHEAD = 4


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Stop(Exception):
    """The producer of a stream whose caller stopped reading gives up."""


def streaming(method: Callable[..., Iterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """An asyncio server-streaming handler from a plain generator method: see `stream`."""

    @functools.wraps(method)
    async def wrapper(self: Service, request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            self.authorise(method.__name__, context)
        except Exception as exc:
            await abort(context, exc)
        async for message in stream(lambda: method(self, request, context), context):
            yield message

    return wrapper


async def stream(messages: Callable[[], Iterator[Any]], context: Any) -> AsyncIterator[Any]:
    """The messages of a plain generator, which runs on a worker thread (it reads disks or
    databases) up to a few messages ahead of the network, so that reading the next chunk
    overlaps with sending this one."""
    loop = asyncio.get_running_loop()
    transfers = TRANSFERS.get()
    # Unbounded on the loop side; `room` bounds it from the producer's side. The producer
    # never waits for the loop to take an item (a thread round trip per message would cost
    # more than the message).
    ready: asyncio.Queue[Any] = asyncio.Queue()
    room = threading.Semaphore(_AHEAD)
    stopped = threading.Event()

    def hand_over(item: Any) -> None:
        # A caller that reads nothing for the idle timeout gives its thread back: the stream
        # ends with StreamIdle once it reads again (or when it goes away).
        if not room.acquire(timeout=transfers.idle_timeout):
            stopped.set()
            idle = StreamIdle(f"the caller read nothing for {transfers.idle_timeout:g} seconds")
            loop.call_soon_threadsafe(ready.put_nowait, _Failed(idle))
            raise _Stop
        if not stopped.is_set():
            loop.call_soon_threadsafe(ready.put_nowait, item)

    def produce() -> None:
        try:
            for message in messages():
                if stopped.is_set():
                    return
                hand_over(message)
            hand_over(_END)
        except _Stop:
            return
        except BaseException as exc:  # handed to the handler, which reports it
            try:
                hand_over(_Failed(exc))
            except _Stop:
                return

    producer = _in_thread(transfers, produce)
    try:
        while (message := await ready.get()) is not _END:
            room.release()
            if isinstance(message, _Failed):
                raise message.error
            yield message
    except Exception as exc:
        await abort(context, exc)
    finally:
        # The caller went away or the stream ended: wake a producer waiting for room.
        stopped.set()
        room.release()
        await producer


R = TypeVar("R")


async def client_stream(
    service: Service, method: str, context: Any, store: Callable[[Callable[[], Any]], R]
) -> R:
    """Serve a client-streaming call: `store(receive)` runs on a worker thread and calls
    `receive()` for each message (None at the end), while the loop reads ahead into `inbox`;
    `room` bounds how far, and the thread never waits on the loop per message."""
    try:
        service.authorise(method, context)
    except Exception as exc:
        await abort(context, exc)
    loop = asyncio.get_running_loop()
    transfers = TRANSFERS.get()
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    room = asyncio.Semaphore(_AHEAD)

    async def pump() -> None:
        try:
            while True:
                await room.acquire()
                try:
                    message = await asyncio.wait_for(context.read(), transfers.idle_timeout)
                except TimeoutError:
                    inbox.put(
                        _Failed(
                            StreamIdle(
                                f"the caller sent nothing for {transfers.idle_timeout:g} seconds"
                            )
                        )
                    )
                    return
                if message is grpc.aio.EOF:
                    inbox.put(None)
                    return
                inbox.put(message)
        except BaseException as exc:  # the storing thread reports it
            inbox.put(_Failed(exc))
            raise

    def receive() -> Any:
        item = inbox.get()
        loop.call_soon_threadsafe(room.release)
        if isinstance(item, _Failed):
            raise item.error
        return item

    reader = asyncio.ensure_future(pump())
    # What ends the reader once the call is over (the call aborted under its read, or
    # cancelled) was handed to the storing thread already, or no longer matters.
    reader.add_done_callback(_retrieve)
    try:
        return await _in_thread(transfers, lambda: store(receive))
    except Exception as exc:
        await abort(context, exc)
    finally:
        reader.cancel()


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class WrappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """An interceptor that wraps each method's handler once, the first time it is called, and
    hands out the wrapped one after. A method the server does not have is not remembered (gRPC
    answers UNIMPLEMENTED), so callers naming made-up methods cannot grow the cache."""

    def __init__(self) -> None:
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = details.method
        path = method.decode() if isinstance(method, bytes) else str(method)
        if path in self._handlers:
            return self._handlers[path]
        handler = await continuation(details)
        if handler is None:
            return None
        self._handlers[path] = self.wrap(path, handler)
        return self._handlers[path]

    def wrap(self, path: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        raise NotImplementedError


def rpc_name(path: str) -> str:
    """`Service.Method` of a method's path (`/pinvault.v1.Store/Put` is `Store.Put`)."""
    service, _, name = path.rpartition("/")
    return f"{service.rpartition('.')[2]}.{name}"


class Metering(WrappingInterceptor):
    """Counts every call of every method by the status code it ended with, and times it
    (vault/server/metrics.py). The outermost interceptor: calls the gatekeeper refuses count
    too."""

    def wrap(self, path: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        return _metered(rpc_name(path), handler)


def _metered(rpc: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler`, its calls counted and timed as `rpc`."""
    kind, behaviour = next(
        (kind, getattr(handler, kind))
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
        if getattr(handler, kind) is not None
    )

    async def metered(request: Any, context: Any) -> Any:
        began = time.perf_counter()
        code = "UNKNOWN"
        try:
            result = behaviour(request, context)
            if hasattr(result, "__aiter__"):
                try:
                    async for message in result:
                        await context.write(message)
                finally:
                    await result.aclose()
                response = None
            else:
                response = await result
            code = _code(context, "OK")
            return response
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except grpc.aio.AbortError:
            code = _code(context, "UNKNOWN")
            raise
        finally:
            count_rpc(rpc, code, time.perf_counter() - began)

    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(
        metered,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _code(context: Any, default: str) -> str:
    code = context.code()
    return default if code is None else str(code.name)
