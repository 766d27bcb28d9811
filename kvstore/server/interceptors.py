"""Server interceptors' common base and the error edge.

:class:`HandlerInterceptor` wraps each method's behavior once (auth.py and metrics.py build on
it); :class:`ErrorInterceptor`, the innermost, turns exceptions escaping a handler into gRPC
statuses through ``kvstore.rpc.status``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NoReturn

import grpc

from kvstore.errors import KVStoreError
from kvstore.rpc.status import error_metadata, status_for

_log = logging.getLogger("kvstore.server")

Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    unary: Callable[[Behavior], Behavior],
    streaming: Callable[[Behavior], Behavior],
) -> grpc.RpcMethodHandler:
    """A copy of ``handler`` whose behavior is wrapped: ``unary`` wraps coroutine behaviors
    (unary responses), ``streaming`` wraps async-generator behaviors (streamed responses)."""
    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kw)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kw)


class HandlerInterceptor(grpc.aio.ServerInterceptor, ABC):
    """An interceptor that wraps each method's behavior; the wrapped handler is built once per
    method and reused, since a method's handler never changes (this keeps per-call overhead
    to the wrappers themselves)."""

    def __init__(self) -> None:
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    @abstractmethod
    def wrap_unary(self, method: str, behavior: Behavior) -> Behavior:
        """Wrap a coroutine behavior (unary response) of ``method``."""

    @abstractmethod
    def wrap_streaming(self, method: str, behavior: Behavior) -> Behavior:
        """Wrap an async-generator behavior (streamed response) of ``method``."""

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The handler that serves ``method`` in place of ``handler``."""
        return wrap_handler(handler, lambda b: self.wrap_unary(method, b),
                            lambda b: self.wrap_streaming(method, b))

    async def intercept_service(self, continuation, handler_call_details):
        full_method = handler_call_details.method
        wrapped = self._handlers.get(full_method)
        if wrapped is None:
            handler = await continuation(handler_call_details)
            if handler is None:
                return None
            wrapped = self.wrap(method_name(full_method), handler)
            self._handlers[full_method] = wrapped
        return wrapped


def method_name(full_method: str) -> str:
    """``/kvstore.v1.KVStore/Lookup`` -> ``Lookup``."""
    return full_method.rsplit("/", 1)[-1]


async def abort_with(context: grpc.aio.ServicerContext, exc: KVStoreError) -> NoReturn:
    """End the call with the status of a kvstore exception, its class in the trailers."""
    await context.abort(status_for(exc), str(exc) or type(exc).__name__,
                        trailing_metadata=error_metadata(exc))


_MAX_DETAIL_CHARS = 200  # of an unexpected exception's text in an INTERNAL status

# Failures an operator should see in the log; the rest are a client's own mistakes (DEBUG).
_NOTEWORTHY = frozenset({grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


class ErrorInterceptor(HandlerInterceptor):
    """Turns exceptions escaping a handler into statuses; the innermost interceptor.

    kvstore exceptions become their status (:func:`status_for`) with the class named in the
    trailing metadata; anything else is logged with its traceback and becomes INTERNAL, and the
    daemon keeps serving.
    """

    async def _abort(self, context: grpc.aio.ServicerContext, method: str, exc: Exception):
        if isinstance(exc, KVStoreError):
            code = status_for(exc)
            _log.log(logging.WARNING if code in _NOTEWORTHY else logging.DEBUG,
                     "%s failed: %s", method, exc,
                     extra={"rpc": method, "code": code.name, "error": type(exc).__name__})
            await abort_with(context, exc)
        _log.error("%s raised unexpectedly", method, exc_info=exc, extra={"rpc": method})
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: "
                            f"{type(exc).__name__}: {str(exc)[:_MAX_DETAIL_CHARS]}")

    def wrap_unary(self, method: str, behavior: Behavior) -> Behavior:
        async def run(request, context):
            try:
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - this is the edge; nothing escapes
                await self._abort(context, method, exc)

        return run

    def wrap_streaming(self, method: str, behavior: Behavior) -> Behavior:
        async def run(request, context):
            try:
                async for response in behavior(request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - this is the edge; nothing escapes
                await self._abort(context, method, exc)

        return run
