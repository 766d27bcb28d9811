"""The calls both clients make, planned once: each request built from a method's arguments and
its response read back into kvstore values. ``Client`` and ``AsyncClient`` add only their
transport (a blocking or an asyncio channel) and the zero-copy paths around it."""

from __future__ import annotations

import contextlib
import itertools
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Generic, TypeVar

import grpc
import numpy as np
import torch
from google.protobuf.message import Message

from kvstore.api import (
    MAX_CARRIED_RELEASES,
    BlockInfo,
    HealthInfo,
    Lease,
    LookupResult,
    Medium,
    ModelProfile,
    Reservation,
    StoreStats,
)
from kvstore.client.address import Target
from kvstore.client.mappings import fresh_tensor
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError
from kvstore.keys import BlockKey, Namespace
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.convert import (
    block_info_from_proto,
    health_from_proto,
    lease_from_proto,
    lookup_from_proto,
    namespace_to_proto,
    profile_to_proto,
    reservation_from_proto,
    stats_from_proto,
    tokens_to_bytes,
)
from kvstore.rpc.datapath import CHANNEL_METHODS, FRAME, DataAddress, connect
from kvstore.rpc.status import ERROR_METADATA_KEY, RETRY_AFTER_METADATA_KEY, translate
from kvstore.rpc.tensors import (
    ChunkAssembler,
    iter_chunks,
    tensor_from_buffer,
    tensor_header,
    tensor_view,
)
from kvstore.spec import DTYPES

Tokens = Sequence[int] | np.ndarray | torch.Tensor
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Unary(Generic[R]):
    """One unary call: which stub method, its request, and how to read its response."""

    method: str  # the KVStore stub's method name, e.g. "Lookup"
    request: Message
    parse: Callable[[Any], R]  # response message -> what the client method returns


def _nothing(_response: Message) -> None:
    return None


def _block_infos(response: pb.ListBlocksResponse) -> list[BlockInfo]:
    return [block_info_from_proto(b) for b in response.blocks]


def lookup(ns: Namespace, tokens: Tokens) -> Unary[LookupResult]:
    request = pb.LookupRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens),
                               packed=True)  # the keys as one bytes field (lookup_from_proto)
    return Unary("Lookup", request, lookup_from_proto)


def evict(tenant: str | None, model_id: str | None, keys: Sequence[BlockKey] | None,
          everything: bool) -> Unary[int]:
    request = pb.EvictRequest(tenant=tenant or "", model_id=model_id or "",
                              keys=list(keys or ()), everything=everything)
    return Unary("Evict", request, attrgetter("num_blocks"))


def stats(tenant: str | None) -> Unary[StoreStats]:
    return Unary("Stats", pb.StatsRequest(tenant=tenant or ""), stats_from_proto)


def list_blocks(tenant: str | None, model_id: str | None, tier: str | None,
                limit: int) -> Unary[list[BlockInfo]]:
    request = pb.ListBlocksRequest(tenant=tenant or "", model_id=model_id or "",
                                   tier=tier or "", limit=limit)
    return Unary("ListBlocks", request, _block_infos)


def hint(ns: Namespace, tokens: Tokens, deadline_s: float, policy: str = "best_effort"
         ) -> Unary[int]:
    request = pb.HintRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens),
                             deadline_s=deadline_s, policy=policy)
    return Unary("Hint", request, attrgetter("num_blocks"))


def cancel_hint(ns: Namespace, tokens: Tokens) -> Unary[int]:
    request = pb.CancelHintRequest(namespace=namespace_to_proto(ns),
                                   tokens=tokens_to_bytes(tokens))
    return Unary("CancelHint", request, attrgetter("num_hints"))


def report_prefill(ns: Namespace, new_tokens: int, cached_tokens: int, seconds: float,
                   profile: ModelProfile | None) -> Unary[None]:
    request = pb.ReportPrefillRequest(namespace=namespace_to_proto(ns), new_tokens=new_tokens,
                                      cached_tokens=cached_tokens, seconds=seconds)
    if profile is not None:
        request.profile.CopyFrom(profile_to_proto(profile))
    return Unary("ReportPrefill", request, _nothing)


def health() -> Unary[HealthInfo]:
    return Unary("Health", pb.HealthRequest(), health_from_proto)


