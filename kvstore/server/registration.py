"""Registering the KVStore servicer's methods, with request parsing that cannot fail a call.

gRPC parses a request before any handler runs; a message that does not parse is answered here
with INVALID_ARGUMENT, logged as a client error, instead of gRPC's UNKNOWN or an internal
error mid-stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvstore.errors import InvalidArgument
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.server.service import KVStoreService


class _Undecodable:
    """A request message that did not parse; the handler answers it with INVALID_ARGUMENT.

    gRPC parses a request before any handler runs and, when the parser raises, ends the call
    with UNKNOWN (unary requests) or hands the exception to the handler mid-stream, which the
    error edge then logs with a traceback as an internal error. Parsing into this marker
    instead keeps the answer a client error, logged like one.
    """

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except DecodeError as exc:  # the text names the message type, never the bytes
            return _Undecodable(str(exc))

    return deserialize


def _parsed(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise InvalidArgument(f"request does not parse: {request.error}")
    return request


async def _parsed_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _parsed(request)


def _checked(behavior: Callable, client_streaming: bool, server_streaming: bool) -> Callable:
    """``behavior`` raising InvalidArgument where a request message did not parse."""
    take = _parsed_stream if client_streaming else _parsed
    if server_streaming:
        async def streamed(request, context):
            async for response in behavior(take(request), context):
                yield response

        return streamed

    async def unary(request, context):
        return await behavior(take(request), context)

    return unary


_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_to_server(service: KVStoreService, server: grpc.aio.Server) -> None:
    """Register every method of the KVStore service (what the generated
    ``add_KVStoreServicer_to_server`` does), with request parsing that cannot fail the call."""
    descriptor = pb.DESCRIPTOR.services_by_name["KVStore"]
    handlers = {}
    for method in descriptor.methods:
        streams = (method.client_streaming, method.server_streaming)
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        handlers[method.name] = _HANDLER_FACTORIES[streams](
            _checked(getattr(service, method.name), *streams),
            request_deserializer=_lenient(request_cls.FromString),
            response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))
    server.add_registered_method_handlers(descriptor.full_name, handlers)
