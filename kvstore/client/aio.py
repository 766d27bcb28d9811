"""The asyncio client of the kvstore daemon."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
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


class AsyncClient:
    """The asyncio twin of :class:`kvstore.client.Client`; same arguments, same results.

    Page encoding, decoding and shared-memory copies run in worker threads so the caller's
    event loop keeps running. Use ``async with AsyncClient(...) as client`` or ``aclose()``.
    """

    def __init__(self, address: str | None = None, *, token: str | None = None,
                 retry: RetryPolicy | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_message_bytes: int = 256 << 20, zero_copy: bool | None = None) -> None:
        self._target = parse_address(address)
        self._channel = grpc.aio.insecure_channel(self._target.grpc_target,
                                                  options=channel_options(max_message_bytes))
        self._stub = pbg.KVStoreStub(self._channel)
        self._metadata = call_metadata(token)
        self._retry = retry or RetryPolicy()
        self._timeout_s = timeout_s
        self._chunk_bytes = chunk_limit(max_message_bytes)
        self._zero_copy = zero_copy
        self._arena_ok: bool | None = None  # auto mode: can this process map the arena?
        self._maps = ArenaMaps()
        self._cleanups: set[asyncio.Future[None]] = set()

    # ------------------------------------------------------------------------------ plumbing

    async def _call(self, attempt: Callable[[], Awaitable[T]]) -> T:
        delays = self._retry.delays()
        while True:
            try:
                return await attempt()
            except grpc.RpcError as err:
                delay = next(delays, None) if self._retry.should_retry(rpc_code(err)) else None
                if delay is None:
                    raise translate(err) from None
                await asyncio.sleep(delay)

    async def _unary(self, method: str, request):
        rpc = getattr(self._stub, method)
        return await self._call(
            lambda: rpc(request, timeout=self._timeout_s, metadata=self._metadata))

    async def _zero_copy_mode(self, requested: bool | None) -> tuple[bool, bool]:
        """(use shared memory, fail rather than fall back); see Client._zero_copy_mode."""
        choice = self._zero_copy if requested is None else requested
        if choice is not None:
            return choice, choice
        if self._arena_ok is None:
            usable = False
            if self._target.is_unix:
                arena = (await self.health()).arena_path
                usable = await asyncio.to_thread(self._maps.usable, arena)
            self._arena_ok = usable
        return self._arena_ok, False

    async def _give_back(self, reservation_id: str, write: asyncio.Future[None]) -> None:
        """Abort a reservation once its slot writer has stopped (see Client._give_back).

        The abort runs as its own task, shielded: a caller cancelled again meanwhile still
        leaves no reservation behind, and :meth:`aclose` waits for it.
        """
        cleanup = asyncio.ensure_future(self._abort_after(reservation_id, write))
        self._cleanups.add(cleanup)
        cleanup.add_done_callback(self._cleanups.discard)
        await asyncio.shield(cleanup)

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
                if strict:
                    raise InvalidArgument(f"zero-copy put needs the DRAM arena: {exc}") from exc
                self._arena_ok = False
        header, view = put_header(ns, tokens, kv)

        async def messages() -> AsyncIterator[pb.PutRequest]:
            for message in put_stream(header, view, self._chunk_bytes):
                yield message

        response = await self._call(lambda: self._stub.Put(
            messages(), timeout=self._timeout_s, metadata=self._metadata))
        return response.tokens_written

    async def _put_shared(self, ns: Namespace, tokens: Tokens, kv: torch.Tensor) -> int:
        ns.spec.check_kv(kv, num_tokens=len(tokens_to_bytes(tokens)) // 4)
        reservation = await self.reserve(ns, tokens)
        write = asyncio.ensure_future(
            asyncio.to_thread(write_reservation, self._maps, ns, kv, reservation))
        committing = False
        try:
            await asyncio.shield(write)
            committing = True
            return await self.commit(reservation.reservation_id)
        except BaseException as exc:
            if must_abort(exc, committing):
                await self._give_back(reservation.reservation_id, write)
            raise

    async def get(self, ns: Namespace, tokens: Tokens, *, zero_copy: bool | None = None
                  ) -> torch.Tensor | None:
        """The K/V of the longest stored prefix of ``tokens``, or None if nothing matched."""
        use, strict = await self._zero_copy_mode(zero_copy)
        if use:
            try:
                return await self._get_shared(ns, tokens)
            except (OSError, LeaseNotFound) as exc:
                if strict:
                    raise InvalidArgument(f"zero-copy get failed: {exc}") from exc
                if isinstance(exc, OSError):
                    self._arena_ok = False
        request = pb.GetRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens))
        return await self._call(lambda: self._get_stream(request))

    async def _get_stream(self, request: pb.GetRequest) -> torch.Tensor | None:
        assembler = GetAssembler()
        call = self._stub.Get(request, timeout=self._timeout_s, metadata=self._metadata)
        async for message in call:
            assembler.add(message)
        return assembler.result()

    async def _get_shared(self, ns: Namespace, tokens: Tokens) -> torch.Tensor | None:
        lease = await self.acquire(ns, tokens)
        try:
            kv = await asyncio.to_thread(read_lease, self._maps, ns, lease)
        finally:
            # LeaseNotFound here means the lease expired mid-read (see Client._get_shared).
            await self.release(lease.lease_id)
        return kv

    # --------------------------------------------------------------------------- control path

    async def lookup(self, ns: Namespace, tokens: Tokens) -> LookupResult:
        request = pb.LookupRequest(namespace=namespace_to_proto(ns),
                                   tokens=tokens_to_bytes(tokens))
        return lookup_from_proto(await self._unary("Lookup", request))

    async def evict(self, *, tenant: str | None = None, model_id: str | None = None,
                    keys: Sequence[BlockKey] | None = None, everything: bool = False) -> int:
        request = pb.EvictRequest(tenant=tenant or "", model_id=model_id or "",
                                  keys=list(keys or ()), everything=everything)
        return (await self._unary("Evict", request)).num_blocks

    async def stats(self, tenant: str | None = None) -> StoreStats:
        response = await self._unary("Stats", pb.StatsRequest(tenant=tenant or ""))
        return stats_from_proto(response)

    async def list_blocks(self, *, tenant: str | None = None, model_id: str | None = None,
                          tier: str | None = None, limit: int = 1000) -> list[BlockInfo]:
        request = pb.ListBlocksRequest(tenant=tenant or "", model_id=model_id or "",
                                       tier=tier or "", limit=limit)
        response = await self._unary("ListBlocks", request)
        return [block_info_from_proto(b) for b in response.blocks]

    async def hint(self, ns: Namespace, tokens: Tokens, deadline_s: float) -> int:
        request = pb.HintRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens),
                                 deadline_s=deadline_s)
        return (await self._unary("Hint", request)).num_blocks

    async def health(self) -> HealthInfo:
        r = await self._unary("Health", pb.HealthRequest())
        return HealthInfo(status=r.status, version=r.version, uptime_s=r.uptime_s, pid=r.pid,
                          tenant=r.tenant, is_admin=r.is_admin, arena_path=r.arena_path)

    async def acquire(self, ns: Namespace, tokens: Tokens, lease_s: float | None = None
                      ) -> Lease:
        request = pb.AcquireRequest(namespace=namespace_to_proto(ns),
                                    tokens=tokens_to_bytes(tokens), lease_s=lease_s or 0.0)
        return lease_from_proto(await self._unary("Acquire", request))

    async def release(self, lease_id: str) -> None:
        await self._unary("Release", pb.ReleaseRequest(lease_id=lease_id))

    async def reserve(self, ns: Namespace, tokens: Tokens, lease_s: float | None = None
                      ) -> Reservation:
        request = pb.ReserveRequest(namespace=namespace_to_proto(ns),
                                    tokens=tokens_to_bytes(tokens), lease_s=lease_s or 0.0)
        return reservation_from_proto(await self._unary("Reserve", request))

    async def commit(self, reservation_id: str) -> int:
        request = pb.CommitRequest(reservation_id=reservation_id)
        return (await self._unary("Commit", request)).tokens_published

    async def abort(self, reservation_id: str) -> None:
        """Give a reservation's slots back unpublished; LeaseNotFound for an unknown id."""
        await self._unary("Abort", pb.AbortRequest(reservation_id=reservation_id))

    # ------------------------------------------------------------------------------ lifecycle

    async def aclose(self) -> None:
        if self._cleanups:  # aborts of interrupted puts still on their way
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        self._maps.close()
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
