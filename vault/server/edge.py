"""The transport edge: the services' plain methods run as asyncio gRPC handlers, and errors
become status codes here and nowhere else."""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Final, NoReturn, TypeVar

import grpc

from vault.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
    Unavailable,
    VaultError,
    VerificationError,
)
from vault.server.auth import CALLER, Gate

log = logging.getLogger(__name__)

_CODES: Final[dict[type[VaultError], grpc.StatusCode]] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    IntegrityError: grpc.StatusCode.DATA_LOSS,
    VerificationError: grpc.StatusCode.DATA_LOSS,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    QuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


def status_for(error: VaultError) -> grpc.StatusCode:
    for kind in type(error).__mro__:
        if kind in _CODES:
            return _CODES[kind]
    return grpc.StatusCode.INTERNAL


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
        """Refuse the call unless its caller may make it; the caller is `auth.caller()` after."""
        if self.gate.mode != "local":
            CALLER.set(
                self.gate.check(
                    f"{self.rpc_service}.{method}",
                    context.invocation_metadata() or (),
                    context.auth_context(),
                )
            )

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


_END = object()
_AHEAD = 4


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


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
    # Unbounded on the loop side; `room` bounds it from the producer's side. The producer
    # never waits for the loop to take an item (a thread round trip per message would cost
    # more than the message).
    ready: asyncio.Queue[Any] = asyncio.Queue()
    room = threading.Semaphore(_AHEAD)
    stopped = threading.Event()

    def hand_over(item: Any) -> None:
        room.acquire()
        if not stopped.is_set():
            loop.call_soon_threadsafe(ready.put_nowait, item)

    def produce() -> None:
        try:
            for message in messages():
                if stopped.is_set():
                    return
                hand_over(message)
            hand_over(_END)
        except BaseException as exc:  # handed to the handler, which reports it
            hand_over(_Failed(exc))

    producer = loop.run_in_executor(None, produce)
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
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    room = asyncio.Semaphore(_AHEAD)

    async def pump() -> None:
        try:
            while True:
                await room.acquire()
                message = await context.read()
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
    try:
        return await asyncio.to_thread(store, receive)
    except Exception as exc:
        await abort(context, exc)
    finally:
        reader.cancel()
