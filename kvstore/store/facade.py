"""The Store: put / lookup / get / evict / stats and leases over an ordered chain of tiers."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
import torch

from kvstore.api import (
    BlockInfo,
    Counters,
    Lease,
    LookupResult,
    Medium,
    ModelProfile,
    Reservation,
    StoreStats,
    TierStats,
)
from kvstore.codecs.base import unpack_blob
from kvstore.codecs.raw import RawCodec
from kvstore.config import KVStoreConfig
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError, shown
from kvstore.keys import BlockKey, Namespace, block_keys, token_array
from kvstore.madvise import fresh_tensor
from kvstore.page import Page, PageMeta, PendingPage
from kvstore.policy import UseHistory, build_order
from kvstore.policy.base import EvictionOrder
from kvstore.policy.cost import PrefillModel, advise
from kvstore.room import Footprint
from kvstore.spec import KVSpec
from kvstore.store.decode import PageDecoder, decode_pages
from kvstore.store.directory import BlockDirectory, BlockEntry
from kvstore.store.hints import HintPolicy, Hints, hint_policy
from kvstore.store.leases import LeaseManager, page_bound
from kvstore.store.placement import Link, Placement
from kvstore.tiers.base import (
    DevicePages,
    FdRegions,
    HostPinning,
    InPlaceWrites,
    SharedTier,
    Tier,
)

log = logging.getLogger("kvstore.store")

Tokens = Sequence[int] | torch.Tensor

# Prefixes longer than this are hashed on a worker thread, so one long request never stalls the
# loop: block keys cost about 1 ms per 32k tokens on the 2-core box (2026-12-01, one pass over
# the token buffer), so this bounds the inline cost near 1 ms. The hop itself is not free: a
# 32k-token Lookup through the daemon spent about a fifth of its time handing the hashing to a
# thread and back (py-spy, 2026-12-01).
INLINE_HASH_TOKENS = 32768


async def _keys(ns: Namespace, tokens: np.ndarray) -> list[BlockKey]:
    """The block keys of ``tokens`` under ``ns``, hashed off the loop for long prefixes."""
    if tokens.size > INLINE_HASH_TOKENS:
        return await asyncio.to_thread(block_keys, ns, tokens)
    return block_keys(ns, tokens)


def _eviction_order(links: Sequence[Link], index: int, history: UseHistory) -> EvictionOrder:
    """The order ``links[index]``'s settings name. The value order scores a hit by the read time
    it saves against the next tier down; in the last tier by its own read time (recompute is
    taken to cost at least twice the slowest read: the store has no prefill model per tier).
    Value orders share the chain's ``history``, so a block keeps its uses as it moves down."""
    here = links[index].path
    lower = links[index + 1].path if index + 1 < len(links) else None

    def saved_s(footprint: Footprint, depth: int | None) -> float:
        cost = here.time_s(footprint.nbytes, queued=False)
        return cost if lower is None else lower.time_s(footprint.nbytes, queued=False) - cost

    return build_order(links[index].settings.eviction, saved_s, history=history, rank=index)


@dataclass(slots=True)
class PinnedKV:
    """A stored prefix's K/V as views of its pages in place (``Store.get_in_place``): ``pieces``
    are, in order, the bytes of the canonical tensor of ``shape`` and ``dtype``; they stay valid
    until ``release()`` unpins the blocks (call it once, when done sending)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[memoryview]
    release: Callable[[], None]

    @property
    def nbytes(self) -> int:
        return sum(len(piece) for piece in self.pieces)


def canonical_pieces(sections: Sequence[memoryview], spec: KVSpec) -> list[memoryview]:
    """The byte runs of blocks' raw K/V sections (each ``[L, 2, bt, H, D]``, C order) in the
    order of the canonical tensor of all of them (``[L, 2, n * bt, H, D]``): for each layer
    and K/V, each block's run of ``bt`` tokens. A single block is one piece."""
    if len(sections) == 1:
        return [memoryview(sections[0]).cast("B")]
    views = [memoryview(section).cast("B") for section in sections]
    run = len(views[0]) // (spec.num_layers * 2)
    return [view[i * run : (i + 1) * run]
            for i in range(spec.num_layers * 2) for view in views]


@dataclass(slots=True)
class _Encoded:
    meta: PageMeta
    data: memoryview  # the page, in a buffer of the put's ``WriteBuffers``


def _page_of(block: _Encoded | PendingPage) -> memoryview | PendingPage:
    return block if isinstance(block, PendingPage) else block.data


