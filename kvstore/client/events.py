"""A client's KV event subscription: the daemon's ``SubscribeEvents`` stream read as typed
batches, for the blocking and the asyncio client.

Opening waits for the daemon to confirm the subscription (``SUBSCRIBED_HEADER`` in the stream's
initial metadata), within the client's ``timeout_s``: every event after ``subscribe_events``
returns reaches the subscriber, and a refusal raises there, as the other verbs' errors do
(FailedPrecondition when the daemon's events are off, PermissionDenied for another tenant's,
CapacityError over ``events.max_subscribers`` or ``max_subscribers_per_tenant``). Opening is
retried on UNAVAILABLE under the client's policy; a stream that breaks later is not: its
subscriber subscribes again (the daemon numbers the new stream's batches from 0).
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

import grpc

from kvstore.api import KVEventBatch
from kvstore.client.address import ClientSettings
from kvstore.client.retry import retrying, retrying_async
from kvstore.errors import DeadlineExceeded
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.convert import event_batch_from_proto
from kvstore.rpc.metadata import SUBSCRIBED_HEADER
from kvstore.rpc.status import translate

if TYPE_CHECKING:
    from typing import Self


def _is_subscribed(metadata: Any) -> bool:
    return any(key == SUBSCRIBED_HEADER for key, _ in metadata or ())


def _unconfirmed(settings: ClientSettings) -> DeadlineExceeded:
    return DeadlineExceeded(f"the daemon did not confirm the event subscription within "
                            f"{settings.timeout_s} s (the client's timeout_s)")


class EventStream:
    """The blocking client's subscription: iterate for ``KVEventBatch``es; ``close()`` (or
    leaving its ``with`` block) cancels the stream and ends the iteration. An error the stream
    ends with raises as its kvstore exception; the daemon draining ends it."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._closed = False

    @classmethod
    def open(cls, stub: Any, tenant: str | None, settings: ClientSettings) -> EventStream:
        request = pb.SubscribeEventsRequest(tenant=tenant or "")

        def attempt() -> Any:
            call = stub.SubscribeEvents(request, metadata=settings.metadata)
            # Cancelling the call is the one way to bound the blocking wait below.
            timer = threading.Timer(settings.timeout_s, call.cancel)
            timer.start()
            try:
                metadata = call.initial_metadata()
            finally:
                timer.cancel()
            if _is_subscribed(metadata):
                return call
            if call.code() == grpc.StatusCode.CANCELLED:  # only the timer cancels it here
                raise _unconfirmed(settings)
            raise call  # refused: the call is the RpcError with the daemon's status

        return cls(retrying(settings.retry, attempt))

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> KVEventBatch:
        if self._closed:
            raise StopIteration
        try:
            return event_batch_from_proto(next(self._call))
        except grpc.RpcError as err:
            if self._closed:  # closed by another thread while this one read
                raise StopIteration from None
            raise translate(err) from None

    def close(self) -> None:
        """Cancel the stream; the daemon drops the subscription. Idempotent."""
        self._closed = True
        self._call.cancel()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncEventStream:
    """The asyncio client's subscription: ``async for`` over ``KVEventBatch``es; ``aclose()``
    (or leaving its ``async with`` block) cancels the stream and ends the iteration."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._closed = False

    @classmethod
    async def open(cls, stub: Any, tenant: str | None, settings: ClientSettings
                   ) -> AsyncEventStream:
        request = pb.SubscribeEventsRequest(tenant=tenant or "")

        async def attempt() -> Any:
            call = stub.SubscribeEvents(request, metadata=settings.metadata)
            try:
                metadata = await asyncio.wait_for(call.initial_metadata(), settings.timeout_s)
            except BaseException:  # the wait timed out, or the caller was cancelled
                call.cancel()
                raise
            if _is_subscribed(metadata):
                return call
            raise grpc.aio.AioRpcError(await call.code(), metadata,
                                       await call.trailing_metadata(), await call.details())

        try:
            return cls(await retrying_async(settings.retry, attempt))
        except TimeoutError:
            raise _unconfirmed(settings) from None

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> KVEventBatch:
        if self._closed:
            raise StopAsyncIteration
        try:
            message = await self._call.read()
        except grpc.RpcError as err:
            raise translate(err) from None
        except asyncio.CancelledError:
            # aclose() from another task cancels the call under this read: the iteration
            # ends. A cancellation of this task itself goes on.
            task = asyncio.current_task()
            if self._closed and not (task is not None and task.cancelling()):
                raise StopAsyncIteration from None
            raise
        if message is grpc.aio.EOF:
            raise StopAsyncIteration
        return event_batch_from_proto(message)

    async def aclose(self) -> None:
        """Cancel the stream; the daemon drops the subscription. Idempotent."""
        self._closed = True
        self._call.cancel()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
