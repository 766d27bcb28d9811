"""Background write-through: every new block copied into the tiers that ask for it, through one
bounded queue per tier that drops rather than stalls."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.api import TierStats
from kvstore.errors import KVStoreError
from kvstore.page import finished_page
from kvstore.store.directory import BlockDirectory, BlockEntry
from kvstore.store.placement import Link, Placement
from kvstore.tiers.base import SharedTier

log = logging.getLogger("kvstore.store")

# What each queue counts, exported in its tier's stats as ``write_through_<name>``.
COUNTS = ("queued", "written", "skipped", "dropped_full", "failed", "dropped_closing")
# Copying a batch out of the tier it is read from costs about 1 ms per 8 MiB on the 2-core
# box; larger batches are copied on a thread, so the loop never holds still that long.
THREAD_COPY_BYTES = 8 << 20


@dataclass(slots=True)
class _Backlog:
    """One write-through tier's queue: blocks waiting, bounded in blocks and bytes (those in
    the batch being written count until it is done)."""

    link: Link
    items: deque[tuple[BlockEntry, int]] = field(default_factory=deque)  # (block, its bytes)
    num_blocks: int = 0
    nbytes: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # something is queued
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # nothing queued or in flight
    task: asyncio.Task[None] | None = None
    is_dropping: bool = False  # the last block offered was dropped (logged once per spell)

    def has_room(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` may join (one larger than the byte bound alone may)."""
        settings = self.link.settings
        if self.num_blocks >= settings.write_through_queue_blocks:
            return False
        return not self.num_blocks or self.nbytes + nbytes <= settings.write_through_queue_bytes

    def take(self, batch_bytes: int) -> list[tuple[BlockEntry, int]]:
        """The next batch: blocks of one tenant, in order, about ``batch_bytes`` in all."""
        batch = [self.items.popleft()]
        tenant, nbytes = batch[0][0].meta.tenant, batch[0][1]
        while (self.items and self.items[0][0].meta.tenant == tenant
               and nbytes + self.items[0][1] <= batch_bytes):
            batch.append(self.items.popleft())
            nbytes += batch[-1][1]
        return batch


