"""The KVStore gRPC servicer: a thin layer that validates requests and calls the Store.

Authentication, error translation and metrics are interceptors (auth.py, interceptors.py,
metrics.py); this module only parses each request, applies the tenant rules of the caller
(``auth.current_caller()``) and converts values to and from their wire form. The calls a call
channel also carries (``CHANNEL_METHODS``) have a core taking ``(request, CallScope)``, which
both the gRPC method and the channel (``server/channel.py``) run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np

from kvstore import __version__
from kvstore.api import MAX_CARRIED_RELEASES, MAX_LEASE_S
from kvstore.config import KVStoreConfig
from kvstore.errors import (
    CapacityError,
    FailedPrecondition,
    InvalidArgument,
    LeaseNotFound,
)
from kvstore.keys import MAX_NAME_CHARS, Namespace
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.convert import (
    block_info_to_proto,
    key_from_bytes,
    lease_to_proto,
    lookup_to_proto,
    medium_from_proto,
    namespace_from_proto,
    pin_info_to_proto,
    profile_from_proto,
    reservation_to_proto,
    stats_to_proto,
    tokens_from_bytes,
)
from kvstore.rpc.descriptors import fd_socket_path
from kvstore.rpc.framing import CHANNEL_METHODS
from kvstore.rpc.metadata import SUBSCRIBED_HEADER
from kvstore.rpc.tensors import (
    ChunkAssembler,
    chunk_limit,
    expected_tensor,
    iter_chunks,
    tensor_from_buffer,
    tensor_header,
    tensor_view,
)
from kvstore.server import calls
from kvstore.server.auth import UNIX_PEER_PREFIX, Caller, current_caller
from kvstore.server.channel import CallScope, Core
from kvstore.server.data_socket import DataSocketServer
from kvstore.server.heap import HEAP
from kvstore.server.kv_events import EventHub
from kvstore.server.limits import StreamClock
from kvstore.server.put_bodies import PutBodies
from kvstore.server.sessions import HEARTBEAT_S, Session, Sessions
from kvstore.server.slow_readers import paced
from kvstore.server.transfers import Transfer
from kvstore.store import Store

MAX_HINT_DEADLINE_S = 3600.0
MAX_EVENT_HANDLE_BYTES = 64  # cudaIpcEventHandle_t
MAX_DEVICE_NAME = 64  # "GPU-" and a UUID: 40
MAX_LIST_LIMIT = 100_000
DEFAULT_LIST_LIMIT = 1000
MIN_CHUNK_BYTES = 64 << 10  # a Get may ask for smaller chunks, not for a million tiny ones


def _seconds(value: float, name: str, upper: float, allow_zero: bool) -> float:
    if not math.isfinite(value) or value < 0 or value > upper or (value == 0 and not allow_zero):
        raise InvalidArgument(f"{name} must be in {'[' if allow_zero else '('}0, {upper:g}] "
                              f"seconds, got {value!r}")
    return value


def max_put_bytes(config: KVStoreConfig) -> int:
    """The largest tensor one Put may carry. It is held in memory before the store sees it:
    bound it by what the fastest tier (memory) holds. Also the budget of all data tickets."""
    return max(config.server.max_message_bytes, config.tier_chain()[0].settings.capacity_bytes)


def _device(name: str) -> str:
    """A request's GPU name (``kvstore.ipc.device_id``), bounded: it only steers placement."""
    if len(name) > MAX_DEVICE_NAME:
        raise InvalidArgument(f"device names a GPU in at most {MAX_DEVICE_NAME} characters, got "
                              f"{len(name)}")
    return name


def _require_unix(scope: CallScope, method: str, instead: str) -> None:
    """FailedPrecondition unless the caller is on the Unix socket: a zero-copy grant names
    arena pages that only a process on this host, handed the arena there, can map."""
    if not scope.peer.startswith(UNIX_PEER_PREFIX):
        raise FailedPrecondition(f"{method} hands out shared-memory pages, which a caller over "
                                 f"TCP cannot map; use {instead}, which streams the bytes")


# A Hold stream looks at the daemon's draining and its session's events this often.
HOLD_POLL_S = 0.25


