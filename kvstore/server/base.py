"""What server and client share: error <-> status mapping, wire conversions, handler wrapping.

Every edge of the daemon translates the kvstore exception tree (``kvstore.errors``) to gRPC
statuses with :func:`status_for`, and names the exception class in the trailing metadata key
``kvstore-error`` so :func:`error_from_status` on the client side raises the same type.

Wire forms (see ``kvstore.proto``): tokens are little-endian uint32 bytes, block keys 16 raw
bytes, tensors raw bytes + dtype name + shape in the canonical layout.
"""

from __future__ import annotations

import array
import contextlib
import logging
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
import torch

from kvstore import errors
from kvstore.api import (
    COUNTER_NAMES,
    TIER_COUNTERS,
    BlockInfo,
    BlockLocation,
    Counters,
    Lease,
    LookupResult,
    Medium,
    Reservation,
    SlotGrant,
    StoreStats,
    TierStats,
)
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError, shown
from kvstore.keys import KEY_BYTES, BlockKey, Namespace, token_array
from kvstore.server import kvstore_pb2 as pb
from kvstore.spec import DTYPES, KVSpec

ERROR_METADATA_KEY = "kvstore-error"
DEFAULT_CHUNK_BYTES = 4 << 20  # streamed tensor chunk; big enough to amortise per-message cost
_MESSAGE_OVERHEAD_BYTES = 64 << 10  # room for the proto framing around a chunk
_log = logging.getLogger("kvstore.server")
_NATIVE_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"

# Most specific first: the first class in an exception's MRO found here decides its status.
_STATUS_BY_ERROR: dict[type[KVStoreError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.CodecError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.CorruptPage: grpc.StatusCode.DATA_LOSS,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.AlreadyRunning: grpc.StatusCode.FAILED_PRECONDITION,
}
_ERROR_BY_STATUS: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.CapacityError,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.DATA_LOSS: errors.CorruptPage,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
}


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status a kvstore exception maps to; INTERNAL for anything unexpected."""
    for cls in type(exc).__mro__:
        code = _STATUS_BY_ERROR.get(cls)  # type: ignore[arg-type]
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def error_from_status(
    code: grpc.StatusCode, details: str, metadata: Sequence[tuple[str, Any]] | None = None
) -> KVStoreError:
    """The kvstore exception for a failed call: the class the server named, else by status."""
    named = next((str(v) for k, v in metadata or () if k == ERROR_METADATA_KEY), None)
    cls = getattr(errors, named, None) if named else None
    if not (isinstance(cls, type) and issubclass(cls, KVStoreError)):
        cls = _ERROR_BY_STATUS.get(code, KVStoreError)
    if cls is KVStoreError:
        return KVStoreError(f"{code.name}: {details}")
    return cls(details or code.name)


def error_metadata(exc: KVStoreError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that names the exception class for the client."""
    return ((ERROR_METADATA_KEY, type(exc).__name__),)


def chunk_limit(max_message_bytes: int) -> int:
    """The largest tensor chunk that fits in one message under ``max_message_bytes``."""
    return max(64 << 10, min(DEFAULT_CHUNK_BYTES, max_message_bytes - _MESSAGE_OVERHEAD_BYTES))


# ---------------------------------------------------------------------------------- wrapping

Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    unary: Callable[[Behavior], Behavior],
    streaming: Callable[[Behavior], Behavior],
) -> grpc.RpcMethodHandler:
    """A copy of ``handler`` whose behavior is wrapped: ``unary`` wraps coroutine behaviors
    (unary responses), ``streaming`` wraps async-generator behaviors (streamed responses)."""
    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kw)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kw)


class HandlerInterceptor(grpc.aio.ServerInterceptor, ABC):
    """An interceptor that wraps each method's behavior; the wrapped handler is built once per
    method and reused, since a method's handler never changes (this keeps per-call overhead
    to the wrappers themselves)."""

    def __init__(self) -> None:
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    @abstractmethod
    def wrap_unary(self, method: str, behavior: Behavior) -> Behavior:
        """Wrap a coroutine behavior (unary response) of ``method``."""

    @abstractmethod
    def wrap_streaming(self, method: str, behavior: Behavior) -> Behavior:
        """Wrap an async-generator behavior (streamed response) of ``method``."""

    async def intercept_service(self, continuation, handler_call_details):
        full_method = handler_call_details.method
        wrapped = self._handlers.get(full_method)
        if wrapped is None:
            handler = await continuation(handler_call_details)
            if handler is None:
                return None
            name = method_name(full_method)
            wrapped = wrap_handler(handler, lambda b: self.wrap_unary(name, b),
                                   lambda b: self.wrap_streaming(name, b))
            self._handlers[full_method] = wrapped
        return wrapped