class WriteThrough:
    """Copies new blocks into every tier with ``write_through`` set (by default the shared
    tier), in the background.

    - ``offer`` never waits: a block joins its tier's queue, or, when the queue is full (its
      ``write_through_queue_blocks`` or ``write_through_queue_bytes``), is dropped and counted
      (``dropped_full``); it may still reach the tier by demotion. A block the tier holds
      already is skipped.
    - One task per tier writes the queue in order. A shared tier gets batches of one tenant's
      blocks of about its ``write_batch_bytes`` in one ``write_many`` (pipelined round trips),
      after making room for the whole batch within its byte budget (else page by page, each
      making its own room). The pages are copied out of the tier they are read from, so no
      block stays pinned during a round trip to a slow or dead store. Other tiers get one
      ``Placement.copy`` per block.
    - A block evicted before its turn is skipped; one evicted while it was written is deleted
      from the tier again (an eviction must not be undone by a copy in flight).
    - ``close`` drains the queues for at most a grace period, then drops what is left
      (``dropped_closing``).

    Called only from the store's event loop.

    Args:
        directory: the store's block directory.
        placement: the store's placement over the chain (reads, room, copies).
    """

    def __init__(self, directory: BlockDirectory, placement: Placement) -> None:
        self._dir = directory
        self._placement = placement
        self._links = placement.write_through_links()
        self._backlogs: list[_Backlog] = []

    def open(self) -> None:
        """Start a writer per write-through tier (on the loop the store opens on)."""
        self._backlogs = [_Backlog(link) for link in self._links]
        for backlog in self._backlogs:
            backlog.idle.set()
            backlog.task = asyncio.get_running_loop().create_task(self._run(backlog))

    async def close(self, grace_s: float) -> None:
        """Let the writers empty their queues for at most ``grace_s``, then stop them."""
        try:
            async with asyncio.timeout(grace_s):
                for backlog in self._backlogs:
                    await backlog.idle.wait()
        except TimeoutError:
            pass
        for backlog in self._backlogs:
            if backlog.num_blocks:
                backlog.counts["dropped_closing"] += backlog.num_blocks
                log.warning("write-through to %s: %d blocks (%d bytes) not written before "
                            "the %.1f s grace ran out", backlog.link.name, backlog.num_blocks,
                            backlog.nbytes, grace_s)
            if backlog.task is not None:
                backlog.task.cancel()
        await asyncio.gather(*(b.task for b in self._backlogs if b.task is not None),
                             return_exceptions=True)

    def offer(self, entries: Sequence[BlockEntry]) -> None:
        """Queue new blocks for every write-through tier, or drop and count them (no waiting)."""
        for backlog in self._backlogs:
            counts = backlog.counts
            for entry in entries:
                if backlog.link.name in entry.sizes:
                    counts["skipped"] += 1
                    continue
                nbytes = max(entry.sizes.values(), default=0)
                if not backlog.has_room(nbytes):
                    counts["dropped_full"] += 1
                    if not backlog.is_dropping:
                        log.warning("write-through to %s: queue full (%d blocks, %d bytes); "
                                    "dropping new blocks until it drains", backlog.link.name,
                                    backlog.num_blocks, backlog.nbytes)
                    backlog.is_dropping = True
                    continue
                backlog.is_dropping = False
                backlog.items.append((entry, nbytes))
                backlog.num_blocks += 1
                backlog.nbytes += nbytes
                counts["queued"] += 1
            if backlog.items:
                backlog.idle.clear()
                backlog.ready.set()

    def add_stats(self, tiers: dict[str, TierStats]) -> None:
        """Each write-through tier's counters and queue, in its stats' extra gauges."""
        for backlog in self._backlogs:
            stats = tiers.get(backlog.link.name)
            if stats is None:
                continue
            for name, value in backlog.counts.items():
                stats.extra[f"write_through_{name}"] = value
            stats.extra["write_through_queue_blocks"] = backlog.num_blocks
            stats.extra["write_through_queue_bytes"] = backlog.nbytes

    # ------------------------------------------------------------------------------ writer

    async def _run(self, backlog: _Backlog) -> None:
        tier = backlog.link.tier
        batch_bytes = tier.write_batch_bytes if isinstance(tier, SharedTier) else 0
        while True:
            await backlog.ready.wait()
            while backlog.items:
                batch = backlog.take(batch_bytes)
                try:
                    if isinstance(tier, SharedTier):
                        await self._write_batch(backlog, [entry for entry, _ in batch])
                    else:
                        await self._copy(backlog, batch[0][0])
                except KVStoreError as exc:
                    backlog.counts["failed"] += len(batch)
                    log.warning("write-through to %s failed: %s", backlog.link.name, exc)
                finally:
                    backlog.num_blocks -= len(batch)
                    backlog.nbytes -= sum(nbytes for _, nbytes in batch)
            backlog.ready.clear()
            backlog.idle.set()

    def _is_current(self, entry: BlockEntry) -> bool:
        """Whether the block is still stored as this entry (not evicted, not being evicted)."""
        return entry.live and self._dir.get(entry.meta.key) is entry

    async def _copy(self, backlog: _Backlog, entry: BlockEntry) -> None:
        link, counts = backlog.link, backlog.counts
        if link.name in entry.sizes or not self._is_current(entry):
            counts["skipped"] += 1
        elif await self._placement.copy(entry, link):
            counts["written"] += 1
        else:
            counts["failed"] += 1

    async def _write_batch(self, backlog: _Backlog, entries: list[BlockEntry]) -> None:
        link, counts = backlog.link, backlog.counts
        todo = [e for e in entries if link.name not in e.sizes and self._is_current(e)]
        counts["skipped"] += len(entries) - len(todo)
        pages = await self._read_copies(backlog, todo)
        if not pages:
            return
        total = sum(len(data) for _, data in pages)
        shared: SharedTier = link.tier  # type: ignore[assignment]
        if await self._placement.make_room(link, total, pages[0][0].meta.tenant):
            results = await shared.write_many([(entry.meta, data) for entry, data in pages])
        else:  # the batch does not fit at once: each page makes its own room, or is refused
            results = [await self._placement.write(link, entry.meta, data)
                       for entry, data in pages]
        for (entry, data), ok in zip(pages, results):
            if ok:
                ok = await self._record(link, entry, len(data))
            counts["written" if ok else "failed"] += 1

    async def _read_copies(self, backlog: _Backlog, entries: list[BlockEntry]
                           ) -> list[tuple[BlockEntry, bytes]]:
        """Each block's page in the tier's codec, copied out of the memory it is read from
        (a page of a local tier is a view, valid only while its block is pinned)."""
        link, pages = backlog.link, []
        self._dir.pin(entries)
        try:
            for entry in entries:
                page, _ = await self._placement.read(entry)
                data = None if page is None else await self._placement.transcode(
                    entry.meta, page.data, link)
                if data is None:
                    backlog.counts["failed"] += 1
                    continue
                pages.append((entry, finished_page(data)))
            if sum(len(data) for _, data in pages) > THREAD_COPY_BYTES:
                return await asyncio.to_thread(_owned, pages)
            return _owned(pages)
        finally:
            self._dir.unpin(entries)

    async def _record(self, link: Link, entry: BlockEntry, nbytes: int) -> bool:
        """Note a page the tier took; undo it if the block was evicted meanwhile."""
        key = entry.meta.key
        if not self._is_current(entry):
            await link.tier.delete(key)
            current = self._dir.get(key)
            if current is not None and link.name in current.sizes:
                self._dir.unplace(key, link.name)
            return False
        footprint = link.tier.footprint(key)
        if footprint is None:  # gone from the tier already (its TTL, a delete)
            return False
        if link.name not in entry.sizes:
            self._dir.place(entry.meta, link.name, nbytes, footprint)
        return True


def _owned(pages: list[tuple[BlockEntry, Any]]) -> list[tuple[BlockEntry, bytes]]:
    return [(entry, data if isinstance(data, bytes) else bytes(data)) for entry, data in pages]
