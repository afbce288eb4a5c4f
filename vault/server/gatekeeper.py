"""The gate every call passes before its request is read: who is calling (a bearer token, a
client certificate or the one local user), whether they may, and whether they may open one more
stream. Checking a credential costs no query, and failed ones are counted per address
(failed_credentials.py), so an anonymous caller costs the vault almost nothing.

An asyncio gRPC server reads and decodes a unary call's whole request before any handler runs,
an interceptor's own included (measured: 32 refused 60 MiB calls cost 3 GiB that way). So every
method is served here as a request-streaming one, whose request is read only once the caller is
known and allowed; a refused call's bytes are never read."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

import grpc

from vault.config import Config
from vault.errors import InvalidArgument, QuotaExceeded
from vault.server.auth import CALLER, PERMISSIONS, Gate, Identity
from vault.server.decoding import Undecodable, decoder, lenient
from vault.server.edge import (
    TRANSFER_CALLS,
    TRANSFERS,
    StreamIdle,
    Transfers,
    WrappingInterceptor,
    abort,
    rpc_name,
)
from vault.server.failed_credentials import caller_address

# Calls of the open services (health, reflection) whose request is being read at once: they
# ask no credential, so this bounds what anonymous callers make the vault hold.
OPEN_READS: Final = 8
_SERVICE_PREFIX: Final = "/pinvault."


@dataclass(frozen=True, slots=True)
class Limits:
    """What one caller, or all of them, may hold open (the [server] settings)."""

    max_streams: int = 256
    streams_per_caller: int = 64
    stream_idle_timeout: float = 60.0
    max_connections: int = 4096
    connection_idle_timeout: float = 300.0

    @classmethod
    def from_config(cls, config: Config) -> Limits:
        server = config.server
        return cls(
            max_streams=server.max_streams,
            streams_per_caller=server.streams_per_caller,
            stream_idle_timeout=server.stream_idle_timeout,
            max_connections=server.max_connections,
            connection_idle_timeout=server.connection_idle_timeout,
        )


class StreamSlots:
    """Streams open now, in all and per caller; one past either limit is refused."""

    def __init__(self, total: int, per_caller: int) -> None:
        self.total = total
        self.per_caller = per_caller
        self._open: Counter[str] = Counter()

    def take(self, caller: str) -> None:
        if self._open[caller] >= self.per_caller:
            raise QuotaExceeded(
                f"{caller} has {self._open[caller]} streams open, the most one caller may: "
                "wait for one to finish"
            )
        if self._open.total() >= self.total:
            raise QuotaExceeded(
                f"the vault has {self.total} streams open, the most it serves at once: retry soon"
            )
        self._open[caller] += 1

    def give(self, caller: str) -> None:
        self._open[caller] -= 1
        if self._open[caller] <= 0:
            del self._open[caller]


async def _read_one(context: Any, idle: float) -> Any:
    """A unary call's one request, read now that the caller may make it."""
    try:
        request = await asyncio.wait_for(context.read(), idle)
    except TimeoutError:
        raise StreamIdle(f"the call sent no request in {idle:g} seconds") from None
    if request is grpc.aio.EOF:
        raise InvalidArgument("the call carried no request")
    return request


Behaviour = Callable[..., Awaitable[Any]]


async def _respond(behaviour: Callable[..., Any], request: Any, context: Any) -> None:
    """Write a response-streaming behaviour's messages (it may yield them, or write them)."""
    result = behaviour(request, context)
    if not hasattr(result, "__aiter__"):
        await result
        return
    try:
        async for message in result:
            await context.write(message)
    finally:
        await result.aclose()