def method_name(full_method: str) -> str:
    """``/kvstore.v1.KVStore/Lookup`` -> ``Lookup``."""
    return full_method.rsplit("/", 1)[-1]


# ------------------------------------------------------------------------- value conversions


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> bytes:
    """Validated token ids as little-endian uint32 bytes."""
    if isinstance(tokens, (list, tuple)) and tokens and _NATIVE_U32:
        # array("I") converts and range-checks in C: ten times faster than numpy on a list,
        # which is what engines hold. Anything it refuses gets token_array's precise error.
        with contextlib.suppress(TypeError, OverflowError):
            return array.array("I", tokens).tobytes()
    return token_array(tokens).tobytes()


def tokens_from_bytes(data: bytes) -> np.ndarray:
    """Token ids from their wire form; InvalidArgument if the length is not a multiple of 4."""
    if len(data) == 0:
        raise InvalidArgument("tokens is empty")
    if len(data) % 4:
        raise InvalidArgument(
            f"tokens must be little-endian uint32 (a multiple of 4 bytes), got {len(data)} bytes"
        )
    return np.frombuffer(data, dtype="<u4")


def key_from_bytes(raw: bytes, what: str = "block key") -> BlockKey:
    if len(raw) != KEY_BYTES:
        raise InvalidArgument(f"malformed {what}: {len(raw)} bytes, expected {KEY_BYTES}")
    return BlockKey(bytes(raw))


def spec_to_proto(spec: KVSpec) -> pb.KVSpec:
    return pb.KVSpec(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                     head_dim=spec.head_dim, block_tokens=spec.block_tokens, dtype=spec.dtype,
                     position_scheme=spec.position_scheme)


def spec_from_proto(msg: pb.KVSpec) -> KVSpec:
    return KVSpec(num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads,
                  head_dim=msg.head_dim, block_tokens=msg.block_tokens,
                  dtype=msg.dtype or "bfloat16", position_scheme=msg.position_scheme or "rope")


def namespace_to_proto(ns: Namespace) -> pb.Namespace:
    return pb.Namespace(model_id=ns.model_id, revision=ns.revision, adapter_id=ns.adapter_id,
                        tenant=ns.tenant, spec=spec_to_proto(ns.spec), tp_rank=ns.tp_rank,
                        tp_size=ns.tp_size, extra_salt=ns.extra_salt)


def namespace_from_proto(msg: pb.Namespace) -> Namespace:
    """A validated Namespace; InvalidArgument names the missing or malformed field."""
    if not msg.HasField("spec"):
        raise InvalidArgument("namespace.spec is required")
    return Namespace(model_id=msg.model_id, spec=spec_from_proto(msg.spec),
                     revision=msg.revision, adapter_id=msg.adapter_id, tenant=msg.tenant,
                     tp_rank=msg.tp_rank, tp_size=msg.tp_size, extra_salt=msg.extra_salt)


# ------------------------------------------------------------------------------------ tensors


def tensor_header(kv: torch.Tensor) -> pb.TensorHeader:
    return pb.TensorHeader(dtype=str(kv.dtype).removeprefix("torch."), shape=list(kv.shape),
                           total_bytes=kv.numel() * kv.element_size())


def expected_tensor(spec: KVSpec, num_tokens: int, header: pb.TensorHeader) -> int:
    """Check a declared tensor against the spec and token count; return its byte size."""
    if header.dtype not in DTYPES:
        raise InvalidArgument(f"unknown tensor dtype {shown(header.dtype)}; expected one of "
                              f"{sorted(DTYPES)}")
    if header.dtype != spec.dtype:
        raise InvalidArgument(f"kv dtype is {shown(header.dtype)}, the namespace spec says {spec.dtype}")
    expected = spec.shape(num_tokens)
    if tuple(header.shape) != expected:
        raise InvalidArgument(f"kv shape is {tuple(header.shape)}, expected {expected} for "
                              f"{num_tokens} tokens under the namespace spec")
    nbytes = num_tokens * spec.block_bytes // spec.block_tokens
    if header.total_bytes != nbytes:
        raise InvalidArgument(f"kv declares {header.total_bytes} bytes, its shape needs {nbytes}")
    return nbytes


