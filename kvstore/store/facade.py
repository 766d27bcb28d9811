"""The Store: put / lookup / get / evict / stats and leases over an ordered chain of tiers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch

from kvstore.api import (
    BlockInfo,
    Lease,
    LookupResult,
    Medium,
    ModelProfile,
    PinInfo,
    Reservation,
    StoreStats,
)
from kvstore.config import KVStoreConfig
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import BlockKey, Namespace, token_array
from kvstore.page import PageMeta
from kvstore.policy import UseHistory, build_order
from kvstore.policy.base import EvictionOrder
from kvstore.room import Footprint
from kvstore.spec import FLOAT_DTYPE_NAMES, KVSpec
from kvstore.store.demotion import Demoter
from kvstore.store.directory import BlockDirectory, BlockEntry
from kvstore.store.events import EventSink, tier_media
from kvstore.store.groups import match_groups, pin_keys, pin_order
from kvstore.store.held import HeldTable
from kvstore.store.hints import HintPolicy, Hints, hint_policy
from kvstore.store.inventory import Inventory
from kvstore.store.leases import REAPER_INTERVAL_S, LeaseManager
from kvstore.store.namespaces import NAMESPACES_FILE, NamespaceRecords
from kvstore.store.pins import PINS_FILE, PinTable
from kvstore.store.placement import Link, Placement
from kvstore.store.reads import PinnedKV, Reads
from kvstore.store.reservations import Reservations, page_bound
from kvstore.store.shared import Shared, directory_observer
from kvstore.store.slices import LoopShare
from kvstore.store.write_through import WriteThrough
from kvstore.store.writes import Writes
from kvstore.tiers.base import DevicePages, FdRegions, HostPinning, Tier

log = logging.getLogger("kvstore.store")

Tokens = Sequence[int] | torch.Tensor

def _state_dir(links: Sequence[Link]) -> Path | None:
    """Where the store keeps its own small state (pins, namespace records): the directory of
    the first persistent tier, so it lives and goes with the blocks it describes."""
    for link in links:
        path = getattr(link.settings, "path", "")
        if link.tier.is_persistent and path:
            return Path(path)
    return None


def _check_single(ns: Namespace, verb: str) -> None:
    """InvalidArgument for a grouped namespace where only one group's is meant: pages are
    stored, read and held per group (``Namespace.group``)."""
    if ns.is_grouped:
        raise InvalidArgument(f"{verb} takes one group's namespace (Namespace.group(i)); a "
                              "namespace of several groups is for lookup and evict")


def _observers(*observers: Callable[[PageMeta, str, bool], None] | None
               ) -> Callable[[PageMeta, str, bool], None] | None:
    """One directory observer that tells each of ``observers`` (None where none is given)."""
    chosen = [o for o in observers if o is not None]
    if len(chosen) < 2:
        return chosen[0] if chosen else None

    def observe(meta: PageMeta, tier: str, is_held: bool) -> None:
        for observer in chosen:
            observer(meta, tier, is_held)

    return observe


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


class Store:
    """An embedded, asyncio KV block store over the tier chain of ``config``; the daemon serves
    one of these.

    The verbs are here; the work is done by composed parts: ``Writes`` (puts), ``Reads``
    (gets and advice), ``Shared`` (the shared tier), ``WriteThrough`` (new blocks copied to
    the tiers that take every one, by default the shared tier), ``Placement`` (the chain's rules),
    ``LeaseManager`` and ``Reservations`` over one ``HeldTable``, ``Hints``, ``Demoter`` and
    ``Inventory`` (counters, stats, listing, eviction). All methods run on one event loop;
    codec and copy work goes to threads.
    """

    def __init__(self, config: KVStoreConfig | None = None) -> None:
        self.config = config or KVStoreConfig()
        links = [Link.build(i, link) for i, link in enumerate(self.config.tier_chain())]
        self.tiers: dict[str, Tier] = {link.name: link.tier for link in links}
        history = UseHistory()
        orders = {link.name: _eviction_order(links, link.index, history) for link in links}
        events = self.config.events
        # The store's KV events (store/events.py), when a publisher is configured to read them.
        self.events: EventSink | None = EventSink(
            tier_media([(t.name, t.kind) for t in self.config.tier_chain()], events.media),
            events.queue_events) if events.enabled else None
        self._dir = BlockDirectory(list(orders), orders.__getitem__,
                                   observer=_observers(
                                       directory_observer(links),
                                       None if self.events is None else self.events.observe))
        self._held = HeldTable(self.config.quota, self.config.server.lease_timeout_s)
        self._inventory = Inventory(links, self._dir, self._held)
        self._count = self._inventory.count
        share = self.config.quota.share(len(self.config.server.tenant_tokens))
        self._placement = Placement(links, self._dir, self._count, share)
        self._leases = LeaseManager(self._dir, self._placement, self._held)
        self._reservations = Reservations(self._dir, self._placement, self._held, self._count)
        self._hints = Hints(self._dir, self._placement, self._count, self._spawn)
        self._writes = Writes(self._dir, self._placement)
        self._reads = Reads(self._dir, self._placement)
        self._shared = Shared(self._dir, self._placement, self._count)
        self._demoter = Demoter(self._placement)
        self._write_through = WriteThrough(self._dir, self._placement)
        state = _state_dir(links)
        budget = self.config.quota.pin_budget_bytes(len(self.config.server.tenant_tokens),
                                                    links[0].tier.capacity_bytes)
        self._pins = PinTable(self._dir, budget, state and state / PINS_FILE)
        self._namespaces = NamespaceRecords(state and state / NAMESPACES_FILE)
        # Long requests in bounded slices of the loop, few per tenant at once (slices.py).
        self.share = LoopShare()
        self._background: set[asyncio.Task[Any]] = set()
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
        await self._namespaces.load()
        self._namespaces.prune(e.meta.namespace for e in self._dir.entries())
        if await self._pins.load():
            log.info("restored %d pins", len(self._pins.list()))
        self._demoter.open()
        self._write_through.open()
        self._spawn(self._demoter.run())
        self._spawn(self._pins.run())
        self._spawn(self._housekeeping())
        self._spawn(self._leases.reaper())
        self._spawn(self._reservations.reaper())
        self._is_open = True
        log.info("store open: %d blocks restored", len(self._dir))

    async def close(self, grace_s: float | None = None) -> None:
        """Stop background work, persist memory-only blocks if configured, close the tiers.

        Args:
            grace_s: how long blocks still queued for write-through tiers may take to be
                written (default ``server.shutdown_grace_s``); what is left is dropped.
        """
        if not self._is_open:
            return
        self._is_open = False
        grace = self.config.server.shutdown_grace_s if grace_s is None else grace_s
        await self._write_through.close(grace)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self._pins.save()
        await self._namespaces.save()
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
        _check_single(ns, "put")
        self._check_codec(ns)
        arr = token_array(tokens)
        kv = ns.spec.check_kv(kv, num_tokens=arr.size)
        keys = await self._keys(ns, arr)
        self._namespaces.note(ns)
        self._placement.note(keys)
        self._count(ns.tenant, puts=1)
        if self.events is not None:
            self.events.expect(ns, keys, arr)
        try:
            stored = await self._writes.put(ns, keys, kv)
        finally:
            if self.events is not None:
                self.events.forget(keys)
        self._stored(stored)
        self._count(ns.tenant, put_tokens=len(stored) * ns.spec.block_tokens)
        return len(stored) * ns.spec.block_tokens

    async def lookup(self, ns: Namespace, tokens: Tokens) -> LookupResult:
        """The longest stored prefix of ``tokens`` and which tier holds each of its blocks.

        A grouped namespace (``Namespace.is_grouped``) gets the longest prefix at which every
        group is whole (``kvstore.store.groups``), the shared tier's pages included; its hints
        and pins cover every page of that hit."""
        self._check_open()
        arr = token_array(tokens)
        if ns.is_grouped:
            return await self._lookup_groups(ns, arr)
        bt = ns.spec.block_tokens
        # A long prompt's hashing, probing and sightings go in slices, within one of its
        # tenant's turns: other tenants' calls run between the slices (store/slices.py).
        share = self.share
        async with share.turn(ns.tenant, arr.size // bt):
            all_keys = await share.keys(ns, arr)
            self._hints.arrived(ns.tenant, all_keys)  # a hinted request is here: it loads itself
            entries, per_tier = await share.match_prefix(self._dir, all_keys, bt)
            # Each step over the whole chain (a copy, a free, a touch) takes a loop turn of
            # its own: at 262,144 blocks each costs 1-4 ms, together they held the loop 9 ms.
            heavy = share.is_heavy(len(all_keys))
            if heavy:
                await share.pause()
            shared_keys, cluster_tokens = await self._shared.probe(ns, all_keys, len(entries))
            await share.truncate(all_keys, 0)  # the hashed keys go, a slice at a time
            keys = await share.stored_keys(entries)
            self._dir.touch(entries, keys=keys)
            if shared_keys:
                name = self._placement.shared_link().name
                per_tier[name] = per_tier.get(name, 0) + len(shared_keys) * bt
                keys += shared_keys
            if heavy:
                await share.pause()
            await share.each(keys, self._placement.note)
            advised = await self._reads.advise(ns, entries, len(shared_keys), arr.size, share)
        matched = len(keys) * bt
        self._count(ns.tenant, lookups=1, lookup_hit_tokens=matched,
                    lookup_miss_tokens=arr.size - matched)
        return LookupResult(arr.size, matched, per_tier, keys, advised_tokens=advised,
                            cluster_tokens=cluster_tokens)

    async def _lookup_groups(self, ns: Namespace, arr: np.ndarray) -> LookupResult:
        bt = ns.spec.block_tokens
        async with self.share.turn(ns.tenant, arr.size // bt * len(ns.cache.groups)):
            n, needed, keys, from_shared = await match_groups(
                self._dir, self.share, ns, arr, self._placement.note, self._shared)
            if self._hints.is_pending(ns.tenant):  # a hinted request is here: it loads itself
                self._hints.arrived(ns.tenant, await pin_keys(self.share, ns, arr))
        # A hit's pages are used together: each group's are touched as one chain, so the
        # eviction orders see them at the same recency (a state snapshot without its
        # attention prefix, or the reverse, is worth nothing).
        for entries in needed:
            self._dir.touch(entries)
        per_tier: dict[str, int] = {}
        if from_shared:  # the hit loads as fast as its slowest page: counted there
            per_tier[self._placement.shared_link().name] = n * bt
        elif n:
            slowest = {name: i for i, name in enumerate(self._dir.tier_names)}
            worst = max((slowest[e.fastest] for group in needed for e in group), default=0)
            per_tier[self._dir.tier_names[worst]] = n * bt
        matched = n * bt
        self._count(ns.tenant, lookups=1, lookup_hit_tokens=matched,
                    lookup_miss_tokens=arr.size - matched)
        return LookupResult(arr.size, matched, per_tier, tuple(keys))

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
        keys = await self._keys(ns, arr)
        self._namespaces.note(ns)  # blocks the shared tier holds may be brought in
        await self._shared.adopt(ns, keys)
        got = await self._reads.get(ns, keys, front)
        if got is None:
            return None
        out, below = got
        for entry in below:  # a block fetched from further down is likely reused
            self._spawn(self._promote(entry, self._placement.links[0]))
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
        keys = await self._keys(ns, token_array(tokens))
        self._namespaces.note(ns)  # blocks the shared tier holds may be brought in
        await self._shared.adopt(ns, keys)
        pinned = await self._reads.in_place(ns, keys)
        if pinned is not None:
            self._count(ns.tenant, gets=1, get_tokens=pinned.shape[2])
        return pinned

    async def evict(self, *, tenant: str | None = None, model_id: str | None = None,
                    keys: Sequence[BlockKey] | None = None, everything: bool = False,
                    revision: str | None = None, adapter_id: str | None = None,
                    namespace: Namespace | bytes | None = None) -> int:
        """Remove matching blocks from every tier, children first; return the count. Every
        given filter must match.

        ``revision`` (also the weights epoch: an engine that updates weights in place names the
        epoch in its namespace's revision, e.g. ``"main+e3"``, so new blocks get new keys),
        ``adapter_id`` and ``namespace`` (a Namespace or its fingerprint) make it an
        invalidation: matching blocks go even when pinned (their TTL pins end), and none is
        seen by a lookup, get or lease started after this returns (a block a lease holds is
        deleted once released). Revision and adapter are matched through the namespaces this
        store wrote blocks in (``kvstore.store.namespaces``). Otherwise pinned blocks stay.
        """
        self._check_open()
        fingerprints = None
        if revision is not None or adapter_id is not None:
            fingerprints = self._namespaces.matching(revision=revision, adapter_id=adapter_id)
        if namespace is not None:
            if isinstance(namespace, Namespace):  # a grouped one: every group's pages
                fps = {namespace.group(g).fingerprint for g in range(len(namespace.cache.groups))}
            else:
                fps = {bytes(namespace)}
            fingerprints = fps if fingerprints is None else fingerprints & fps
        removed = await self._inventory.evict(tenant=tenant, model_id=model_id, keys=keys,
                                              everything=everything, namespaces=fingerprints,
                                              unpin=self._pins.forget)
        if everything and self.events is not None and not len(self._dir):
            self.events.cleared()
        return removed

    async def pin(self, ns: Namespace, tokens: Tokens, ttl_s: float) -> PinInfo:
        """Keep the stored prefix of ``tokens`` in the cache for ``ttl_s`` seconds, where it
        lies (``kvstore.store.pins``: neither demoted nor dropped), across restarts.

        CapacityError naming the bytes asked, pinned and the budget (``quota.pin_bytes``)
        when the tenant's pins would exceed it. A prefix with nothing stored pins nothing
        (``num_blocks`` 0). A grouped namespace pins, as one pin, every page of every group
        that its lookup's hit needs (``kvstore.store.groups``)."""
        self._check_open()
        arr = token_array(tokens)
        if ns.is_grouped:  # every page the grouped hit needs, whatever its group
            return self._pins.pin_entries(ns, await self._hit_pages(ns, arr), ttl_s)
        return self._pins.pin(ns, await self._keys(ns, arr), ttl_s)

    async def unpin(self, ns: Namespace, tokens: Tokens) -> int:
        """End ``ns``'s tenant's pins of every prefix of ``tokens``; return how many ended."""
        self._check_open()
        arr = token_array(tokens)
        if ns.is_grouped:
            async with self.share.turn(ns.tenant, arr.size // ns.spec.block_tokens):
                return self._pins.unpin(ns.tenant, await pin_keys(self.share, ns, arr))
        return self._pins.unpin(ns.tenant, await self._keys(ns, arr))

    def list_pins(self, tenant: str | None = None) -> list[PinInfo]:
        """TTL pins of ``tenant`` (None: all), soonest to expire first."""
        return self._pins.list(tenant)

    def stats(self, tenant: str | None = None) -> StoreStats:
        """Counters per tier and per request type; with ``tenant``, only that tenant's blocks."""
        stats = self._inventory.stats(tenant)
        if tenant is None:
            self._write_through.add_stats(stats.tiers)
        return stats

    def list_blocks(self, *, tenant: str | None = None, model_id: str | None = None,
                    tier: str | None = None, limit: int = 1000) -> list[BlockInfo]:
        """Stored blocks matching the filters, most recently used first."""
        return self._inventory.list_blocks(tenant=tenant, model_id=model_id, tier=tier,
                                           limit=limit)

    def check_holder(self, held_id: str, kind: str, caller_tenant: str | None) -> None:
        """PermissionDenied if lease or reservation ``held_id`` (``kind`` names what the caller
        takes it for) is another tenant's than ``caller_tenant`` (None: a caller who may end
        any); a caller that ends one on a tenant's behalf asks this first."""
        self._held.check_holder(held_id, kind, caller_tenant)

    async def acquire(self, ns: Namespace, tokens: Tokens, lease_s: float | None = None,
                      medium: Medium = Medium.HOST, first_block: int = 0,
                      device: str = "") -> Lease:
        """Pin the stored prefix of ``tokens`` where same-host clients map it, until
        ``release`` or the lease's deadline; blocks only the shared tier holds are brought in
        first, as for ``get``. ``first_block``: pin the prefix's blocks from this one on.
        ``device``: the caller's GPU (``kvstore.ipc.device_id``), where blocks promoted into a
        GPU tier land while it has room there."""
        self._check_open()
        keys = await self._keys(ns, token_array(tokens))
        self._hints.arrived(ns.tenant, keys)
        self._namespaces.note(ns)  # blocks the shared tier holds may be brought in
        await self._shared.adopt(ns, keys)
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
        _check_single(ns, "reserve")
        self._check_codec(ns)
        self._namespaces.note(ns)
        arr = token_array(tokens)
        keys = await self._keys(ns, arr)
        if self.events is None:
            return await self._reservations.reserve(ns, keys, lease_s, Medium(medium), device)
        self.events.expect(ns, keys, arr)  # the commit's stored events carry these tokens
        try:
            reservation = await self._reservations.reserve(ns, keys, lease_s, Medium(medium),
                                                           device)
        except BaseException:
            self.events.forget(keys)
            raise
        reserved = set(self._reservations.reserved_keys(reservation.reservation_id))
        self.events.forget([key for key in keys if key not in reserved])
        return reservation

    async def commit(self, reservation_id: str, ready_event: bytes = b"") -> int:
        """Publish what a writer put into a reservation's slots; ``ready_event`` is the IPC
        handle of a CUDA event it recorded after writing device slots."""
        self._check_open()
        keys = self._reservations.reserved_keys(reservation_id)
        try:
            written = await self._reservations.commit(reservation_id, ready_event)
        finally:
            if self.events is not None:
                self.events.forget(keys)
        self._stored([e for e in map(self._dir.get, keys) if e is not None] if written else [])
        return written

    async def abort(self, reservation_id: str) -> None:
        """Free a reservation's slots (a writer that gave up); LeaseNotFound if unknown."""
        self._check_open()
        if self.events is not None:
            self.events.forget(self._reservations.reserved_keys(reservation_id))
        self._reservations.abort(reservation_id)

    async def hint(self, ns: Namespace, tokens: Tokens, deadline_s: float,
                   policy: str | HintPolicy = HintPolicy.BEST_EFFORT) -> int:
        """Promote the stored prefix of ``tokens`` into the fastest tier ahead of a queued
        request (kvstore.store.hints): returns the blocks scheduled, or with ``wait`` those
        that landed in time. The hint ends when a lookup or acquire of the prefix by the same
        tenant arrives, or on ``cancel_hint``."""
        self._check_open()
        arr = token_array(tokens)
        if ns.is_grouped:  # every page the grouped hit needs, named as its pin would be
            keys = [e.meta.key for e in await self._hit_pages(ns, arr)]
            if not keys:
                return 0
        else:
            keys = await self._keys(ns, arr)
        return await self._hints.hint(ns, keys, deadline_s, hint_policy(policy))

    async def cancel_hint(self, ns: Namespace, tokens: Tokens) -> int:
        """The hinted request for ``tokens`` was dropped: end the tenant's hints for that
        prefix (what had not landed counts as cancelled). Returns how many hints ended."""
        self._check_open()
        return self._hints.arrived(ns.tenant, await self._hint_keys(ns, token_array(tokens)))

    async def _hit_pages(self, ns: Namespace, arr: np.ndarray) -> list[BlockEntry]:
        """The pages held here that grouped ``ns``'s hit on ``arr`` needs, ``ns``'s tenant's
        only, in ``pin_order`` (the page that names a pin or hint last)."""
        async with self.share.turn(ns.tenant, arr.size // ns.spec.block_tokens):
            _, needed, _, _ = await match_groups(self._dir, self.share, ns, arr,
                                                 lambda keys: None)
        return [e for e in pin_order(ns, needed) if e.meta.tenant == ns.tenant]

    async def _hint_keys(self, ns: Namespace, arr: np.ndarray) -> list[BlockKey]:
        """The keys that may name a hint (or pin) of a prefix of ``arr``."""
        if not ns.is_grouped:
            return await self._keys(ns, arr)
        async with self.share.turn(ns.tenant, arr.size // ns.spec.block_tokens):
            return await pin_keys(self.share, ns, arr)

    def set_model_profile(self, ns: Namespace, profile: ModelProfile) -> None:
        """What prefill of ``ns``'s model costs; lookups in it then advise how much to fetch.
        Kept per tenant and model: one tenant's reports never steer another's advice."""
        self._reads.set_model_profile(ns, profile)

    def report_prefill(self, ns: Namespace, new_tokens: int, cached_tokens: int,
                       seconds: float) -> None:
        """The engine prefilled ``new_tokens`` after ``cached_tokens`` in ``seconds``: corrects
        the model's FLOP rate (ignored until a profile is set)."""
        self._reads.report_prefill(ns, new_tokens, cached_tokens, seconds)

    def slot_page_bytes(self, spec: KVSpec) -> int:
        """The slot a zero-copy writer gets for one block of ``spec`` (0 if no tier lends)."""
        link = self._placement.slot_link()
        return 0 if link is None else page_bound(link.codec, spec)

    # ----------------------------------------------------------------------------- internals

    def _check_codec(self, ns: Namespace) -> None:
        """InvalidArgument when the fastest tier's codec is lossy and ``ns``'s pages are bytes
        (an fp8 engine cache, a state group): those are stored raw or zstd only."""
        codec = self._placement.links[0].codec
        if ns.spec.dtype not in FLOAT_DTYPE_NAMES and not codec.lossless:
            raise InvalidArgument(
                f"tier {self._placement.links[0].name!r} encodes with the lossy codec "
                f"{codec.name!r}, which re-encodes only bfloat16/float16/float32 attention and "
                f"latent groups; {ns.spec.dtype} pages (fp8 engine caches, state groups) need "
                "a raw or zstd tier")

    async def _keys(self, ns: Namespace, tokens: np.ndarray) -> list[BlockKey]:
        """The block keys of ``tokens`` under ``ns``: a long prompt's hashed in slices, in
        one of its tenant's turns (store/slices.py)."""
        _check_single(ns, "this call")
        async with self.share.turn(ns.tenant, tokens.size // ns.spec.block_tokens):
            return await self.share.keys(ns, tokens)

    def _check_open(self) -> None:
        if not self._is_open:
            raise KVStoreError("store is not open (use 'async with Store(config)')")

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _stored(self, entries: list[BlockEntry]) -> None:
        """New blocks were written: wake the demoter, queue them for write-through tiers
        (never waits: a full queue drops and counts)."""
        self._demoter.wake()
        if entries:
            self._write_through.offer(entries)

    async def _housekeeping(self) -> None:
        """Background: delete invalidated blocks once released, bound and save the
        namespace records."""
        while True:
            await asyncio.sleep(REAPER_INTERVAL_S)
            try:
                await self._inventory.sweep()
                if self._namespaces.needs_prune():
                    self._namespaces.prune(e.meta.namespace for e in self._dir.entries())
                if self._namespaces.dirty:
                    await self._namespaces.save()
            except (KVStoreError, OSError):
                log.exception("store housekeeping failed; retrying")

    async def _promote(self, entry: BlockEntry, target: Link) -> None:
        if await self._placement.promote(entry, target):
            self._demoter.wake()
