"""gRPC server reflection under both names tools ask for: `grpc.reflection.v1` (which grpcurl
and other current tools try first) and `grpc.reflection.v1alpha` (which grpcio-reflection
ships), answered by one servicer whose symbol look-up also resolves a method's full name."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

V1ALPHA_SERVICE: Final = "grpc.reflection.v1alpha.ServerReflection"
V1_SERVICE: Final = "grpc.reflection.v1.ServerReflection"
METHOD: Final = "ServerReflectionInfo"
_V1_FILE: Final = "grpc/reflection/v1/reflection.proto"


class _Reflection(ReflectionServicer):  # type: ignore[misc]
    """The asyncio reflection servicer, which also finds the file of `package.Service.Method`
    (the protobuf pool knows services and messages by name, not their methods)."""

    def _file_containing_symbol(self, request: Any, fully_qualified_name: str) -> Any:
        try:
            self._pool.FindFileContainingSymbol(fully_qualified_name)
        except KeyError:
            service_name, _, method = fully_qualified_name.rpartition(".")
            try:
                service = self._pool.FindServiceByName(service_name)
            except KeyError:
                service = None
            if service is not None and method in service.methods_by_name:
                fully_qualified_name = service_name
        return super()._file_containing_symbol(request, fully_qualified_name)


def _add_v1_descriptor(pool: Any) -> None:
    """Puts the v1 reflection file in `pool`, so that the v1 service can be described too: it
    is the v1alpha file under the v1 package (the two are wire-identical)."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    proto.name = _V1_FILE
    proto.package = "grpc.reflection.v1"
    proto.ClearField("options")
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name[len(old) :]
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old) :]
            method.output_type = new + method.output_type[len(old) :]
    pool.AddSerializedFile(proto.SerializeToString())


def enable(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serves reflection on `server` under both names, listing `service_names` and the two
    reflection services themselves."""
    pool = descriptor_pool.Default()
    _add_v1_descriptor(pool)
    servicer = _Reflection((*service_names, V1_SERVICE, V1ALPHA_SERVICE), pool=pool)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(name, {METHOD: handler})
            for name in (V1ALPHA_SERVICE, V1_SERVICE)
        ]
    )
