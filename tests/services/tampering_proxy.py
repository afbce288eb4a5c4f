"""A hostile vault for tests: a gRPC server on 127.0.0.1 port 0 that forwards every pinvault
call to a real `vault serve` and lets a test rewrite the answers on their way back, as a
malicious server or network would. A real server cannot be made to lie; this proxy can.

    with TamperingProxy(server.address) as proxy:
        proxy.tamper("Ledger/Lookup", lambda request, answer: forged(answer))
        server.run("lookup", digest, env={"PINVAULT_CLIENT_SERVER": proxy.address})

A unary rule gets the request and the real answer and returns the answer to send; a streaming
rule gets the request and the real answers (an iterator) and yields the answers to send. The
file handoff is refused by default, so that blob bytes pass through the proxy to be tampered
with; call streaming methods' rules with care not to buffer whole blobs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from types import TracebackType
from typing import Any, Self

import blake3
import grpc
from google.protobuf.message import Message

from vault.wire import pinvault_pb2 as pb

UnaryRule = Callable[[Any, Any], Any]


class Abort:
    """What a unary rule returns to answer with an error status instead of a message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details


StreamRule = Callable[[Any, Iterator[Any]], Iterator[Any]]


def _no_handoff(request: pb.HandoffRequest, answer: pb.HandoffInfo) -> pb.HandoffInfo:
    return pb.HandoffInfo()


class TamperingProxy:
    """Forwards every method of every pinvault service (`Service/Method`) to `upstream`."""

    def __init__(self, upstream: str, *, handoff: bool = False) -> None:
        self.upstream = upstream
        self.address = ""
        self.calls: list[str] = []
        self._rules: dict[str, UnaryRule | StreamRule] = {}
        if not handoff:
            self._rules["Store/Handoff"] = _no_handoff
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._server: grpc.Server | None = None

    def tamper(self, method: str, rule: UnaryRule | StreamRule) -> None:
        """Rewrite the answers of `method` ("Ledger/Lookup", "Store/Get") with `rule`."""
        with self._lock:
            self._rules[method] = rule

    def clear(self, method: str) -> None:
        with self._lock:
            self._rules.pop(method, None)

    def _rule(self, method: str) -> UnaryRule | StreamRule | None:
        with self._lock:
            self.calls.append(method)
            return self._rules.get(method)

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> Self:
        self._channel = grpc.insecure_channel(
            self.upstream,
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
            ],
        )
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16),
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
            ],
        )
        server.add_generic_rpc_handlers(
            [self._handler(s) for s in pb.DESCRIPTOR.services_by_name.values()]
        )
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._server = server
        self.address = f"127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace=None).wait()
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def __enter__(self) -> Self:
        return self.start() if self._server is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- forwarding -------------------------------------------------------------------------

    def _handler(self, service: Any) -> grpc.GenericRpcHandler:
        handlers = {}
        for method in service.methods:
            handlers[method.name] = self._method(service, method)
        return grpc.method_handlers_generic_handler(service.full_name, handlers)

    def _method(self, service: Any, method: Any) -> grpc.RpcMethodHandler:
        path = f"/{service.full_name}/{method.name}"
        name = f"{service.name}/{method.name}"
        request_type: type[Message] = getattr(pb, method.input_type.name)
        answer_type: type[Message] = getattr(pb, method.output_type.name)
        decode_request, encode_request = request_type.FromString, request_type.SerializeToString
        decode_answer, encode_answer = answer_type.FromString, answer_type.SerializeToString

        def upstream() -> grpc.Channel:
            assert self._channel is not None
            return self._channel

        def metadata(context: grpc.ServicerContext) -> list[tuple[str, str]]:
            return [(k, v) for k, v in context.invocation_metadata() if not k.startswith(":")]

        def failed(context: grpc.ServicerContext, exc: grpc.RpcError) -> None:
            context.abort(exc.code(), exc.details() or "")

        if not method.client_streaming and not method.server_streaming:

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                call = upstream().unary_unary(path, encode_request, decode_answer)
                try:
                    answer = call(request, metadata=metadata(context))
                except grpc.RpcError as exc:
                    failed(context, exc)
                rule = self._rule(name)
                told = rule(request, answer) if rule else answer
                if isinstance(told, Abort):
                    context.abort(told.code, told.details)
                return told

            return grpc.unary_unary_rpc_method_handler(unary_unary, decode_request, encode_answer)

        if not method.client_streaming:

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                call = upstream().unary_stream(path, encode_request, decode_answer)
                answers = call(request, metadata=metadata(context))
                rule = self._rule(name)
                try:
                    yield from (rule(request, answers) if rule else answers)
                except grpc.RpcError as exc:
                    failed(context, exc)

            return grpc.unary_stream_rpc_method_handler(unary_stream, decode_request, encode_answer)

        # Client-streaming calls (Put, PutBatch) are forwarded; their answers can be rewritten.
        def stream_unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            call = upstream().stream_unary(path, encode_request, decode_answer)
            try:
                answer = call(requests, metadata=metadata(context))
            except grpc.RpcError as exc:
                failed(context, exc)
            rule = self._rule(name)
            return rule(None, answer) if rule else answer

        return grpc.stream_unary_rpc_method_handler(stream_unary, decode_request, encode_answer)


def flip_chunk(*, digest: str | None = None, at: int | None = None) -> StreamRule:
    """A Store/Get rule: flip one byte in the chunks of `digest` (any blob if None) that start
    at offset `at` (any chunk if None), and recompute each such chunk's hash, so that the chunk
    list the server sends agrees with the bytes it sends: only a check of the whole digest
    catches it."""

    def rule(request: pb.GetRequest, answers: Iterator[pb.GetResponse]) -> Iterator[pb.GetResponse]:
        for answer in answers:
            if (
                answer.WhichOneof("part") == "chunk"
                and digest in (None, request.digest)
                and at in (None, answer.chunk.offset)
            ):
                data = bytearray(answer.chunk.data)
                data[len(data) // 2] ^= 0x01
                answer.chunk.data = bytes(data)
                answer.chunk.hash = blake3.blake3(bytes(data)).digest()
            yield answer

    return rule
