"""Value types <-> their proto messages (see ``kvstore.proto`` for the wire conventions).

Tokens are little-endian uint32 bytes, block keys 16 raw bytes. ``*_from_proto`` functions that
read what a client sent validate it and raise InvalidArgument naming the field.
"""

from __future__ import annotations

import array
import contextlib
import json
import struct
import sys
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from kvstore.api import (
    COUNTER_NAMES,
    TIER_COUNTERS,
    BlockInfo,
    BlockLocation,
    BlockLocations,
    Counters,
    HealthInfo,
    KVEvent,
    KVEventBatch,
    KVEventKind,
    Lease,
    LookupResult,
    Medium,
    ModelProfile,
    PinInfo,
    Reservation,
    SlotGrant,
    SlotGrants,
    StoreStats,
    TierStats,
)
from kvstore.errors import InvalidArgument, shown
from kvstore.groups import CacheSpec
from kvstore.keys import KEY_BYTES, MAX_NAME_CHARS, BlockKey, Namespace, token_array
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.spec import KVSpec

_NATIVE_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> bytes:
    """Validated token ids as little-endian uint32 bytes."""
    if isinstance(tokens, (list, tuple)) and tokens and _NATIVE_U32:
        # array("I") converts and range-checks in C: ten times faster than numpy on a list,
        # which is what engines hold. Anything it refuses gets token_array's precise error.
        with contextlib.suppress(TypeError, OverflowError):
            return array.array("I", tokens).tobytes()
    return token_array(tokens).tobytes()


def tokens_from_bytes(data: bytes, max_tokens: int | None = None) -> np.ndarray:
    """Token ids from their wire form (no copy).

    Raises:
        InvalidArgument: empty, not a multiple of 4 bytes, or more than ``max_tokens`` tokens
            (checked before anything else looks at them).
    """
    if len(data) == 0:
        raise InvalidArgument("tokens is empty")
    if len(data) % 4:
        raise InvalidArgument(
            f"tokens must be little-endian uint32 (a multiple of 4 bytes), got {len(data)} bytes"
        )
    if max_tokens is not None and len(data) // 4 > max_tokens:
        raise InvalidArgument(f"{len(data) // 4} tokens in one request exceed the cap of "
                              f"{max_tokens} (server.max_request_tokens)")
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
    """A validated KVSpec; InvalidArgument names the field."""
    if len(msg.position_scheme) > MAX_NAME_CHARS:  # part of every key and page: keep it small
        raise InvalidArgument(f"KVSpec.position_scheme must be at most {MAX_NAME_CHARS} "
                              "characters")
    return KVSpec(num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads,
                  head_dim=msg.head_dim, block_tokens=msg.block_tokens,
                  dtype=msg.dtype or "bfloat16", position_scheme=msg.position_scheme or "rope")


def namespace_to_proto(ns: Namespace) -> pb.Namespace:
    if isinstance(ns.spec, CacheSpec):
        cache = json.dumps(ns.spec.to_dict(), separators=(",", ":")).encode()
        return pb.Namespace(model_id=ns.model_id, revision=ns.revision,
                            adapter_id=ns.adapter_id, tenant=ns.tenant, tp_rank=ns.tp_rank,
                            tp_size=ns.tp_size, extra_salt=ns.extra_salt, cache_spec=cache)
    return pb.Namespace(model_id=ns.model_id, revision=ns.revision, adapter_id=ns.adapter_id,
                        tenant=ns.tenant, spec=spec_to_proto(ns.spec), tp_rank=ns.tp_rank,
                        tp_size=ns.tp_size, extra_salt=ns.extra_salt)


MAX_CACHE_SPEC_BYTES = 64 * 1024  # a cache of MAX_GROUPS groups of MAX_PARTS parts fits


def cache_spec_from_wire(data: bytes) -> CacheSpec:
    """A validated CacheSpec from a Namespace's ``cache_spec``; InvalidArgument names the fault."""
    if len(data) > MAX_CACHE_SPEC_BYTES:
        raise InvalidArgument(f"namespace.cache_spec is {len(data)} bytes, over "
                              f"{MAX_CACHE_SPEC_BYTES}")
    try:
        parsed = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"namespace.cache_spec is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidArgument("namespace.cache_spec must be a JSON object")
    spec = CacheSpec.from_dict(parsed)
    if len(spec.position_scheme) > MAX_NAME_CHARS:
        raise InvalidArgument(f"CacheSpec.position_scheme must be at most {MAX_NAME_CHARS} "
                              "characters")
    return spec


