"""Value types every edge shares: the store returns them, the wire carries them, clients hold them.

Nothing here knows the store, a tier implementation or gRPC: the store (``kvstore.store``), the
wire conversions (``kvstore.rpc``) and the clients (``kvstore.client``) all import this module and
nothing of each other.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES, BlockKey

MAX_LEASE_S = 3600.0  # a lease or reservation longer than this is a client bug, not a use case
MAX_CARRIED_RELEASES = 64  # leases one Acquire or Reserve may release first (their `release`)


class Medium(enum.StrEnum):
    """Which memory a slot tier lends slots from, so one lease type covers every slot tier."""

    HOST = "host"  # a tenant's shared-memory arena; ``region`` names it, its fd comes by fdpass
    DEVICE = "device"  # a GPU memory pool exported over CUDA IPC; ``region`` names the pool


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How much of a prompt's prefix is stored, and where.

    ``advised_tokens`` is the cost model's advice: the prefix worth fetching (the rest is cheaper
    to recompute). None means no advice: fetch everything matched.

    ``cluster_tokens`` is what other hosts hold past the match, in their local tiers, as the
    shared tier's directory says: host -> tokens in a row after ``matched_tokens``.
    """

    num_tokens: int  # tokens in the request
    matched_tokens: int  # longest stored prefix, a multiple of block_tokens
    tokens_per_tier: dict[str, int]  # matched tokens by the fastest tier holding each block
    keys: tuple[BlockKey, ...]  # matched block keys, in prefix order
    advised_tokens: int | None = None
    cluster_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_to_fetch(self) -> int:
        """Tokens a client should load: the advice if there is one, else the whole match."""
        return self.matched_tokens if self.advised_tokens is None else self.advised_tokens


@dataclass(frozen=True, slots=True)
class BlockLocation:
    """A stored page a same-host client reads in place, in a slot tier's memory."""

    key: BlockKey
    medium: Medium
    region: str  # the tenant's arena (HOST, see kvstore.rpc.descriptors) or pool name (DEVICE)
    offset: int  # bytes from the start of the region
    length: int  # page bytes


class _BlockTable(ABC):
    """The blocks of one lease or reservation as arrays, one entry per block: keys (16 bytes
    each), which of ``regions`` each lies in, its offset and length. Built once by whoever
    makes it (the store, the wire), read with numpy by the GPU path (one vectorised pass over
    hundreds of blocks) and as a sequence of per-block values by everyone else."""

    __slots__ = ("keys", "lengths", "medium", "offsets", "region_index", "regions")

    def __init__(self, keys: bytes, medium: Medium, regions: Sequence[str],
                 region_index: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
        n = len(offsets)
        self.keys = bytes(keys)
        self.medium = Medium(medium)
        self.regions = tuple(regions)
        self.region_index = np.ascontiguousarray(region_index, dtype=np.uint32)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.uint64)
        self.lengths = np.ascontiguousarray(lengths, dtype=np.uint64)
        if len(self.keys) != n * KEY_BYTES or len(self.region_index) != n or len(
                self.lengths) != n:
            raise InvalidArgument(f"a block table of {n} offsets has {len(self.keys)} key "
                                  f"bytes, {len(self.region_index)} region indices and "
                                  f"{len(self.lengths)} lengths")
        if n and int(self.region_index.max()) >= len(self.regions):
            raise InvalidArgument(f"a block table names region {int(self.region_index.max())} "
                                  f"of {len(self.regions)}")

    @staticmethod
    def _columns(items: list, what: str) -> tuple[bytes, Medium, list[str], list[int]]:
        """The keys, medium, region names and region index of ``items`` (one medium)."""
        regions: dict[str, int] = {}
        index = [regions.setdefault(x.region, len(regions)) for x in items]
        mediums = {Medium(x.medium) for x in items}
        if len(mediums) > 1:
            raise InvalidArgument(f"{what} lie in one medium, got "
                                  f"{sorted(m.value for m in mediums)}")
        return (b"".join(bytes(x.key) for x in items),
                mediums.pop() if mediums else Medium.HOST, list(regions), index)

    def __len__(self) -> int:
        return len(self.offsets)

    def key(self, i: int) -> BlockKey:
        return BlockKey(self.keys[i * KEY_BYTES:(i + 1) * KEY_BYTES])

    def region(self, i: int) -> str:
        return self.regions[int(self.region_index[i])]

    def _items(self) -> Iterator[object]:
        return (self._item(i) for i in range(len(self)))

    @abstractmethod
    def _item(self, i: int) -> object:
        """Entry ``i`` as its value type (``BlockLocation``, ``SlotGrant``)."""

    def __iter__(self) -> Iterator[object]:
        return self._items()

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self._item(j) for j in range(len(self))[i])
        if not -len(self) <= i < len(self):
            raise IndexError(f"block {i} of a table of {len(self)}")
        return self._item(i % len(self))

    def _fields(self) -> tuple:
        return (self.keys, self.medium, self.regions, self.region_index.tolist(),
                self.offsets.tolist(), self.lengths.tolist())

    def __eq__(self, other: object) -> bool:
        if type(other) is type(self):
            return self._fields() == other._fields()  # type: ignore[attr-defined]
        if isinstance(other, tuple):
            return tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


