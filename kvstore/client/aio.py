"""The asyncio client of the kvstore daemon."""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
    PinInfo,
    Reservation,
    StoreStats,
)
from kvstore.client import requests
from kvstore.client.address import DEFAULT_TIMEOUT_S, ClientSettings
from kvstore.client.channels import DataSocket, is_transfer_failure, open_put_refused
from kvstore.client.events import AsyncEventStream
from kvstore.client.mappings import (
    BlockVisitor,
    ZeroCopy,
    check_get_out,
    check_in_time,
    fill_out,
    must_abort,
    put_pieces,
    read_lease,
    visit_lease,
    write_reservation,
)
from kvstore.client.releases import AsyncLateReleases
from kvstore.client.requests import GetAssembler, PutStream, Tokens, Unary
from kvstore.client.retry import RetryPolicy, retrying_async
from kvstore.client.transport import (
    AsyncChannelTransport,
    AsyncGrpcTransport,
    AsyncSession,
    AsyncTransport,
)
from kvstore.client.verified import verified_stub
from kvstore.copies import resolve_copy_threads
from kvstore.dumpable import protect_client_process
from kvstore.errors import CapacityError, KVStoreError, LeaseNotFound
from kvstore.keys import BlockKey, Namespace
from kvstore.rpc import framing
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
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
                 copy_threads: int | None = None, protect_process: bool | None = None) -> None:
        protect_client_process(protect_process)
        self._settings = ClientSettings.resolve(address, token, retry, timeout_s, max_message_bytes)
        self._copy_threads = resolve_copy_threads(copy_threads)
        self._channel = grpc.aio.insecure_channel(self._settings.target.grpc_target,
                                                  options=self._settings.channel_options)
        self._stub = verified_stub(pbg.KVStoreStub(self._channel), self._settings.target)
        self._zero_copy = ZeroCopy(zero_copy, self._settings.target.is_unix, token)
        self._session = AsyncSession(self._stub, self._settings,
                                     self._zero_copy.maps.regions_retired)
        self._transport: AsyncTransport = AsyncGrpcTransport(self._stub, self._settings,
                                                             self._session)
        if call_channel:
            self._transport = AsyncChannelTransport(self._transport, self._settings, token,
                                                    max_message_bytes)
        self._data = DataSocket(data_socket, self._settings.target, token,
                                self._settings.timeout_s)
        # Releases of leases whose reads ended, and aborts, sent after the call returned.
        self._late = AsyncLateReleases(self.release)

    # ------------------------------------------------------------------------------ plumbing

    async def _call(self, attempt: Callable[[], Awaitable[T]]) -> T:
        return await retrying_async(self._settings.retry, attempt)

    async def _unary(self, call: Unary[T]) -> T:
        return call.parse(await self._transport.call(call.method, call.request,
                                                     self._settings.timeout_s))

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
        await asyncio.shield(self._late.later(self._abort_after(reservation_id, write)))

    async def _abort_after(self, reservation_id: str, write: asyncio.Future[None]) -> None:
        # A cancelled caller does not stop the worker thread writing the slots: freeing them
        # before it stops would let it write into slots another put now holds.
        with contextlib.suppress(Exception):  # the write's error already reached the caller
            await write
        with contextlib.suppress(KVStoreError):
            await self.abort(reservation_id)

    # ------------------------------------------------------------------------------ data path

    async def put(self, ns: Namespace, tokens: Tokens, kv: torch.Tensor, *,
                  zero_copy: bool | None = None, first_block: int = 0) -> int:
        """Store ``kv`` for ``tokens``; returns the tokens newly written (full blocks only).
        ``first_block``: see :meth:`kvstore.client.Client.put`."""
        requests.check_first_block(first_block)
        use, strict = await self._zero_copy_mode(zero_copy)
        if use:
            try:
                return await self._put_shared(ns, tokens, kv, first_block)
            except OSError as exc:
                self._zero_copy.put_failed(exc, strict)
        if first_block:
            head = requests.stored_head(ns, tokens, kv, first_block)
            kv = requests.behind_head(ns, await self.get(ns, head, zero_copy=False), kv,
                                      first_block)
        if self._late.is_waiting:  # a lease of this client's read must not keep it from room
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
                return open_put_refused(err, self._data)

        ticket = await self._call(open_put)
        sock = None if ticket is None else await asyncio.to_thread(self._data.connect, ticket)
        if sock is None:
            return None
        try:
            await asyncio.to_thread(framing.send_put, sock, ticket.ticket, self._data.token,
                                    stream.view())
        except OSError as exc:  # dropped (a full data socket): the ticket lapses there
            self._data.fell_back("Put", exc)
            return None

        async def message() -> AsyncIterator[pb.PutRequest]:
            yield requests.ticket_put(ticket)

        try:  # not retried: the ticket is spent whatever the outcome
            return stream.parse(await self._stub.Put(
                message(), timeout=self._settings.timeout_s, metadata=self._settings.metadata))
        except grpc.RpcError as err:
            exc = translate(err)
        if not is_transfer_failure(exc):
            raise exc
        self._data.fell_back("Put", exc)
        return None

    async def _put_shared(self, ns: Namespace, tokens: Tokens, kv: torch.Tensor,
                          first_block: int = 0) -> int:
        """Reserve, write and commit ``kv``, piece by piece (``put_pieces``)."""
        requests.check_put(ns, tokens[first_block * ns.spec.block_tokens:], kv)
        written = 0
        for end in put_pieces(ns, len(tokens), first_block):
            reservation = await self.reserve(ns, tokens[:end])
            write = asyncio.ensure_future(
                asyncio.to_thread(write_reservation, self._zero_copy.maps, ns, kv, reservation,
                                  first_block, self._copy_threads))
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
        return await self._fill_out(await self._get(ns, tokens), out)

    async def _get(self, ns: Namespace, tokens: Tokens) -> torch.Tensor | None:
        """See Client._get."""
        if self._data.usable:
            request = requests.get_request(ns, tokens, data_socket=True)
            kv = await self._call(lambda: self._get_stream(request))
            if kv is not _NO_DATA_SOCKET:
                return kv
        request = requests.get_request(ns, tokens)
        return await self._call(lambda: self._get_stream(request))

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
                try:
                    await asyncio.to_thread(framing.receive_get, sock, assembler.ticket.ticket,
                                            self._data.token, assembler.target)
                except OSError as exc:  # dropped (a full data socket): stream this Get
                    call.cancel()
                    self._data.fell_back("Get", exc)
                    return _NO_DATA_SOCKET
                assembler.target = None
        return assembler.result()

    async def _acquire_to_read(self, ns: Namespace, tokens: Tokens) -> Lease:
        """See Client._acquire_to_read."""
        try:
            return await self.acquire(ns, tokens)
        except CapacityError:
            if not self._late.is_pending:
                raise
        await self.flush_releases()
        return await self.acquire(ns, tokens)

    async def _read_leased(self, lease: Lease, read_pages: Callable[[], T]) -> T:
        """``read_pages()`` in a worker thread, then the lease's Release sent late; see
        Client._get_shared."""
        read = asyncio.ensure_future(asyncio.to_thread(read_pages))
        try:
            result = await asyncio.shield(read)
        finally:
            # Released in a task of its own once the copy stopped (a cancelled caller does not
            # stop the thread reading the pages): the caller does not wait for the round trip
            # (see Client._get_shared), and aclose does.
            self._late.send(lease.lease_id, read)
        check_in_time(lease)  # expired mid-read: the caller falls back (Client._get_shared)
        return result

    async def _get_shared(self, ns: Namespace, tokens: Tokens, out: torch.Tensor | None = None
                          ) -> torch.Tensor | None:
        lease = await self._acquire_to_read(ns, tokens)
        return await self._read_leased(lease, lambda: read_lease(
            self._zero_copy.maps, ns, lease, out, self._copy_threads))

    async def read_blocks(self, ns: Namespace, tokens: Tokens, visit: BlockVisitor, *,
                          first_block: int = 0, zero_copy: bool | None = None) -> int:
        """See :meth:`kvstore.client.Client.read_blocks`; through shared memory ``visit`` runs
        in a worker thread."""
        requests.check_first_block(first_block)
        use, strict = await self._zero_copy_mode(zero_copy)
        if use:
            try:
                lease = await self._acquire_to_read(ns, tokens)
                return await self._read_leased(lease, lambda: visit_lease(
                    self._zero_copy.maps, ns, lease, visit, first_block))
            except (OSError, LeaseNotFound) as exc:
                self._zero_copy.get_failed(exc, strict)
        return requests.visit_blocks(ns, await self._get(ns, tokens), visit, first_block)

    # --------------------------------------------------------------------------- control path

    async def lookup(self, ns: Namespace, tokens: Tokens) -> LookupResult:
        return await self._unary(requests.lookup(ns, tokens))

    async def evict(self, *, tenant: str | None = None, model_id: str | None = None,
                    keys: Sequence[BlockKey] | None = None, everything: bool = False,
                    revision: str | None = None, adapter_id: str | None = None,
                    namespace: Namespace | bytes | None = None) -> int:
        """See :meth:`kvstore.client.Client.evict` (this client's late Releases first)."""
        await self.flush_releases()
        return await self._unary(requests.evict(tenant, model_id, keys, everything, revision,
                                                adapter_id, namespace))

    async def invalidate(self, ns: Namespace) -> int:
        """See :meth:`kvstore.client.Client.invalidate`."""
        return await self.evict(tenant=ns.tenant, model_id=ns.model_id, revision=ns.revision)

    async def pin(self, ns: Namespace, tokens: Tokens, ttl_s: float) -> PinInfo:
        """See :meth:`kvstore.client.Client.pin`."""
        return await self._unary(requests.pin(ns, tokens, ttl_s))

    async def unpin(self, ns: Namespace, tokens: Tokens) -> int:
        return await self._unary(requests.unpin(ns, tokens))

    async def list_pins(self, tenant: str | None = None) -> list[PinInfo]:
        return await self._unary(requests.list_pins(tenant))

    async def stats(self, tenant: str | None = None) -> StoreStats:
        return await self._unary(requests.stats(tenant))

    async def subscribe_events(self, tenant: str | None = None) -> AsyncEventStream:
        """See :meth:`kvstore.client.Client.subscribe_events`. A coroutine, as every verb of
        this client: it returns once the daemon confirmed the subscription, then ``async for
        batch in stream``; ``aclose()`` or its ``async with`` block ends the stream."""
        return await AsyncEventStream.open(self._stub, tenant, self._settings)

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
        carried = self._late.take()
        num_released = None
        try:
            result, num_released = await self._unary(call(carried))
        finally:
            self._late.carried(carried, num_released)
        return result

    async def commit(self, reservation_id: str, ready_event: bytes = b"") -> int:
        return await self._unary(requests.commit(reservation_id, ready_event))

    async def abort(self, reservation_id: str) -> None:
        """Give a reservation's slots back unpublished; LeaseNotFound for an unknown id."""
        await self._unary(requests.abort(reservation_id))

    async def release_later(self, lease_id: str) -> None:
        """See :meth:`kvstore.client.Client.release_later`; the Release goes alone from a task
        of its own."""
        self._late.send(lease_id)

    async def flush_releases(self) -> None:
        """See :meth:`kvstore.client.Client.flush_releases`."""
        await self._late.flush()

    # ------------------------------------------------------------------------------ lifecycle

    async def aclose(self) -> None:
        """Close the channel; leases and reservations still held are given back."""
        await self.flush_releases()  # aborts and releases still on their way
        await self._session.aclose()
        self._zero_copy.maps.close()
        await self._transport.aclose()
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