# How long a late Release waits for the client's next Acquire to carry it before it goes alone:
# gets back to back (a prompt's chunks, a batch's prompts) come well within it, and an engine's
# scheduler steps, tens of milliseconds apart, mostly do.
RELEASE_LINGER_S = 0.05


class CarriedReleases:
    """The Releases a client holds back for its next Acquire or Reserve to carry (their
    ``release`` field), and the rules both clients keep: a call carries at most
    ``MAX_CARRIED_RELEASES``; what the daemon did not release goes in Releases of their own;
    a daemon that released none of those it was given does not read the field, and carrying
    stops. Not locked: the blocking client keeps it under its lock, the async client on its
    loop."""

    def __init__(self) -> None:
        self.waiting: dict[str, float] = {}  # lease id -> when its Release goes alone
        self.can_carry = True

    def take(self) -> list[str]:
        """Lease ids for a call to carry, no longer waiting (hand them to ``left_over``)."""
        if not self.can_carry or not self.waiting:
            return []
        taken = list(itertools.islice(self.waiting, MAX_CARRIED_RELEASES))
        for lease_id in taken:
            del self.waiting[lease_id]
        return taken

    def left_over(self, lease_ids: list[str], num_released: int | None) -> list[str]:
        """Of ``lease_ids``, carried by a call that ended releasing ``num_released`` of them
        (None: the call failed, so whether it did is unknown), those to release alone now
        (one already gone is answered LeaseNotFound, which the clients ignore)."""
        if not lease_ids or num_released == len(lease_ids):
            return []
        if num_released == 0:
            self.can_carry = False
        return list(lease_ids)


def acquire(ns: Namespace, tokens: Tokens, lease_s: float | None,
            medium: Medium = Medium.HOST, first_block: int = 0, device: str = "",
            release: Sequence[str] = ()) -> Unary[tuple[Lease, int]]:
    """An Acquire that releases ``release`` first (late Releases riding on it); its result is
    the lease and how many of them the daemon released (0 from one that does not read them)."""
    if first_block < 0:
        raise InvalidArgument(f"first_block must be >= 0, got {first_block}")
    request = pb.AcquireRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens),
                                lease_s=lease_s or 0.0, medium=Medium(medium).value,
                                packed=True,  # the blocks as one table (lease_from_proto)
                                first_block=first_block, device=device, release=release)
    return Unary("Acquire", request, _lease_and_released)


def _lease_and_released(msg: pb.AcquireResponse) -> tuple[Lease, int]:
    return lease_from_proto(msg), msg.released


def release(lease_id: str) -> Unary[None]:
    return Unary("Release", pb.ReleaseRequest(lease_id=lease_id), _nothing)


def reserve(ns: Namespace, tokens: Tokens, lease_s: float | None,
            medium: Medium = Medium.HOST, device: str = "", release: Sequence[str] = ()
            ) -> Unary[tuple[Reservation, int]]:
    """A Reserve that releases ``release`` first, as :func:`acquire`."""
    request = pb.ReserveRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens),
                                lease_s=lease_s or 0.0, medium=Medium(medium).value,
                                packed=True,  # the slots as one table
                                device=device, release=release)
    return Unary("Reserve", request, _reservation_and_released)


def _reservation_and_released(msg: pb.ReserveResponse) -> tuple[Reservation, int]:
    return reservation_from_proto(msg), msg.released


def commit(reservation_id: str, ready_event: bytes = b"") -> Unary[int]:
    request = pb.CommitRequest(reservation_id=reservation_id, ready_event=ready_event)
    return Unary("Commit", request, attrgetter("tokens_published"))


def abort(reservation_id: str) -> Unary[None]:
    return Unary("Abort", pb.AbortRequest(reservation_id=reservation_id), _nothing)


# ------------------------------------------------------------------------------ streamed calls


