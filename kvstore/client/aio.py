"""The asyncio client of the kvstore daemon."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import grpc
import torch

from kvstore.api import (
    BlockInfo,
    HealthInfo,
    Lease,
    LookupResult,
    Medium,
    ModelProfile,
    Reservation,
    StoreStats,
)
from kvstore.client import requests
from kvstore.client.address import DEFAULT_TIMEOUT_S, ClientSettings
from kvstore.client.mappings import (
    ZeroCopy,
    check_get_out,
    check_in_time,
    fill_out,
    must_abort,
    put_pieces,
    read_lease,
    write_reservation,
)
from kvstore.client.requests import (
    RELEASE_LINGER_S,
    REPLY_TYPES,
    CallChannels,
    CarriedReleases,
    ChannelBroken,
    ChannelStatus,
    DataSocket,
    GetAssembler,
    PutStream,
    Tokens,
    Unary,
    data_address,
    read_reply,
    reply_header,
)
from kvstore.client.retry import RetryPolicy, next_delay
from kvstore.copies import resolve_copy_threads
from kvstore.errors import CapacityError, FailedPrecondition, KVStoreError, LeaseNotFound
from kvstore.keys import BlockKey, Namespace
from kvstore.rpc import datapath
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.datapath import CHANNEL_METHODS, FRAME, MAX_REQUEST_ID, OPENED_ID, DataAddress
from kvstore.rpc.session import OPEN_TIMEOUT_S, SESSION_HEADER, SESSION_METHODS, new_session_id
from kvstore.rpc.status import translate

if TYPE_CHECKING:
    from typing import Self

T = TypeVar("T")
_NO_DATA_SOCKET = object()  # a Get's ticket named a data socket this client cannot reach
log = logging.getLogger("kvstore.client")


class AsyncClient:
    """The asyncio twin of :class:`kvstore.client.Client`; same arguments, same results.

    Page encoding, decoding and shared-memory copies run in worker threads so the caller's
    event loop keeps running. Use ``async with AsyncClient(...) as client`` or ``aclose()``.
    """

    def __init__(self, address: str | None = None, *, token: str | None = None,
                 retry: RetryPolicy | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_message_bytes: int = 256 << 20, zero_copy: bool | None = None,
                 data_socket: bool = True, call_channel: bool = True,
                 copy_threads: int | None = None) -> None:
        self._settings = ClientSettings.resolve(address, token, retry, timeout_s, max_message_bytes)
        self._copy_threads = resolve_copy_threads(copy_threads)
        self._max_reply_bytes = max_message_bytes
        self._calls = CallChannels(call_channel, self._settings.target)
        self._calls_channel: AsyncChannel | None = None
        self._calls_lock: asyncio.Lock | None = None  # one task opens the call channel
        self._token = token
        self._channel = grpc.aio.insecure_channel(self._settings.target.grpc_target,
                                                  options=self._settings.channel_options)
        self._stub = pbg.KVStoreStub(self._channel)
        self._zero_copy = ZeroCopy(zero_copy, self._settings.target.is_unix, token)
        self._session: tuple[tuple[str, str], ...] | None = None  # None: not opened yet
        self._hold = None
        self._hold_task: asyncio.Task[None] | None = None
        self._data = DataSocket(data_socket, self._settings.target, token,
                                self._settings.timeout_s)
        self._cleanups: set[asyncio.Future[None]] = set()
        # Leases whose reads ended, waiting for the next Acquire to release them (see
        # kvstore.client.sync.LateReleases); flushing: flush_releases wants them sent now.
        self._carry = CarriedReleases()  # its waiting ids' Releases are timed by tasks
        self._flushing = asyncio.Event()

    # ------------------------------------------------------------------------------ plumbing

    async def _call(self, attempt: Callable[[], Awaitable[T]]) -> T:
        delays = self._settings.retry.delays()
        while True:
            try:
                return await attempt()
            except grpc.RpcError as err:
                await asyncio.sleep(next_delay(self._settings.retry, delays, err))

    async def _unary(self, call: Unary[T]) -> T:
        if call.method in CHANNEL_METHODS and self._calls.usable:
            channel = await self._open_calls_channel()
            if channel is not None:
                try:
                    return call.parse(await self._call(lambda: channel.call(
                        call.method, call.request, self._settings.timeout_s)))
                except ChannelBroken as exc:  # the daemon went or restarted: gRPC retries
                    log.debug("call channel broke under %s: %s", call.method, exc)
        rpc = getattr(self._stub, call.method)
        metadata = self._settings.metadata
        if call.method in SESSION_METHODS:
            metadata = metadata + await self._session_metadata()
        return call.parse(await self._call(
            lambda: rpc(call.request, timeout=self._settings.timeout_s, metadata=metadata)))

    async def _session_metadata(self) -> tuple[tuple[str, str], ...]:
        """See ``Client._session_metadata``."""
        if self._session is None:
            self._session = ()
            session_id = new_session_id()
            call = self._stub.Hold(pb.HoldRequest(session=session_id),
                                   metadata=self._settings.metadata)
            try:
                await asyncio.wait_for(call.read(), OPEN_TIMEOUT_S)
            except (grpc.RpcError, TimeoutError):
                call.cancel()
                return self._session
            self._hold = call
            self._hold_task = asyncio.get_running_loop().create_task(
                _drain_hold(call, self._zero_copy.maps.regions_retired))
            self._session = ((SESSION_HEADER, session_id),)
        return self._session

    async def _open_calls_channel(self) -> AsyncChannel | None:
        """See ``Client._open_calls_channel``."""
        channel = self._calls_channel
        if channel is not None and not channel.closed:
            return channel
        if self._calls_lock is None:
            self._calls_lock = asyncio.Lock()
        async with self._calls_lock:
            if self._calls_channel is not None and not self._calls_channel.closed:
                return self._calls_channel
            if not self._calls.usable:
                return None
            if self._hold_task is not None and self._hold_task.done():  # the daemon restarted
                self._hold = self._hold_task = self._session = None
            try:
                ticket = await self._stub.OpenChannel(
                    pb.OpenChannelRequest(), timeout=self._settings.timeout_s,
                    metadata=self._settings.metadata + await self._session_metadata())
                address = data_address(self._settings.target, ticket)
                if address is None:
                    raise FailedPrecondition("the call channel is not served over this "
                                             "client's transport")
                self._calls_channel = await AsyncChannel.open(
                    address, ticket.ticket, self._token, self._settings.timeout_s,
                    self._max_reply_bytes)
            except (grpc.RpcError, OSError, KVStoreError, TimeoutError) as exc:
                self._calls.refused(exc)
                log.debug("no call channel, calls go over gRPC: %s", exc)
                return None
            return self._calls_channel

    async def _zero_copy_mode(self, requested: bool | None) -> tuple[bool, bool]:
        """(use shared memory, fail rather than fall back); see Client._zero_copy_mode."""
        if self._zero_copy.must_probe(requested):
            arena = (await self.health()).arena_path
            self._zero_copy.probed(await asyncio.to_thread(self._zero_copy.maps.usable, arena))
        return self._zero_copy.mode(requested)

    async def _give_back(self, reservation_id: str, write: asyncio.Future[None]) -> None:
        """Abort a reservation once its slot writer has stopped (see Client._give_back).

        The abort runs as its own task, shielded: a caller cancelled again meanwhile still
        leaves no reservation behind, and :meth:`aclose` waits for it.
        """
        await asyncio.shield(self._later(self._abort_after(reservation_id, write)))

    async def _abort_after(self, reservation_id: str, write: asyncio.Future[None]) -> None:
        # A cancelled caller does not stop the worker thread writing the slots: freeing them
        # before it stops would let it write into slots another put now holds.
        with contextlib.suppress(Exception):  # the write's error already reached the caller
            await write
        with contextlib.suppress(KVStoreError):
            await self.abort(reservation_id)

    # ------------------------------------------------------------------------------ data path

    async def put(self, ns: Namespace, tokens: Tokens, kv: torch.Tensor, *,
                  zero_copy: bool | None = None) -> int:
        """Store ``kv`` for ``tokens``; returns the tokens newly written (full blocks only)."""
        use, strict = await self._zero_copy_mode(zero_copy)
        if use:
            try:
                return await self._put_shared(ns, tokens, kv)
            except OSError as exc:
                self._zero_copy.put_failed(exc, strict)
        if self._carry.waiting:  # a lease of this client's read must not keep it from room
            await self.flush_releases()
        stream = PutStream(ns, tokens, kv, self._settings.chunk_bytes)
        if self._data.usable:
            written = await self._put_data_socket(stream)
            if written is not None:
                return written

        async def messages() -> AsyncIterator[pb.PutRequest]:
            for message in stream:
                yield message

        return stream.parse(await self._call(lambda: self._stub.Put(
            messages(), timeout=self._settings.timeout_s, metadata=self._settings.metadata)))

    async def _put_data_socket(self, stream: PutStream) -> int | None:
        """See Client._put_data_socket; the socket work runs in a worker thread."""
        async def open_put() -> pb.DataTicket | None:
            try:
                return await self._stub.OpenPut(stream.header, timeout=self._settings.timeout_s,
                                                metadata=self._settings.metadata)
            except grpc.RpcError as err:
                return requests.open_put_refused(err, self._data)

        ticket = await self._call(open_put)
        sock = None if ticket is None else await asyncio.to_thread(self._data.connect, ticket)
        if sock is None:
            return None
        with contextlib.suppress(OSError):  # the Put call below says what went wrong
            await asyncio.to_thread(datapath.send_put, sock, ticket.ticket, self._data.token,
                                    stream.view())

        async def message() -> AsyncIterator[pb.PutRequest]:
            yield requests.ticket_put(ticket)

        try:  # not retried: the ticket is spent whatever the outcome
            return stream.parse(await self._stub.Put(
                message(), timeout=self._settings.timeout_s, metadata=self._settings.metadata))
        except grpc.RpcError as err:
            raise translate(err) from None

    async def _put_shared(self, ns: Namespace, tokens: Tokens, kv: torch.Tensor) -> int:
        """Reserve, write and commit ``kv``, piece by piece (``put_pieces``)."""
        requests.check_put(ns, tokens, kv)
        written = 0
        for end in put_pieces(ns, len(tokens)):
            reservation = await self.reserve(ns, tokens[:end])
            write = asyncio.ensure_future(
                asyncio.to_thread(write_reservation, self._zero_copy.maps, ns, kv, reservation, 0,
                                  self._copy_threads))
            committing = False
            try:
                await asyncio.shield(write)
                committing = True
                written += await self.commit(reservation.reservation_id)
            except BaseException as exc:
                if must_abort(exc, committing):
                    await self._give_back(reservation.reservation_id, write)
                raise
        return written

    async def get(self, ns: Namespace, tokens: Tokens, *, zero_copy: bool | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The K/V of the longest stored prefix of ``tokens``, or None if nothing matched;
        ``out``: see :meth:`kvstore.client.Client.get`."""
        check_get_out(ns, len(tokens), out)
        use, strict = await self._zero_copy_mode(zero_copy)
        if use:
            try:
                return await self._get_shared(ns, tokens, out)
            except (OSError, LeaseNotFound) as exc:
                self._zero_copy.get_failed(exc, strict)
        if self._data.usable:
            request = requests.get_request(ns, tokens, data_socket=True)
            kv = await self._call(lambda: self._get_stream(request))
            if kv is not _NO_DATA_SOCKET:
                return await self._fill_out(kv, out)
        request = requests.get_request(ns, tokens)
        return await self._fill_out(await self._call(lambda: self._get_stream(request)), out)

    async def _fill_out(self, kv: torch.Tensor | None, out: torch.Tensor | None
                        ) -> torch.Tensor | None:
        """``kvstore.client.mappings.fill_out``, its copy in a worker thread."""
        if kv is None or out is None:
            return kv
        return await asyncio.to_thread(fill_out, kv, out, self._copy_threads)

    async def _get_stream(self, request: pb.GetRequest) -> torch.Tensor | None | object:
        """See Client._get_stream; the socket work runs in a worker thread."""
        assembler = GetAssembler()
        call = self._stub.Get(request, timeout=self._settings.timeout_s,
                              metadata=self._settings.metadata)
        async for message in call:
            assembler.add(message)
            if assembler.ticket is not None and assembler.target is not None:
                sock = await asyncio.to_thread(self._data.connect, assembler.ticket)
                if sock is None:
                    call.cancel()
                    return _NO_DATA_SOCKET
                with contextlib.suppress(OSError):  # the stream's status says why
                    await asyncio.to_thread(datapath.receive_get, sock, assembler.ticket.ticket,
                                            self._data.token, assembler.target)
                assembler.target = None
        return assembler.result()

    async def _get_shared(self, ns: Namespace, tokens: Tokens, out: torch.Tensor | None = None
                          ) -> torch.Tensor | None:
        try:
            lease = await self.acquire(ns, tokens)
        except CapacityError:  # at the lease quota: see Client._acquire_to_read
            if not self._cleanups:
                raise
            await self.flush_releases()
            lease = await self.acquire(ns, tokens)
        read = asyncio.ensure_future(
            asyncio.to_thread(read_lease, self._zero_copy.maps, ns, lease, out,
                              self._copy_threads))
        try:
            kv = await asyncio.shield(read)
        finally:
            # Released in a task of its own once the copy stopped (a cancelled caller does not
            # stop the thread reading the pages): the caller does not wait for the round trip
            # (see Client._get_shared), and aclose does.
            queued = self._carry.can_carry and read.done()
            if queued:  # at once: the caller's next Acquire may come before the task runs
                self._carry.waiting[lease.lease_id] = 0.0
            self._later(self._release_after(lease.lease_id, read, queued))
        check_in_time(lease)  # expired mid-read: the caller falls back (Client._get_shared)
        return kv

    def _later(self, work: Awaitable[None]) -> asyncio.Future[None]:
        """Run ``work`` as a task :meth:`aclose` waits for."""
        cleanup = asyncio.ensure_future(work)
        self._cleanups.add(cleanup)
        cleanup.add_done_callback(self._cleanups.discard)
        return cleanup

    async def _release_after(self, lease_id: str, read: asyncio.Future, queued: bool) -> None:
        """Once the read ended: up to ``RELEASE_LINGER_S`` for an Acquire to carry the
        Release (``queued``: waiting for one already), then the Release alone."""
        with contextlib.suppress(Exception):  # the read's error already reached the caller
            await read
        if not queued and self._carry.can_carry:
            self._carry.waiting[lease_id] = 0.0
            queued = True
        if queued:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RELEASE_LINGER_S):
                    await self._flushing.wait()
            if self._carry.waiting.pop(lease_id, None) is None:
                return  # an Acquire took it
        await self._release_quietly(lease_id)

    async def _release_quietly(self, lease_id: str) -> None:
        with contextlib.suppress(KVStoreError):  # expired, or the daemon went: nothing held
            await self.release(lease_id)

    def _carried(self, lease_ids: list[str], num_released: int | None) -> None:
        """See ``LateReleases.carried``: what the Acquire did not release goes alone."""
        for lease_id in self._carry.left_over(lease_ids, num_released):
            self._later(self._release_quietly(lease_id))

    # --------------------------------------------------------------------------- control path

    async def lookup(self, ns: Namespace, tokens: Tokens) -> LookupResult:
        return await self._unary(requests.lookup(ns, tokens))

    async def evict(self, *, tenant: str | None = None, model_id: str | None = None,
                    keys: Sequence[BlockKey] | None = None, everything: bool = False) -> int:
        """See :meth:`kvstore.client.Client.evict` (this client's late Releases first)."""
        await self.flush_releases()
        return await self._unary(requests.evict(tenant, model_id, keys, everything))

    async def stats(self, tenant: str | None = None) -> StoreStats:
        return await self._unary(requests.stats(tenant))

    async def list_blocks(self, *, tenant: str | None = None, model_id: str | None = None,
                          tier: str | None = None, limit: int = 1000) -> list[BlockInfo]:
        return await self._unary(requests.list_blocks(tenant, model_id, tier, limit))

    async def hint(self, ns: Namespace, tokens: Tokens, deadline_s: float,
                   policy: str = "best_effort") -> int:
        return await self._unary(requests.hint(ns, tokens, deadline_s, policy))

    async def cancel_hint(self, ns: Namespace, tokens: Tokens) -> int:
        return await self._unary(requests.cancel_hint(ns, tokens))

    async def report_prefill(self, ns: Namespace, new_tokens: int = 0, cached_tokens: int = 0,
                             seconds: float = 0.0, profile: ModelProfile | None = None) -> None:
        await self._unary(requests.report_prefill(ns, new_tokens, cached_tokens, seconds,
                                                  profile))

    async def health(self) -> HealthInfo:
        return await self._unary(requests.health())

    async def acquire(self, ns: Namespace, tokens: Tokens, lease_s: float | None = None,
                      medium: Medium = Medium.HOST, first_block: int = 0,
                      device: str = "") -> Lease:
        return await self._carrying(lambda carried: requests.acquire(
            ns, tokens, lease_s, medium, first_block, device, release=carried))

    async def release(self, lease_id: str) -> None:
        await self._unary(requests.release(lease_id))

    async def reserve(self, ns: Namespace, tokens: Tokens, lease_s: float | None = None,
                      medium: Medium = Medium.HOST, device: str = "") -> Reservation:
        return await self._carrying(lambda carried: requests.reserve(
            ns, tokens, lease_s, medium, device, release=carried))

    async def _carrying(self, call: Callable[[list[str]], Unary[tuple[T, int]]]) -> T:
        """See ``Client._carrying``."""
        carried = self._carry.take()
        num_released = None
        try:
            result, num_released = await self._unary(call(carried))
        finally:
            self._carried(carried, num_released)
        return result

    async def commit(self, reservation_id: str, ready_event: bytes = b"") -> int:
        return await self._unary(requests.commit(reservation_id, ready_event))

    async def abort(self, reservation_id: str) -> None:
        """Give a reservation's slots back unpublished; LeaseNotFound for an unknown id."""
        await self._unary(requests.abort(reservation_id))

    async def flush_releases(self) -> None:
        """See :meth:`kvstore.client.Client.flush_releases`."""
        if self._cleanups:
            self._flushing.set()
            try:
                await asyncio.gather(*self._cleanups, return_exceptions=True)
            finally:
                self._flushing.clear()

    # ------------------------------------------------------------------------------ lifecycle

    async def aclose(self) -> None:
        """Close the channel; leases and reservations still held are given back."""
        await self.flush_releases()  # aborts and releases still on their way
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None
            await asyncio.gather(self._hold_task, return_exceptions=True)
        self._zero_copy.maps.close()
        if self._calls_channel is not None:
            await self._calls_channel.aclose()
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class AsyncChannel:
    """A call channel (``kvstore.rpc.datapath``) for an asyncio client: calls in flight at
    once, their replies matched by request id by one reader task."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 max_reply_bytes: int) -> None:
        self._reader, self._writer = reader, writer
        self._max_reply_bytes = max_reply_bytes
        self._pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._last_id = OPENED_ID
        self._task = asyncio.get_running_loop().create_task(self._read_replies())
        self.closed = False

    @classmethod
    async def open(cls, address: DataAddress, ticket: bytes, token: str | None,
                   timeout_s: float, max_reply_bytes: int) -> AsyncChannel:
        """Connect, present ``ticket`` and wait for the daemon to open the channel;
        ChannelStatus with the daemon's reason where it refuses."""
        async with asyncio.timeout(timeout_s):
            if address.family == socket.AF_UNIX:
                reader, writer = await asyncio.open_unix_connection(address.address)
            else:
                reader, writer = await asyncio.open_connection(*address.address)
            try:
                writer.write(datapath.encode_hello(ticket, token))
                length, status, _ = reply_header(await reader.readexactly(FRAME.size),
                                                 max_reply_bytes)
                read_reply(status, await reader.readexactly(length), None)
            except BaseException:
                writer.close()
                raise
        return cls(reader, writer, max_reply_bytes)

    async def call(self, method: str, request, timeout_s: float):
        """See ``BlockingChannel.call``; a timed-out call's late reply is dropped."""
        if self.closed:
            raise ChannelBroken("the call channel is closed")
        self._last_id = request_id = self._last_id % MAX_REQUEST_ID + 1
        reply = self._pending[request_id] = asyncio.get_running_loop().create_future()
        try:
            self._writer.write(datapath.encode_frame(datapath.method_byte(method), request_id,
                                                     request.SerializeToString()))
            async with asyncio.timeout(timeout_s):
                await self._writer.drain()
                status, body = await reply
        except TimeoutError:
            raise ChannelStatus(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except OSError as exc:
            self._fail(ChannelBroken(f"the call channel failed: {exc}"))
            raise ChannelBroken(f"the call channel failed: {exc}") from exc
        finally:
            self._pending.pop(request_id, None)
            if reply.done() and not reply.cancelled():
                reply.exception()  # failed with the channel: what this call raised says so
        return read_reply(status, body, REPLY_TYPES[method])

    async def _read_replies(self) -> None:
        try:
            while True:
                length, status, request_id = reply_header(
                    await self._reader.readexactly(FRAME.size), self._max_reply_bytes)
                body = await self._reader.readexactly(length)
                reply = self._pending.get(request_id)
                if reply is not None and not reply.done():
                    reply.set_result((status, body))
        except (asyncio.IncompleteReadError, OSError) as exc:
            self._fail(exc if isinstance(exc, ChannelBroken) else
                       ChannelBroken(f"the daemon closed the call channel: {exc!r}"))

    def _fail(self, exc: ChannelBroken) -> None:
        self.closed = True
        for reply in self._pending.values():
            if not reply.done():
                reply.set_exception(exc)
        self._writer.close()

    async def aclose(self) -> None:
        self.closed = True
        self._task.cancel()
        self._writer.close()
        await asyncio.gather(self._task, return_exceptions=True)


async def _drain_hold(call, regions_retired: Callable[[], None]) -> None:
    """Read a Hold stream's events until it ends, dropping the mappings of regions the daemon
    gave back as soon as it says so. With ``read`` (the first event was read so), not the
    iterator: gRPC refuses to mix them on one call, which ended the task at once."""
    with contextlib.suppress(grpc.RpcError, asyncio.CancelledError):
        while (event := await call.read()) is not grpc.aio.EOF:
            if event.regions_retired:
                regions_retired()
