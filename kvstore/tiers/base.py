"""The Tier contract and the capabilities a tier may add (lending slots of shared memory; being
shared by several hosts).

A tier stores whole encoded pages (``kvstore.page``) by ``BlockKey``. It knows nothing about
prefixes, namespaces or policy: the store (``kvstore.store``) walks an ordered chain of tiers,
fastest first, decides what goes where and makes room; a tier only admits, holds, returns and
forgets pages within its capacity, and says what it would need freed for a page to fit. The
store never names a tier: it checks capabilities with ``isinstance`` (``SlotTier`` lends slots
of memory other processes map, and ``FdRegions`` hands those out as file descriptors;
``SharedTier`` is seen by several hosts and answers batched prefix probes).

Threading: every method is called from the store's event loop. Async methods may await file or
device I/O (through threads); sync methods must return quickly and never block on I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvstore.api import Medium, TierStats
from kvstore.keys import BlockKey
from kvstore.page import Page, PageMeta, PendingPage
from kvstore.room import Footprint, RoomNeed
from kvstore.spec import KVSpec

__all__ = [
    "NEAR_DEVICE",
    "CheckedCopies",
    "ClusterEntry",
    "DevicePages",
    "FdRegions",
    "Footprint",
    "HostPinning",
    "InPlaceWrites",
    "RoomNeed",
    "SharedTier",
    "Slot",
    "SlotTier",
    "Tier",
    "TierStats",
]


class Tier(ABC):
    """One storage tier. Implementations own their memory or files and their counters.

    Contract:
    - ``write`` stores a complete encoded page under ``key`` or returns False (no room); it never
      leaves a partial page readable and never evicts: making room is the store's job
      (``room_for`` says what it takes). Writing a key already present is a no-op that returns
      True.
    - ``read`` returns the verified, parsed page, or None on a miss. A page that fails
      verification is removed, counted in ``stats().corrupt`` and reported as a miss: a tier
      never returns bytes that fail their checksum.
    - ``read(key, verify=False)`` returns the page parsed but with its checksum unchecked, so a
      caller can verify it where it uses it (``kvstore.page.verify_page`` on a worker thread,
      just before decoding it while it is in cache). Such a caller must not use or pass on a
      byte before ``verify_page`` accepted the page; when it refuses, the caller reads the key
      again with ``verify=True``, and the tier's own check removes and counts the page (a tier
      is the only judge of its pages: a caller never deletes one for being corrupt). A header
      or meta that does not parse is handled as in a verified read. A tier that verified a page
      when it stored it, in memory nobody else can write, returns it trusted
      (``Page.is_trusted``, which ``verify_page`` accepts as it is) on either kind of read.
    - ``delete`` forgets a key (idempotent). ``close`` flushes what must persist.
    - ``used_bytes`` never exceeds ``capacity_bytes``.
    - Room: ``room_for(n)`` is None when a page of ``n`` bytes fits now; otherwise the space to
      free, in ``footprint`` terms: deleting unpinned blocks whose footprints are of
      ``need.size_class`` (any class if None) and add up to ``need.nbytes`` lets the page fit.
      ``max_page_bytes`` is the largest page the tier could ever hold.
      ``room_for_tenant(n, tenant)`` answers the same for a page of ``tenant`` in a tier whose
      memory is split by tenant: its need may name the tenant whose blocks must go (and the
      exact blocks, ``RoomNeed.keys``), which is not always the one whose page is coming; a
      tier shared by all tenants alike answers ``room_for(n)``.
    """

    name: str = "tier"
    is_persistent: bool = False  # pages survive a restart (``entries`` lists them at open)

    @property
    @abstractmethod
    def capacity_bytes(self) -> int:
        """Configured bound on stored bytes."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes currently charged against capacity (slot or segment space)."""

    @property
    @abstractmethod
    def max_page_bytes(self) -> int:
        """The largest page this tier can hold when empty."""

    @abstractmethod
    def contains(self, key: BlockKey) -> bool:
        """Whether ``key`` is stored (no I/O)."""

    @abstractmethod
    def room_for(self, nbytes: int) -> RoomNeed | None:
        """None if a page of ``nbytes`` fits now; else what must be freed first."""

    def room_for_tenant(self, nbytes: int, tenant: str,
                        protected: Callable[[BlockKey], bool] | None = None
                        ) -> RoomNeed | None:
        """None if ``tenant``'s page of ``nbytes`` fits now; else what must be freed first. A
        tier that names exact blocks to free (``RoomNeed.keys``) names none ``protected``
        says must stay (pinned by a lease or a copy in flight) where it has a choice."""
        return self.room_for(nbytes)

    async def held_outside(self) -> dict[str, int]:
        """Bytes of the tier's capacity that each tenant's memory still holds after the tier
        gave it back (memory it could not free yet), charged to that tenant's share; tenants
        holding none are left out. Default: none."""
        return {}

    def can_write(self, nbytes: int) -> bool:
        """Whether a page of ``nbytes`` fits now without evicting anything."""
        return self.room_for(nbytes) is None

    @abstractmethod
    def footprint(self, key: BlockKey) -> Footprint | None:
        """The space the stored page of ``key`` takes (its size class and charge), or None."""

    def moved_keys(self) -> list[BlockKey]:
        """Stored keys whose footprint changed since the last call (a log-structured tier
        relocates pages when it compacts); the store re-files them in its eviction order."""
        return []

    @abstractmethod
    async def write(self, key: BlockKey, page: bytes | memoryview, meta: PageMeta) -> bool:
        """Store an encoded page; True if stored (or already present), False if no room."""

    @abstractmethod
    async def read(self, key: BlockKey, *, verify: bool = True) -> Page | None:
        """The verified page for ``key`` (``kvstore.page.decode_page``), or None (miss or
        corrupt); with ``verify=False`` the parsed page whose checksum the caller checks (see
        the class docstring). The payload may be a view into tier memory: it stays valid until
        the key is deleted, and the store never deletes a block while a reader holds it."""

    @abstractmethod
    async def delete(self, key: BlockKey) -> bool:
        """Forget ``key``; True if it was stored."""

    @abstractmethod
    def entries(self) -> Iterator[PageMeta]:
        """Meta of every stored page (for rebuilding the directory after a restart)."""

    @abstractmethod
    def page_size(self, key: BlockKey) -> int | None:
        """Bytes of the stored page for ``key`` (no I/O), or None if absent."""

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of this tier's counters (``evictions`` is the store's to count)."""

    async def open(self) -> None:
        """Acquire files, memory and indexes. Called once before use."""

    async def close(self) -> None:
        """Flush what must persist and release resources."""


class Slot(Protocol):
    """A fixed piece of a slot tier's memory, lent to one writer at a time."""

    @property
    def offset(self) -> int: ...

    @property
    def slot_bytes(self) -> int: ...


