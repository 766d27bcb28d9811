"""The calls both clients make, planned once: each request built from a method's arguments and
its response read back into kvstore values. ``Client`` and ``AsyncClient`` add only their
transport (``kvstore.client.transport``) and the zero-copy paths around it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from google.protobuf.message import Message

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
from kvstore.client.mappings import BlockVisitor, fresh_tensor
from kvstore.errors import InvalidArgument, KVStoreError, NotFound
from kvstore.keys import BlockKey, Namespace
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.convert import (
    block_info_from_proto,
    health_from_proto,
    lease_from_proto,
    lookup_from_proto,
    namespace_to_proto,
    pin_info_from_proto,
    profile_to_proto,
    reservation_from_proto,
    stats_from_proto,
    tokens_to_bytes,
)
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
          everything: bool, revision: str | None = None, adapter_id: str | None = None,
          namespace: Namespace | bytes | None = None) -> Unary[int]:
    if isinstance(namespace, Namespace):
        namespace = namespace.fingerprint
    request = pb.EvictRequest(tenant=tenant or "", model_id=model_id or "",
                              keys=list(keys or ()), everything=everything,
                              revision=revision, adapter_id=adapter_id,
                              namespace=namespace or b"")
    return Unary("Evict", request, attrgetter("num_blocks"))


def pin(ns: Namespace, tokens: Tokens, ttl_s: float) -> Unary[PinInfo]:
    request = pb.PinRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens),
                            ttl_s=ttl_s)
    return Unary("Pin", request, pin_info_from_proto)


def unpin(ns: Namespace, tokens: Tokens) -> Unary[int]:
    request = pb.UnpinRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens))
    return Unary("Unpin", request, attrgetter("num_pins"))


def list_pins(tenant: str | None) -> Unary[list[PinInfo]]:
    return Unary("ListPins", pb.ListPinsRequest(tenant=tenant or ""),
                 lambda response: [pin_info_from_proto(p) for p in response.pins])


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


def check_first_block(first_block: int) -> None:
    if not isinstance(first_block, int) or first_block < 0:
        raise InvalidArgument(f"first_block must be a block index >= 0, got {first_block!r}")


def stored_head(ns: Namespace, tokens: Tokens, kv: torch.Tensor, first_block: int) -> Tokens:
    """The tokens of the blocks before ``first_block``, whose stored K/V a streamed put from
    ``first_block`` on reads back first (its ``kv`` is checked against the rest)."""
    head = first_block * ns.spec.block_tokens
    check_put(ns, tokens[head:], kv)
    return tokens[:head]


def behind_head(ns: Namespace, stored: torch.Tensor | None, kv: torch.Tensor,
                first_block: int) -> torch.Tensor:
    """``kv`` behind ``stored``, the K/V read back for the blocks before ``first_block``;
    NotFound where one of them is not stored."""
    head = first_block * ns.spec.block_tokens
    if stored is None or stored.shape[2] < head:
        have = 0 if stored is None else stored.shape[2] // ns.spec.block_tokens
        raise NotFound(f"block {have} of the prefix is not stored; the blocks before "
                       f"block {first_block} must be stored before more are added to them")
    return torch.cat((stored, kv), dim=2)


def visit_blocks(ns: Namespace, kv: torch.Tensor | None,
                 visit: BlockVisitor, first_block: int) -> int:
    """Hand the blocks of a streamed get's ``kv`` to ``visit`` from ``first_block`` on (see
    ``Client.read_blocks``); the number of blocks it holds."""
    if kv is None:
        return 0
    bt = ns.spec.block_tokens
    num_blocks = kv.shape[2] // bt
    for i in range(first_block, num_blocks):
        visit(i, kv[:, :, i * bt : (i + 1) * bt])
    return num_blocks


def ticket_put(ticket: pb.DataTicket) -> pb.PutRequest:
    """The one message of a Put whose bytes went over the data socket under ``ticket``."""
    return pb.PutRequest(header=pb.PutHeader(ticket=ticket.ticket))


def get_request(ns: Namespace, tokens: Tokens, data_socket: bool = False) -> pb.GetRequest:
    return pb.GetRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens),
                         data_socket=data_socket)


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