class WriteBuffers:
    """Buffers that in-process puts write their pages into, kept for the next put: puts to a
    fastest tier that takes finished pages only (one that frames them in place,
    ``InPlaceWrites``, needs none), and lifts.

    A fresh buffer costs a page fault per 4 KiB on its first write (on the 2-core box a 32 MiB
    put spent 62 ms encoding into fresh buffers against 4 ms for one copy into warm memory),
    so a put takes one, the tiers copy its pages out, and it comes back. A put that fails or
    is cancelled does not give its buffer back: a tier may still hold a view of it. Thread-safe
    (taken on encoding threads, given back on the loop).
    """

    MAX_KEPT = 4  # buffers kept: about as many as puts encode at once on a busy daemon
    MAX_KEPT_BYTES = 256 << 20  # 8 puts of 16 2-MiB blocks

    def __init__(self) -> None:
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        """A buffer of at least ``nbytes`` (the smallest kept one that fits, else a new one)."""
        with self._lock:
            fits = [b for b in self._free if len(b) >= nbytes]
            if fits:
                chosen = min(fits, key=len)
                self._free.remove(chosen)
                return chosen
        return bytearray(nbytes)

    def give(self, buf: bytearray) -> None:
        """Keep ``buf`` for a later put, dropping the smallest kept ones past the bounds."""
        if len(buf) > self.MAX_KEPT_BYTES:
            return
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=len, reverse=True)
            while (len(self._free) > self.MAX_KEPT
                   or sum(map(len, self._free)) > self.MAX_KEPT_BYTES):
                self._free.pop()