# Namespaces a daemon has built from the wire, by their serialised message: building one
# (validation, its fingerprint's canonical JSON and hash) cost 28 us on the 2-core box
# (2026-12-01), a tenth of a small Lookup's own work; a daemon sees a handful of namespaces.
_NAMESPACES: dict[bytes, Namespace] = {}
_MAX_CACHED_NAMESPACES = 256


def namespace_from_proto(msg: pb.Namespace) -> Namespace:
    """A validated Namespace; InvalidArgument names the missing or malformed field.

    Namespaces already built from the same message are reused (they are immutable); one that
    fails validation is never remembered.
    """
    wire = msg.SerializeToString(deterministic=True)
    ns = _NAMESPACES.get(wire)
    if ns is None:
        ns = _namespace_from_proto(msg)
        if len(_NAMESPACES) >= _MAX_CACHED_NAMESPACES:
            _NAMESPACES.pop(next(iter(_NAMESPACES)), None)  # the oldest
        _NAMESPACES[wire] = ns
    return ns


def _namespace_from_proto(msg: pb.Namespace) -> Namespace:
    if msg.cache_spec:
        if msg.HasField("spec"):
            raise InvalidArgument("namespace carries both spec and cache_spec")
        spec: KVSpec | CacheSpec = cache_spec_from_wire(msg.cache_spec)
    elif not msg.HasField("spec"):
        raise InvalidArgument("namespace.spec is required")
    else:
        spec = spec_from_proto(msg.spec)
    return Namespace(model_id=msg.model_id, spec=spec,
                     revision=msg.revision, adapter_id=msg.adapter_id, tenant=msg.tenant,
                     tp_rank=msg.tp_rank, tp_size=msg.tp_size, extra_salt=msg.extra_salt)


def lookup_to_proto(result: LookupResult, packed: bool = False,
                    packed_keys: bytes | None = None) -> pb.LookupResponse:
    """The reply to a Lookup; ``packed``: the keys as one bytes field (the request asked),
    ``packed_keys`` where the caller joined them already."""
    if packed:
        keys = {"packed_keys": b"".join(result.keys) if packed_keys is None else packed_keys}
    else:
        keys = {"keys": list(result.keys)}
    return pb.LookupResponse(num_tokens=result.num_tokens, matched_tokens=result.matched_tokens,
                             tokens_per_tier=result.tokens_per_tier,
                             advised_tokens=result.advised_tokens,
                             cluster_tokens=result.cluster_tokens, **keys)


def lookup_from_proto(msg: pb.LookupResponse) -> LookupResult:
    """A Lookup reply, its keys packed (a daemon that was asked) or not (an older daemon).

    Raises:
        InvalidArgument: packed keys that are not whole 16-byte keys, or both forms at once.
    """
    if msg.packed_keys:
        if msg.keys:
            raise InvalidArgument("a Lookup reply carries keys and packed_keys")
        keys = split_keys(msg.packed_keys, "Lookup reply packed_keys")
    else:
        keys = tuple(msg.keys)  # BlockKey is bytes: no call per key
    return LookupResult(num_tokens=msg.num_tokens, matched_tokens=msg.matched_tokens,
                        tokens_per_tier=dict(msg.tokens_per_tier), keys=keys,
                        advised_tokens=(msg.advised_tokens if msg.HasField("advised_tokens")
                                        else None),
                        cluster_tokens=dict(msg.cluster_tokens))


@lru_cache(maxsize=64)
def _key_struct(num_keys: int) -> struct.Struct:
    return struct.Struct(f"{KEY_BYTES}s" * num_keys)