def check_put(ns: Namespace, tokens: Tokens, kv: torch.Tensor) -> bytes:
    """The wire form of ``tokens``, once ``kv`` is checked against the namespace spec."""
    token_bytes = tokens_to_bytes(tokens)
    ns.spec.check_kv(kv, num_tokens=len(token_bytes) // 4)
    return token_bytes


class PutStream:
    """The messages of a streamed Put: a header validated against the namespace spec, then the
    tensor bytes in chunks. Each iteration starts over, so a retried call sends it all again."""

    def __init__(self, ns: Namespace, tokens: Tokens, kv: torch.Tensor, chunk_bytes: int) -> None:
        token_bytes = check_put(ns, tokens, kv)
        self.header = pb.PutHeader(namespace=namespace_to_proto(ns), tokens=token_bytes,
                                   tensor=tensor_header(kv))
        self._view = tensor_view(kv)
        self._chunk_bytes = chunk_bytes

    def __iter__(self) -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(header=self.header)
        for chunk in iter_chunks(self._view, self._chunk_bytes):
            yield pb.PutRequest(chunk=chunk)

    def view(self) -> memoryview:
        """The tensor's bytes (for the data socket)."""
        return self._view

    @staticmethod
    def parse(response: pb.PutResponse) -> int:
        """Tokens newly written."""
        return response.tokens_written


def ticket_put(ticket: pb.DataTicket) -> pb.PutRequest:
    """The one message of a Put whose bytes went over the data socket under ``ticket``."""
    return pb.PutRequest(header=pb.PutHeader(ticket=ticket.ticket))


def get_request(ns: Namespace, tokens: Tokens, data_socket: bool = False) -> pb.GetRequest:
    return pb.GetRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens),
                         data_socket=data_socket)


def open_put_refused(err: grpc.RpcError, data: DataSocket) -> None:
    """None where a failed OpenPut means "stream this Put instead", else ``err`` re-raised.

    A daemon older than the data socket (UNIMPLEMENTED) or one that offers none to this
    caller (FAILED_PRECONDITION) makes the client stream for a while; one whose tickets are
    all taken (CapacityError, not a rate limit) makes it stream this one Put.
    """
    code = err.code() if hasattr(err, "code") else None
    if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION):
        data.refused()
        return
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and type(translate(err)) is CapacityError:
        return
    raise err


class DataSocket:
    """Whether a client moves tensor bytes over the daemon's data socket, and where to.

    On by default: a daemon that offers none says so (OpenPut refused, a Get header without a
    ticket) and the client streams chunks; a data socket it cannot connect to makes it stream
    for ``RETRY_S`` before it tries again.
    """

    RETRY_S = 30.0

    def __init__(self, enabled: bool, target: Target, token: str | None,
                 timeout_s: float) -> None:
        self.token = token
        self._enabled = enabled
        self._target = target
        self._timeout_s = timeout_s
        self._retry_at = 0.0

    @property
    def usable(self) -> bool:
        return self._enabled and time.monotonic() >= self._retry_at

    def refused(self) -> None:
        """The daemon offers no data socket to this client: stream for a while."""
        self._retry_at = time.monotonic() + self.RETRY_S

    def connect(self, ticket: pb.DataTicket) -> socket.socket | None:
        """A connection for ``ticket``'s transfer; None (and streaming for a while) when the
        data socket cannot be reached."""
        address = self._address(ticket)
        # Firewalled, or the daemon went: the ticket expires there on its own.
        with contextlib.suppress(OSError):
            if address is not None:
                return connect(address, self._timeout_s)
        self.refused()
        return None

    def _address(self, ticket: pb.DataTicket) -> DataAddress | None:
        return data_address(self._target, ticket)