class SlotTier(Tier):
    """A tier of fixed slots in memory other processes on the host map (shared-memory arenas,
    a GPU pool exported over IPC): it lends slots for zero-copy writes and locates pages for
    pinned zero-copy reads. A tenant's memory is in regions of its own (one or several), which
    only that tenant's clients are given to map.

    - ``allocate_slot(nbytes, tenant)`` gives a writer a free slot in ``tenant``'s region
      ``region_of(tenant)``, owned by no key (None: no room; the store makes room first, asking
      ``room_for_slot``). ``slot_view`` is the slot's memory in this process.
    - a writer's slot becomes a stored page through the tier's capability for the memory it
      is in: ``CheckedCopies`` (host slots: the tier copies the page where no client can write
      and the store checks that copy) or ``DevicePages`` (device slots). ``abort`` frees a
      slot never published.
    - ``region_of(tenant)`` names the region a client maps to write ``tenant``'s slots (an
      arena; a pool); ``locate(key)`` is ``(region, offset, length)`` of a stored page: the
      region of its tenant it is in (not always ``region_of``: a tier may keep stored pages in
      regions of their own), valid while the store keeps the block pinned.
    - ``room_for_slot(nbytes, tenant)`` is ``room_for_tenant`` for a slot ``allocate_slot``
      would lend (a tier whose slots are not where it keeps pages answers for its slots).
    """

    @property
    @abstractmethod
    def medium(self) -> Medium:
        """Which memory the slots are in."""

    @abstractmethod
    def region_of(self, tenant: str) -> str:
        """What a client of ``tenant`` maps to reach that tenant's slots."""

    def slot_region(self, slot: Slot, tenant: str) -> str:
        """The region ``slot`` (lent to ``tenant``) lies in: ``region_of(tenant)`` unless the
        tier lends a tenant slots in several regions."""
        return self.region_of(tenant)

    def room_for_slot(self, nbytes: int, tenant: str,
                      protected: Callable[[BlockKey], bool] | None = None) -> RoomNeed | None:
        """None if ``allocate_slot(nbytes, tenant)`` can lend a slot now; else what to free
        (``protected`` as for ``room_for_tenant``)."""
        return self.room_for_tenant(nbytes, tenant, protected)

    @abstractmethod
    async def allocate_slot(self, nbytes: int, tenant: str) -> Slot | None: ...

    @abstractmethod
    def slot_view(self, slot: Slot) -> memoryview: ...

    @abstractmethod
    def abort(self, slot: Slot) -> None: ...

    @abstractmethod
    def locate(self, key: BlockKey) -> tuple[str, int, int] | None:
        """``(region, offset, length)`` of the stored page of ``key``, or None."""


