"""What the sync and async clients share: addresses, retries, errors, request building and
the shared-memory (zero-copy) page paths.

Zero-copy: a client on the daemon's host reads pages straight out of the DRAM arena file
(Acquire, mmap, verify, decode, Release) and writes them into reserved slots (Reserve, encode,
write, Commit; Abort if the write fails or is interrupted) instead of streaming tensor bytes
through the socket. ``zero_copy=None`` (the
default) picks it automatically for ``unix://`` addresses when this process can map the arena
Health names (checked once per client), and otherwise streams; ``True`` insists on it (errors
if impossible), ``False`` always streams.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from kvstore import codecs
from kvstore.api import Lease, Medium, Reservation
from kvstore.config import ServerConfig
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError
from kvstore.keys import Namespace
from kvstore.page import PageMeta, decode_page, encode_page
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.convert import namespace_to_proto, tokens_to_bytes
from kvstore.rpc.tensors import (
    ChunkAssembler,
    iter_chunks,
    tensor_from_buffer,
    tensor_header,
    tensor_view,
)

Tokens = Sequence[int] | np.ndarray | torch.Tensor
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter, applied to UNAVAILABLE only (every other status is an
    answer, not a transport failure). ``max_attempts=1`` disables retries."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2  # each delay is scaled by a random factor in [1 - jitter, 1 + jitter]

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise InvalidArgument(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise InvalidArgument("RetryPolicy backoffs must be >= 0 and multiplier >= 1")
        if not 0 <= self.jitter < 1:
            raise InvalidArgument(f"RetryPolicy.jitter must be in [0, 1), got {self.jitter}")

    def should_retry(self, code: grpc.StatusCode | None) -> bool:
        return code == grpc.StatusCode.UNAVAILABLE

    def delays(self) -> Iterator[float]:
        """The sleep before each retry (``max_attempts - 1`` of them)."""
        delay = self.initial_backoff_s
        for _ in range(self.max_attempts - 1):
            yield min(delay, self.max_backoff_s) * random.uniform(1 - self.jitter, 1 + self.jitter)
            delay *= self.multiplier


NO_RETRY = RetryPolicy(max_attempts=1)


@dataclass(frozen=True, slots=True)
class Target:
    """A parsed client address."""

    grpc_target: str
    is_unix: bool


def default_address() -> str:
    return f"unix://{ServerConfig().socket_path}"


def parse_address(address: str | None) -> Target:
    """``unix:///path`` (or a bare absolute path) or ``host:port``."""
    address = address or default_address()
    if address.startswith("unix:"):
        return Target(address, True)
    if address.startswith("/"):
        return Target(f"unix://{address}", True)
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"address {address!r}: expected unix:///path or host:port")
    return Target(address, False)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    # Reconnect quickly: the daemon is local, and gRPC's default first reconnect waits 1 s,
    # longer than a daemon restart, during which every call fails fast as UNAVAILABLE.
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000)]


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def rpc_code(err: grpc.RpcError) -> grpc.StatusCode | None:
    return err.code() if hasattr(err, "code") else None


# ------------------------------------------------------------------------ request building