def tensor_from_buffer(buf: bytearray, header: pb.TensorHeader) -> torch.Tensor:
    """A tensor viewing ``buf`` (no copy) with the header's dtype and shape."""
    dtype = DTYPES.get(header.dtype)
    if dtype is None:
        raise InvalidArgument(f"unknown tensor dtype {shown(header.dtype)}")
    numel = int(np.prod(header.shape)) if len(header.shape) else 1
    if numel * torch.empty((), dtype=dtype).element_size() != len(buf):
        raise InvalidArgument(f"tensor of shape {tuple(header.shape)} {shown(header.dtype)} does not "
                              f"match its {len(buf)} bytes")
    if not buf:
        return torch.empty(tuple(header.shape), dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(tuple(header.shape))


def tensor_view(kv: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor (copied only if it is not contiguous)."""
    flat = kv.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def iter_chunks(view: memoryview, chunk_bytes: int) -> Iterator[bytes]:
    for start in range(0, len(view), chunk_bytes):
        yield bytes(view[start : start + chunk_bytes])


class ChunkAssembler:
    """Collects streamed chunks into one preallocated buffer, refusing more than declared."""

    def __init__(self, total_bytes: int, max_bytes: int) -> None:
        if total_bytes > max_bytes:
            raise CapacityError(f"tensor of {total_bytes} bytes exceeds the {max_bytes}-byte "
                                "limit for one request")
        self.buffer = bytearray(total_bytes)
        self._view = memoryview(self.buffer)
        self.received = 0

    def add(self, chunk: bytes) -> None:
        end = self.received + len(chunk)
        if end > len(self.buffer):
            raise InvalidArgument(f"received more than the {len(self.buffer)} bytes declared")
        self._view[self.received : end] = chunk
        self.received = end

    def finish(self) -> bytearray:
        if self.received != len(self.buffer):
            raise InvalidArgument(f"stream ended after {self.received} of "
                                  f"{len(self.buffer)} declared bytes")
        self._view.release()
        return self.buffer


# ------------------------------------------------------------------------ store value types


def lookup_to_proto(result: LookupResult) -> pb.LookupResponse:
    return pb.LookupResponse(num_tokens=result.num_tokens, matched_tokens=result.matched_tokens,
                             tokens_per_tier=result.tokens_per_tier, keys=list(result.keys),
                             advised_tokens=result.advised_tokens)


def lookup_from_proto(msg: pb.LookupResponse) -> LookupResult:
    return LookupResult(num_tokens=msg.num_tokens, matched_tokens=msg.matched_tokens,
                        tokens_per_tier=dict(msg.tokens_per_tier),
                        keys=tuple(BlockKey(k) for k in msg.keys),
                        advised_tokens=(msg.advised_tokens if msg.HasField("advised_tokens")
                                        else None))


def block_info_to_proto(info: BlockInfo) -> pb.BlockInfo:
    return pb.BlockInfo(key=info.key, tenant=info.tenant, model_id=info.model_id,
                        tiers=list(info.tiers), size_bytes=info.size_bytes, age_s=info.age_s,
                        hits=info.hits, block_index=info.block_index, parent=info.parent or b"")


def block_info_from_proto(msg: pb.BlockInfo) -> BlockInfo:
    return BlockInfo(key=BlockKey(msg.key), tenant=msg.tenant, model_id=msg.model_id,
                     tiers=tuple(msg.tiers), size_bytes=msg.size_bytes, age_s=msg.age_s,
                     hits=msg.hits, block_index=msg.block_index,
                     parent=BlockKey(msg.parent) if msg.parent else None)




def stats_to_proto(stats: StoreStats) -> pb.StatsResponse:
    msg = pb.StatsResponse(counters=stats.counters.as_dict(), active_leases=stats.active_leases,
                           active_reservations=stats.active_reservations,
                           num_blocks=stats.num_blocks)
    for name, tier in stats.tiers.items():
        entry = msg.tiers[name]
        entry.name = tier.name
        for field in TIER_COUNTERS:
            setattr(entry, field, max(0, int(getattr(tier, field))))
        entry.extra.update({k: float(v) for k, v in tier.extra.items()})
    return msg


def stats_from_proto(msg: pb.StatsResponse) -> StoreStats:
    """StoreStats from the wire; counters this build does not know are dropped."""
    tiers = {
        name: TierStats(name=t.name or name, extra=dict(t.extra),
                        **{field: getattr(t, field) for field in TIER_COUNTERS})
        for name, t in msg.tiers.items()
    }
    counters = Counters(**{k: v for k, v in msg.counters.items() if k in COUNTER_NAMES})
    return StoreStats(tiers=tiers, counters=counters, active_leases=msg.active_leases,
                      active_reservations=msg.active_reservations, num_blocks=msg.num_blocks)


def medium_from_proto(name: str) -> Medium:
    """The Medium a location names; an empty name is a host arena (older daemons)."""
    try:
        return Medium(name or Medium.HOST)
    except ValueError:
        raise InvalidArgument(f"unknown memory medium {name[:32]!r}") from None


def lease_to_proto(lease: Lease) -> pb.AcquireResponse:
    blocks = [pb.BlockLocation(key=b.key, medium=b.medium.value, region=b.region,
                               offset=b.offset, length=b.length) for b in lease.blocks]
    return pb.AcquireResponse(lease_id=lease.lease_id, deadline=lease.deadline,
                              matched_tokens=lease.matched_tokens, blocks=blocks)


def lease_from_proto(msg: pb.AcquireResponse) -> Lease:
    blocks = tuple(BlockLocation(key=BlockKey(b.key), medium=medium_from_proto(b.medium),
                                 region=b.region, offset=b.offset, length=b.length)
                   for b in msg.blocks)
    return Lease(lease_id=msg.lease_id, deadline=msg.deadline,
                 matched_tokens=msg.matched_tokens, blocks=blocks)


def reservation_to_proto(reservation: Reservation) -> pb.ReserveResponse:
    blocks = [pb.SlotGrant(key=g.key, block_index=g.block_index, parent=g.parent or b"",
                           medium=g.medium.value, region=g.region, offset=g.offset,
                           capacity_bytes=g.capacity_bytes) for g in reservation.blocks]
    return pb.ReserveResponse(reservation_id=reservation.reservation_id,
                              deadline=reservation.deadline, codec=reservation.codec,
                              blocks=blocks)


def reservation_from_proto(msg: pb.ReserveResponse) -> Reservation:
    blocks = tuple(SlotGrant(key=BlockKey(g.key), block_index=g.block_index,
                             parent=BlockKey(g.parent) if g.parent else None,
                             medium=medium_from_proto(g.medium), region=g.region,
                             offset=g.offset,
                             capacity_bytes=g.capacity_bytes) for g in msg.blocks)
    return Reservation(reservation_id=msg.reservation_id, deadline=msg.deadline,
                       codec=msg.codec, blocks=blocks)


# ------------------------------------------------------------------------------ error edge


# Failures an operator should see in the log; the rest are a client's own mistakes (DEBUG).
_NOTEWORTHY = frozenset({grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


class ErrorInterceptor(HandlerInterceptor):
    """Turns exceptions escaping a handler into statuses; the innermost interceptor.

    kvstore exceptions become their status (:func:`status_for`) with the class named in the
    trailing metadata; anything else is logged with its traceback and becomes INTERNAL, and the
    daemon keeps serving.
    """

    async def _abort(self, context: grpc.aio.ServicerContext, method: str, exc: Exception):
        if isinstance(exc, KVStoreError):
            code, meta = status_for(exc), error_metadata(exc)
            _log.log(logging.WARNING if code in _NOTEWORTHY else logging.DEBUG,
                     "%s failed: %s", method, exc,
                     extra={"rpc": method, "code": code.name, "error": type(exc).__name__})
            await context.abort(code, str(exc) or type(exc).__name__, trailing_metadata=meta)
        _log.error("%s raised unexpectedly", method, exc_info=exc, extra={"rpc": method})
        await context.abort(grpc.StatusCode.INTERNAL,
                            f"internal error in {method}: {type(exc).__name__}: {exc}")

    def wrap_unary(self, method: str, behavior: Behavior) -> Behavior:
        async def run(request, context):
            try:
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - this is the edge; nothing escapes
                await self._abort(context, method, exc)

        return run

    def wrap_streaming(self, method: str, behavior: Behavior) -> Behavior:
        async def run(request, context):
            try:
                async for response in behavior(request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - this is the edge; nothing escapes
                await self._abort(context, method, exc)

        return run