class BlockLocations(_BlockTable, Sequence["BlockLocation"]):
    """A lease's blocks (see ``_BlockTable``); items are ``BlockLocation`` values."""

    __slots__ = ()

    @classmethod
    def of(cls, blocks: Iterable[BlockLocation]) -> BlockLocations:
        if isinstance(blocks, BlockLocations):
            return blocks
        blocks = list(blocks)
        return cls(*cls._columns(blocks, "a lease's blocks"), [b.offset for b in blocks],
                   [b.length for b in blocks])

    def _item(self, i: int) -> BlockLocation:
        return BlockLocation(self.key(i), self.medium, self.region(i), int(self.offsets[i]),
                             int(self.lengths[i]))


class SlotGrants(_BlockTable, Sequence["SlotGrant"]):
    """A reservation's slots (see ``_BlockTable``; ``lengths`` are the slots' capacities),
    with each block's position in the prefix and its parent (16 zero bytes for the first
    block); items are ``SlotGrant`` values."""

    __slots__ = ("block_index", "parents")

    def __init__(self, keys: bytes, medium: Medium, regions: Sequence[str],
                 region_index: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                 block_index: np.ndarray, parents: bytes) -> None:
        super().__init__(keys, medium, regions, region_index, offsets, lengths)
        self.block_index = np.ascontiguousarray(block_index, dtype=np.uint32)
        self.parents = bytes(parents)
        if len(self.block_index) != len(self) or len(self.parents) != len(self) * KEY_BYTES:
            raise InvalidArgument(f"a slot table of {len(self)} slots has "
                                  f"{len(self.block_index)} block indices and "
                                  f"{len(self.parents)} parent bytes")

    @classmethod
    def of(cls, grants: Iterable[SlotGrant]) -> SlotGrants:
        if isinstance(grants, SlotGrants):
            return grants
        grants = list(grants)
        return cls(*cls._columns(grants, "a reservation's slots"), [g.offset for g in grants],
                   [g.capacity_bytes for g in grants],
                   [g.block_index for g in grants],
                   b"".join(bytes(g.parent) if g.parent else bytes(KEY_BYTES) for g in grants))

    def parent(self, i: int) -> BlockKey | None:
        if int(self.block_index[i]) == 0:
            return None
        return BlockKey(self.parents[i * KEY_BYTES:(i + 1) * KEY_BYTES])

    def _item(self, i: int) -> SlotGrant:
        return SlotGrant(self.key(i), int(self.block_index[i]), self.parent(i), self.medium,
                         self.region(i), int(self.offsets[i]), int(self.lengths[i]))

    def _fields(self) -> tuple:
        return (*super()._fields(), self.block_index.tolist(), self.parents)


@dataclass(frozen=True, slots=True)
class Lease:
    """Pinned blocks of a prefix; they stay where ``blocks`` say until release or the deadline.

    ``blocks`` is a ``BlockLocations`` (a tuple of ``BlockLocation`` given here becomes one)."""

    lease_id: str
    deadline: float  # time.time() after which the store reclaims the pins
    matched_tokens: int
    blocks: BlockLocations
    codec: str = ""  # the codec chain of the leased pages (one slot tier, one codec)
    tier: str = ""  # the name of the tier whose slots hold them

    def __post_init__(self) -> None:
        if not isinstance(self.blocks, BlockLocations):
            object.__setattr__(self, "blocks", BlockLocations.of(self.blocks))


@dataclass(frozen=True, slots=True)
class SlotGrant:
    """A slot a client may write one encoded page into before ``commit``."""

    key: BlockKey
    block_index: int
    parent: BlockKey | None
    medium: Medium
    region: str  # as in BlockLocation
    offset: int
    capacity_bytes: int  # the page written must not be longer


@dataclass(frozen=True, slots=True)
class Reservation:
    """Slots for the blocks of a prefix not stored yet. ``blocks`` is a ``SlotGrants`` (a
    tuple of ``SlotGrant`` given here becomes one)."""

    reservation_id: str
    deadline: float
    codec: str  # the codec chain pages written into the slots must use
    blocks: SlotGrants
    # The commit computes the pages' checksums on its own copy (host slots of this daemon):
    # a writer need not hash what it writes and may leave them zero.
    sealed: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.blocks, SlotGrants):
            object.__setattr__(self, "blocks", SlotGrants.of(self.blocks))


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """A listing row for ``kvstore ls``."""

    key: BlockKey
    tenant: str
    model_id: str
    tiers: tuple[str, ...]
    size_bytes: int
    age_s: float
    hits: int
    block_index: int
    parent: BlockKey | None


@dataclass(frozen=True, slots=True)
class PinInfo:
    """A TTL pin: a tenant's stored prefix kept in the cache until ``expires_in_s`` runs out
    (``kvstore.store.pins``)."""

    tenant: str
    model_id: str
    key: BlockKey  # the prefix's last block: its key names the whole prefix
    num_blocks: int  # blocks of the prefix that were stored when it was pinned
    size_bytes: int  # bytes those blocks take in every tier holding them now
    expires_in_s: float