def split_keys(packed: bytes, what: str = "packed keys") -> tuple[BlockKey, ...]:
    """16-byte keys laid end to end, as a tuple of keys: split in C (one struct unpack), no
    Python code per key. InvalidArgument if ``packed`` is not whole keys."""
    if len(packed) % KEY_BYTES:
        raise InvalidArgument(f"malformed {what}: {len(packed)} bytes is not a whole number of "
                              f"{KEY_BYTES}-byte keys")
    return _key_struct(len(packed) // KEY_BYTES).unpack(packed)  # type: ignore[return-value]


def block_info_to_proto(info: BlockInfo) -> pb.BlockInfo:
    return pb.BlockInfo(key=info.key, tenant=info.tenant, model_id=info.model_id,
                        tiers=list(info.tiers), size_bytes=info.size_bytes, age_s=info.age_s,
                        hits=info.hits, block_index=info.block_index, parent=info.parent or b"")


def block_info_from_proto(msg: pb.BlockInfo) -> BlockInfo:
    return BlockInfo(key=BlockKey(msg.key), tenant=msg.tenant, model_id=msg.model_id,
                     tiers=tuple(msg.tiers), size_bytes=msg.size_bytes, age_s=msg.age_s,
                     hits=msg.hits, block_index=msg.block_index,
                     parent=BlockKey(msg.parent) if msg.parent else None)


def pin_info_to_proto(info: PinInfo) -> pb.PinInfo:
    return pb.PinInfo(tenant=info.tenant, model_id=info.model_id, key=info.key,
                      num_blocks=info.num_blocks, size_bytes=info.size_bytes,
                      expires_in_s=info.expires_in_s)


def pin_info_from_proto(msg: pb.PinInfo) -> PinInfo:
    return PinInfo(tenant=msg.tenant, model_id=msg.model_id, key=BlockKey(msg.key),
                   num_blocks=msg.num_blocks, size_bytes=msg.size_bytes,
                   expires_in_s=msg.expires_in_s)


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
        raise InvalidArgument(f"unknown memory medium {shown(name, 32)}") from None


def _table_to_proto(blocks: BlockLocations | SlotGrants) -> pb.BlockTable:
    msg = pb.BlockTable(medium=blocks.medium.value, regions=list(blocks.regions),
                        keys=blocks.keys, region_index=blocks.region_index.astype("<u4").tobytes(),
                        offsets=blocks.offsets.astype("<u8").tobytes(),
                        lengths=blocks.lengths.astype("<u8").tobytes())
    if isinstance(blocks, SlotGrants):
        msg.block_index = blocks.block_index.astype("<u4").tobytes()
        msg.parents = blocks.parents
    return msg


def _array(data: bytes, dtype: str, n: int, field: str) -> np.ndarray:
    """``n`` little-endian entries of a BlockTable field; InvalidArgument names the field."""
    width = np.dtype(dtype).itemsize
    if len(data) != n * width:
        raise InvalidArgument(f"BlockTable.{field} holds {len(data)} bytes for {n} blocks "
                              f"of {width} bytes")
    return np.frombuffer(data, dtype=dtype)


def _table_from_proto(msg: pb.BlockTable, grants: bool) -> BlockLocations | SlotGrants:
    keys = msg.keys
    if len(keys) % KEY_BYTES:
        raise InvalidArgument(f"BlockTable.keys holds {len(keys)} bytes, not {KEY_BYTES} a "
                              "block")
    n = len(keys) // KEY_BYTES
    fields = (keys, medium_from_proto(msg.medium), list(msg.regions),
              _array(msg.region_index, "<u4", n, "region_index"),
              _array(msg.offsets, "<u8", n, "offsets"), _array(msg.lengths, "<u8", n, "lengths"))
    if not grants:
        return BlockLocations(*fields)
    if len(msg.parents) != n * KEY_BYTES:
        raise InvalidArgument(f"BlockTable.parents holds {len(msg.parents)} bytes for {n} "
                              "blocks")
    return SlotGrants(*fields, _array(msg.block_index, "<u4", n, "block_index"), msg.parents)


def lease_to_proto(lease: Lease, packed: bool = False) -> pb.AcquireResponse:
    """The reply to an Acquire; ``packed``: the blocks as one BlockTable (the request asked)."""
    msg = pb.AcquireResponse(lease_id=lease.lease_id, deadline=lease.deadline,
                             matched_tokens=lease.matched_tokens, codec=lease.codec,
                             tier=lease.tier)
    if packed:
        msg.table.CopyFrom(_table_to_proto(lease.blocks))
    else:
        msg.blocks.extend(pb.BlockLocation(key=b.key, medium=b.medium.value, region=b.region,
                                           offset=b.offset, length=b.length)
                          for b in lease.blocks)
    return msg


def lease_from_proto(msg: pb.AcquireResponse) -> Lease:
    """A Lease from either form of the reply (a table, or a message per block)."""
    if msg.HasField("table"):
        blocks = _table_from_proto(msg.table, grants=False)
    else:
        blocks = BlockLocations.of(
            BlockLocation(key=BlockKey(b.key), medium=medium_from_proto(b.medium),
                          region=b.region, offset=b.offset, length=b.length)
            for b in msg.blocks)
    return Lease(lease_id=msg.lease_id, deadline=msg.deadline,
                 matched_tokens=msg.matched_tokens, blocks=blocks, codec=msg.codec,
                 tier=msg.tier)


def reservation_to_proto(reservation: Reservation, packed: bool = False) -> pb.ReserveResponse:
    """The reply to a Reserve; ``packed``: the slots as one BlockTable (the request asked)."""
    msg = pb.ReserveResponse(reservation_id=reservation.reservation_id,
                             deadline=reservation.deadline, codec=reservation.codec,
                             sealed=reservation.sealed)
    if packed:
        msg.table.CopyFrom(_table_to_proto(reservation.blocks))
    else:
        msg.blocks.extend(pb.SlotGrant(key=g.key, block_index=g.block_index,
                                       parent=g.parent or b"", medium=g.medium.value,
                                       region=g.region, offset=g.offset,
                                       capacity_bytes=g.capacity_bytes)
                          for g in reservation.blocks)
    return msg


def reservation_from_proto(msg: pb.ReserveResponse) -> Reservation:
    """A Reservation from either form of the reply (a table, or a message per slot)."""
    if msg.HasField("table"):
        blocks = _table_from_proto(msg.table, grants=True)
    else:
        blocks = SlotGrants.of(
            SlotGrant(key=BlockKey(g.key), block_index=g.block_index,
                      parent=BlockKey(g.parent) if g.parent else None,
                      medium=medium_from_proto(g.medium), region=g.region, offset=g.offset,
                      capacity_bytes=g.capacity_bytes) for g in msg.blocks)
    return Reservation(reservation_id=msg.reservation_id, deadline=msg.deadline,
                       codec=msg.codec, blocks=blocks, sealed=msg.sealed)


def health_from_proto(msg: pb.HealthResponse) -> HealthInfo:
    return HealthInfo(status=msg.status, version=msg.version, uptime_s=msg.uptime_s,
                      pid=msg.pid, tenant=msg.tenant, is_admin=msg.is_admin,
                      arena_path=msg.arena_path, call_channel=msg.call_channel)


def profile_to_proto(profile: ModelProfile) -> pb.ModelProfile:
    return pb.ModelProfile(num_params=profile.num_params, num_layers=profile.num_layers,
                           hidden_size=profile.hidden_size, flops_per_s=profile.flops_per_s)


def profile_from_proto(msg: pb.ModelProfile) -> ModelProfile:
    """A validated ModelProfile; InvalidArgument if a field is missing or not positive."""
    return ModelProfile(num_params=msg.num_params, num_layers=msg.num_layers,
                        hidden_size=msg.hidden_size, flops_per_s=msg.flops_per_s)


_EVENT_KINDS = {pb.KV_EVENT_STORED: KVEventKind.STORED, pb.KV_EVENT_REMOVED: KVEventKind.REMOVED,
                pb.KV_EVENT_ALL_CLEARED: KVEventKind.ALL_CLEARED}


def event_from_proto(msg: pb.KVEvent) -> KVEvent:
    """A KVEvent; InvalidArgument naming the field for a kind this client does not know, a key
    that is not 16 bytes or tokens that are not whole uint32s."""
    kind = _EVENT_KINDS.get(msg.kind)
    if kind is None:
        raise InvalidArgument(f"unknown KV event kind {msg.kind} (a newer daemon?)")
    return KVEvent(
        kind=kind, keys=tuple(key_from_bytes(k, "event key") for k in msg.keys),
        parent=key_from_bytes(msg.parent, "event parent") if msg.parent else None,
        tokens=tokens_from_bytes(msg.tokens) if msg.tokens else None,
        block_tokens=msg.block_tokens, first_block_index=msg.first_block_index, tier=msg.tier,
        medium=msg.medium, tenant=msg.tenant, model_id=msg.model_id, namespace=msg.namespace)


def event_batch_from_proto(msg: pb.KVEventBatch) -> KVEventBatch:
    return KVEventBatch(seq=msg.seq, ts=msg.ts, host=msg.host, num_dropped=msg.num_dropped,
                        events=tuple(event_from_proto(e) for e in msg.events))
