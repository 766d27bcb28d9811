"""The SSD tier's write side: batched appends, the fsync policy, group commits and compaction.

``SegmentWriter`` is an object ``kvstore.tiers.ssd.tier.SsdTier`` holds; that module's
docstring says what each fsync policy guarantees.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os

from kvstore.config import SsdConfig
from kvstore.errors import CapacityError, CorruptPage, KVStoreError
from kvstore.keys import BlockKey
from kvstore.page import Page, PageMeta
from kvstore.tiers.ssd.index import IndexRecord, LmdbIndex
from kvstore.tiers.ssd.segments import (
    DeadOrder,
    Segment,
    SegmentFiles,
    aligned,
    append,
    segment_path,
    sync_directory,
)

log = logging.getLogger("kvstore.tiers.ssd")  # the SSD tier's logger: these are its messages

# One append is at most this big unless a single page is bigger. On the work disk, O_DIRECT `dd`
# ran at 2.7 GB/s with 1-2 MiB blocks but 1.9 GB/s with 16 MiB blocks (2026-11-29).
MAX_BATCH_BYTES = 4 << 20
NUM_BUFFERS = 2  # appends in flight: one copies its pages while the other is written
_WRITTEN = memoryview(b"")  # what a PendingWrite holds once its page is in the file
# "batch" flushes early once this much appended data waits, so appends go on while a group
# commits. 2 MiB pages, 8-64 in flight, work disk (2026-11-29): 4, 8 and 16 MiB all reached
# 0.85-0.9 of dd; 32 MiB stalled at 8 in flight (0.28 GB/s) until the next interval.
GROUP_COMMIT_BYTES = 8 << 20


def disk_error(exc: OSError, action: str) -> KVStoreError:
    """What a writer hears when ``action`` (which names the file) failed with ``exc``: a full
    file system is CapacityError (RESOURCE_EXHAUSTED at the edge), anything else KVStoreError."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CapacityError(f"ssd {action} failed: its file system is full ({exc.strerror})")
    return KVStoreError(f"ssd {action} failed: {exc.strerror or exc}")


@dataclass(eq=False, slots=True)
class PendingWrite:
    """A page on its way to disk; ``future`` resolves when it is durable and indexed."""

    key: BlockKey
    data: memoryview
    meta: PageMeta
    checksum: int
    future: asyncio.Future[bool]
    relocate_from: IndexRecord | None = None  # set when compaction moves a committed page
    segment: Segment | None = None
    offset: int = 0
    is_cancelled: bool = False  # deleted before it was committed: commit it as dead bytes
    length: int = -1  # the page's bytes (``data`` is let go once they are in the file)

    def __post_init__(self) -> None:
        self.length = len(self.data)

    @property
    def padded(self) -> int:
        return aligned(self.length)