@dataclass(frozen=True, slots=True)
class ClusterEntry:
    """One host's holding of one block, as the cluster directory reports it."""

    key: BlockKey
    host: str
    tiers: tuple[str, ...]  # that host's local tiers holding the block, fastest first
    block_index: int
    model_id: str
    expires_in_s: float  # the entry vanishes this long from now unless the host renews it


class SharedTier(Tier):
    """A tier several hosts see (a Redis or Valkey server or cluster). Implementations own
    their connections, time bounds, retries and counters.

    - The store does not own what it holds: pages appear (other hosts write them) and vanish
      (their TTL, other hosts, the server's own eviction) without this host's knowing.
      ``contains``, ``footprint``, ``used_bytes`` and ``room_for`` speak of the pages this host
      wrote and has not seen expire (its byte budget); the batched calls ask the shared store.
    - Tenants: stored keys carry the tenant; a call made for one tenant never reads, probes or
      lists another's pages. ``read(key)`` finds the pages this host wrote; a page another host
      wrote is read with ``read_many`` and the tenant it is for.
    - ``exists_prefix(keys, tenant)`` is how many leading ``keys`` are stored, in one round trip
      per group of keys that live together (a cluster node); ``read_many`` returns the pages,
      each verified (checksum, key, tenant and namespace fingerprint), or None for a miss; a
      page that fails is deleted, counted in ``stats().corrupt`` and is a miss.
    - Faults are misses, never exceptions: when the store is unreachable or slow, every call
      answers (0, None, False) within the tier's configured time bound; ``health`` says what is
      wrong, and service resumes by itself when the store answers again.
    - The directory: ``note_local`` records that this host's local tier ``tier`` now holds (or
      no longer holds) a block; the tier publishes such changes in batches. ``holders`` and
      ``cluster_entries`` read what the live hosts published; a host's entries vanish once it
      stops renewing them.
    """

    @abstractmethod
    async def exists_prefix(self, keys: Sequence[BlockKey], tenant: str) -> int:
        """How many leading ``keys`` of ``tenant`` are stored (0 when unreachable)."""

    @abstractmethod
    async def read_many(self, keys: Sequence[BlockKey], tenant: str, namespace: bytes
                        ) -> list[Page | None]:
        """The verified page of each key, or None (a miss, a corrupt or foreign page)."""

    @abstractmethod
    async def write_many(self, pages: Sequence[tuple[PageMeta, bytes | memoryview]]
                         ) -> list[bool]:
        """Store each page (as ``write``); True where stored or already present."""

    @property
    def write_batch_bytes(self) -> int:
        """About how many bytes of pages one ``write_many`` call should carry: what the tier
        sends in one round trip (the store batches its background writes to this size)."""
        return 16 << 20

    @abstractmethod
    def note_local(self, meta: PageMeta, tier: str, is_held: bool) -> None:
        """This host's local tier ``tier`` now holds (or no longer holds) the block (no I/O)."""

    @abstractmethod
    async def holders(self, keys: Sequence[BlockKey], tenant: str
                      ) -> list[dict[str, tuple[str, ...]]]:
        """For each key, the live hosts (other than this one) holding it: host -> tiers."""

    @abstractmethod
    async def cluster_entries(self, tenant: str, limit: int) -> list[ClusterEntry]:
        """What the live hosts hold of ``tenant``'s blocks, at most ``limit`` entries."""

    @abstractmethod
    def health(self) -> str:
        """"" when the shared store answers; otherwise what is wrong, in words (no secrets)."""


class PageCheck(Protocol):
    """The store's check of one page a writer put into a slot, made on the tier's copy of it
    while the copy lands (``CheckedCopies.claim``)."""

    def feed(self, view: memoryview, copied: int) -> None:
        """The first ``copied`` bytes of ``view`` (the copy, read-only, exactly the page's
        length) are final: check what came since the last call; raise on a fault."""

    def finish(self, out: memoryview) -> PageMeta:
        """All of the page is copied and fed: finish the checks and seal the copy (``out``,
        the same memory, writable); the page's meta, or raise."""