def data_address(target: Target, ticket: pb.DataTicket) -> DataAddress | None:
    """Where this client connects to present ``ticket`` (None: not over its transport)."""
    if target.is_unix:
        return DataAddress(socket.AF_UNIX, ticket.unix_path) if ticket.unix_path else None
    if not ticket.tcp_port:
        return None
    host = target.grpc_target.rpartition(":")[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return DataAddress(family, (host, ticket.tcp_port))


# ------------------------------------------------------------------------------ call channels

_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
_METHODS = pb.DESCRIPTOR.services_by_name["KVStore"].methods_by_name
REPLY_TYPES: dict[str, type[Message]] = {
    name: getattr(pb, _METHODS[name].output_type.name) for name in CHANNEL_METHODS}


class ChannelStatus(grpc.RpcError):
    """A call that failed on a call channel, read like its gRPC twin's failure (code, details,
    trailers), so the clients' retry and translation treat both alike."""

    def __init__(self, code: grpc.StatusCode, details: str, error: str = "",
                 retry_after_s: float = 0.0) -> None:
        super().__init__(details)
        self._code, self._details = code, details
        self._trailers: tuple[tuple[str, str], ...] = ()
        if error:
            self._trailers += ((ERROR_METADATA_KEY, error),)
        if retry_after_s:
            self._trailers += ((RETRY_AFTER_METADATA_KEY, f"{retry_after_s:.3f}"),)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailers


class ChannelBroken(ConnectionError):
    """A call channel closed or failed under a call: the client makes it over gRPC."""


def read_reply(status: int, body: bytes, reply_type: type[Message] | None) -> Message | None:
    """A reply frame's response message (None without ``reply_type``: the hello's answer);
    ChannelStatus for a failed call."""
    if status:
        error = pb.CallError.FromString(body)
        raise ChannelStatus(_STATUS_BY_VALUE.get(status, grpc.StatusCode.UNKNOWN),
                            error.details, error.error, error.retry_after_s)
    return reply_type.FromString(body) if reply_type is not None else None


def reply_header(header: bytes, max_reply_bytes: int) -> tuple[int, int, int]:
    """``(body bytes, status, request id)`` of a reply frame's header; ChannelBroken for a
    body larger than the client takes."""
    length, status, request_id = FRAME.unpack(header)
    if length > max_reply_bytes:
        raise ChannelBroken(f"the daemon sent a {length}-byte reply on the call channel; "
                            f"this client takes at most {max_reply_bytes}")
    return length, status, request_id


class CallChannels:
    """Whether a client makes its small calls (``CHANNEL_METHODS``) on a call channel.

    On by default: the client asks OpenChannel at its first such call; a daemon that serves
    none (UNIMPLEMENTED: older than channels; FAILED_PRECONDITION: off) or whose channels
    this tenant has used up makes it call over gRPC for ``RETRY_S`` before it asks again. A
    channel that breaks (the daemon restarted) is opened again at the next call.
    """

    RETRY_S = 30.0

    def __init__(self, enabled: bool, target: Target) -> None:
        self._enabled = enabled
        self.target = target
        self._retry_at = 0.0

    @property
    def usable(self) -> bool:
        return self._enabled and time.monotonic() >= self._retry_at

    def refused(self, err: BaseException) -> None:
        """Opening a channel failed with ``err``: a daemon that said no is asked again only
        after ``RETRY_S``; one that could not be reached, at the next call."""
        code = err.code() if isinstance(err, grpc.RpcError) and hasattr(err, "code") else None
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self._retry_at = time.monotonic() + self.RETRY_S


class GetAssembler:
    """Builds the tensor of a streamed Get from its header and chunks, or, when the header
    carries a data ticket, gives the tensor to fill from the data socket (:attr:`ticket`,
    :attr:`target`)."""

    def __init__(self) -> None:
        self._header: pb.GetHeader | None = None
        self._chunks: ChunkAssembler | None = None
        self._tensor: torch.Tensor | None = None
        self.ticket: pb.DataTicket | None = None
        self.target: memoryview | None = None  # where the data socket's bytes go

    def add(self, message: pb.GetResponse) -> None:
        if message.WhichOneof("part") == "header":
            self._header = message.header
            if message.header.HasField("data"):
                self._receive_into(message.header)
            elif message.header.found:
                total = message.header.tensor.total_bytes
                self._chunks = ChunkAssembler(total, max_bytes=total)
        elif self._chunks is None:
            raise KVStoreError("Get stream sent data without a header")
        else:
            self._chunks.add(message.chunk)

    def _receive_into(self, header: pb.GetHeader) -> None:
        dtype = DTYPES.get(header.tensor.dtype)
        if dtype is None:
            raise KVStoreError(f"Get header names an unknown dtype {header.tensor.dtype!r}")
        # uninitialised (the data socket writes every byte) and on huge pages where the
        # kernel gives them: faulting fresh memory in 4 KiB pages cost more than the copy
        self._tensor = fresh_tensor(tuple(header.tensor.shape), dtype)
        self.target = memoryview(self._tensor.view(-1).view(torch.uint8).numpy())
        if len(self.target) != header.data.total_bytes:
            raise KVStoreError(f"Get header: a {header.tensor.dtype} tensor of shape "
                               f"{tuple(header.tensor.shape)} is not the "
                               f"{header.data.total_bytes} bytes its ticket moves")
        self.ticket = header.data

    def result(self) -> torch.Tensor | None:
        if self._header is None:
            raise KVStoreError("Get stream ended without a header")
        if self._tensor is not None:
            return self._tensor
        if self._chunks is None:
            return None
        return tensor_from_buffer(self._chunks.finish(), self._header.tensor)