def put_header(ns: Namespace, tokens: Tokens, kv: torch.Tensor
               ) -> tuple[pb.PutHeader, memoryview]:
    """The Put header and the tensor bytes, validated against the namespace spec."""
    token_bytes = tokens_to_bytes(tokens)
    ns.spec.check_kv(kv, num_tokens=len(token_bytes) // 4)
    header = pb.PutHeader(namespace=namespace_to_proto(ns), tokens=token_bytes,
                          tensor=tensor_header(kv))
    return header, tensor_view(kv)


def put_stream(header: pb.PutHeader, view: memoryview, chunk_bytes: int
               ) -> Iterator[pb.PutRequest]:
    yield pb.PutRequest(header=header)
    for chunk in iter_chunks(view, chunk_bytes):
        yield pb.PutRequest(chunk=chunk)


class GetAssembler:
    """Builds the tensor of a streamed Get from its header and chunks."""

    def __init__(self) -> None:
        self._header: pb.GetHeader | None = None
        self._chunks: ChunkAssembler | None = None

    def add(self, message: pb.GetResponse) -> None:
        if message.WhichOneof("part") == "header":
            self._header = message.header
            if message.header.found:
                total = message.header.tensor.total_bytes
                self._chunks = ChunkAssembler(total, max_bytes=total)
        elif self._chunks is None:
            raise KVStoreError("Get stream sent data without a header")
        else:
            self._chunks.add(message.chunk)

    def result(self) -> torch.Tensor | None:
        if self._header is None:
            raise KVStoreError("Get stream ended without a header")
        if self._chunks is None:
            return None
        return tensor_from_buffer(self._chunks.finish(), self._header.tensor)


# ---------------------------------------------------------------------- shared-memory pages


class ArenaMaps:
    """mmaps of the daemon's DRAM arena files, opened on first use and reused.

    An arena grows in chunks, so a slot past the mapped end remaps the file. Thread-safe: the
    async client reads and writes pages from worker threads.
    """

    def __init__(self) -> None:
        self._maps: dict[tuple[str, bool], mmap.mmap] = {}
        self._lock = threading.Lock()

    def _map(self, path: str, end: int, writable: bool) -> mmap.mmap:
        current = self._maps.get((path, writable))
        if current is not None and len(current) >= end:
            return current
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mapped = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        if len(mapped) < end:
            mapped.close()
            raise InvalidArgument(f"arena {path} is {len(mapped)} bytes; a slot ends at {end}")
        if current is not None:
            self._close_map(current)
        self._maps[(path, writable)] = mapped
        return mapped

    def usable(self, path: str) -> bool:
        """Whether this process can map ``path`` for reading and writing."""
        if not path:
            return False
        try:
            with self._lock:
                self._map(path, 0, writable=True)
        except (OSError, ValueError):
            return False
        return True

    def view(self, path: str, offset: int, length: int, writable: bool = False) -> memoryview:
        with self._lock:
            mapped = self._map(path, offset + length, writable)
            return memoryview(mapped)[offset : offset + length]

    @staticmethod
    def _close_map(mapped: mmap.mmap) -> None:
        # BufferError: a caller still holds a view; the mapping goes when the last one does.
        with contextlib.suppress(BufferError):
            mapped.close()

    def close(self) -> None:
        with self._lock:
            for mapped in self._maps.values():
                self._close_map(mapped)
            self._maps.clear()


def _check_host(medium: Medium) -> None:
    if medium is not Medium.HOST:
        raise InvalidArgument(f"a {medium.value} slot cannot be mapped through the host arena")


def read_lease(maps: ArenaMaps, ns: Namespace, lease: Lease) -> torch.Tensor | None:
    """The K/V of a lease's pinned pages, each verified against its key."""
    if not lease.blocks:
        return None
    bt = ns.spec.block_tokens
    out = torch.empty(ns.spec.shape(len(lease.blocks) * bt), dtype=ns.spec.torch_dtype)
    for i, loc in enumerate(lease.blocks):
        _check_host(loc.medium)
        page = decode_page(maps.view(loc.region, loc.offset, loc.length),
                           expected_key=loc.key)
        codecs.decode(page.payload, out=out[:, :, i * bt : (i + 1) * bt])
    return out


def must_abort(exc: BaseException, committing: bool) -> bool:
    """Whether a zero-copy put that raised ``exc`` still holds its reservation and must Abort
    it: always while the slots are being written; during Commit only when the caller was
    interrupted (KeyboardInterrupt, cancellation), since a Commit the daemon answered has
    already published or freed the slots."""
    return not committing or not isinstance(exc, Exception)


def write_reservation(maps: ArenaMaps, ns: Namespace, kv: torch.Tensor,
                      reservation: Reservation) -> None:
    """Encode each reserved block of ``kv`` with the reservation's codec as a page and write it
    into its slot."""
    codec = codecs.get(reservation.codec)
    bt = ns.spec.block_tokens
    kv = kv.detach().cpu()
    for grant in reservation.blocks:
        _check_host(grant.medium)
        block = kv[:, :, grant.block_index * bt : (grant.block_index + 1) * bt].contiguous()
        meta = PageMeta(key=grant.key, namespace=ns.fingerprint, parent=grant.parent,
                        block_index=grant.block_index, tenant=ns.tenant, model_id=ns.model_id,
                        codec=codec.name, codec_id=codec.codec_id)
        page = encode_page(meta, codec.encode(block))
        if len(page) > grant.capacity_bytes:
            raise CapacityError(f"page of {len(page)} bytes exceeds its "
                                f"{grant.capacity_bytes}-byte slot")
        maps.view(grant.region, grant.offset, len(page), writable=True)[:] = page