class Store:
    """An embedded, asyncio KV block store over the tier chain of ``config``; the daemon serves
    one of these.

    All methods run on one event loop; codec and copy work goes to threads.
    """

    def __init__(self, config: KVStoreConfig | None = None) -> None:
        self.config = config or KVStoreConfig()
        links = [Link.build(i, link) for i, link in enumerate(self.config.tier_chain())]
        self.tiers: dict[str, Tier] = {link.name: link.tier for link in links}
        history = UseHistory()
        orders = {link.name: _eviction_order(links, link.index, history) for link in links}
        self._dir = BlockDirectory(list(orders), orders.__getitem__,
                                   observer=self._directory_observer(links))
        share = self.config.quota.share(len(self.config.server.tenant_tokens))
        self._placement = Placement(links, self._dir, self._count, share)
        self._leases = LeaseManager(self._dir, self._placement,
                                    self.config.server.lease_timeout_s, self.config.quota,
                                    self._count, self._spawn)
        self._hints = Hints(self._dir, self._placement, self._count, self._spawn)
        # Blocks an in-process put is writing; a put of the same block waits on it.
        self._writing: dict[BlockKey, asyncio.Future[None]] = {}
        self._buffers = WriteBuffers()
        # The cost model's recompute estimate, by (tenant, model id).
        self._prefill: dict[tuple[str, str], PrefillModel] = {}
        self._totals = Counters()
        self._by_tenant: dict[str, Counters] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._demote_wakeup: asyncio.Event | None = None
        self._is_open = False

    @property
    def host_regions(self) -> FdRegions | None:
        """The slot tier whose host arenas same-host clients map for zero-copy reads and
        writes, each tenant's by a descriptor the daemon sends it (None if none)."""
        link = self._placement.slot_link()
        if link is None or link.tier.medium is not Medium.HOST:  # type: ignore[attr-defined]
            return None
        return link.tier if isinstance(link.tier, FdRegions) else None

    # ----------------------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        """Open every tier and rebuild the directory from what persistent tiers hold."""
        opened: list[Tier] = []
        try:
            for tier in self.tiers.values():
                await tier.open()
                opened.append(tier)
        except BaseException:
            for tier in reversed(opened):
                await tier.close()
            raise
        for link in self._placement.links:
            for meta in link.tier.entries():
                self._dir.place(meta, link.name, link.tier.page_size(meta.key),
                                link.tier.footprint(meta.key))
        if any(isinstance(t, DevicePages) for t in self.tiers.values()):
            # Demotion off the GPU copies into host tiers: pin what lends host slots (in the
            # background, chunk by chunk as arenas grow; about 0.5 s per GiB).
            for tier in self.tiers.values():
                if isinstance(tier, HostPinning):
                    self._spawn(tier.pin_cuda())
        self._demote_wakeup = asyncio.Event()
        self._spawn(self._demoter())
        self._spawn(self._leases.reaper())
        self._is_open = True
        log.info("store open: %d blocks restored", len(self._dir))

    async def close(self) -> None:
        """Stop background work, persist memory-only blocks if configured, close the tiers."""
        if not self._is_open:
            return
        self._is_open = False
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        saved = await self._placement.persist()
        if saved:
            log.info("persisted %d memory-only blocks on close", saved)
        for tier in self.tiers.values():
            await tier.close()

    # ----------------------------------------------------------------------------- requests

    async def put(self, ns: Namespace, tokens: Tokens, kv: torch.Tensor) -> int:
        """Store the full blocks of ``kv`` for ``tokens``; return the tokens newly written.

        ``kv`` is in the canonical layout with exactly ``len(tokens)`` tokens; blocks already
        stored are not rewritten (but a block held only below a tier whose admission lifts it,
        as under the value order, is copied up from ``kv``: the engine recomputed it) and a
        trailing partial block is ignored. Every block written is
        reachable by a following lookup: blocks the put holds are pinned until it returns, so
        making room for later blocks never evicts earlier ones, and when a block finds no room
        anywhere the put stops there (CapacityError if that is the first block to write).
        """
        self._check_open()
        arr = token_array(tokens)
        kv = ns.spec.check_kv(kv, num_tokens=arr.size)
        keys = await _keys(ns, arr)
        self._placement.note(keys)
        self._count(ns.tenant, puts=1)
        in_flight = [self._writing[k] for k in keys if k in self._writing]
        held = [e for e in map(self._dir.get, keys) if e is not None]
        todo = [i for i, k in enumerate(keys) if k not in self._dir and k not in self._writing]
        lifts = [i for i, e in enumerate(map(self._dir.get, keys))
                 if e is not None and self._placement.lift_target(e) is not None]
        claimed = self._claim_writes(keys[i] for i in todo)
        self._dir.pin(held)
        written = 0
        try:
            if todo:
                written = await self._store_blocks(ns, keys, kv, todo, held)
            if lifts:  # blocks held only further down: the engine's copy goes up (lift)
                await self._lift(ns, keys, kv, lifts)
        finally:
            self._release_writes(claimed)
            self._dir.unpin(held)
        if in_flight:  # another put is storing some of these blocks: return once it has
            await asyncio.gather(*(asyncio.shield(f) for f in in_flight))
        self._dir.touch(self._dir.match_prefix(keys), hit=False)
        self._wake_demoter()
        if written and self._placement.write_through_links():
            self._spawn(self._placement.write_through(held[-written:]))
        self._count(ns.tenant, put_tokens=written * ns.spec.block_tokens)
        return written * ns.spec.block_tokens

    async def lookup(self, ns: Namespace, tokens: Tokens) -> LookupResult:
        """The longest stored prefix of ``tokens`` and which tier holds each of its blocks."""
        self._check_open()
        arr = token_array(tokens)
        all_keys = await _keys(ns, arr)
        self._hints.arrived(ns.tenant, all_keys)  # a hinted request is here: it loads itself
        entries = self._dir.match_prefix(all_keys)
        bt = ns.spec.block_tokens
        per_tier = self._dir.tokens_per_tier(entries, bt)
        keys = tuple(all_keys[:len(entries)])
        self._dir.touch(entries, keys=keys)
        shared_keys, cluster_tokens = await self._probe_shared(ns, all_keys, len(keys))
        if shared_keys:
            name = self._placement.shared_link().name
            per_tier[name] = per_tier.get(name, 0) + len(shared_keys) * bt
            keys += shared_keys
        self._placement.note(keys)
        matched = len(keys) * bt
        self._count(ns.tenant, lookups=1, lookup_hit_tokens=matched,
                    lookup_miss_tokens=arr.size - matched)
        return LookupResult(arr.size, matched, per_tier, keys,
                            advised_tokens=self._advise(ns, entries, len(shared_keys), arr.size),
                            cluster_tokens=cluster_tokens)

    async def get(self, ns: Namespace, tokens: Tokens, out: torch.Tensor | None = None
                  ) -> torch.Tensor | None:
        """K/V of the longest stored prefix of ``tokens`` (canonical layout), or None.

        The blocks are read concurrently without verification, and each is verified on a
        decode thread right before it is decoded, as soon as it is read. A block that fails is
        read again, verified (the tier drops and counts a corrupt copy; the next tier may serve
        the block), and the prefix ends at the first block that cannot be served: only
        verified bytes are returned. Blocks served from below the fastest tier are promoted.

        Args:
            out: a buffer of the caller's to write the K/V into (``KVSpec.check_out``: checked
                before anything is read; InvalidArgument names what is wrong); the result is
                then a view of its front. None: a fresh tensor (on huge pages where large:
                ``fresh_tensor``; faulting a fresh 16 MiB result in 4 KiB at a time cost 8x
                the copy into it).
        """
        self._check_open()
        arr = token_array(tokens)
        front = None if out is None else ns.spec.check_out(out, arr.size)
        keys = await _keys(ns, arr)
        await self._adopt_shared(ns, keys)
        entries = self._dir.match_prefix(keys)
        if not entries:
            return None
        bt = ns.spec.block_tokens
        num_tokens = len(entries) * bt
        out = (fresh_tensor(ns.spec.shape(num_tokens), ns.spec.torch_dtype) if front is None
               else front[:, :, :num_tokens])
        outs = out.split(bt, dim=2)
        self._dir.pin(entries)
        started = time.perf_counter()
        try:
            async with PageDecoder(outs) as decoder:
                sources = await self._read_pages(entries, decoder.add)
            self._observe_read(entries, sources, time.perf_counter() - started)
            failed = [i for i in decoder.failed if i < len(sources)]  # after a miss: unused
            num_blocks = await self._redo_failed(entries, failed, sources, outs)
        finally:
            self._dir.unpin(entries)
        if num_blocks == 0:
            return None
        if num_blocks < len(entries):  # only the verified prefix is returned
            out = out[:, :, :num_blocks * bt]
            if front is None:  # a fresh result: copied, so the rest's memory goes
                out = out.clone()
        self._dir.touch(entries[:num_blocks])
        first = self._placement.links[0]
        for entry, source in zip(entries[:num_blocks], sources):
            if source is not first:  # a block fetched from further down is likely reused
                self._spawn(self._promote(entry, first))
        self._count(ns.tenant, gets=1, get_tokens=out.shape[2])
        return out

    async def get_in_place(self, ns: Namespace, tokens: Tokens) -> PinnedKV | None:
        """The K/V of the longest stored prefix of ``tokens`` as views of its pages where they
        lie, pinned until ``PinnedKV.release``: for a sender that moves the bytes straight
        from there (one copy, into a socket). None when some block of the prefix is not a
        raw page in trusted memory of the fastest tier (``get`` serves those), or nothing is
        stored.

        Trusted pages (``Page.is_trusted``) were verified when stored and nobody can change
        them, so they are neither hashed nor copied here.
        """
        self._check_open()
        keys = await _keys(ns, token_array(tokens))
        await self._adopt_shared(ns, keys)
        entries = self._dir.match_prefix(keys)
        first = self._placement.links[0]
        if not entries or any(first.name not in entry.sizes for entry in entries):
            return None
        self._dir.pin(entries)
        try:
            sections = [await self._trusted_section(first.tier, entry, ns.spec)
                        for entry in entries]
        except BaseException:
            self._dir.unpin(entries)
            raise
        if any(section is None for section in sections):
            self._dir.unpin(entries)
            return None
        self._dir.touch(entries)
        self._count(ns.tenant, gets=1, get_tokens=len(entries) * ns.spec.block_tokens)
        return PinnedKV(ns.spec.shape(len(entries) * ns.spec.block_tokens), ns.spec.torch_dtype,
                        canonical_pieces(sections, ns.spec),
                        lambda: self._dir.unpin(entries))

    @staticmethod
    async def _trusted_section(tier: Tier, entry: BlockEntry, spec: KVSpec
                               ) -> memoryview | None:
        """The K/V bytes of ``entry``'s raw page of ``spec`` in place, if ``tier`` serves it
        from trusted memory; else None."""
        page = await tier.read(entry.meta.key, verify=False)
        if page is None or not page.is_trusted or page.meta.codec != RawCodec.name:
            return None
        parts = unpack_blob(page.payload, verify=False)
        if parts.dtype != spec.torch_dtype or parts.shape != spec.shape(spec.block_tokens):
            return None
        return parts.sections[0]

    async def evict(self, *, tenant: str | None = None, model_id: str | None = None,
                    keys: Sequence[BlockKey] | None = None, everything: bool = False) -> int:
        """Remove matching unpinned blocks from every tier, children first; return the count."""
        self._check_open()
        if not (everything or tenant or model_id or keys):
            raise InvalidArgument("evict needs tenant, model_id, keys or everything=True")
        wanted = set(keys) if keys is not None else None
        chosen = [
            e for e in self._dir.entries()
            if e.pins == 0
            and (tenant is None or e.meta.tenant == tenant)
            and (model_id is None or e.meta.model_id == model_id)
            and (wanted is None or e.meta.key in wanted)
        ]
        chosen.sort(key=lambda e: -e.meta.block_index)
        removed = 0
        for entry in chosen:
            # Earlier deletes awaited: a lease, read or promotion may have pinned it since.
            # Once taken, nobody starts reading it (BlockEntry.live) while its copies go.
            if not self._dir.take_for_eviction(entry):
                continue
            try:
                for name in list(entry.sizes):
                    await self.tiers[name].delete(entry.meta.key)
                    self._dir.unplace(entry.meta.key, name)
            finally:
                gone = self._dir.end_eviction(entry)
            removed += gone
        return removed

    def stats(self, tenant: str | None = None) -> StoreStats:
        """Counters per tier and per request type; with ``tenant``, only that tenant's blocks."""
        if tenant is None:
            tiers = {}
            for link in self._placement.links:
                tiers[link.name] = stats = link.tier.stats()
                stats.evictions = link.evictions
                # The cost model's current estimate of reading out of this tier.
                stats.extra["read_bytes_per_s"] = link.path.bytes_per_s
                stats.extra["read_fixed_s"] = link.path.fixed_s
            return StoreStats(
                tiers=tiers, counters=dataclasses.replace(self._totals),
                active_leases=self._leases.num_leases,
                active_reservations=self._leases.num_reservations,
                num_blocks=len(self._dir),
            )
        tiers = {name: TierStats(name=name, capacity_bytes=t.capacity_bytes)
                 for name, t in self.tiers.items()}
        num_blocks = 0
        for entry in self._dir.entries():
            if entry.meta.tenant != tenant:
                continue
            num_blocks += 1
            for name, nbytes in entry.sizes.items():
                tiers[name].used_bytes += nbytes
                tiers[name].num_blocks += 1
                tiers[name].hits += entry.hits
        counters = dataclasses.replace(self._by_tenant.get(tenant, Counters()))
        return StoreStats(tiers=tiers, counters=counters, num_blocks=num_blocks)

    def list_blocks(self, *, tenant: str | None = None, model_id: str | None = None,
                    tier: str | None = None, limit: int = 1000) -> list[BlockInfo]:
        """Stored blocks matching the filters, most recently used first."""
        if tier is not None and tier not in self.tiers:
            raise InvalidArgument(f"unknown tier {shown(tier)}; tiers are {list(self.tiers)}")
        if limit < 0:
            raise InvalidArgument(f"limit must be >= 0, got {limit}")
        now = time.time()
        rows = [
            self._dir.info(e, now) for e in self._dir.entries()
            if (tenant is None or e.meta.tenant == tenant)
            and (model_id is None or e.meta.model_id == model_id)
            and (tier is None or tier in e.sizes)
        ]
        rows.sort(key=lambda r: r.age_s)
        return rows[:limit]

    # Leases and reservations live in kvstore.store.leases, hints in kvstore.store.hints; these
    # delegate to them.

    async def acquire(self, ns: Namespace, tokens: Tokens, lease_s: float | None = None,
                      medium: Medium = Medium.HOST, first_block: int = 0,
                      device: str = "") -> Lease:
        """Pin the stored prefix of ``tokens`` where same-host clients map it, until
        ``release`` or the lease's deadline; blocks only the shared tier holds are brought in
        first, as for ``get``. ``first_block``: pin the prefix's blocks from this one on.
        ``device``: the caller's GPU (``kvstore.ipc.device_id``), where blocks promoted into a
        GPU tier land while it has room there."""
        self._check_open()
        keys = await _keys(ns, token_array(tokens))
        self._hints.arrived(ns.tenant, keys)
        await self._adopt_shared(ns, keys)
        return await self._leases.acquire(ns, keys, lease_s, Medium(medium), first_block,
                                          device)

    async def release(self, lease_id: str) -> None:
        self._check_open()
        self._leases.release(lease_id)

    async def reserve(self, ns: Namespace, tokens: Tokens, lease_s: float | None = None,
                      medium: Medium = Medium.HOST, device: str = "") -> Reservation:
        """Slots of ``medium`` for the blocks of ``tokens`` not stored yet (``device``: the
        writer's GPU, as for ``acquire``); publish them with ``commit``."""
        self._check_open()
        return await self._leases.reserve(ns, await _keys(ns, token_array(tokens)), lease_s,
                                          Medium(medium), device)

    async def commit(self, reservation_id: str, ready_event: bytes = b"") -> int:
        """Publish what a writer put into a reservation's slots; ``ready_event`` is the IPC
        handle of a CUDA event it recorded after writing device slots."""
        self._check_open()
        keys = self._leases.reserved_keys(reservation_id)
        written = await self._leases.commit(reservation_id, ready_event)
        self._wake_demoter()
        if written and self._placement.write_through_links():
            entries = [e for e in map(self._dir.get, keys) if e is not None]
            self._spawn(self._placement.write_through(entries))
        return written

    async def abort(self, reservation_id: str) -> None:
        """Free a reservation's slots (a writer that gave up); LeaseNotFound if unknown."""
        self._check_open()
        self._leases.abort(reservation_id)

    async def hint(self, ns: Namespace, tokens: Tokens, deadline_s: float,
                   policy: str | HintPolicy = HintPolicy.BEST_EFFORT) -> int:
        """Promote the stored prefix of ``tokens`` into the fastest tier ahead of a queued
        request (kvstore.store.hints): returns the blocks scheduled, or with ``wait`` those
        that landed in time. The hint ends when a lookup or acquire of the prefix by the same
        tenant arrives, or on ``cancel_hint``."""
        self._check_open()
        return await self._hints.hint(ns, await _keys(ns, token_array(tokens)), deadline_s,
                                      hint_policy(policy))

    async def cancel_hint(self, ns: Namespace, tokens: Tokens) -> int:
        """The hinted request for ``tokens`` was dropped: end the tenant's hints for that
        prefix (what had not landed counts as cancelled). Returns how many hints ended."""
        self._check_open()
        return self._hints.arrived(ns.tenant, await _keys(ns, token_array(tokens)))

    def set_model_profile(self, ns: Namespace, profile: ModelProfile) -> None:
        """What prefill of ``ns``'s model costs; lookups in it then advise how much to fetch.
        Kept per tenant and model: one tenant's reports never steer another's advice."""
        key = (ns.tenant, ns.model_id)
        current = self._prefill.get(key)
        if current is None or current.profile != profile:
            self._prefill[key] = PrefillModel(profile)

    def report_prefill(self, ns: Namespace, new_tokens: int, cached_tokens: int,
                       seconds: float) -> None:
        """The engine prefilled ``new_tokens`` after ``cached_tokens`` in ``seconds``: corrects
        the model's FLOP rate (ignored until a profile is set)."""
        model = self._prefill.get((ns.tenant, ns.model_id))
        if model is not None:
            model.observe(new_tokens, cached_tokens, seconds)

    def slot_page_bytes(self, spec: KVSpec) -> int:
        """The slot a zero-copy writer gets for one block of ``spec`` (0 if no tier lends)."""
        link = self._placement.slot_link()
        return 0 if link is None else page_bound(link.codec, spec)

    # ----------------------------------------------------------------------------- internals

    def _claim_writes(self, keys) -> list[BlockKey]:
        """Mark blocks as being written so concurrent puts wait instead of writing twice."""
        loop = asyncio.get_running_loop()
        claimed = []
        for key in keys:
            self._writing[key] = loop.create_future()
            claimed.append(key)
        return claimed

    def _release_writes(self, keys) -> None:
        for key in keys:
            future = self._writing.pop(key, None)
            if future is not None and not future.done():
                future.set_result(None)

    def _check_open(self) -> None:
        if not self._is_open:
            raise KVStoreError("store is not open (use 'async with Store(config)')")

    def _count(self, tenant: str, **deltas: int) -> None:
        self._totals.add(**deltas)
        self._by_tenant.setdefault(tenant, Counters()).add(**deltas)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _store_blocks(self, ns: Namespace, keys: list[BlockKey], kv: torch.Tensor,
                            todo: list[int], held: list[BlockEntry]) -> int:
        """Place the put's new blocks at ``todo`` in order, pinning each into ``held``; return
        how many were stored (the put stops at the first that finds no room anywhere).

        A fastest tier that frames pages in place (``InPlaceWrites``) gets them pending: each
        page is copied and hashed once, into the memory it is served from. Otherwise the pages
        are framed into a reused buffer first (``_encode_blocks``) and the tier copies them.
        """
        buffer = None
        if isinstance(self._placement.links[0].tier, InPlaceWrites):
            blocks: list[_Encoded] | list[PendingPage] = await self._prepare(ns, keys, kv, todo)
        else:
            blocks, buffer = await asyncio.to_thread(self._encode_blocks, ns, keys, kv, todo)
        written = 0
        for block in blocks:
            try:
                entry = await self._placement.store_new(block.meta, _page_of(block))
            except CapacityError:
                if written == 0:
                    raise
                break  # the blocks after this one could never be matched
            self._dir.pin([entry])
            held.append(entry)
            written += 1
        del blocks, block  # the views into the buffer (or the caller's K/V), before its reuse
        if buffer is not None:
            self._buffers.give(buffer)  # every write has returned: no tier holds a view
        return written

    async def _prepare(self, ns: Namespace, keys: list[BlockKey], kv: torch.Tensor,
                       todo: list[int]) -> list[PendingPage]:
        """The pending pages of the blocks at ``todo``: raw ones of CPU K/V on the loop (views
        of ``kv``, a few microseconds a block, less than a thread hop), others on a thread (a
        lossy codec quantises here)."""
        codec = self._placement.links[0].codec
        if isinstance(codec, RawCodec) and kv.device.type == "cpu":
            return self._pending_pages(ns, keys, kv, todo)
        return await asyncio.to_thread(self._pending_pages, ns, keys, kv, todo)

    async def _lift(self, ns: Namespace, keys: list[BlockKey], kv: torch.Tensor,
                    lifts: list[int]) -> None:
        """Write the put's pages of blocks held only further down into faster tiers."""
        encoded, buffer = await asyncio.to_thread(self._encode_blocks, ns, keys, kv, lifts)
        for block in encoded:
            entry = self._dir.get(block.meta.key)
            if entry is not None and entry.live:
                await self._placement.lift(entry, block.data)
        del encoded
        self._buffers.give(buffer)

    def _encode_blocks(self, ns: Namespace, keys: list[BlockKey], kv: torch.Tensor,
                       todo: list[int]) -> tuple[list[_Encoded], bytearray]:
        """Encode the blocks at ``todo`` with the fastest tier's codec into pages, written
        straight into one reused buffer (``kvstore.page.write_page``: one pass that copies or
        quantises and hashes, no joins); return the pages and the buffer (runs in a worker
        thread)."""
        # Version 1 pages: tiers that copy pages in size their slots by its unpadded length
        # (the HBM tier's device pages).
        pages = self._pending_pages(ns, keys, kv, todo, aligned=False)
        buffer = self._buffers.take(sum(page.nbytes for page in pages))
        view = memoryview(buffer)
        out, pos = [], 0
        for page in pages:
            page.write_into(view[pos:pos + page.nbytes])
            out.append(_Encoded(page.meta, view[pos:pos + page.nbytes]))
            pos += page.nbytes
        return out, buffer

    def _pending_pages(self, ns: Namespace, keys: list[BlockKey], kv: torch.Tensor,
                       todo: list[int], aligned: bool = True) -> list[PendingPage]:
        """The blocks at ``todo`` prepared with the fastest tier's codec, as pages not framed
        yet (``aligned``: version 2, the payload hashed once, by its blob checksum)."""
        bt = ns.spec.block_tokens
        codec = self._placement.links[0].codec
        kv = kv.detach().cpu()
        pages = []
        for i in todo:
            meta = PageMeta(key=keys[i], namespace=ns.fingerprint,
                            parent=keys[i - 1] if i else None, block_index=i,
                            tenant=ns.tenant, model_id=ns.model_id, codec=codec.name,
                            codec_id=codec.codec_id)
            pages.append(PendingPage(meta, codec.prepare(kv[:, :, i * bt:(i + 1) * bt]),
                                     aligned))
        return pages

    async def _read_pages(self, entries: list[BlockEntry],
                          on_page: Callable[[int, Page], None]) -> list[Link]:
        """Read pinned entries concurrently from their fastest tiers, unverified, handing each
        page to ``on_page(index, page)`` as it arrives (the caller verifies it before any use);
        return the link each block came from, up to the first that could not be read (the
        prefix ends there)."""

        async def read(i: int, entry: BlockEntry) -> Link | None:
            page, source = await self._placement.read(entry, verify=False)
            if page is not None:
                on_page(i, page)
            return source

        sources = await asyncio.gather(*(read(i, e) for i, e in enumerate(entries)))
        return list(itertools.takewhile(lambda source: source is not None, sources))

    async def _redo_failed(self, entries: list[BlockEntry], failed: list[int],
                           sources: list[Link], outs: Sequence[torch.Tensor]) -> int:
        """Read the blocks at ``failed`` (ascending) again, verified, and decode them; return
        how many leading blocks hold verified K/V (``len(sources)`` when all read ones do)."""
        for i in failed:
            page, source = await self._placement.read(entries[i], verify=True)
            if page is None or await decode_pages([page], [outs[i]]):
                return i
            sources[i] = source
        return len(sources)

    def _advise(self, ns: Namespace, entries: list[BlockEntry], num_shared: int,
                num_tokens: int) -> int | None:
        """The prefix worth fetching per the cost model, or None without a prefill model:
        ``entries`` held here, then ``num_shared`` blocks in the shared tier (sized by its
        codec's bound: their pages are not known here)."""
        prefill = self._prefill.get((ns.tenant, ns.model_id))
        if prefill is None or not (entries or num_shared):
            return None
        links = [self._placement.fastest_holder(e) for e in entries]
        names = [link.name for link in links]
        sizes = [e.sizes[link.name] for e, link in zip(entries, links)]
        shared = self._placement.shared_link() if num_shared else None
        if shared is not None:
            names += [shared.name] * num_shared
            sizes += [page_bound(shared.codec, ns.spec)] * num_shared
        advice = advise(names, sizes, ns.spec.block_tokens, num_tokens,
                        {link.name: link.path for link in self._placement.links}, prefill)
        return advice.fetch_tokens

    def _observe_read(self, entries: list[BlockEntry], sources: list[Link],
                      seconds: float) -> None:
        """Feed a get's read-and-decode time to the path model of the tier it came from (only
        when one tier served every block: then the time is that path's alone)."""
        if not sources or any(source is not sources[0] for source in sources):
            return
        link = sources[0]
        link.path.observe(sum(e.sizes.get(link.name, 0) for e in entries[:len(sources)]),
                          seconds)

    # ------------------------------------------------------------------------ the shared tier

    def _directory_observer(self, links: Sequence[Link]
                            ) -> Callable[[PageMeta, str, bool], None] | None:
        """What tells a shared tier's directory which blocks this host's local tiers hold."""
        shared = next((link.tier for link in links if isinstance(link.tier, SharedTier)), None)
        if shared is None:
            return None
        local = {link.name for link in links if link.tier is not shared}

        def observe(meta: PageMeta, tier: str, is_held: bool) -> None:
            if tier in local:
                shared.note_local(meta, tier, is_held)

        return observe

    async def _probe_shared(self, ns: Namespace, keys: Sequence[BlockKey], matched: int
                            ) -> tuple[tuple[BlockKey, ...], dict[str, int]]:
        """Past the ``matched`` leading keys the directory knows: the keys the shared tier
        holds next (one batched probe), and the tokens other hosts hold after those."""
        link = self._placement.shared_link()
        if link is None or matched >= len(keys):
            return (), {}
        shared: SharedTier = link.tier  # type: ignore[assignment]
        rest = keys[matched:]
        found = await shared.exists_prefix(rest, ns.tenant)
        held_by = await shared.holders(rest[found:], ns.tenant) if found < len(rest) else []
        cluster: dict[str, int] = {}
        for host in set().union(*held_by):
            run = next((i for i, hosts in enumerate(held_by) if host not in hosts), len(held_by))
            if run:
                cluster[host] = run * ns.spec.block_tokens
        return tuple(rest[:found]), cluster

    async def _adopt_shared(self, ns: Namespace, keys: Sequence[BlockKey]) -> None:
        """Bring the blocks the shared tier holds just past the local match into the fastest
        tier that takes them (verified by the shared tier: key, checksum, namespace), so the
        get serves them like any local block."""
        link = self._placement.shared_link()
        held = self._dir.match_prefix(keys)
        if link is None or len(held) == len(keys):
            return
        shared: SharedTier = link.tier  # type: ignore[assignment]
        start = len(held)
        pages = await shared.read_many(keys[start:], ns.tenant, ns.fingerprint)
        held = self._dir.match_prefix(keys)  # pinned: making room never evicts the prefix
        self._dir.pin(held)
        try:
            for key, page in zip(keys[start:], pages):
                if page is None:
                    break
                entry = self._dir.get(key)
                if entry is not None and not entry.live:  # being evicted: the prefix ends
                    break
                if entry is None:
                    try:
                        entry = await self._placement.store_new(page.meta, page.data)
                    except CapacityError:
                        break
                    self._count(ns.tenant, promotions=1)
                self._dir.pin([entry])
                held.append(entry)
        finally:
            self._dir.unpin(held)

    async def _promote(self, entry: BlockEntry, target: Link) -> None:
        if await self._placement.promote(entry, target):
            self._wake_demoter()

    def _wake_demoter(self) -> None:
        if any(link.is_above_high_watermark() for link in self._placement.links[:-1]):
            self._demote_wakeup.set()

    async def _demoter(self) -> None:
        """Background: tiers above their high watermark demote down to their low one."""
        while True:
            await self._demote_wakeup.wait()
            self._demote_wakeup.clear()
            await self._placement.demote_above_watermarks()