class SegmentWriter:
    """Appends queued pages to segments, makes them durable, indexes them, reclaims space.

    ``SsdTier`` holds one. It owns the write side: the queue and pages in flight, the space
    accounting (``used_bytes``, the active segment, dead bytes by segment), the writer and
    flusher tasks and compaction. It shares the tier's index, segment table, descriptor cache,
    LMDB journal and counters, and reads a committed page back (to move it) through the tier's
    ``read_entry``. Called from the tier's event loop only.
    """

    def __init__(self, config: SsdConfig, index: dict[bytes, IndexRecord],
                 segments: dict[int, Segment], files: SegmentFiles, lmdb: LmdbIndex,
                 counts: dict[str, int], reserve_bytes: int,
                 read_entry: Callable[[IndexRecord], Awaitable[Page]],
                 drop_corrupt: Callable[[IndexRecord, CorruptPage], None]) -> None:
        self._config = config
        self._dir = Path(config.path)
        self._index = index
        self._segments = segments
        self.files = files  # the tier replaces it at open, once O_DIRECT is decided
        self._lmdb = lmdb
        self._counts = counts
        self._reserve_bytes = reserve_bytes
        self._read_entry = read_entry
        self._drop_corrupt = drop_corrupt
        self.capacity_bytes = config.capacity_bytes
        self.used_bytes = 0  # segment sizes plus space reserved by queued writes
        self.active: Segment | None = None
        self.next_segment_id = 1
        self.inflight: dict[bytes, PendingWrite] = {}
        self.moved: list[BlockKey] = []  # relocated by compaction since the tier was asked
        self.dead_order = DeadOrder()  # segments by dead bytes, for room_for and reclaim
        self.is_closing = False  # refuse new calls
        self._is_stopping = False  # compaction drained: the writer and flusher may exit
        self._queue: deque[PendingWrite] = deque()
        self._unsynced: list[PendingWrite] = []  # appended, waiting for the "batch" flusher
        self._unsynced_bytes = 0
        self._emptied: set[Segment] = set()
        self._compact_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._flush_wake = asyncio.Event()
        self._buffers: asyncio.Queue[mmap.mmap] = asyncio.Queue()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writer_task: asyncio.Task[None] | None = None
        self._flusher_task: asyncio.Task[None] | None = None

    @property
    def has_started(self) -> bool:
        return self._writer_task is not None

    def start(self) -> None:
        """Start the writer and the flusher (the tier's ``open``, once recovered)."""
        for _ in range(NUM_BUFFERS):
            self._buffers.put_nowait(mmap.mmap(-1, MAX_BATCH_BYTES))
        self.is_closing = self._is_stopping = False
        self._writer_task = asyncio.create_task(self._writer())
        self._flusher_task = asyncio.create_task(self._flusher())

    async def stop(self) -> None:
        """Refuse new calls, finish queued writes, make them durable and indexed."""
        self.is_closing = True
        async with self._compact_lock:  # a running compaction stops early and drains
            self._is_stopping = True
        self._wake.set()
        self._flush_wake.set()
        await asyncio.gather(self._writer_task, self._flusher_task)
        while self._tasks:  # appends and removals in flight
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self._flush()  # the last group commit
        await self.remove_emptied()

    def recovered(self, next_segment_id: int) -> None:
        """The tier's ``open`` recovered the segments: order them by dead bytes."""
        for seg in self._segments.values():
            self.dead_order.note(seg)
        self.next_segment_id = next_segment_id

    def forget_segments(self) -> None:
        """The tier released its files: no segment is active or ordered any more."""
        self.dead_order = DeadOrder()
        self.active = None

    def take_moved(self) -> list[BlockKey]:
        """The keys compaction relocated since the last call."""
        moved, self.moved = self.moved, []
        return moved

    def submit(self, key: BlockKey, data: memoryview, meta: PageMeta, checksum: int,
                relocate_from: IndexRecord | None = None) -> PendingWrite:
        """Reserve space and queue a page for the writer (the caller checked that it fits)."""
        future = asyncio.get_running_loop().create_future()
        pending = PendingWrite(key, data, meta, checksum, future, relocate_from)
        self.used_bytes += pending.padded
        self._queue.append(pending)
        self._wake.set()
        return pending

    async def _writer(self) -> None:
        """Combine queued pages into appends; each batch then runs as its own task."""
        while True:
            if not self._queue:
                if self._is_stopping:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            buffer = await self._buffers.get()
            try:
                seg, batch = await self._next_batch()
            except OSError as exc:  # cannot create a segment file: fail what is queued
                self._buffers.put_nowait(buffer)
                batch = list(self._queue)
                self._queue.clear()
                self._fail(batch, disk_error(exc, f"creating a segment in {self._dir}"))
                continue
            self._spawn(self._write_batch(seg, batch, buffer))

    async def _next_batch(self) -> tuple[Segment, list[PendingWrite]]:
        """Place the queued pages that fit one append in one segment."""
        limit = self._config.segment_bytes
        seg = self.active
        first = self._queue[0].padded
        if seg is None or seg.is_broken or (seg.size_bytes and seg.size_bytes + first > limit):
            seg = await self._open_segment()
        batch: list[PendingWrite] = []
        nbytes = 0
        while self._queue:
            p = self._queue[0]
            if batch and (nbytes + p.padded > MAX_BATCH_BYTES
                          or seg.size_bytes + p.padded > limit):
                break
            self._queue.popleft()
            p.segment, p.offset = seg, seg.size_bytes
            seg.size_bytes += p.padded  # the space was reserved in _used_bytes at submit
            seg.live_bytes += p.padded
            seg.num_inflight += 1
            batch.append(p)
            nbytes += p.padded
        return seg, batch

    async def _open_segment(self) -> Segment:
        segment_id = self.next_segment_id
        self.next_segment_id += 1
        path = segment_path(self._dir, segment_id)
        seg = Segment(segment_id, path, 0)
        self.files.create(seg)
        if self._config.fsync != "never":
            try:
                await asyncio.to_thread(sync_directory, self._dir)
            except OSError:
                self.files.forget(seg)
                await aiofiles.os.remove(path)
                raise
        self._segments[segment_id] = seg
        self.dead_order.note(seg)
        self.active = seg
        return seg

    async def _write_batch(self, seg: Segment, batch: list[PendingWrite], buffer: mmap.mmap
                           ) -> None:
        """Fill the buffer, append it after the segment's previous batch, then commit."""
        nbytes = sum(p.padded for p in batch)
        try:
            fd = self.files.acquire(seg)
            try:
                await asyncio.to_thread(append, fd, buffer, batch, nbytes)
            finally:
                self.files.release(seg)
        except OSError as exc:
            seg.is_broken = True
            log.error("ssd append of %d bytes to %s failed: %s", nbytes, seg.path.name, exc)
            self._fail(batch, disk_error(exc, f"append of {nbytes} bytes to {seg.path}"))
            return
        finally:
            self._buffers.put_nowait(buffer)
        for p in batch:  # in the file now: a view of a tier's memory must not outlive that
            p.data = _WRITTEN
        self._counts["bytes_written"] += nbytes
        self._counts["appends"] += 1
        await self._after_append(seg, batch, nbytes)

    async def _after_append(self, seg: Segment, batch: list[PendingWrite], nbytes: int) -> None:
        """Make the batch durable per the fsync policy, then index it."""
        policy = self._config.fsync
        if policy == "batch":
            self._unsynced.extend(batch)
            self._unsynced_bytes += nbytes
            is_idle = not self._queue and self._buffers.qsize() == NUM_BUFFERS
            if is_idle or self._unsynced_bytes >= GROUP_COMMIT_BYTES:
                self._flush_wake.set()
            return
        if policy == "always" or any(p.relocate_from is not None for p in batch):
            try:
                await self._fdatasync(seg)
            except OSError as exc:
                seg.is_broken = True  # after a failed fsync the file's state is unknown
                log.error("ssd fdatasync of %s failed: %s", seg.path.name, exc)
                self._fail(batch, disk_error(exc, f"fdatasync of {seg.path}"))
                return
        for p in batch:
            self._stage(p)
        await self._finish(batch)

    async def _fdatasync(self, seg: Segment) -> None:
        fd = self.files.acquire(seg)
        try:
            await asyncio.to_thread(os.fdatasync, fd)
        finally:
            self.files.release(seg)

    def _stage(self, p: PendingWrite) -> None:
        """Enter an appended page in the in-memory index and the journal (or count it dead)."""
        seg = p.segment
        seg.num_inflight -= 1
        old = self._index.get(p.key)
        if p.is_cancelled or (p.relocate_from is not None and old is not p.relocate_from):
            seg.live_bytes -= p.padded  # deleted meanwhile
            self._note_if_empty(seg)
            return
        if old is not None:
            self.release(old)  # a compaction victim is removed by its compactor, later
            self.moved.append(p.key)
        entry = IndexRecord(p.meta, seg.segment_id, p.offset, p.length, p.checksum)
        self._index[p.key] = entry
        seg.keys.add(p.key)
        self._lmdb.put(p.key, entry)

    async def _flusher(self) -> None:
        """Group commits ("batch") and deferred deletions, every ``fsync_interval_s``."""
        while not self._is_stopping:
            try:
                await asyncio.wait_for(self._flush_wake.wait(), self._config.fsync_interval_s)
            except TimeoutError:
                pass
            self._flush_wake.clear()
            await self._flush()

    async def _flush(self) -> None:
        """Sync the segments appended since the last flush, then commit their entries."""
        batch, self._unsynced, self._unsynced_bytes = self._unsynced, [], 0
        for seg in {p.segment for p in batch}:
            try:
                await self._fdatasync(seg)
            except OSError as exc:
                seg.is_broken = True
                log.error("ssd fdatasync of %s failed: %s", seg.path.name, exc)
                failed = [p for p in batch if p.segment is seg]
                batch = [p for p in batch if p.segment is not seg]
                self._fail(failed, disk_error(exc, f"fdatasync of {seg.path}"))
        for p in batch:
            self._stage(p)
        await self._finish(batch)

    async def _finish(self, batch: list[PendingWrite]) -> None:
        """Commit the journal (staged pages and deletions), then answer the batch's writers."""
        try:
            await self._lmdb.commit()
        except KVStoreError as exc:
            # The journal is retried by the next commit. The writers hear of the failure, so
            # their pages leave the index: a retry must write them again, not find them.
            log.error("ssd index commit failed: %s", exc)
            for p in batch:
                self._unstage(p)
            self._answer(batch, exc)
            return
        self._answer(batch, None)
        await self.remove_emptied()

    def _unstage(self, p: PendingWrite) -> None:
        """Take a staged page back out of the index after its commit failed. A page moved by
        compaction stays: its committed old place outlives the failure (``_remove_emptied``
        waits for a commit), and the move is committed with the next one."""
        entry = self._index.get(p.key)
        if (p.relocate_from is not None or entry is None or p.segment is None
                or (entry.segment_id, entry.offset) != (p.segment.segment_id, p.offset)):
            return
        del self._index[p.key]
        self._lmdb.forget(p.key)
        self.release(entry)

    def _answer(self, batch: list[PendingWrite], exc: BaseException | None) -> None:
        for p in batch:
            if self.inflight.get(p.key) is p:
                del self.inflight[p.key]
            if p.future.done():
                continue
            if exc is None:
                p.future.set_result(True)
            else:
                p.future.set_exception(exc)

    def _fail(self, batch: list[PendingWrite], exc: BaseException) -> None:
        """Count unstaged pages' space as dead and raise ``exc`` in their writers."""
        for p in batch:
            if p.segment is None:
                self.used_bytes -= p.padded  # never placed in a segment
            else:
                p.segment.num_inflight -= 1
                p.segment.live_bytes -= p.padded
                self._note_if_empty(p.segment)
        self._answer(batch, exc)
        self._spawn(self.remove_emptied())

    def fits(self, padded: int) -> bool:
        """Whether a page fits beside the space held back for compaction."""
        return self.used_bytes + padded <= self.capacity_bytes - self._reserve_bytes

    def is_idle_sealed(self, seg: Segment) -> bool:
        """Whether ``seg`` could be compacted now: sealed, holding bytes, nothing in flight."""
        return (seg is not self.active and not seg.is_compacting and seg.num_inflight == 0
                and seg.size_bytes > 0)

    def _compaction_victim(self, tried: set[Segment], free: int) -> Segment | None:
        """The deadest idle sealed segment not in ``tried`` whose live pages fit in ``free``:
        among those at least ``compact_dead_fraction`` dead first, then, since the store deleted
        pages to make this room (``room_for`` counts every dead byte), among every one with
        dead bytes. O(log n) per segment passed over (``DeadOrder``)."""
        def takes(s: Segment) -> bool:
            return (self.is_idle_sealed(s) and s.dead_bytes > 0 and s not in tried
                    and s.live_bytes <= free)

        fraction = self._config.compact_dead_fraction
        threshold = fraction * self._config.segment_bytes
        # Deadest first, so once the dead bytes fall below the fraction of a full segment no
        # later one qualifies unless it is a short segment: those wait for the second pass.
        seg = self.dead_order.first(lambda s: s.dead_bytes < threshold or (
            takes(s) and s.dead_bytes >= fraction * s.size_bytes))
        if seg is not None and seg.dead_bytes >= threshold:
            return seg
        return self.dead_order.first(takes)

    def release(self, entry: IndexRecord) -> None:
        """A committed page left the index: its bytes are dead now."""
        seg = self._segments.get(entry.segment_id)
        if seg is not None:
            seg.live_bytes -= entry.padded
            seg.keys.discard(entry.meta.key)
            self._note_if_empty(seg)

    def _note_if_empty(self, seg: Segment) -> None:
        """After ``seg``'s live bytes dropped: reorder it, and queue it for removal if empty."""
        self.dead_order.note(seg)
        if seg.live_bytes == 0 and seg.num_inflight == 0 and not seg.is_removed:
            self._emptied.add(seg)

    async def remove_emptied(self) -> None:
        """Delete segments without live bytes (a compaction victim waits for its commit).

        Nothing is deleted while the index is behind (its last commit failed): the committed
        index may still point into an emptied segment, at pages whose new places are not
        committed yet.
        """
        if self._lmdb.is_behind:
            return
        for seg in list(self._emptied):
            if seg.is_compacting:
                continue
            self._emptied.discard(seg)
            if seg.live_bytes == 0 and seg.num_inflight == 0 and not seg.is_removed:
                await self._remove_segment(seg)

    async def _remove_segment(self, seg: Segment) -> None:
        seg.is_removed = True
        self._segments.pop(seg.segment_id, None)
        self.dead_order.discard(seg)
        if self.active is seg:
            self.active = None
        try:
            await aiofiles.os.remove(seg.path)
        except FileNotFoundError:
            pass
        self.used_bytes -= seg.size_bytes  # only now: the bytes never outlive the bound
        self.files.forget(seg)  # closed now, or by its last user

    async def reclaim(self, padded: int) -> None:
        """Compact dead segments until a page of ``padded`` bytes fits, or nothing is left:
        those at least ``compact_dead_fraction`` dead first, then, since the store deleted
        pages to make this room (``room_for`` counts every dead byte), the deadest others."""
        async with self._compact_lock:
            tried: set[Segment] = set()
            while not self.fits(padded) and not self.is_closing:
                victim = self._compaction_victim(tried, self.capacity_bytes - self.used_bytes)
                if victim is None:
                    return
                tried.add(victim)
                await self._compact(victim)

    async def _compact(self, seg: Segment) -> None:
        """Copy the live pages of ``seg`` into the active segment, then delete its file."""
        seg.is_compacting = True
        self._counts["compactions"] += 1
        before = seg.size_bytes
        try:
            moves: list[PendingWrite] = []
            for key in list(seg.keys):
                entry = self._index.get(key)
                if entry is None or entry.segment_id != seg.segment_id or self.is_closing:
                    continue
                moved = await self._move(entry)
                if moved is None:
                    break  # concurrent writes took the free space; try again later
                moves += moved
                if sum(p.padded for p in moves) >= 4 * MAX_BATCH_BYTES:
                    await self._await_moves(moves)  # bounds the memory held by copies
                    moves = []
            await self._await_moves(moves)
        finally:
            seg.is_compacting = False
            self._note_if_empty(seg)
        await self.remove_emptied()
        log.info("ssd compaction of %s: %d bytes, %d still live", seg.path.name, before,
                 seg.live_bytes)

    async def _move(self, entry: IndexRecord) -> list[PendingWrite] | None:
        """Queue a copy of a committed page; None when there is no room for it."""
        try:
            page = await self._read_entry(entry)
        except CorruptPage as exc:
            self._drop_corrupt(entry, exc)
            return []
        if self._index.get(entry.meta.key) is not entry:
            return []  # deleted while we read it
        if self.used_bytes + entry.padded > self.capacity_bytes:
            return None
        return [self.submit(entry.meta.key, page.data, entry.meta, entry.checksum, entry)]

    async def _await_moves(self, moves: list[PendingWrite]) -> None:
        results = await asyncio.gather(*(p.future for p in moves), return_exceptions=True)
        if failed := [r for r in results if isinstance(r, BaseException)]:
            log.error("ssd compaction: %d of %d copies failed: %s", len(failed), len(moves),
                      failed[0])

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("ssd background task failed: %r", task.exception())