@runtime_checkable
class CheckedCopies(Protocol):
    """A slot tier of host memory whose writers fill slots through a host view
    (``slot_view``): a slot becomes a stored page in two steps, so that a reservation's pages
    are all checked before any is published. ``claim`` takes room for the page where no client
    can write, copies the page there and runs the store's ``check`` on that copy, both in a
    thread, piece by piece, each piece checked while it is in cache (``PageCheck``), and
    returns at once (None, the slot still the caller's, when there is no room);
    ``checked`` waits for them (raising what ``check`` raised); ``publish`` then makes the
    checked copy readable and frees the writer's slot, or ``drop`` gives the room back. Only
    the copy is checked and served: whatever the writer does to its slot during or after the
    copy reaches no reader unchecked."""

    async def claim(self, slot: Slot, key: BlockKey, nbytes: int,
                    check: PageCheck) -> object | None:
        """Start copying the ``nbytes``-byte page in ``slot`` and checking the copy
        (``check.finish`` returns the page's meta or raises); None when there is no room."""

    async def checked(self, claim: object) -> PageMeta:
        """Wait for a claim's copy and check; its meta, or what ``check`` raised."""

    def publish(self, claim: object) -> int:
        """Make a checked claim readable as its key (a copy stored meanwhile is kept) and free
        the writer's slot; the page's length."""

    def drop(self, claim: object) -> None:
        """Give a claim's room back (once its copy is done); the writer's slot stays the
        caller's."""


@runtime_checkable
class InPlaceWrites(Protocol):
    """A tier that frames a page the store built straight into its own memory
    (``PendingPage.write_into``: one pass that copies and hashes), instead of copying a page
    framed elsewhere. Same contract as ``write``."""

    async def write_pending(self, key: BlockKey, page: PendingPage) -> bool:
        """Frame ``page`` (``page.meta.key`` is ``key``) into room of this tier; False (counted
        ``rejected``) when there is none."""


@runtime_checkable
class DevicePages(Protocol):
    """A slot tier whose slots hold device pages (``kvstore.codecs.device``): a writer puts a
    block's codec sections there with the engine kernels, not a framed page, and the tier frames
    them as a host page when the block leaves it. The store cannot check such a slot on the host
    without copying it off the device: it publishes it under the meta it builds itself; the
    pool is the writer's tenant's alone, so a bad page reaches nobody else."""

    def device_slot_bytes(self, codec: str, spec: KVSpec) -> int:
        """Bytes of the slot one block of ``spec`` under ``codec`` takes."""

    async def publish_sections(self, slot: Slot, key: BlockKey, meta: PageMeta, spec: KVSpec,
                               ready_event: bytes = b"") -> int:
        """Make the device page in ``slot`` readable as ``key`` once the writer's event
        (``ready_event``, an IPC handle; empty: already written) fired; its host page bytes."""


# The GPU (``kvstore.ipc.device_id``) whose kernels will use the device slots and pages a request
# makes now: a tier of device pages on several GPUs puts them on that one when it has room
# there. The store sets it around a reservation and a lease's promotions; "" prefers none.
NEAR_DEVICE: ContextVar[str] = ContextVar("kvstore_near_device", default="")


@runtime_checkable
class HostPinning(Protocol):
    """A tier of host memory that can register itself as pinned CUDA memory (cudaHostRegister),
    now and as it grows, so copies off a GPU tier DMA into it."""

    async def pin_cuda(self) -> bool:
        """Register (in the background, chunk by chunk); False without CUDA."""


@runtime_checkable
class FdRegions(Protocol):
    """A slot tier whose regions are memory files (memfds) with no path: a client maps one
    through a descriptor the daemon sends it, over its Unix socket, once the caller's tenant
    may have it (``kvstore.server.fdpass``). A region that holds stored pages is sealed against
    every writer but the tier (``F_SEAL_FUTURE_WRITE``) and opens with a header page
    (``kvstore.page.is_published``); when the tier gives such a region back, its header says
    so (``kvstore.page.is_retired``) and clients drop their mappings of it; its memory is
    freed then, whoever still holds it (a client may pass a descriptor on to processes the
    daemon never sees), so clients get a description that cannot resize it."""

    def region_fd(self, region: str) -> tuple[str, int] | None:
        """``(tenant, fd)`` of ``region``, or None if there is no such region (or it was given
        back). The tier keeps owning the descriptor: callers send or duplicate it, never close
        it."""

    def on_retired(self, listener: Callable[[str], None]) -> None:
        """Have ``listener(tenant)`` called, on the event loop, each time the tier gives back
        regions of ``tenant`` that clients may map, so they can be told to drop them."""
