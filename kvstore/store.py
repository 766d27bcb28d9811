"""The tier manager: put / lookup / get / evict / leases over the DRAM and SSD tiers (asyncio)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Self

import torch

from kvstore import codecs
from kvstore.api import (
    BlockInfo,
    BlockLocation,
    Counters,
    Lease,
    LookupResult,
    Reservation,
    SlotGrant,
    StoreStats,
    TierStats,
)
from kvstore.config import KVStoreConfig
from kvstore.decode import PageDecoder, decode_pages
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError, shown
from kvstore.index import BlockDirectory, BlockEntry
from kvstore.keys import BlockKey, Namespace, block_keys, token_array
from kvstore.leases import LeaseManager
from kvstore.page import HEADER_BYTES, MAX_META_BYTES, Page, PageMeta, encode_page
from kvstore.tiers.base import Tier
from kvstore.tiers.dram import DramTier
from kvstore.tiers.ssd import SsdTier

log = logging.getLogger("kvstore.store")

__all__ = ["BlockInfo", "BlockLocation", "Counters", "Lease", "LookupResult", "Reservation",
           "SlotGrant", "Store", "StoreStats"]

TIER_ORDER = ("dram", "ssd")  # fastest first: reads come from the first tier holding a block


@dataclass(slots=True)
class _Encoded:
    meta: PageMeta
    data: bytes


class Store:
    """An embedded, asyncio KV block store; the daemon serves one of these.

    All methods run on one event loop; codec and copy work goes to threads.
    """

    def __init__(self, config: KVStoreConfig | None = None) -> None:
        self.config = config or KVStoreConfig()
        self.dram = DramTier(self.config.dram)
        self.ssd: SsdTier | None = SsdTier(self.config.ssd) if self.config.ssd.enabled else None
        self.tiers: dict[str, Tier] = {"dram": self.dram}
        if self.ssd is not None:
            self.tiers["ssd"] = self.ssd
        self._codecs = {"dram": codecs.get(self.config.dram.codec),
                        "ssd": codecs.get(self.config.ssd.codec)}
        self._dir = BlockDirectory(self.tiers)
        self._leases: LeaseManager | None = None  # set in open()
        # Blocks being written (by a put or a reservation); a put of the same block waits on it.
        self._writing: dict[BlockKey, asyncio.Future[None]] = {}
        self._totals = Counters()
        self._by_tenant: dict[str, Counters] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._demote_wakeup: asyncio.Event | None = None
        self._is_open = False

    # ----------------------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        """Open every tier and rebuild the directory from what persistent tiers hold."""
        for tier in self.tiers.values():
            await tier.open()
        for name, tier in self.tiers.items():
            for meta in tier.entries():
                self._dir.place(meta, name, tier.page_size(meta.key))
        self._leases = LeaseManager(self)
        self._demote_wakeup = asyncio.Event()
        self._spawn(self._demoter())
        self._spawn(self._leases.reaper())
        self._is_open = True
        log.info("store open: %d blocks restored", len(self._dir))

    async def close(self) -> None:
        """Stop background work, persist DRAM-only blocks if configured, close the tiers."""
        if not self._is_open:
            return
        self._is_open = False
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.ssd is not None and self.config.ssd.persist_on_close:
            await self._persist_dram()
        for tier in self.tiers.values():
            await tier.close()

    # ----------------------------------------------------------------------------- requests

    async def put(self, ns: Namespace, tokens: Sequence[int] | torch.Tensor, kv: torch.Tensor
                  ) -> int:
        """Store the full blocks of ``kv`` for ``tokens``; return the tokens newly written.

        ``kv`` is in the canonical layout with exactly ``len(tokens)`` tokens; blocks already
        stored are not rewritten and a trailing partial block is ignored.
        """
        self._check_open()
        arr = token_array(tokens)
        kv = ns.spec.check_kv(kv, num_tokens=arr.size)
        keys = block_keys(ns, arr)
        if self.ssd is not None:
            self.ssd.note_accesses(keys)
        in_flight = [self._writing[k] for k in keys if k in self._writing]
        todo = [i for i, k in enumerate(keys) if k not in self._dir and k not in self._writing]
        self._count(ns.tenant, puts=1)
        claimed = self.claim_writes(keys[i] for i in todo)
        written = 0
        try:
            if todo:
                encoded = await asyncio.to_thread(self._encode_blocks, ns, keys, kv, todo)
                for block in encoded:
                    written += await self._store_new(block)
        finally:
            self.release_writes(claimed)
        if in_flight:  # another writer is storing some of these blocks: return once it has
            await asyncio.gather(*(asyncio.shield(f) for f in in_flight))
        self._dir.touch(self._dir.match_prefix(keys), hit=False)
        self._wake_demoter()
        self._count(ns.tenant, put_tokens=written * ns.spec.block_tokens)
        return written * ns.spec.block_tokens

    async def lookup(self, ns: Namespace, tokens: Sequence[int] | torch.Tensor) -> LookupResult:
        """The longest stored prefix of ``tokens`` and which tier holds each of its blocks."""
        self._check_open()
        arr = token_array(tokens)
        keys = block_keys(ns, arr)
        entries = self._dir.match_prefix(keys)
        bt = ns.spec.block_tokens
        per_tier: dict[str, int] = {}
        for entry in entries:
            tier = self._fastest_tier(entry)
            per_tier[tier] = per_tier.get(tier, 0) + bt
        self._dir.touch(entries)
        if self.ssd is not None:
            self.ssd.note_accesses([e.meta.key for e in entries])
        matched = len(entries) * bt
        self._count(ns.tenant, lookups=1, lookup_hit_tokens=matched,
                    lookup_miss_tokens=arr.size - matched)
        return LookupResult(arr.size, matched, per_tier, tuple(e.meta.key for e in entries))

    async def get(self, ns: Namespace, tokens: Sequence[int] | torch.Tensor
                  ) -> torch.Tensor | None:
        """K/V of the longest stored prefix of ``tokens`` (canonical layout), or None.

        The blocks are read concurrently without verification, and each is verified on a
        decode thread right before it is decoded, as soon as it is read. A block that fails is
        read again, verified (the tier drops and counts a corrupt copy; the next tier may serve
        the block), and the prefix ends at the first block that cannot be served: only
        verified bytes are returned.
        """
        self._check_open()
        entries = self._dir.match_prefix(block_keys(ns, token_array(tokens)))
        if not entries:
            return None
        bt = ns.spec.block_tokens
        out = torch.empty(ns.spec.shape(len(entries) * bt), dtype=ns.spec.torch_dtype)
        outs = out.split(bt, dim=2)
        self._dir.pin(entries)
        try:
            async with PageDecoder(outs) as decoder:
                sources = await self._read_pages(entries, decoder.add)
            failed = [i for i in decoder.failed if i < len(sources)]  # after a miss: unused
            num_blocks = await self._redo_failed(entries, failed, sources, outs)
        finally:
            self._dir.unpin(entries)
        if num_blocks == 0:
            return None
        if num_blocks < len(entries):  # copy out the verified prefix: the rest is not returned
            out = out[:, :, :num_blocks * bt].clone()
        self._dir.touch(entries[:num_blocks])
        for entry, source in zip(entries[:num_blocks], sources):
            if source == "ssd":  # a block fetched from SSD is likely reused: bring it up
                self._spawn(self.promote(entry))
        self._count(ns.tenant, gets=1, get_tokens=out.shape[2])
        return out

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
        for entry in chosen:
            for name in list(entry.sizes):
                await self.tiers[name].delete(entry.meta.key)
                self._dir.unplace(entry.meta.key, name)
        return len(chosen)

    def stats(self, tenant: str | None = None) -> StoreStats:
        """Counters per tier and per request type; with ``tenant``, only that tenant's blocks."""
        if tenant is None:
            return StoreStats(
                tiers={name: t.stats() for name, t in self.tiers.items()},
                counters=dataclasses.replace(self._totals),
                active_leases=self._leases.num_leases if self._leases else 0,
                active_reservations=(self._leases.num_reservations
                                     if self._leases else 0),
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

    # Leases, reservations and hints live in kvstore.leases; these delegate to it.

    async def acquire(self, ns: Namespace, tokens: Sequence[int] | torch.Tensor,
                      lease_s: float | None = None) -> Lease:
        self._check_open()
        return await self._leases.acquire(ns, tokens, lease_s)

    async def release(self, lease_id: str) -> None:
        self._check_open()
        self._leases.release(lease_id)

    async def reserve(self, ns: Namespace, tokens: Sequence[int] | torch.Tensor,
                      lease_s: float | None = None) -> Reservation:
        self._check_open()
        return await self._leases.reserve(ns, tokens, lease_s)

    async def commit(self, reservation_id: str) -> int:
        self._check_open()
        return await self._leases.commit(reservation_id)

    async def abort(self, reservation_id: str) -> None:
        """Free a reservation's slots (a writer that gave up); LeaseNotFound if unknown."""
        self._check_open()
        self._leases.abort(reservation_id)

    async def hint(self, ns: Namespace, tokens: Sequence[int] | torch.Tensor,
                   deadline_s: float) -> int:
        self._check_open()
        return self._leases.hint(ns, tokens, deadline_s)

    # ----------------------------------------------------------------------------- internals

    def claim_writes(self, keys) -> list[BlockKey]:
        """Mark blocks as being written so concurrent puts wait instead of writing twice."""
        loop = asyncio.get_running_loop()
        claimed = []
        for key in keys:
            self._writing[key] = loop.create_future()
            claimed.append(key)
        return claimed

    def release_writes(self, keys) -> None:
        for key in keys:
            future = self._writing.pop(key, None)
            if future is not None and not future.done():
                future.set_result(None)

    def _check_open(self) -> None:
        if not self._is_open:
            raise KVStoreError("store is not open (use 'async with Store(config)')")

    def _count(self, tenant: str, **deltas: int) -> None:
        for counters in (self._totals, self._by_tenant.setdefault(tenant, Counters())):
            for name, delta in deltas.items():
                setattr(counters, name, getattr(counters, name) + delta)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def dram_page_bound(self, spec) -> int:
        """Upper bound on the encoded page of one block of ``spec`` in DRAM (slot size to
        reserve for zero-copy writers)."""
        codec = self._codecs["dram"]
        payload = codec.bytes_per_element(spec) * spec.elements_per_block
        # zstd can expand incompressible data by a few bytes per 128 KiB block plus its frame.
        slack = 64 + spec.block_bytes // 1024 if "zstd" in codec.name else 0
        return HEADER_BYTES + MAX_META_BYTES // 64 + int(payload) + 64 + slack

    def _fastest_tier(self, entry: BlockEntry) -> str:
        return next(name for name in TIER_ORDER if name in entry.sizes)

    def _encode_blocks(self, ns: Namespace, keys: list[BlockKey], kv: torch.Tensor,
                       todo: list[int]) -> list[_Encoded]:
        """Encode the blocks at ``todo`` into pages (runs in a worker thread)."""
        bt = ns.spec.block_tokens
        codec = self._codecs["dram"]
        kv = kv.detach().cpu()
        out = []
        for i in todo:
            meta = PageMeta(key=keys[i], namespace=ns.fingerprint,
                            parent=keys[i - 1] if i else None, block_index=i,
                            tenant=ns.tenant, model_id=ns.model_id, codec=codec.name,
                            codec_id=codec.codec_id)
            payload = codec.encode(kv[:, :, i * bt:(i + 1) * bt])
            out.append(_Encoded(meta, encode_page(meta, payload)))
        return out

    async def _store_new(self, block: _Encoded) -> int:
        """Place a freshly encoded page in DRAM, or straight on SSD if DRAM cannot take it."""
        if await self._write(self.dram, "dram", block.meta, block.data):
            return 1
        if self.ssd is not None:
            data = await self._transcode(block.meta, block.data, "ssd")
            if await self._write(self.ssd, "ssd", block.meta, data, force=True):
                return 1
        raise CapacityError(f"no tier can hold a {len(block.data)}-byte page "
                            f"(dram capacity {self.dram.capacity_bytes})")

    async def _write(self, tier: Tier, name: str, meta: PageMeta, data: bytes | memoryview,
                     force: bool = False) -> bool:
        """Make room in ``tier`` and write; record the placement on success."""
        if not await self._make_room(name, len(data)):
            return False
        ok = (await tier.write(meta.key, data, meta, force=force) if name == "ssd"
              else await tier.write(meta.key, data, meta))
        if ok:
            self._dir.place(meta, name, len(data))
        return ok

    async def _make_room(self, name: str, nbytes: int) -> bool:
        tier = self.tiers[name]
        for victim in self._dir.victims(name):
            if tier.can_write(nbytes):
                return True
            await self._evict_one(name, victim)
        return tier.can_write(nbytes)

    async def _evict_one(self, name: str, key: BlockKey) -> None:
        """Give up ``key`` in tier ``name``: demote DRAM blocks to SSD first if SSD admits them."""
        entry = self._dir.get(key)
        if entry is None or entry.pins:
            return
        if name == "dram" and self.ssd is not None and "ssd" not in entry.sizes:
            self._dir.pin([entry])  # the page view must outlive the SSD write
            try:
                page = await self.dram.read(key)
                if page is not None:
                    data = await self._transcode(entry.meta, page.data, "ssd")
                    if await self._write(self.ssd, "ssd", entry.meta, data):
                        self._count(entry.meta.tenant, demotions=1)
            finally:
                self._dir.unpin([entry])
            if entry.pins:  # a reader arrived while we were writing; keep it in DRAM
                return
        tier = self.tiers[name]
        if name == "dram":
            await tier.delete(key, evicted=True)
        else:
            await tier.delete(key)
        if self._dir.unplace(key, name) is None:
            self._count(entry.meta.tenant, dropped=1)

    async def _transcode(self, meta: PageMeta, data: bytes | memoryview, target: str
                         ) -> bytes | memoryview:
        """The page re-encoded with ``target``'s codec (unchanged if it already matches)."""
        codec = self._codecs[target]
        if meta.codec == codec.name:
            return data

        def work() -> bytes:
            from kvstore.page import decode_page

            kv = codecs.decode(decode_page(data).payload)
            new_meta = dataclasses.replace(meta, codec=codec.name, codec_id=codec.codec_id)
            return encode_page(new_meta, codec.encode(kv))

        return await asyncio.to_thread(work)

    async def _read_pages(self, entries: list[BlockEntry],
                          on_page: Callable[[int, Page], None]) -> list[str]:
        """Read pinned entries concurrently from their fastest tiers, unverified, handing each
        page to ``on_page(index, page)`` as it arrives (the caller verifies it before any use);
        return the tier each block came from, up to the first that could not be read (the
        prefix ends there)."""

        async def read(i: int, entry: BlockEntry) -> str | None:
            page, source = await self._read_entry(entry, verify=False)
            if page is not None:
                on_page(i, page)
            return source

        sources = await asyncio.gather(*(read(i, e) for i, e in enumerate(entries)))
        return list(itertools.takewhile(lambda source: source is not None, sources))

    async def _read_entry(self, entry: BlockEntry, verify: bool = True
                          ) -> tuple[Page | None, str | None]:
        for name in TIER_ORDER:
            if name not in entry.sizes:
                continue
            page = await self.tiers[name].read(entry.meta.key, verify=verify)
            if page is not None:
                return page, name
            self._dir.unplace(entry.meta.key, name)  # corrupt or lost: forget this copy
        return None, None

    async def _redo_failed(self, entries: list[BlockEntry], failed: list[int],
                           sources: list[str], outs: Sequence[torch.Tensor]) -> int:
        """Read the blocks at ``failed`` (ascending) again, verified, and decode them; return
        how many leading blocks hold verified K/V (``len(sources)`` when all read ones do)."""
        for i in failed:
            page, source = await self._read_entry(entries[i], verify=True)
            if page is None or await decode_pages([page], [outs[i]]):
                return i
            sources[i] = source
        return len(sources)

    async def promote(self, entry: BlockEntry) -> bool:
        """Copy an SSD-only block into DRAM; True if it is in DRAM afterwards."""
        key = entry.meta.key
        if "dram" in entry.sizes:
            return True
        if self.ssd is None or "ssd" not in entry.sizes or self._dir.get(key) is not entry:
            return False
        self._dir.pin([entry])
        try:
            page = await self.ssd.read(key)
            if page is None:
                self._dir.unplace(key, "ssd")
                return False
            data = await self._transcode(entry.meta, page.data, "dram")
            if "dram" in entry.sizes:  # another promotion won the race
                return True
            ok = await self._write(self.dram, "dram", entry.meta, bytes(data))
        finally:
            self._dir.unpin([entry])
        if ok:
            self._count(entry.meta.tenant, promotions=1)
            self._wake_demoter()
        return ok

    def _wake_demoter(self) -> None:
        cfg = self.config.dram
        if self.dram.used_bytes > cfg.high_watermark * self.dram.capacity_bytes:
            self._demote_wakeup.set()

    async def _demoter(self) -> None:
        """Background: when DRAM passes its high watermark, demote down to the low one."""
        cfg = self.config.dram
        while True:
            await self._demote_wakeup.wait()
            self._demote_wakeup.clear()
            target = cfg.low_watermark * self.dram.capacity_bytes
            try:
                for victim in self._dir.victims("dram"):
                    if self.dram.used_bytes <= target:
                        break
                    await self._evict_one("dram", victim)
            except KVStoreError:
                log.exception("demotion pass failed; will retry on the next write")

    async def _persist_dram(self) -> None:
        """On shutdown, write every DRAM-only block to SSD so a restart finds it."""
        saved = 0
        for entry in sorted(self._dir.entries(), key=lambda e: e.meta.block_index):
            if "dram" not in entry.sizes or "ssd" in entry.sizes:
                continue
            page = await self.dram.read(entry.meta.key)
            if page is None:
                continue
            data = await self._transcode(entry.meta, page.data, "ssd")
            with contextlib.suppress(KVStoreError):
                saved += await self._write(self.ssd, "ssd", entry.meta, data, force=True)
        if saved:
            log.info("persisted %d DRAM blocks to SSD on close", saved)
