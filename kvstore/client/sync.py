"""The blocking client of the kvstore daemon."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import grpc
import torch

from kvstore.api import BlockInfo, HealthInfo, Lease, LookupResult, Reservation, StoreStats
from kvstore.client.base import (
    DEFAULT_TIMEOUT_S,
    ArenaMaps,
    GetAssembler,
    RetryPolicy,
    Tokens,
    call_metadata,
    channel_options,
    must_abort,
    parse_address,
    put_header,
    put_stream,
    read_lease,
    rpc_code,
    write_reservation,
)
from kvstore.errors import InvalidArgument, KVStoreError, LeaseNotFound
from kvstore.keys import BlockKey, Namespace
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.convert import (
    block_info_from_proto,
    lease_from_proto,
    lookup_from_proto,
    namespace_to_proto,
    reservation_from_proto,
    stats_from_proto,
    tokens_to_bytes,
)
from kvstore.rpc.status import translate
from kvstore.rpc.tensors import chunk_limit

if TYPE_CHECKING:
    from typing import Self

T = TypeVar("T")


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
            sockets (falling back to streaming when the arena cannot be opened), True always
            (errors if impossible), False never. Each call can override it.
    """

    def __init__(self, address: str | None = None, *, token: str | None = None,
                 retry: RetryPolicy | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_message_bytes: int = 256 << 20, zero_copy: bool | None = None) -> None:
        self._target = parse_address(address)
        self._channel = grpc.insecure_channel(self._target.grpc_target,
                                              options=channel_options(max_message_bytes))
        self._stub = pbg.KVStoreStub(self._channel)
        self._metadata = call_metadata(token)
        self._retry = retry or RetryPolicy()
        self._timeout_s = timeout_s
        self._chunk_bytes = chunk_limit(max_message_bytes)
        self._zero_copy = zero_copy
        self._arena_ok: bool | None = None  # auto mode: can this process map the arena?
        self._maps = ArenaMaps()

    # ------------------------------------------------------------------------------ plumbing

    def _call(self, attempt: Callable[[], T]) -> T:
        delays = self._retry.delays()
        while True:
            try:
                return attempt()
            except grpc.RpcError as err:
                delay = next(delays, None) if self._retry.should_retry(rpc_code(err)) else None
                if delay is None:
                    raise translate(err) from None
                time.sleep(delay)

    def _unary(self, method: str, request):
        rpc = getattr(self._stub, method)
        return self._call(lambda: rpc(request, timeout=self._timeout_s, metadata=self._metadata))

    def _zero_copy_mode(self, requested: bool | None) -> tuple[bool, bool]:
        """(use shared memory, fail rather than fall back)."""
        choice = self._zero_copy if requested is None else requested
        if choice is not None:
            return choice, choice
        if self._arena_ok is None:
            self._arena_ok = self._target.is_unix and self._maps.usable(self.health().arena_path)
        return self._arena_ok, False

    def _give_back(self, reservation_id: str) -> None:
        """Abort a reservation now rather than leave its slots held until the deadline. Best
        effort: the error that stopped the put is what the caller sees."""
        with contextlib.suppress(KVStoreError):
            self.abort(reservation_id)

    # ------------------------------------------------------------------------------ data path

    def put(self, ns: Namespace, tokens: Tokens, kv: torch.Tensor, *,
            zero_copy: bool | None = None) -> int:
        """Store ``kv`` (canonical layout, one row per token) for ``tokens``.

        Returns:
            Tokens newly written (full blocks only).
        """
        use, strict = self._zero_copy_mode(zero_copy)
        if use:
            try:
                return self._put_shared(ns, tokens, kv)
            except OSError as exc:
                if strict:
                    raise InvalidArgument(f"zero-copy put needs the DRAM arena: {exc}") from exc
                self._arena_ok = False
        header, view = put_header(ns, tokens, kv)
        response = self._call(lambda: self._stub.Put(
            put_stream(header, view, self._chunk_bytes), timeout=self._timeout_s,
            metadata=self._metadata))
        return response.tokens_written

    def _put_shared(self, ns: Namespace, tokens: Tokens, kv: torch.Tensor) -> int:
        ns.spec.check_kv(kv, num_tokens=len(tokens_to_bytes(tokens)) // 4)
        reservation = self.reserve(ns, tokens)
        committing = False
        try:
            write_reservation(self._maps, ns, kv, reservation)
            committing = True
            return self.commit(reservation.reservation_id)
        except BaseException as exc:
            if must_abort(exc, committing):
                self._give_back(reservation.reservation_id)
            raise

    def get(self, ns: Namespace, tokens: Tokens, *, zero_copy: bool | None = None
            ) -> torch.Tensor | None:
        """The K/V of the longest stored prefix of ``tokens``, or None if nothing matched."""
        use, strict = self._zero_copy_mode(zero_copy)
        if use:
            try:
                return self._get_shared(ns, tokens)
            except (OSError, LeaseNotFound) as exc:
                if strict:
                    raise InvalidArgument(f"zero-copy get failed: {exc}") from exc
                if isinstance(exc, OSError):
                    self._arena_ok = False
        request = pb.GetRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens))
        return self._call(lambda: self._get_stream(request))

    def _get_stream(self, request: pb.GetRequest) -> torch.Tensor | None:
        assembler = GetAssembler()
        for message in self._stub.Get(request, timeout=self._timeout_s, metadata=self._metadata):
            assembler.add(message)
        return assembler.result()

    def _get_shared(self, ns: Namespace, tokens: Tokens) -> torch.Tensor | None:
        lease = self.acquire(ns, tokens)
        try:
            kv = read_lease(self._maps, ns, lease)
        finally:
            # LeaseNotFound here means the lease expired mid-read: the slots may have been
            # reused, so the caller falls back instead of trusting what was read.
            self.release(lease.lease_id)
        return kv

    # --------------------------------------------------------------------------- control path

    def lookup(self, ns: Namespace, tokens: Tokens) -> LookupResult:
        request = pb.LookupRequest(namespace=namespace_to_proto(ns),
                                   tokens=tokens_to_bytes(tokens))
        return lookup_from_proto(self._unary("Lookup", request))

    def evict(self, *, tenant: str | None = None, model_id: str | None = None,
              keys: Sequence[BlockKey] | None = None, everything: bool = False) -> int:
        """Remove blocks matching every given filter; returns how many were removed."""
        request = pb.EvictRequest(tenant=tenant or "", model_id=model_id or "",
                                  keys=list(keys or ()), everything=everything)
        return self._unary("Evict", request).num_blocks

    def stats(self, tenant: str | None = None) -> StoreStats:
        return stats_from_proto(self._unary("Stats", pb.StatsRequest(tenant=tenant or "")))

    def list_blocks(self, *, tenant: str | None = None, model_id: str | None = None,
                    tier: str | None = None, limit: int = 1000) -> list[BlockInfo]:
        request = pb.ListBlocksRequest(tenant=tenant or "", model_id=model_id or "",
                                       tier=tier or "", limit=limit)
        return [block_info_from_proto(b) for b in self._unary("ListBlocks", request).blocks]

    def hint(self, ns: Namespace, tokens: Tokens, deadline_s: float) -> int:
        """Announce a queued request; returns the blocks scheduled for promotion."""
        request = pb.HintRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens),
                                 deadline_s=deadline_s)
        return self._unary("Hint", request).num_blocks

    def health(self) -> HealthInfo:
        r = self._unary("Health", pb.HealthRequest())
        return HealthInfo(status=r.status, version=r.version, uptime_s=r.uptime_s, pid=r.pid,
                          tenant=r.tenant, is_admin=r.is_admin, arena_path=r.arena_path)

    def acquire(self, ns: Namespace, tokens: Tokens, lease_s: float | None = None) -> Lease:
        """Pin the matched prefix in the DRAM arena until :meth:`release` or the deadline."""
        request = pb.AcquireRequest(namespace=namespace_to_proto(ns),
                                    tokens=tokens_to_bytes(tokens), lease_s=lease_s or 0.0)
        return lease_from_proto(self._unary("Acquire", request))

    def release(self, lease_id: str) -> None:
        self._unary("Release", pb.ReleaseRequest(lease_id=lease_id))

    def reserve(self, ns: Namespace, tokens: Tokens, lease_s: float | None = None
                ) -> Reservation:
        """DRAM slots for the blocks of ``tokens`` not stored yet; publish with :meth:`commit`."""
        request = pb.ReserveRequest(namespace=namespace_to_proto(ns),
                                    tokens=tokens_to_bytes(tokens), lease_s=lease_s or 0.0)
        return reservation_from_proto(self._unary("Reserve", request))

    def commit(self, reservation_id: str) -> int:
        """Verify and publish the pages written into a reservation's slots.

        Returns:
            Tokens published.
        """
        request = pb.CommitRequest(reservation_id=reservation_id)
        return self._unary("Commit", request).tokens_published

    def abort(self, reservation_id: str) -> None:
        """Give a reservation's slots back unpublished, so its blocks can be written again at
        once. Raises LeaseNotFound for an id never issued or already committed, aborted or
        expired."""
        self._unary("Abort", pb.AbortRequest(reservation_id=reservation_id))

    # ------------------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        self._maps.close()
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