class Gatekeeper(WrappingInterceptor):
    """Serves every vault method only to a caller the gate names and allows, before its request
    is read; counts streams against their caller."""

    def __init__(self, gate: Gate, limits: Limits | None = None) -> None:
        self.gate = gate
        self.limits = limits or Limits()
        self.slots = StreamSlots(self.limits.max_streams, self.limits.streams_per_caller)
        # Streams block on disks and on their callers; they get threads of their own, one per
        # open stream at most, so that look-ups and other short calls keep the workers.
        self.transfers = Transfers(
            ThreadPoolExecutor(max_workers=self.limits.max_streams, thread_name_prefix="stream"),
            self.limits.stream_idle_timeout,
        )
        self._open_reads = 0
        # A method's guarded handler, by path: handlers do not change while the server runs.
        super().__init__()

    def close(self) -> None:
        if self.transfers.executor is not None:
            self.transfers.executor.shutdown(wait=False, cancel_futures=True)

    def wrap(self, path: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        rpc = rpc_name(path)
        if path.startswith(_SERVICE_PREFIX) and rpc in PERMISSIONS:
            return self._guarded(rpc, handler)
        return self._open(rpc, handler)

    # ------------------------------------------------------------------ the vault's methods

    def _identify(self, rpc: str, context: Any) -> Identity:
        return self.gate.check(
            rpc,
            context.invocation_metadata() or (),
            context.auth_context(),
            address=caller_address(context.peer() or ""),
        )

    def _guarded(self, rpc: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        streams = handler.request_streaming or handler.response_streaming or rpc in TRANSFER_CALLS
        idle = self.limits.stream_idle_timeout

        async def enter(context: Any) -> str:
            """The caller's stream key (or "" for a unary call) once it may go on."""
            try:
                identity = self._identify(rpc, context)
                key = identity.name if streams else ""
                if streams:
                    self.slots.take(key)
            except Exception as exc:
                await abort(context, exc)
            CALLER.set(identity)
            TRANSFERS.set(self.transfers)
            return key

        async def leave(key: str) -> None:
            if streams:
                self.slots.give(key)

        decode = decoder(rpc, handler.request_deserializer)
        options = {
            "request_deserializer": decode,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None and self.gate.mode == "local":
            # Local mode has no credential to check first: every caller on the vault's host
            # is its one user, whose requests are read as any known caller's are (within the
            # message cap), so the call stays unary and costs no stream machinery. gRPC
            # decodes its request before the handler runs.
            unary_unary = handler.unary_unary

            async def unary_unary_local(request: Any, context: Any) -> Any:
                key = await enter(context)
                try:
                    if isinstance(request, Undecodable):
                        await abort(context, request.error)
                    return await unary_unary(request, context)
                finally:
                    await leave(key)

            options["request_deserializer"] = lenient(decode)
            return grpc.unary_unary_rpc_method_handler(unary_unary_local, **options)
        if handler.unary_unary is not None:
            unary_unary = handler.unary_unary

            async def unary_unary_guarded(requests: Any, context: Any) -> Any:
                key = await enter(context)
                try:
                    try:
                        request = await _read_one(context, idle)
                        self.gate.permit_request(rpc, CALLER.get(), request)
                    except Exception as exc:
                        await abort(context, exc)
                    return await unary_unary(request, context)
                finally:
                    await leave(key)

            return grpc.stream_unary_rpc_method_handler(unary_unary_guarded, **options)
        if handler.unary_stream is not None:
            unary_stream = handler.unary_stream

            async def unary_stream_guarded(requests: Any, context: Any) -> None:
                key = await enter(context)
                try:
                    try:
                        request = await _read_one(context, idle)
                        self.gate.permit_request(rpc, CALLER.get(), request)
                    except Exception as exc:
                        await abort(context, exc)
                    await _respond(unary_stream, request, context)
                finally:
                    await leave(key)

            return grpc.stream_stream_rpc_method_handler(unary_stream_guarded, **options)
        if handler.stream_unary is not None:
            stream_unary = handler.stream_unary

            async def stream_unary_guarded(requests: Any, context: Any) -> Any:
                key = await enter(context)
                try:
                    return await stream_unary(requests, context)
                finally:
                    await leave(key)

            return grpc.stream_unary_rpc_method_handler(stream_unary_guarded, **options)
        stream_stream = handler.stream_stream

        async def stream_stream_guarded(requests: Any, context: Any) -> None:
            key = await enter(context)
            try:
                await _respond(stream_stream, requests, context)
            finally:
                await leave(key)

        return grpc.stream_stream_rpc_method_handler(stream_stream_guarded, **options)

    # ------------------------------------------------------------------ health, reflection

    def _open(self, rpc: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """An open service's method, whose request is read only while few others are."""
        options = {
            "request_deserializer": decoder(rpc, handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }
        if handler.request_streaming:
            return _refusing_undecodable(handler, options)
        idle = self.limits.stream_idle_timeout

        async def read(context: Any) -> Any:
            if self._open_reads >= OPEN_READS:
                await abort(context, QuotaExceeded("too many calls at once: retry soon"))
            self._open_reads += 1
            try:
                return await _read_one(context, idle)
            except Exception as exc:
                await abort(context, exc)
            finally:
                self._open_reads -= 1

        if handler.unary_unary is not None:
            unary_unary = handler.unary_unary

            async def unary_unary_open(requests: Any, context: Any) -> Any:
                return await unary_unary(await read(context), context)

            return grpc.stream_unary_rpc_method_handler(unary_unary_open, **options)
        unary_stream = handler.unary_stream

        async def unary_stream_open(requests: Any, context: Any) -> None:
            await _respond(unary_stream, await read(context), context)

        return grpc.stream_stream_rpc_method_handler(unary_stream_open, **options)


def _refusing_undecodable(
    handler: grpc.RpcMethodHandler, options: dict[str, Any]
) -> grpc.RpcMethodHandler:
    """A request-streaming method of an open service (reflection), whose requests are decoded
    as it reads them: one that cannot be is refused as a bad argument."""
    if handler.stream_unary is not None:
        stream_unary = handler.stream_unary

        async def stream_unary_open(requests: Any, context: Any) -> Any:
            try:
                return await stream_unary(requests, context)
            except InvalidArgument as exc:
                await abort(context, exc)

        return grpc.stream_unary_rpc_method_handler(stream_unary_open, **options)
    stream_stream = handler.stream_stream

    async def stream_stream_open(requests: Any, context: Any) -> None:
        try:
            await _respond(stream_stream, requests, context)
        except InvalidArgument as exc:
            await abort(context, exc)

    return grpc.stream_stream_rpc_method_handler(stream_stream_open, **options)
