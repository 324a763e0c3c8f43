"""gRPC server reflection, as grpcurl and Postman ask for it: grpc.reflection.v1 and v1alpha.

grpcio-reflection implements v1alpha only. grpc.reflection.v1 is the same protocol under a new
package name (the same messages, field for field), so the v1 method is served by the very same
servicer with the v1alpha message classes doing the (identical) wire encoding.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer  # the grpc.aio servicer

V1 = "grpc.reflection.v1.ServerReflection"
V1ALPHA = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Both reflection services list `service_names` (and themselves)."""
    servicer = ReflectionServicer([*service_names, V1ALPHA, V1])
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}) for name in (V1ALPHA, V1)])
