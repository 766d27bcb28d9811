"""The clients' one transport seam: ``call(method, request, timeout_s)`` of a unary call, chosen
once per client: over gRPC (``GrpcTransport``), or on call channels where the daemon offers them
(``ChannelTransport``: ``CHANNEL_METHODS`` only, over gRPC otherwise, while the daemon serves none
to this client, or when a channel broke under a call). Each has an asyncio twin. Every call is
retried by the client's ``RetryPolicy``; Acquire and Reserve carry the client's ``Session``, a
Hold stream that gives back what the client holds the moment it goes away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import grpc
from google.protobuf.message import Message

from kvstore.client.address import ClientSettings
from kvstore.client.channels import AsyncChannel, BlockingChannel, ChannelBroken, data_address
from kvstore.client.retry import retrying, retrying_async
from kvstore.errors import FailedPrecondition, KVStoreError
from kvstore.rpc import framing
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.framing import CHANNEL_METHODS
from kvstore.rpc.metadata import OPEN_TIMEOUT_S, SESSION_HEADER, SESSION_METHODS, new_session_id

MAX_CALL_CHANNELS = 2  # a client's call channels: its caller's and its late Releases' worker
log = logging.getLogger("kvstore.client")
Metadata = tuple[tuple[str, str], ...]


class Transport(Protocol):
    """How a blocking client makes a unary call: the response message, or the kvstore error
    its failure translates to (after the client's retries)."""

    def call(self, method: str, request: Message, timeout_s: float) -> Message: ...

    def close(self) -> None: ...


class AsyncTransport(Protocol):
    """How an asyncio client makes a unary call (see ``Transport``)."""

    async def call(self, method: str, request: Message, timeout_s: float) -> Message: ...

    async def aclose(self) -> None: ...


class CallChannels:
    """Whether a client makes its small calls (``CHANNEL_METHODS``) on a call channel now.

    The client asks OpenChannel at its first such call; a daemon that serves none
    (UNIMPLEMENTED: older than channels; FAILED_PRECONDITION: off) or whose channels this
    tenant has used up makes it call over gRPC for ``RETRY_S`` before it asks again. A channel
    that breaks (the daemon restarted) is opened again at the next call.
    """

    RETRY_S = 30.0

    def __init__(self) -> None:
        self._retry_at = 0.0

    @property
    def usable(self) -> bool:
        return time.monotonic() >= self._retry_at

    def refused(self, err: BaseException) -> None:
        """Opening a channel failed with ``err``: a daemon that said no is asked again only
        after ``RETRY_S``; one that could not be reached, at the next call."""
        code = err.code() if isinstance(err, grpc.RpcError) and hasattr(err, "code") else None
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self._retry_at = time.monotonic() + self.RETRY_S
        log.debug("no call channel, calls go over gRPC: %s", err)


# ------------------------------------------------------------------------------ blocking


class Session:
    """This client's session, opened at its first Acquire or Reserve: a Hold stream whose end
    gives back what the client holds, the moment its process goes away; ``regions_retired``
    hears the stream's retired-regions events. A daemon without sessions: none."""

    def __init__(self, stub: pbg.KVStoreStub, settings: ClientSettings,
                 regions_retired: Callable[[], None]) -> None:
        self._stub, self._settings = stub, settings
        self._regions_retired = regions_retired
        self.metadata: Metadata | None = None  # None: not opened yet
        self._hold: grpc.Call | None = None

    def open(self) -> Metadata:
        """The session's call metadata, opening it at the first call (empty: no session)."""
        if self.metadata is None:
            self.metadata = ()
            session_id = new_session_id()
            try:
                call = self._stub.Hold(pb.HoldRequest(session=session_id),
                                       metadata=self._settings.metadata)
            except grpc.RpcError:  # no socket directory yet: the next call asks again
                self.metadata = None
                return ()
            opened = threading.Event()
            threading.Thread(target=_drain_hold, args=(call, opened, self._regions_retired),
                             daemon=True, name="kvstore-session").start()
            if opened.wait(OPEN_TIMEOUT_S) and call.running():
                self._hold = call
                self.metadata = ((SESSION_HEADER, session_id),)
            else:
                call.cancel()
        return self.metadata

    def renew_if_ended(self) -> None:
        """Open a new session at the next call where the daemon ended this one (it
        restarted)."""
        if self._hold is not None and not self._hold.running():
            self._hold, self.metadata = None, None

    def close(self) -> None:
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None


class GrpcTransport:
    """Unary calls over gRPC."""

    def __init__(self, stub: pbg.KVStoreStub, settings: ClientSettings, session: Session
                 ) -> None:
        self._stub, self._settings, self._session = stub, settings, session

    def call(self, method: str, request: Message, timeout_s: float) -> Message:
        rpc = getattr(self._stub, method)
        metadata = self._settings.metadata
        if method in SESSION_METHODS:
            metadata = metadata + self._session.open()
        return retrying(self._settings.retry,
                        lambda: rpc(request, timeout=timeout_s, metadata=metadata))

    def open_channel(self) -> pb.DataTicket:
        """A ticket for a new call channel, bound to this client's session (opened again
        where the daemon restarted)."""
        self._session.renew_if_ended()
        return self._stub.OpenChannel(
            pb.OpenChannelRequest(), timeout=self._settings.timeout_s,
            metadata=self._settings.metadata + self._session.open())

    def close(self) -> None:
        """Nothing of its own: the client closes its gRPC channel and session."""


class ChannelTransport:
    """``CHANNEL_METHODS`` on this client's call channels, everything else (and those, where no
    channel can be had or one broke under the call) through ``grpc``. One call at a time per
    channel; a second is opened while the client has fewer than ``MAX_CALL_CHANNELS`` (a get's
    Acquire then need not wait for, nor go around, the Release its worker sends for the last
    get)."""

    def __init__(self, grpc_transport: GrpcTransport, settings: ClientSettings,
                 token: str | None, max_reply_bytes: int) -> None:
        self._grpc, self._settings = grpc_transport, settings
        self._token, self._max_reply_bytes = token, max_reply_bytes
        self._calls = CallChannels()
        self.channels: list[BlockingChannel] = []
        self._lock = threading.Lock()  # one thread opens a call channel

    def call(self, method: str, request: Message, timeout_s: float) -> Message:
        if method in CHANNEL_METHODS and self._calls.usable:
            channel = self._free_channel()  # its lock taken; None: all busy, or none
            if channel is not None:
                try:
                    return retrying(self._settings.retry,
                                    lambda: channel.call(method, request, timeout_s))
                except ChannelBroken as exc:  # the daemon went or restarted: gRPC retries
                    log.debug("call channel broke under %s: %s", method, exc)
                finally:
                    channel.lock.release()
        return self._grpc.call(method, request, timeout_s)

    def _free_channel(self) -> BlockingChannel | None:
        """A call channel no other thread is calling on, its lock taken (a new one where there
        are fewer than ``MAX_CALL_CHANNELS``); None where all are busy, or the daemon serves
        none to this client (``CallChannels``)."""
        for channel in self.channels:
            if not channel.closed and channel.lock.acquire(blocking=False):
                if not channel.closed:
                    return channel
                channel.lock.release()
        with self._lock:
            self.channels = [c for c in self.channels if not c.closed]
            if len(self.channels) >= MAX_CALL_CHANNELS:
                return None
            channel = self._open_channel()
            if channel is None:
                return None
            channel.lock.acquire()
            self.channels.append(channel)
            return channel

    def _open_channel(self) -> BlockingChannel | None:
        """A new call channel (under ``_lock``); None where the daemon refuses it."""
        try:
            ticket = self._grpc.open_channel()
            address = data_address(self._settings.target, ticket)
            if address is None:
                raise FailedPrecondition("the call channel is not served over this "
                                         "client's transport")
            return BlockingChannel.open(framing.connect(address, self._settings.timeout_s),
                                        ticket.ticket, self._token, self._max_reply_bytes)
        except (grpc.RpcError, OSError, KVStoreError) as exc:
            self._calls.refused(exc)
            return None

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def _drain_hold(call, opened: threading.Event, regions_retired: Callable[[], None]) -> None:
    """Read a Hold stream's events until it ends (``opened`` once the first arrived), dropping
    the mappings of regions the daemon gave back as soon as it says so."""
    with contextlib.suppress(grpc.RpcError):
        for event in call:
            opened.set()
            if event.regions_retired:
                regions_retired()
    opened.set()


# ------------------------------------------------------------------------------ asyncio


class AsyncSession:
    """The asyncio twin of ``Session``."""

    def __init__(self, stub: pbg.KVStoreStub, settings: ClientSettings,
                 regions_retired: Callable[[], None]) -> None:
        self._stub, self._settings = stub, settings
        self._regions_retired = regions_retired
        self.metadata: Metadata | None = None  # None: not opened yet
        self._hold = None
        self.hold_task: asyncio.Task[None] | None = None

    async def open(self) -> Metadata:
        """See ``Session.open``."""
        if self.metadata is None:
            self.metadata = ()
            session_id = new_session_id()
            try:
                call = self._stub.Hold(pb.HoldRequest(session=session_id),
                                       metadata=self._settings.metadata)
            except grpc.RpcError:  # no socket directory yet: the next call asks again
                self.metadata = None
                return ()
            try:
                await asyncio.wait_for(call.read(), OPEN_TIMEOUT_S)
            except (grpc.RpcError, TimeoutError):
                call.cancel()
                return self.metadata
            self._hold = call
            self.hold_task = asyncio.get_running_loop().create_task(
                _drain_hold_async(call, self._regions_retired))
            self.metadata = ((SESSION_HEADER, session_id),)
        return self.metadata

    def renew_if_ended(self) -> None:
        """See ``Session.renew_if_ended``."""
        if self.hold_task is not None and self.hold_task.done():  # the daemon restarted
            self._hold = self.hold_task = self.metadata = None

    async def aclose(self) -> None:
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None
            await asyncio.gather(self.hold_task, return_exceptions=True)


class AsyncGrpcTransport:
    """The asyncio twin of ``GrpcTransport``."""

    def __init__(self, stub: pbg.KVStoreStub, settings: ClientSettings,
                 session: AsyncSession) -> None:
        self._stub, self._settings, self._session = stub, settings, session

    async def call(self, method: str, request: Message, timeout_s: float) -> Message:
        rpc = getattr(self._stub, method)
        metadata = self._settings.metadata
        if method in SESSION_METHODS:
            metadata = metadata + await self._session.open()
        return await retrying_async(self._settings.retry,
                                    lambda: rpc(request, timeout=timeout_s, metadata=metadata))

    async def open_channel(self) -> pb.DataTicket:
        """See ``GrpcTransport.open_channel``."""
        self._session.renew_if_ended()
        return await self._stub.OpenChannel(
            pb.OpenChannelRequest(), timeout=self._settings.timeout_s,
            metadata=self._settings.metadata + await self._session.open())

    async def aclose(self) -> None:
        """Nothing of its own: the client closes its gRPC channel and session."""


class AsyncChannelTransport:
    """The asyncio twin of ``ChannelTransport``: one call channel, calls in flight on it at
    once."""

    def __init__(self, grpc_transport: AsyncGrpcTransport, settings: ClientSettings,
                 token: str | None, max_reply_bytes: int) -> None:
        self._grpc, self._settings = grpc_transport, settings
        self._token, self._max_reply_bytes = token, max_reply_bytes
        self._calls = CallChannels()
        self.channel: AsyncChannel | None = None
        self._lock: asyncio.Lock | None = None  # one task opens the call channel

    async def call(self, method: str, request: Message, timeout_s: float) -> Message:
        if method in CHANNEL_METHODS and self._calls.usable:
            channel = await self._open_channel()
            if channel is not None:
                try:
                    return await retrying_async(self._settings.retry,
                                                lambda: channel.call(method, request, timeout_s))
                except ChannelBroken as exc:  # the daemon went or restarted: gRPC retries
                    log.debug("call channel broke under %s: %s", method, exc)
        return await self._grpc.call(method, request, timeout_s)

    async def _open_channel(self) -> AsyncChannel | None:
        """The call channel, opened where there is none (see ``ChannelTransport``)."""
        channel = self.channel
        if channel is not None and not channel.closed:
            return channel
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.channel is not None and not self.channel.closed:
                return self.channel
            if not self._calls.usable:
                return None
            try:
                ticket = await self._grpc.open_channel()
                address = data_address(self._settings.target, ticket)
                if address is None:
                    raise FailedPrecondition("the call channel is not served over this "
                                             "client's transport")
                self.channel = await AsyncChannel.open(
                    address, ticket.ticket, self._token, self._settings.timeout_s,
                    self._max_reply_bytes)
            except (grpc.RpcError, OSError, KVStoreError, TimeoutError) as exc:
                self._calls.refused(exc)
                return None
            return self.channel

    async def aclose(self) -> None:
        if self.channel is not None:
            await self.channel.aclose()


async def _drain_hold_async(call, regions_retired: Callable[[], None]) -> None:
    """Read a Hold stream's events until it ends, dropping the mappings of regions the daemon
    gave back as soon as it says so. With ``read`` (the first event was read so), not the
    iterator: gRPC refuses to mix them on one call, which ended the task at once."""
    with contextlib.suppress(grpc.RpcError, asyncio.CancelledError):
        while (event := await call.read()) is not grpc.aio.EOF:
            if event.regions_retired:
                regions_retired()
