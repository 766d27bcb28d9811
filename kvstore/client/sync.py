"""The blocking client of the kvstore daemon."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
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
from kvstore.client.events import EventStream
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
from kvstore.client.releases import LateReleases
from kvstore.client.requests import GetAssembler, PutStream, Tokens, Unary
from kvstore.client.retry import RetryPolicy, retrying
from kvstore.client.transport import ChannelTransport, GrpcTransport, Session, Transport
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


class Client:
    """A connection to the daemon; methods mirror :class:`kvstore.store.Store`.

    Args:
        address: ``unix:///path/to/kvstore.sock`` (default: the configured socket) or
            ``host:port``.
        token: bearer token of a tenant or the admin (required over TCP).
        retry: backoff for UNAVAILABLE; other statuses raise at once.
        timeout_s: deadline of each call.
        max_message_bytes: largest gRPC message either way; tensors stream in chunks below it.
        zero_copy: move tensor bytes through the shared DRAM arena: None picks it for Unix
            sockets whenever the daemon hands this client its arena (streaming meanwhile, and
            asking again at most every ``kvstore.client.mappings.PROBE_RETRY_S``), True always
            (errors if impossible), False never. Each call can override it.
        data_socket: without shared memory, move tensor bytes over the daemon's data socket
            (outside gRPC's framing, under one-time tickets) where it offers one; False:
            always stream them in gRPC messages.
        call_channel: make Lookup, Acquire/Release and Reserve/Commit/Abort on a call channel
            (one connection beside gRPC, opened at the first of them) where the daemon offers
            one, over gRPC otherwise or when it breaks; False: always over gRPC.
        copy_threads: threads (this client's own, 1 to 4) a get's copy into the result
            shares once it moves 4 MiB or more; None: the host's cores, at most 4.
        protect_process: make this whole process non-dumpable (``kvstore.dumpable``), so
            other processes of its uid cannot read its mappings of the tenant's arena, its
            descriptors or its token through /proc or ptrace; it also ends core dumps and
            same-uid debuggers, and the daemon then takes on trust that this process let go
            of memory given back. None: ``KVSTORE_CLIENT_PROTECT_PROCESS=1`` turns it on.
    """

    def __init__(self, address: str | None = None, *, token: str | None = None,
                 retry: RetryPolicy | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_message_bytes: int = 256 << 20, zero_copy: bool | None = None,
                 data_socket: bool = True, call_channel: bool = True,
                 copy_threads: int | None = None, protect_process: bool | None = None) -> None:
        protect_client_process(protect_process)
        self._settings = ClientSettings.resolve(address, token, retry, timeout_s, max_message_bytes)
        self._copy_threads = resolve_copy_threads(copy_threads)
        self._channel = grpc.insecure_channel(self._settings.target.grpc_target,
                                              options=self._settings.channel_options)
        self._stub = verified_stub(pbg.KVStoreStub(self._channel), self._settings.target)
        self._zero_copy = ZeroCopy(zero_copy, self._settings.target.is_unix, token)
        self._session = Session(self._stub, self._settings, self._zero_copy.maps.regions_retired)
        self._transport: Transport = GrpcTransport(self._stub, self._settings, self._session)
        if call_channel:
            self._transport = ChannelTransport(self._transport, self._settings, token,
                                               max_message_bytes)
        self._data = DataSocket(data_socket, self._settings.target, token,
                                self._settings.timeout_s)
        self._late = LateReleases(self.release)

    # ------------------------------------------------------------------------------ plumbing

    def _call(self, attempt: Callable[[], T]) -> T:
        return retrying(self._settings.retry, attempt)

    def _unary(self, call: Unary[T]) -> T:
        return call.parse(self._transport.call(call.method, call.request,
                                               self._settings.timeout_s))

    def _zero_copy_mode(self, requested: bool | None) -> tuple[bool, bool]:
        """(use shared memory, fail rather than fall back)."""
        if self._zero_copy.must_probe(requested):
            self._zero_copy.probed(self._zero_copy.maps.usable(self.health().arena_path))
        return self._zero_copy.mode(requested)

    def _give_back(self, reservation_id: str) -> None:
        """Abort a reservation now rather than leave its slots held until the deadline. Best
        effort: the error that stopped the put is what the caller sees."""
        with contextlib.suppress(KVStoreError):
            self.abort(reservation_id)

    # ------------------------------------------------------------------------------ data path

    def put(self, ns: Namespace, tokens: Tokens, kv: torch.Tensor, *,
            zero_copy: bool | None = None, first_block: int = 0) -> int:
        """Store ``kv`` (canonical layout, one row per token) for ``tokens``.

        Args:
            first_block: ``kv`` holds the tokens from this block on: an engine adding blocks
                to a prefix it stored earlier hands over only the new ones. The blocks before
                it must be stored (NotFound if one is not). Through shared memory nothing else
                moves; streaming reads the stored blocks back first, as the Put RPC carries
                the whole prefix.

        Returns:
            Tokens newly written (full blocks only).
        """
        requests.check_first_block(first_block)
        use, strict = self._zero_copy_mode(zero_copy)
        if use:
            try:
                return self._put_shared(ns, tokens, kv, first_block)
            except OSError as exc:
                self._zero_copy.put_failed(exc, strict)
        if first_block:
            kv = self._with_stored_head(ns, tokens, kv, first_block)
        if self._late.is_pending:  # a lease of this client's read must not keep it from room
            self._late.flush()
        stream = PutStream(ns, tokens, kv, self._settings.chunk_bytes)
        if self._data.usable:
            written = self._put_data_socket(stream)
            if written is not None:
                return written
        return stream.parse(self._call(lambda: self._stub.Put(
            iter(stream), timeout=self._settings.timeout_s, metadata=self._settings.metadata)))

    def _put_data_socket(self, stream: PutStream) -> int | None:
        """Put ``stream``'s tensor over the data socket; None where the daemon offers none
        (the caller streams it instead)."""
        def open_put() -> pb.DataTicket | None:
            try:
                return self._stub.OpenPut(stream.header, timeout=self._settings.timeout_s,
                                          metadata=self._settings.metadata)
            except grpc.RpcError as err:
                return open_put_refused(err, self._data)

        ticket = self._call(open_put)
        sock = None if ticket is None else self._data.connect(ticket)
        if sock is None:
            return None
        try:
            framing.send_put(sock, ticket.ticket, self._data.token, stream.view())
        except OSError as exc:  # dropped (a full data socket): the ticket lapses there
            self._data.fell_back("Put", exc)
            return None
        # Not retried: the ticket is spent whatever the outcome.
        try:
            return stream.parse(self._stub.Put(
                iter((requests.ticket_put(ticket),)), timeout=self._settings.timeout_s,
                metadata=self._settings.metadata))
        except grpc.RpcError as err:
            exc = translate(err)
        if not is_transfer_failure(exc):
            raise exc
        self._data.fell_back("Put", exc)
        return None

    def _put_shared(self, ns: Namespace, tokens: Tokens, kv: torch.Tensor,
                    first_block: int = 0) -> int:
        """Reserve, write and commit ``kv``, piece by piece (``put_pieces``)."""
        requests.check_put(ns, tokens[first_block * ns.spec.block_tokens:], kv)
        written = 0
        for end in put_pieces(ns, len(tokens), first_block):
            reservation = self.reserve(ns, tokens[:end])
            committing = False
            try:
                write_reservation(self._zero_copy.maps, ns, kv, reservation, first_block,
                                  self._copy_threads)
                committing = True
                written += self.commit(reservation.reservation_id)
            except BaseException as exc:
                if must_abort(exc, committing):
                    self._give_back(reservation.reservation_id)
                raise
        return written

    def _with_stored_head(self, ns: Namespace, tokens: Tokens, kv: torch.Tensor,
                          first_block: int) -> torch.Tensor:
        """``kv`` behind the stored K/V of the blocks before ``first_block``."""
        head = requests.stored_head(ns, tokens, kv, first_block)
        return requests.behind_head(ns, self.get(ns, head, zero_copy=False), kv, first_block)

    def get(self, ns: Namespace, tokens: Tokens, *, zero_copy: bool | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The K/V of the longest stored prefix of ``tokens``, or None if nothing matched.

        Args:
            out: a buffer of the caller's to write the K/V into (a C-contiguous CPU tensor of
                the namespace's dtype and shape, with at least the full-block tokens of
                ``tokens`` on dim 2; InvalidArgument otherwise): reusing a warm one spares
                a fresh tensor's page faults. The result is then a view of its front,
                ``out[:, :, :matched_tokens]``; past it ``out`` is left as it was.
        """
        check_get_out(ns, len(tokens), out)
        use, strict = self._zero_copy_mode(zero_copy)
        if use:
            try:
                return self._get_shared(ns, tokens, out)
            except (OSError, LeaseNotFound) as exc:
                self._zero_copy.get_failed(exc, strict)
        return fill_out(self._get(ns, tokens), out, self._copy_threads)

    def _get(self, ns: Namespace, tokens: Tokens) -> torch.Tensor | None:
        """A Get over the data socket where the daemon offers one, else streamed."""
        if self._data.usable:
            request = requests.get_request(ns, tokens, data_socket=True)
            kv = self._call(lambda: self._get_stream(request))
            if kv is not _NO_DATA_SOCKET:
                return kv
        request = requests.get_request(ns, tokens)
        return self._call(lambda: self._get_stream(request))

    def _get_stream(self, request: pb.GetRequest) -> torch.Tensor | None | object:
        """The Get's tensor (None: nothing matched); ``_NO_DATA_SOCKET`` when its ticket's
        data socket could not be reached."""
        assembler = GetAssembler()
        call = self._stub.Get(request, timeout=self._settings.timeout_s,
                              metadata=self._settings.metadata)
        for message in call:
            assembler.add(message)
            if assembler.ticket is not None and assembler.target is not None:
                sock = self._data.connect(assembler.ticket)
                if sock is None:
                    call.cancel()
                    return _NO_DATA_SOCKET
                try:
                    framing.receive_get(sock, assembler.ticket.ticket, self._data.token,
                                        assembler.target)
                except OSError as exc:  # dropped (a full data socket): stream this Get
                    call.cancel()
                    self._data.fell_back("Get", exc)
                    return _NO_DATA_SOCKET
                assembler.target = None  # received: what follows is the stream's end
        return assembler.result()

    def _acquire_to_read(self, ns: Namespace, tokens: Tokens) -> Lease:
        """Acquire; a tenant at its lease quota while late Releases of this client are still
        on their way waits for them and asks once more."""
        try:
            return self.acquire(ns, tokens)
        except CapacityError:
            if not self._late.is_pending:
                raise
        self._late.flush()
        return self.acquire(ns, tokens)

    def _get_shared(self, ns: Namespace, tokens: Tokens, out: torch.Tensor | None = None
                    ) -> torch.Tensor | None:
        lease = self._acquire_to_read(ns, tokens)
        try:
            kv = read_lease(self._zero_copy.maps, ns, lease, out, self._copy_threads)
        finally:
            # The Release goes from a worker thread: the caller has its data once the copy
            # ends, a round trip sooner (the lease stays bounded by its deadline, and by this
            # process's session should it die first).
            self._late.send(lease.lease_id)
        # Expired mid-read: the slots may have been reused, so the caller falls back instead
        # of trusting what was read.
        check_in_time(lease)
        return kv

    def read_blocks(self, ns: Namespace, tokens: Tokens, visit: BlockVisitor, *,
                    first_block: int = 0, zero_copy: bool | None = None) -> int:
        """Hand the K/V of the longest stored prefix of ``tokens`` to ``visit(block_index,
        kv)``, block by block from ``first_block`` on, in order.

        ``kv`` is ``[L, 2, block_tokens, H, D]`` and valid only during the call: copy out of
        it. Through shared memory a raw page is handed over in place in the arena, so a caller
        copying blocks into its own buffers (an engine's paged cache) moves each byte once;
        other codecs are decoded into a scratch block first. A page found damaged raises
        CorruptPage after the blocks before it were visited.

        Returns:
            The number of blocks of the stored prefix, visited or not.
        """
        requests.check_first_block(first_block)
        use, strict = self._zero_copy_mode(zero_copy)
        if use:
            try:
                lease = self._acquire_to_read(ns, tokens)
                try:
                    num_blocks = visit_lease(self._zero_copy.maps, ns, lease, visit,
                                             first_block)
                finally:
                    self._late.send(lease.lease_id)  # see _get_shared
                check_in_time(lease)
                return num_blocks
            except (OSError, LeaseNotFound) as exc:
                self._zero_copy.get_failed(exc, strict)
        return requests.visit_blocks(ns, self._get(ns, tokens), visit, first_block)

    # --------------------------------------------------------------------------- control path

    def lookup(self, ns: Namespace, tokens: Tokens) -> LookupResult:
        return self._unary(requests.lookup(ns, tokens))

    def evict(self, *, tenant: str | None = None, model_id: str | None = None,
              keys: Sequence[BlockKey] | None = None, everything: bool = False,
              revision: str | None = None, adapter_id: str | None = None,
              namespace: Namespace | bytes | None = None) -> int:
        """Remove blocks matching every given filter; returns how many were removed. Waits
        for this client's late Releases first (``flush_releases``), so a block this client
        just read is not held back by its own lease.

        ``revision`` (also the weights epoch), ``adapter_id`` ("" is the base model) and
        ``namespace`` (a Namespace or its fingerprint) invalidate: those blocks go even when
        pinned, and no lookup started after this returns sees them."""
        self._late.flush()
        return self._unary(requests.evict(tenant, model_id, keys, everything, revision,
                                          adapter_id, namespace))

    def invalidate(self, ns: Namespace) -> int:
        """Drop every block ``ns``'s model weights made: its tenant, model and revision,
        under any adapter, salt, layout or shard. What an engine's reset-cache hook calls
        after its weights changed; returns how many blocks went."""
        return self.evict(tenant=ns.tenant, model_id=ns.model_id, revision=ns.revision)

    def pin(self, ns: Namespace, tokens: Tokens, ttl_s: float) -> PinInfo:
        """Keep the stored prefix of ``tokens`` in the cache for ``ttl_s`` seconds (where it
        lies: neither demoted nor dropped; across daemon restarts), within the tenant's pin
        budget (CapacityError naming the bytes asked, pinned and the budget)."""
        return self._unary(requests.pin(ns, tokens, ttl_s))

    def unpin(self, ns: Namespace, tokens: Tokens) -> int:
        """End this tenant's pins of every prefix of ``tokens``; returns how many ended."""
        return self._unary(requests.unpin(ns, tokens))

    def list_pins(self, tenant: str | None = None) -> list[PinInfo]:
        """Pins (a tenant caller: its own), soonest to expire first."""
        return self._unary(requests.list_pins(tenant))

    def stats(self, tenant: str | None = None) -> StoreStats:
        return self._unary(requests.stats(tenant))

    def subscribe_events(self, tenant: str | None = None) -> EventStream:
        """The daemon's KV events (blocks each tier stored or removed, the store cleared) as
        ``KVEventBatch``es, from the moment this returns: a tenant caller's own; the admin's
        every tenant's, or ``tenant``'s. Iterate it; ``close()`` or its ``with`` block ends
        the stream (``kvstore.client.events``).

        Raises:
            FailedPrecondition: the daemon's events are off (``events.enabled``).
            PermissionDenied: ``tenant`` is another tenant's.
            CapacityError: over the daemon's ``events.max_subscribers`` or
                ``events.max_subscribers_per_tenant``.
        """
        return EventStream.open(self._stub, tenant, self._settings)

    def list_blocks(self, *, tenant: str | None = None, model_id: str | None = None,
                    tier: str | None = None, limit: int = 1000) -> list[BlockInfo]:
        return self._unary(requests.list_blocks(tenant, model_id, tier, limit))

    def hint(self, ns: Namespace, tokens: Tokens, deadline_s: float,
             policy: str = "best_effort") -> int:
        """Announce a queued request; returns the blocks scheduled for promotion (with
        ``policy="wait"``: those that landed before the deadline; "timeout" gives up there)."""
        return self._unary(requests.hint(ns, tokens, deadline_s, policy))

    def cancel_hint(self, ns: Namespace, tokens: Tokens) -> int:
        """The hinted request was dropped: end its hints; returns how many ended."""
        return self._unary(requests.cancel_hint(ns, tokens))

    def report_prefill(self, ns: Namespace, new_tokens: int = 0, cached_tokens: int = 0,
                       seconds: float = 0.0, profile: ModelProfile | None = None) -> None:
        """Tell the daemon what a prefill cost (``new_tokens`` after ``cached_tokens`` took
        ``seconds``) and, once, the model's ``profile``: Lookup then advises how much of a
        match is worth fetching."""
        self._unary(requests.report_prefill(ns, new_tokens, cached_tokens, seconds, profile))

    def health(self) -> HealthInfo:
        return self._unary(requests.health())

    def acquire(self, ns: Namespace, tokens: Tokens, lease_s: float | None = None,
                medium: Medium = Medium.HOST, first_block: int = 0, device: str = "") -> Lease:
        """Pin the matched prefix in the DRAM arena (``medium`` "device": the GPU pool) until
        :meth:`release` or the deadline; from block ``first_block`` on (the lease's
        ``matched_tokens`` still count from the start of ``tokens``). ``device``: the caller's
        GPU (``kvstore.ipc.device_id``), where the daemon brings blocks into device memory
        while it has room there."""
        return self._carrying(lambda carried: requests.acquire(
            ns, tokens, lease_s, medium, first_block, device, release=carried))

    def release(self, lease_id: str) -> None:
        self._unary(requests.release(lease_id))

    def reserve(self, ns: Namespace, tokens: Tokens, lease_s: float | None = None,
                medium: Medium = Medium.HOST, device: str = "") -> Reservation:
        """DRAM slots (``medium`` "device": GPU pool slots, on the writer's GPU ``device``
        while the daemon has room there) for the blocks of ``tokens`` not stored yet; publish
        with :meth:`commit`."""
        return self._carrying(lambda carried: requests.reserve(ns, tokens, lease_s, medium,
                                                               device, release=carried))

    def _carrying(self, call: Callable[[list[str]], Unary[tuple[T, int]]]) -> T:
        """The result of the call ``call(lease_ids)`` builds, made with this client's late
        Releases riding along (``LateReleases.take``)."""
        carried = self._late.take()
        num_released = None
        try:
            result, num_released = self._unary(call(carried))
        finally:
            self._late.carried(carried, num_released)
        return result

    def commit(self, reservation_id: str, ready_event: bytes = b"") -> int:
        """Verify and publish the pages written into a reservation's slots; ``ready_event``
        is the IPC handle of a CUDA event recorded after device slots were written.

        Returns:
            Tokens published.
        """
        return self._unary(requests.commit(reservation_id, ready_event))

    def abort(self, reservation_id: str) -> None:
        """Give a reservation's slots back unpublished, so its blocks can be written again at
        once. Raises LeaseNotFound for an id never issued or already committed, aborted or
        expired."""
        self._unary(requests.abort(reservation_id))

    def release_later(self, lease_id: str) -> None:
        """Release ``lease_id`` without waiting: the Release rides on this client's next
        Acquire or Reserve within ``RELEASE_LINGER_S``, else goes alone from a worker thread
        (as a get's does); ``flush_releases`` waits for it."""
        self._late.send(lease_id)

    def flush_releases(self) -> None:
        """Wait until the daemon answered the Release of every lease an earlier get or
        read_blocks read, or ``release_later`` was given (they are sent after those calls
        return): another client's evict right after then finds nothing of it pinned (this
        client's ``evict`` waits by itself)."""
        self._late.flush()

    # ------------------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the channel; leases and reservations still held are given back."""
        self._late.close()
        self._session.close()
        self._zero_copy.maps.close()
        self._transport.close()
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