class KVStoreService(pbg.KVStoreServicer):
    """Serves one Store. Every handler raises kvstore exceptions; the interceptors map them."""

    def __init__(self, store: Store, config: KVStoreConfig,
                 is_draining: Callable[[], bool] = lambda: False,
                 datapath: DataSocketServer | None = None,
                 events: EventHub | None = None) -> None:
        self._store = store
        self._events = events  # KV events (server/kv_events.py); None: events are off
        self._datapath = datapath  # the socket data path; None: tensors stream in chunks
        self._config = config
        self._is_draining = is_draining
        self._chunk_bytes = chunk_limit(config.server.max_message_bytes)
        self._max_put_bytes = max_put_bytes(config)
        self._sessions = Sessions(store, config.server.max_concurrent_rpcs)
        regions = store.host_regions
        if regions is not None:
            regions.on_retired(self._sessions.regions_retired)
        self._started = time.monotonic()
        self._max_tokens = config.server.max_request_tokens
        self._idle_s = config.server.stream_idle_timeout_s
        self.put_bodies = PutBodies(config.server.max_tenant_put_bytes, self._idle_s)
        self._fd_socket_path = fd_socket_path(config.server.socket_path)  # Health tells clients

    def _namespace(self, msg: pb.Namespace, action: str, caller: Caller | None = None
                   ) -> Namespace:
        ns = namespace_from_proto(msg)
        (caller or current_caller()).check_namespace_tenant(ns.tenant, action)
        calls.note_namespace(ns)  # the call's span and metric labels
        return ns

    @staticmethod
    def _scope(context) -> CallScope:
        """A gRPC call's caller and peer, for a handler core."""
        caller = current_caller()
        calls.note_tenant(caller.tenant)
        return CallScope(caller, context.peer(), context)

    def _session(self, scope: CallScope):
        """The session a call's grants go under: its channel's, or the one its metadata
        names (None: neither)."""
        if scope.session is not None or scope.context is None:
            return scope.session
        return self._sessions.of_call(scope.context.invocation_metadata(), scope.caller)

    def channel_cores(self) -> dict[str, tuple[type, Core]]:
        """The handler core of each method a call channel carries, with its request class."""
        cores = {"Lookup": self.lookup, "Acquire": self.acquire, "Release": self.release,
                 "Reserve": self.reserve, "Commit": self.commit, "Abort": self.abort}
        methods = pb.DESCRIPTOR.services_by_name["KVStore"].methods_by_name
        return {name: (getattr(pb, methods[name].input_type.name), cores[name])
                for name in CHANNEL_METHODS}

    def _tokens(self, data: bytes) -> np.ndarray:
        return tokens_from_bytes(data, self._max_tokens)

    def _lease_s(self, value: float) -> float | None:
        return _seconds(value, "lease_s", MAX_LEASE_S, allow_zero=True) or None

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        return await self.lookup(request, self._scope(context))

    async def lookup(self, request: pb.LookupRequest, scope: CallScope) -> pb.LookupResponse:
        ns = self._namespace(request.namespace, "look up", scope.caller)
        with calls.phase("store"):
            result = await self._store.lookup(ns, self._tokens(request.tokens))
        calls.note(num_tokens=result.num_tokens, matched_tokens=result.matched_tokens,
                   advised_tokens=result.tokens_to_fetch)
        calls.note_tiers("tokens", result.tokens_per_tier)
        # A long chain's reply is built a slice at a time (store/slices.py): 262,144 keys
        # joined at once held the loop about 3 ms, as a repeated field far longer.
        share = self._store.share
        if request.packed:
            return lookup_to_proto(result, packed=True,
                                   packed_keys=await share.joined(result.keys))
        reply = lookup_to_proto(dataclasses.replace(result, keys=()))
        await share.each(result.keys, reply.keys.extend)
        return reply

    def _checked_put(self, header: pb.PutHeader) -> tuple[Namespace, np.ndarray, int]:
        """A Put header's namespace (the caller may write it), tokens and tensor bytes."""
        ns = self._namespace(header.namespace, "write")
        tokens = self._tokens(header.tokens)
        nbytes = expected_tensor(ns.spec, len(tokens), header.tensor)
        calls.note(num_tokens=len(tokens), bytes=nbytes)
        return ns, tokens, nbytes

    def _datapath_for(self, context) -> DataSocketServer | None:
        """The data path, if this daemon offers one the caller's transport can reach."""
        path = self._datapath
        return path if path is not None and path.serves(context.peer()) else None

    async def OpenPut(self, request: pb.PutHeader, context) -> pb.DataTicket:
        # Everything a streamed Put checks before it reads a chunk is checked here, before
        # the ticket (and its buffer) exist.
        datapath = self._datapath_for(context)
        if datapath is None:
            raise FailedPrecondition("this daemon offers no data socket to this caller "
                                     "(server.data_socket); stream the tensor with Put")
        if request.ticket:
            raise InvalidArgument("OpenPut takes a PutHeader without a ticket")
        ns, tokens, nbytes = self._checked_put(request)
        if nbytes > self._max_put_bytes:
            raise CapacityError(f"tensor of {nbytes} bytes exceeds the {self._max_put_bytes}"
                                "-byte limit for one request")
        transfer = datapath.transfers.open_put(current_caller(), context.peer(), nbytes,
                                     (ns, tokens, request.tensor))
        return datapath.ticket_proto(transfer)

    async def _put_from_ticket(self, header: pb.PutHeader, clock: StreamClock,
                               stream: AsyncIterator[pb.PutRequest]) -> pb.PutResponse:
        """Complete a Put whose bytes come over the data socket under ``header.ticket``."""
        if self._datapath is None:
            raise FailedPrecondition("this daemon offers no data socket; a Put header "
                                     "carries no ticket here")
        if header.HasField("namespace") or header.tokens or header.HasField("tensor"):
            raise InvalidArgument("a Put header with a ticket carries nothing else (OpenPut "
                                  "took the namespace, tokens and tensor)")
        transfer = self._datapath.transfers.claim_put(header.ticket, current_caller())
        reuse = False  # whether the store has let go of the buffer
        try:
            if await clock.next(stream, "Put") is not None:
                raise InvalidArgument("no chunks may follow a Put header with a ticket")
            with calls.phase("receive"):
                buffer = await self._datapath.transfers.wait(transfer)
            ns, tokens, tensor = transfer.context
            calls.note_namespace(ns)
            calls.note(num_tokens=len(tokens), bytes=buffer.nbytes, path="data_socket")
            try:
                with calls.phase("store"):
                    written = await self._store.put(ns, tokens,
                                                    tensor_from_buffer(buffer, tensor))
            except asyncio.CancelledError:
                raise  # its encoding thread may still read the buffer: not reused
            except BaseException:
                reuse = True
                raise
            reuse = True
        finally:
            self._datapath.transfers.discard(transfer, reuse=reuse)
        calls.note(tokens_written=written)
        return pb.PutResponse(tokens_written=written)

    async def Put(self, request_iterator: AsyncIterator[pb.PutRequest], context) -> pb.PutResponse:
        # Every read waits at most stream_idle_timeout_s for progress (limits.StreamClock), and
        # the sizes the header declares are checked before the buffer is allocated.
        stream, clock = aiter(request_iterator), StreamClock(self._idle_s)
        first = await clock.next(stream, "Put")
        if first is None:
            raise InvalidArgument("Put stream is empty: expected a PutHeader first")
        if first.WhichOneof("part") != "header":
            raise InvalidArgument("Put stream must start with a PutHeader")
        header = first.header
        if header.ticket:
            return await self._put_from_ticket(header, clock, stream)
        ns, tokens, nbytes = self._checked_put(header)
        assembler = ChunkAssembler(nbytes, self._max_put_bytes)
        async with self.put_bodies.hold(current_caller().tenant, nbytes):  # before any chunk
            clock.advance()  # waiting for the budget was the daemon's time, not the client's
            calls.note(path="stream")
            return await self._put_streamed(stream, clock, assembler, ns, tokens, header)

    async def _put_streamed(self, stream: AsyncIterator[pb.PutRequest], clock: StreamClock,
                            assembler: ChunkAssembler, ns: Namespace, tokens: np.ndarray,
                            header: pb.PutHeader) -> pb.PutResponse:
        try:
            with calls.phase("receive"):
                while (message := await clock.next(stream, "Put")) is not None:
                    if message.WhichOneof("part") != "chunk":
                        raise InvalidArgument("only chunks may follow the PutHeader")
                    assembler.add(message.chunk)
                    if assembler.is_complete:
                        clock.advance()  # the client now has a full idle gap to close it
                    else:
                        clock.note(len(message.chunk))
            buffer = assembler.finish()
        except BaseException:
            assembler.release()  # a refused or abandoned put gives its bytes back now
            raise
        with calls.phase("store"):
            written = await self._store.put(ns, tokens,
                                            tensor_from_buffer(buffer, header.tensor))
        calls.note(tokens_written=written)
        return pb.PutResponse(tokens_written=written)

    async def Get(self, request: pb.GetRequest, context) -> AsyncIterator[pb.GetResponse]:
        # A reader that stops taking messages is ended after stream_idle_timeout_s and what
        # its Get held (the result, pinned pages, a data ticket) is let go at once.
        async for message in paced(self._get(request, context), context, self._idle_s, "Get"):
            yield message

    async def _get(self, request: pb.GetRequest, context) -> AsyncIterator[pb.GetResponse]:
        ns = self._namespace(request.namespace, "read")
        tokens = self._tokens(request.tokens)
        datapath = self._datapath_for(context) if request.data_socket else None
        if datapath is not None:
            # Raw pages in trusted memory go from where they lie into the data socket: one
            # copy on this side, no decode, no result tensor (else Store.get below).
            with calls.phase("store"):
                pinned = await self._store.get_in_place(ns, tokens)
            if pinned is not None:
                calls.note(matched_tokens=pinned.shape[2], bytes=pinned.nbytes,
                           path="data_socket_in_place")
                try:
                    transfer = datapath.transfers.open_get(current_caller(), context.peer(),
                                                           pinned.pieces)
                    if transfer is not None:
                        header = pb.GetHeader(found=True, matched_tokens=pinned.shape[2],
                                              tensor=pb.TensorHeader(
                                                  dtype=str(pinned.dtype).removeprefix("torch."),
                                                  shape=list(pinned.shape),
                                                  total_bytes=pinned.nbytes))
                        with calls.phase("send"):
                            async for message in self._send_ticket(datapath, transfer,
                                                                   header):
                                yield message
                        return
                finally:
                    pinned.release()
        with calls.phase("store"):
            kv = await self._store.get(ns, tokens)
        if kv is None:
            calls.note(matched_tokens=0, bytes=0)
            yield pb.GetResponse(header=pb.GetHeader(found=False))
            return
        calls.note(matched_tokens=kv.shape[2], bytes=kv.nbytes)
        try:
            async for message in self._send_result(kv, request, context, datapath):
                yield message
        finally:
            HEAP.note_freed(kv.nbytes)  # a burst of results goes back once it is over

    async def _send_result(self, kv, request: pb.GetRequest, context,
                           datapath: DataSocketServer | None) -> AsyncIterator[pb.GetResponse]:
        header = pb.GetHeader(found=True, matched_tokens=kv.shape[2], tensor=tensor_header(kv))
        transfer = None if datapath is None else datapath.transfers.open_get(
            current_caller(), context.peer(), [tensor_view(kv)])
        if transfer is not None:  # None: out of tickets; stream this one
            calls.note(path="data_socket")
            with calls.phase("send"):
                async for message in self._send_ticket(datapath, transfer, header):
                    yield message
            return
        calls.note(path="stream")
        with calls.phase("send"):
            yield pb.GetResponse(header=header)
            chunk_bytes = min(max(request.chunk_bytes, MIN_CHUNK_BYTES) if request.chunk_bytes
                              else self._chunk_bytes, self._chunk_bytes)
            for chunk in iter_chunks(tensor_view(kv), chunk_bytes):
                yield pb.GetResponse(chunk=chunk)

    @staticmethod
    async def _send_ticket(datapath: DataSocketServer, transfer: Transfer, header: pb.GetHeader
                           ) -> AsyncIterator[pb.GetResponse]:
        """A Get's header with its data ticket; then the stream waits on the transfer, whose
        outcome is its status."""
        try:
            header.data.CopyFrom(datapath.ticket_proto(transfer))
            yield pb.GetResponse(header=header)
            await datapath.transfers.wait(transfer)
        finally:
            datapath.transfers.discard(transfer)

    async def Evict(self, request: pb.EvictRequest, context) -> pb.EvictResponse:
        caller = current_caller()
        tenant = caller.scope(request.tenant, "evict blocks")
        if len(request.keys) > MAX_LIST_LIMIT:  # as many as one listing can show
            raise InvalidArgument(f"Evict names {len(request.keys)} keys; at most "
                                  f"{MAX_LIST_LIMIT} per call")
        keys = [key_from_bytes(k) for k in request.keys] or None
        revision = request.revision if request.HasField("revision") else None
        adapter_id = request.adapter_id if request.HasField("adapter_id") else None
        namespace = (key_from_bytes(request.namespace, "namespace fingerprint")
                     if request.namespace else None)
        for name, value in (("revision", revision), ("adapter_id", adapter_id)):
            if value is not None and len(value) > MAX_NAME_CHARS:
                raise InvalidArgument(f"Evict {name} has {len(value)} characters; a namespace's "
                                      f"has at most {MAX_NAME_CHARS}")
        invalidates = revision is not None or adapter_id is not None or namespace is not None
        if not (request.everything or request.tenant or request.model_id or keys
                or invalidates):
            raise InvalidArgument("Evict needs tenant, model_id, keys, revision, adapter_id, "
                                  "namespace or everything")
        everything = request.everything and tenant is None  # a tenant's "everything" is its own
        # A tenant caller's evict, invalidations included, is always scoped to its own blocks.
        removed = await self._store.evict(tenant=tenant, model_id=request.model_id or None,
                                          keys=keys, everything=everything, revision=revision,
                                          adapter_id=adapter_id, namespace=namespace)
        return pb.EvictResponse(num_blocks=removed)

    async def Pin(self, request: pb.PinRequest, context) -> pb.PinInfo:
        ns = self._namespace(request.namespace, "pin")
        info = await self._store.pin(ns, self._tokens(request.tokens), request.ttl_s)
        return pin_info_to_proto(info)

    async def Unpin(self, request: pb.UnpinRequest, context) -> pb.UnpinResponse:
        ns = self._namespace(request.namespace, "unpin")
        return pb.UnpinResponse(num_pins=await self._store.unpin(ns, self._tokens(request.tokens)))

    async def ListPins(self, request: pb.ListPinsRequest, context) -> pb.ListPinsResponse:
        tenant = current_caller().scope(request.tenant, "list pins")
        return pb.ListPinsResponse(pins=[pin_info_to_proto(p)
                                         for p in self._store.list_pins(tenant)])

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        tenant = current_caller().scope(request.tenant, "read stats")
        return stats_to_proto(self._store.stats(tenant=tenant))

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        caller = current_caller()
        datapath = self._datapath_for(context)
        return pb.HealthResponse(
            status="DRAINING" if self._is_draining() else "SERVING", version=__version__,
            uptime_s=time.monotonic() - self._started, pid=os.getpid(),
            tenant=caller.tenant or "", is_admin=caller.is_admin,
            arena_path=self._fd_socket_path if self._store.host_regions is not None else "",
            call_channel=datapath is not None and datapath.offers_calls,
        )

    async def OpenChannel(self, request: pb.OpenChannelRequest, context) -> pb.DataTicket:
        # The token was checked by the interceptor; the ticket binds the channel to this
        # caller, its transport and the session its metadata names (server/channel.py).
        datapath = self._datapath_for(context)
        if datapath is None:
            raise FailedPrecondition("this daemon offers no data socket to this caller "
                                     "(server.data_socket), so no call channel")
        scope = self._scope(context)
        transfer = datapath.open_channel(scope.caller, scope.peer, self._session(scope))
        return datapath.ticket_proto(transfer)

    async def ListBlocks(self, request: pb.ListBlocksRequest, context) -> pb.ListBlocksResponse:
        tenant = current_caller().scope(request.tenant, "list blocks")
        limit = request.limit or DEFAULT_LIST_LIMIT
        if limit > MAX_LIST_LIMIT:
            raise InvalidArgument(f"limit must be at most {MAX_LIST_LIMIT}, got {limit}")
        blocks = self._store.list_blocks(tenant=tenant, model_id=request.model_id or None,
                                         tier=request.tier or None, limit=limit)
        return pb.ListBlocksResponse(blocks=[block_info_to_proto(b) for b in blocks])

    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:
        return await self.reserve(request, self._scope(context))

    async def reserve(self, request: pb.ReserveRequest, scope: CallScope) -> pb.ReserveResponse:
        ns = self._namespace(request.namespace, "write", scope.caller)
        _require_unix(scope, "Reserve", "Put")
        lease_s = self._lease_s(request.lease_s)
        tokens, medium = self._tokens(request.tokens), medium_from_proto(request.medium)
        session = self._session(scope)
        released = await self._release_carried(request.release, scope)  # frees room to make
        with calls.phase("store"):
            reservation = await self._store.reserve(ns, tokens, lease_s, medium,
                                                    _device(request.device))
        calls.note(num_tokens=len(tokens), blocks=len(reservation.blocks),
                   bytes=int(sum(reservation.blocks.lengths)), released=released)
        self._sessions.note(session, reservation.reservation_id, is_lease=False)
        reply = reservation_to_proto(reservation, packed=request.packed)
        reply.released = released
        return reply

    async def Commit(self, request: pb.CommitRequest, context) -> pb.CommitResponse:
        return await self.commit(request, self._scope(context))

    async def commit(self, request: pb.CommitRequest, scope: CallScope) -> pb.CommitResponse:
        self._store.check_holder(request.reservation_id, "reservation", scope.caller.tenant)
        if len(request.ready_event) > MAX_EVENT_HANDLE_BYTES:
            raise InvalidArgument(f"ready_event holds {len(request.ready_event)} bytes; a CUDA "
                                  f"IPC event handle has {MAX_EVENT_HANDLE_BYTES}")
        self._sessions.forget(request.reservation_id)
        with calls.phase("store"):
            published = await self._store.commit(request.reservation_id, request.ready_event)
        calls.note(tokens_published=published)
        return pb.CommitResponse(tokens_published=published)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        return await self.abort(request, self._scope(context))

    async def abort(self, request: pb.AbortRequest, scope: CallScope) -> pb.AbortResponse:
        self._store.check_holder(request.reservation_id, "reservation", scope.caller.tenant)
        self._sessions.forget(request.reservation_id)
        await self._store.abort(request.reservation_id)
        return pb.AbortResponse()

    async def Acquire(self, request: pb.AcquireRequest, context) -> pb.AcquireResponse:
        return await self.acquire(request, self._scope(context))

    async def acquire(self, request: pb.AcquireRequest, scope: CallScope) -> pb.AcquireResponse:
        ns = self._namespace(request.namespace, "read", scope.caller)
        _require_unix(scope, "Acquire", "Get")
        lease_s = self._lease_s(request.lease_s)
        tokens, medium = self._tokens(request.tokens), medium_from_proto(request.medium)
        session = self._session(scope)
        released = await self._release_carried(request.release, scope)  # frees lease quota
        with calls.phase("store"):
            lease = await self._store.acquire(ns, tokens, lease_s, medium, request.first_block,
                                              _device(request.device))
        calls.note(num_tokens=len(tokens), matched_tokens=lease.matched_tokens,
                   blocks=len(lease.blocks), bytes=int(sum(lease.blocks.lengths)),
                   released=released)
        if lease.tier:
            calls.note_tiers("tokens", {lease.tier: len(lease.blocks) * ns.spec.block_tokens})
        self._sessions.note(session, lease.lease_id, is_lease=True)
        reply = lease_to_proto(lease, packed=request.packed)
        reply.released = released
        return reply

    async def _release_carried(self, lease_ids: Sequence[str], scope: CallScope) -> int:
        """Release the leases an Acquire or Reserve carries (its client's reads that ended);
        one that ended already (expired, or its session went) counts as released.
        PermissionDenied for another tenant's, which stays held."""
        if len(lease_ids) > MAX_CARRIED_RELEASES:
            raise InvalidArgument(f"one call carries at most {MAX_CARRIED_RELEASES} leases "
                                  f"to release, got {len(lease_ids)}")
        for lease_id in lease_ids:
            with contextlib.suppress(LeaseNotFound):
                await self._release(lease_id, scope)
        return len(lease_ids)

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        return await self.release(request, self._scope(context))

    async def release(self, request: pb.ReleaseRequest, scope: CallScope) -> pb.ReleaseResponse:
        await self._release(request.lease_id, scope)
        return pb.ReleaseResponse()

    async def _release(self, lease_id: str, scope: CallScope) -> None:
        self._store.check_holder(lease_id, "lease", scope.caller.tenant)
        await self._store.release(lease_id)  # LeaseNotFound for a reservation's id, too
        self._sessions.forget(lease_id)  # only now: a reservation named here stays noted

    async def Hold(self, request: pb.HoldRequest, context) -> AsyncIterator[pb.HoldEvent]:
        """A client's session (``kvstore.server.sessions``): open until the client goes away
        or the daemon drains, a heartbeat every few seconds."""
        session = self._sessions.open(request.session, current_caller())
        try:
            retired = False
            while not self._is_draining():
                yield pb.HoldEvent(server_time=time.time(), regions_retired=retired)
                retired = await self._next_hold_event(session)
        finally:
            await asyncio.shield(self._sessions.close(session))

    async def _next_hold_event(self, session: Session) -> bool:
        """Wait for a Hold stream's next event: True at once when regions its tenant may map
        were given back, False at the next heartbeat (or when the daemon drains)."""
        for _ in range(int(HEARTBEAT_S / HOLD_POLL_S)):
            if self._is_draining():
                return False
            try:
                await asyncio.wait_for(session.retired.wait(), HOLD_POLL_S)
            except TimeoutError:
                continue
            session.retired.clear()
            return True
        return False

    async def Hint(self, request: pb.HintRequest, context) -> pb.HintResponse:
        ns = self._namespace(request.namespace, "prefetch")
        deadline_s = _seconds(request.deadline_s, "deadline_s", MAX_HINT_DEADLINE_S, False)
        policy = request.policy or "best_effort"  # the store names a policy it does not know
        tokens = self._tokens(request.tokens)
        with calls.phase("store"):
            scheduled = await self._store.hint(ns, tokens, deadline_s, policy)
        calls.note(num_tokens=len(tokens), deadline_s=deadline_s, policy=policy,
                   blocks=scheduled)
        return pb.HintResponse(num_blocks=scheduled)

    async def CancelHint(self, request: pb.CancelHintRequest, context
                         ) -> pb.CancelHintResponse:
        ns = self._namespace(request.namespace, "cancel hints for")
        ended = await self._store.cancel_hint(ns, self._tokens(request.tokens))
        return pb.CancelHintResponse(num_hints=ended)

    async def ReportPrefill(self, request: pb.ReportPrefillRequest, context
                            ) -> pb.ReportPrefillResponse:
        ns = self._namespace(request.namespace, "report prefills for")
        if request.HasField("profile"):
            self._store.set_model_profile(ns, profile_from_proto(request.profile))
        if request.new_tokens:
            seconds = _seconds(request.seconds, "seconds", MAX_HINT_DEADLINE_S, False)
            self._store.report_prefill(ns, request.new_tokens, request.cached_tokens, seconds)
        return pb.ReportPrefillResponse()

    async def SubscribeEvents(self, request: pb.SubscribeEventsRequest, context
                              ) -> AsyncIterator[pb.KVEventBatch]:
        """KV events of the caller's tenant (an admin's: every tenant's, or the one it names),
        until the client goes away or the daemon drains."""
        if self._events is None:
            raise FailedPrecondition("KV events are off on this daemon (events.enabled)")
        tenant = current_caller().scope(request.tenant, "subscribe to the events")
        with self._events.subscribe(tenant) as subscription:
            await context.send_initial_metadata(((SUBSCRIBED_HEADER, "1"),))
            while not self._is_draining():
                batch = await subscription.next(HOLD_POLL_S)
                if batch is not None:
                    yield batch