@dataclass(slots=True)
class TierStats:
    """Counters of one tier; ``used_bytes`` and ``num_blocks`` are current values."""

    name: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    num_blocks: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # pages removed to make room (demoted or dropped)
    corrupt: int = 0  # pages that failed verification on read and were removed
    rejected: int = 0  # writes refused (page larger than a slot, full)
    bytes_read: int = 0
    bytes_written: int = 0
    extra: dict[str, float] = field(default_factory=dict)  # tier-specific gauges

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {f.name: getattr(self, f.name)
                                  for f in dataclasses.fields(self) if f.name != "extra"}
        out.update(self.extra)
        return out


TIER_COUNTERS = tuple(f.name for f in dataclasses.fields(TierStats)
                      if f.name not in ("name", "extra"))


@dataclass(slots=True)
class Counters:
    """Request counters, kept in total and per tenant."""

    lookups: int = 0
    lookup_hit_tokens: int = 0
    lookup_miss_tokens: int = 0
    puts: int = 0
    put_tokens: int = 0
    gets: int = 0
    get_tokens: int = 0
    demotions: int = 0
    promotions: int = 0
    dropped: int = 0  # blocks that left the last tier holding them
    hint_blocks: int = 0  # blocks hints scheduled for promotion (those that could arrive in time)
    hint_skipped: int = 0  # blocks hints left alone: they could not arrive before the deadline
    hint_landed: int = 0  # scheduled blocks in the fastest tier before their deadline
    hint_late: int = 0  # scheduled blocks that did not land before the deadline
    hint_cancelled: int = 0  # scheduled blocks not moved: their request arrived or was dropped

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def add(self, **deltas: int) -> None:
        for name, delta in deltas.items():
            setattr(self, name, getattr(self, name) + delta)


COUNTER_NAMES = tuple(f.name for f in dataclasses.fields(Counters))


@dataclass(slots=True)
class StoreStats:
    tiers: dict[str, TierStats]  # by tier name, fastest first
    counters: Counters
    active_leases: int = 0
    active_reservations: int = 0
    num_blocks: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "tiers": {name: s.as_dict() for name, s in self.tiers.items()},
            **self.counters.as_dict(),
            "active_leases": self.active_leases,
            "active_reservations": self.active_reservations,
            "num_blocks": self.num_blocks,
        }


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """What prefill costs for one model: its shape and the FLOP rate the engine achieves."""

    num_params: float  # weights (a 7-8B model: ~8e9)
    num_layers: int
    hidden_size: int
    flops_per_s: float  # achieved during prefill (an H200 at bf16 reaches ~4e14-6e14)

    def __post_init__(self) -> None:
        values = (self.num_params, self.num_layers, self.hidden_size, self.flops_per_s)
        if not all(math.isfinite(v) and v > 0 for v in values):
            raise InvalidArgument("a model profile needs positive, finite params, layers, "
                                  f"hidden size and FLOP rate, got {values}")


@dataclass(frozen=True, slots=True)
class HealthInfo:
    """What Health reports."""

    status: str  # "SERVING" or "DRAINING"
    version: str
    uptime_s: float
    pid: int
    tenant: str  # the caller's tenant; "" for the admin or local trust
    is_admin: bool
    # The daemon's descriptor socket, where a zero-copy client gets its tenant's host arena
    # (kvstore.rpc.descriptors); "" when the daemon has no host arena.
    arena_path: str
    call_channel: bool = False  # the daemon serves this caller call channels (OpenChannel)


class KVEventKind(enum.StrEnum):
    """What a KV event says happened to its blocks."""

    STORED = "stored"  # the tier now holds them
    REMOVED = "removed"  # the tier no longer holds them
    ALL_CLEARED = "all_cleared"  # the store holds no blocks at all any more


@dataclass(frozen=True, slots=True, eq=False)  # eq=False: ``tokens`` is an array
class KVEvent:
    """Blocks of one namespace that one tier gained or lost (``kvstore.server.kv_events``);
    stored blocks are one chain, in order. An ALL_CLEARED event carries no blocks."""

    kind: KVEventKind
    keys: tuple[BlockKey, ...]
    parent: BlockKey | None  # the key before the first (stored events); None for a prefix's first
    tokens: np.ndarray | None  # the blocks' token ids (uint32) where the store had them, else None
    block_tokens: int  # tokens per block; 0 if not known
    first_block_index: int  # position of the first block in its prefix
    tier: str  # the chain's name of the tier
    medium: str  # "GPU", "CPU", "STORAGE", "REMOTE" (or the daemon's ``events.media``)
    tenant: str
    model_id: str
    namespace: bytes  # the namespace fingerprint (``Namespace.fingerprint``)


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """What one ``subscribe_events`` read gives: the events of one drain of the daemon's
    queue that the subscriber may see."""

    seq: int  # this subscription's batch number, from 0
    ts: float  # seconds since the epoch
    host: str  # the daemon's host name (``events.host``)
    num_dropped: int  # events this subscription lost so far because it fell behind
    events: tuple[KVEvent, ...]
