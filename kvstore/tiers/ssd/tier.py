"""The SSD tier: append-only segment files and an LMDB index committed after the data is durable.

Layout of ``config.path``: ``seg-000001.dat`` ... hold encoded pages back to back, each padded
to 4096 bytes (so O_DIRECT can read and write them); ``index/`` is an LMDB environment mapping a
16-byte block key to (segment, offset, length, codec id, checksum, page meta); ``LOCK`` keeps a
second process out. Writers queue pages; one writer task combines what is queued into one
append from a page-aligned buffer. Segment files are removed with aiofiles; their descriptors
are opened on demand and at most ``ssd.max_open_segments`` kept (``SegmentFiles``: least
recently used closed first, never one in use). Appends and reads are positioned
``pwrite``/``preadv`` calls in worker threads, so an append can be in flight while the next
batch is copied, and reads run side by side (O_DIRECT where the file system allows it,
buffered otherwise). The code: ``segments`` (segment files, aligned I/O),
``index`` (the LMDB record format and its journal), ``writer`` (appends, group commits,
compaction) and this module (the Tier API, recovery at open, reads).

What ``write()`` returning True guarantees, per ``config.fsync``:

- ``"always"``: the segment was fdatasync'ed (and the directory fsync'ed when the segment was
  created), then the index entry committed (LMDB synced). The page survives a process crash
  and a power loss.
- ``"batch"``: a background flusher fdatasyncs the segments appended to since its last run,
  then commits all their index entries in one transaction; ``write()`` returns after that group
  commit, so the same guarantee as "always" holds on return. It runs every
  ``fsync_interval_s``, or sooner once ``GROUP_COMMIT_BYTES`` of appended data wait or the
  writer has nothing more queued (then no later page could join the group: waiting would
  only add latency). So a write waits at most one interval plus one flush.
- ``"never"``: the index entry is committed right after the append, with no fdatasync and LMDB
  opened without sync. The page survives a process crash (the data sits in the page cache or
  was written directly); after a power loss the newest pages may be missing, or be damaged and
  then fail verification and be dropped on read: never served.

A write that fails tells its own caller only: a full file system (an append, an fdatasync or
an index commit that ran out of room) is CapacityError naming the file, a full LMDB map names
``ssd.index_map_bytes``. The page does not enter the index, so a retry writes it again; reads
go on, and writes succeed again once there is room. While an index commit is failing, no
segment file is deleted, so everything the committed index points at stays on disk.

Deletions reach the index with the next commit (at most one ``fsync_interval_s`` later); a
deletion lost in a crash only brings back a still valid page for its key. Compaction always
fdatasyncs the copies before committing their new places and only then removes the old file.

On open, index entries that point past a segment's end (or into a missing segment) are
dropped, and bytes past the last indexed page of a segment (a torn tail) are truncated. An
index that is missing, empty beside segments (a rebuild that died before its commit) or found
damaged (it is read whole in a child process first, so that damage which would crash LMDB's
reader costs a child, not the daemon; see ``index``) is rebuilt from the segments: every
page describes and verifies itself. A damaged index is kept as ``index.corrupt-<time>`` and
counted in ``stats().extra["index_resets"]``. Pages deleted before the damage may come back
that way: still valid pages for their keys.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import aiofiles
import aiofiles.os

from kvstore.config import SsdConfig
from kvstore.errors import CapacityError, CorruptPage, InvalidArgument, Unavailable
from kvstore.keys import BlockKey
from kvstore.page import Page, PageMeta
from kvstore.room import Footprint, RoomNeed
from kvstore.tiers.base import Tier, TierStats
from kvstore.tiers.ssd.index import IndexOpen, IndexRecord, IndexState, LmdbIndex
from kvstore.tiers.ssd.segments import (
    ReadBuffers,
    Segment,
    SegmentFiles,
    aligned,
    check_page,
    find_pages,
    lock_directory,
    private_directory,
    probe_o_direct,
    read_page,
    scan_segments,
    segment_path,
)
from kvstore.tiers.ssd.writer import (
    SegmentWriter,
)

log = logging.getLogger(__name__)

# Read buffers kept for reuse (``ReadBuffers``): a get of a 16-block prefix of 2 MiB pages reads
# 16 pages at once, so 64 MiB serves two such gets in flight without a fresh buffer.
READ_BUFFER_BYTES = 64 << 20


class SsdTier(Tier):
    """Pages in append-only segment files, indexed by LMDB, bounded by ``capacity_bytes``.

    Called from one event loop. File I/O goes through aiofiles or worker threads, LMDB
    transactions through worker threads, one write transaction at a time (``LmdbIndex``).
    Space: a reserve of one segment's worth of live
    bytes (``(1 - compact_dead_fraction) * segment_bytes``) is kept for compaction, so
    compaction can always copy a victim's live pages forward.
    """

    name = "ssd"
    is_persistent = True

    def __init__(self, config: SsdConfig, name: str = "ssd") -> None:
        self.name = name
        self._config = config
        self._dir = Path(config.path)
        reserve = int((1.0 - config.compact_dead_fraction) * config.segment_bytes)
        self._reserve_bytes = min(aligned(reserve), config.capacity_bytes // 2)
        self._index: dict[bytes, IndexRecord] = {}
        self._segments: dict[int, Segment] = {}
        self._files = SegmentFiles(config.max_open_segments, o_direct=False)  # set at open
        self._lmdb = LmdbIndex(self._dir, config.index_map_bytes, sync=config.fsync != "never")
        self._read_buffers = ReadBuffers(READ_BUFFER_BYTES)
        self._lock_fd: int | None = None
        self._o_direct = False
        self._counts = dict.fromkeys(("hits", "misses", "corrupt", "rejected",
                                      "bytes_read", "bytes_written", "compactions", "appends",
                                      "index_resets"), 0)
        self._writer = SegmentWriter(config, self._index, self._segments, self._files,
                                     self._lmdb, self._counts, self._reserve_bytes,
                                     self._read_entry, self._drop_corrupt)

    @property
    def capacity_bytes(self) -> int:
        return self._config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._writer.used_bytes

    @property
    def o_direct(self) -> bool:
        """Whether segments are read and written with O_DIRECT (decided at ``open``)."""
        return self._o_direct

    def contains(self, key: BlockKey) -> bool:
        return key in self._index

    @property
    def max_page_bytes(self) -> int:
        return self.capacity_bytes - self._reserve_bytes

    def room_for(self, nbytes: int) -> RoomNeed | None:
        """None if a page of ``nbytes`` fits now, possibly after the write compacts a segment;
        else the live bytes to delete from one sealed segment (a page's size class is its
        segment) so that compacting it frees enough: the deadest idle sealed segment (the one
        compaction takes first), found in O(log n) (``DeadOrder``), not by walking them all.

        Compacting a segment copies its live pages forward, so it can run only while they fit in
        the free space, and it frees the segment's dead bytes.
        """
        padded = aligned(nbytes)
        if self._writer.fits(padded):
            return None
        used = self._writer.used_bytes
        deficit = used + padded - (self.capacity_bytes - self._reserve_bytes)
        free = self.capacity_bytes - used
        seg = self._writer.dead_order.first(self._is_idle_sealed)
        if seg is None:  # only the active segment holds pages: it must fill and seal first
            return RoomNeed(nbytes=deficit)
        delete = max(deficit - seg.dead_bytes, seg.live_bytes - free, 0)
        if delete == 0:
            return None
        return RoomNeed(nbytes=delete, size_class=seg.segment_id)

    def footprint(self, key: BlockKey) -> Footprint | None:
        entry = self._index.get(key)
        if entry is None:
            return None
        return Footprint(size_class=entry.segment_id, nbytes=entry.padded)

    def moved_keys(self) -> list[BlockKey]:
        return [key for key in self._writer.take_moved() if key in self._index]

    def entries(self) -> Iterator[PageMeta]:
        for entry in list(self._index.values()):
            yield entry.meta

    def page_size(self, key: BlockKey) -> int | None:
        entry = self._index.get(key)
        return None if entry is None else entry.length

    def stats(self) -> TierStats:
        c = self._counts
        return TierStats(
            name=self.name, capacity_bytes=self.capacity_bytes, used_bytes=self.used_bytes,
            num_blocks=len(self._index), hits=c["hits"], misses=c["misses"],
            corrupt=c["corrupt"], rejected=c["rejected"],
            bytes_read=c["bytes_read"], bytes_written=c["bytes_written"],
            extra={"segments": len(self._segments),
                   "dead_bytes": sum(s.dead_bytes for s in self._segments.values()),
                   "o_direct": int(self._o_direct), "compactions": c["compactions"],
                   "appends": c["appends"], "read_buffer_bytes": self._read_buffers.kept_bytes,
                   "index_resets": c["index_resets"]})

    async def write(self, key: BlockKey, page: bytes | memoryview, meta: PageMeta) -> bool:
        """Store an encoded page; True once it is durable per ``config.fsync`` and indexed.

        Args:
            key: the block key; must match the page header and ``meta.key``.
            page: a complete encoded page (``kvstore.page.encode_page``); the page header is
                authoritative for the meta kept in the index.
            meta: the block's meta as the store knows it.

        Returns:
            False if no room can be made without evicting.
        """
        self._check_open()
        if key in self._index:
            return True
        writer = self._writer
        if key in writer.inflight:
            return await asyncio.shield(writer.inflight[key].future)
        data, page_meta, checksum = check_page(key, page, meta)
        padded = aligned(len(data))
        if not writer.fits(padded):
            await writer.reclaim(padded)
            self._check_open()
            if key in self._index or key in writer.inflight:  # written while we compacted
                return await self.write(key, page, meta)
            if not writer.fits(padded):
                self._counts["rejected"] += 1
                return False
        pending = writer.submit(key, data, page_meta, checksum)
        writer.inflight[key] = pending
        return await asyncio.shield(pending.future)

    async def read(self, key: BlockKey, *, verify: bool = True) -> Page | None:
        """The page read from its segment (verified unless ``verify=False``: the Tier contract
        in ``kvstore.tiers.base``); None on a miss, or when the page is damaged (then dropped)."""
        self._check_open()
        entry = self._index.get(key)
        if entry is None:
            self._counts["misses"] += 1
            return None
        try:
            page = await self._read_entry(entry, verify)
        except CorruptPage as exc:
            self._drop_corrupt(entry, exc)
            await self._writer.remove_emptied()
            self._counts["misses"] += 1
            return None
        self._counts["hits"] += 1
        self._counts["bytes_read"] += entry.length
        return page

    async def delete(self, key: BlockKey) -> bool:
        self._check_open()
        pending = self._writer.inflight.pop(key, None)
        if pending is not None:
            pending.is_cancelled = True  # its write still returns; a new write starts afresh
        entry = self._index.pop(key, None)
        if entry is None:
            return pending is not None
        self._lmdb.forget(key)  # committed with the next flush: see the module docstring
        self._writer.release(entry)
        await self._writer.remove_emptied()
        return True

    async def open(self) -> None:
        """Lock the directory, probe O_DIRECT, open the index and recover the segments."""
        if self._writer.has_started:
            raise InvalidArgument(f"ssd tier at {self._dir} was opened before; make a new one")
        await asyncio.to_thread(private_directory, self._dir, "ssd.path")
        self._lock_fd = await asyncio.to_thread(lock_directory, self._dir)
        try:
            self._o_direct = self._config.o_direct and await asyncio.to_thread(
                probe_o_direct, self._dir)
            self._files = self._writer.files = SegmentFiles(self._config.max_open_segments,
                                                            self._o_direct)
            await self._recover()
        except BaseException:
            await self._release_resources()
            raise
        self._writer.start()
        log.info("ssd tier open at %s: %d blocks in %d segments, %d bytes, o_direct=%s",
                 self._dir, len(self._index), len(self._segments), self.used_bytes,
                 self._o_direct)

    async def close(self) -> None:
        """Finish queued writes, make them durable and indexed, and release the files."""
        if not self._lmdb.is_open or self._writer.is_closing:
            return
        await self._writer.stop()
        await self._release_resources()

    async def _recover(self) -> None:
        """Rebuild the in-memory index and segment accounting from LMDB and the files; from
        the files alone if the LMDB index is missing or was found damaged."""
        opened = await self._lmdb.open()
        sizes = await asyncio.to_thread(scan_segments, self._dir)
        records = await self._lmdb.load() if opened.state is IndexState.OPENED else []
        if records:
            self._load_index(records, sizes)
        elif sizes:  # also an empty index: one whose rebuild never reached its commit
            await self._rebuild_index(sizes, opened)
        elif opened.state is IndexState.RESET:
            self._log_reset(opened, "there are no segments; starting empty")
        ends: dict[int, int] = {}
        for entry in self._index.values():
            ends[entry.segment_id] = max(ends.get(entry.segment_id, 0),
                                         entry.offset + entry.padded)
        for segment_id, size in sorted(sizes.items()):
            await self._recover_segment(segment_id, size, ends.get(segment_id, 0))
        for key, entry in self._index.items():
            seg = self._segments[entry.segment_id]
            seg.live_bytes += entry.padded
            seg.keys.add(key)
        self._writer.recovered(next_segment_id=max(sizes, default=0) + 1)
        try:
            await self._lmdb.commit()
        except CapacityError as exc:  # kept in the journal; no segment is deleted meanwhile
            log.error("ssd index: the changes made at open are not committed yet, retried "
                      "with the next commit: %s", exc)

    def _load_index(self, records: list[tuple[bytes, bytes]], sizes: dict[int, int]) -> None:
        """Take the committed index entries that point into the segments as they are."""
        for key, raw in records:
            try:
                entry = IndexRecord.unpack(key, raw)
            except (ValueError, KeyError, TypeError, struct.error):
                entry = None
            if entry is None or entry.offset + entry.padded > sizes.get(entry.segment_id, -1):
                self._lmdb.forget(key)  # damaged, or past the end of its segment
                continue
            self._index[key] = entry
        if self._lmdb.journal:
            log.warning("ssd index: dropped %d entries that point past their segment's end",
                        len(self._lmdb.journal))

    async def _rebuild_index(self, sizes: dict[int, int], opened: IndexOpen) -> None:
        """Index every page that verifies in the segment files (the newest copy of a key
        wins: compaction copies forward into newer segments)."""
        for segment_id in sorted(sizes):
            path = segment_path(self._dir, segment_id)
            for found in await asyncio.to_thread(find_pages, path):
                self._index[found.meta.key] = IndexRecord(
                    found.meta, segment_id, found.offset, found.length, found.checksum)
        for key, entry in self._index.items():
            self._lmdb.put(key, entry)
        rebuilt = f"rebuilt it from {len(sizes)} segment files: {len(self._index)} pages"
        if opened.state is IndexState.RESET:
            self._log_reset(opened, rebuilt)
        else:
            log.warning("ssd index in %s is %s; %s", self._dir,
                        "missing" if opened.state is IndexState.CREATED else "empty", rebuilt)

    def _log_reset(self, opened: IndexOpen, outcome: str) -> None:
        self._counts["index_resets"] += 1
        log.warning("ssd index in %s is damaged (%s); moved it to %s and %s", self._dir,
                    opened.damage, opened.moved_to, outcome,
                    extra={"ssd_path": str(self._dir), "moved_to": str(opened.moved_to)})

    async def _recover_segment(self, segment_id: int, size: int, end: int) -> None:
        path = segment_path(self._dir, segment_id)
        if end == 0:
            await aiofiles.os.remove(path)  # nothing indexed in it
            return
        if size > end:
            log.warning("ssd segment %s: truncating %d bytes past its last indexed page",
                        path.name, size - end)
            await asyncio.to_thread(os.truncate, path, end)
        seg = Segment(segment_id, path, end)
        self._files.acquire(seg)  # tightens a segment of an older version; kept if room
        self._files.release(seg)
        self._segments[segment_id] = seg
        self._writer.used_bytes += end

    async def _release_resources(self) -> None:
        while any(seg.num_users for seg in self._segments.values()):
            await asyncio.sleep(0.001)  # reads in worker threads still hold descriptors
        self._files.close_all()
        self._segments.clear()
        self._writer.forget_segments()
        await self._lmdb.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # also drops the flock
            self._lock_fd = None

    def _is_idle_sealed(self, seg: Segment) -> bool:
        """Whether ``seg`` could be compacted now (``SegmentWriter.is_idle_sealed``)."""
        return self._writer.is_idle_sealed(seg)

    def _check_open(self) -> None:
        if not self._lmdb.is_open or self._writer.is_closing:
            raise Unavailable(f"ssd tier at {self._dir} is not open")

    async def _read_entry(self, entry: IndexRecord, verify: bool = True) -> Page:
        """Read (and verify, unless told not to) a committed page; CorruptPage on any fault."""
        seg = self._segments.get(entry.segment_id)
        if seg is None:
            raise CorruptPage(f"segment {entry.segment_id} is gone")
        try:
            fd = self._files.acquire(seg)
        except OSError as exc:
            raise CorruptPage(f"segment {entry.segment_id} cannot be opened: {exc}") from None
        try:
            buf = self._read_buffers.take(entry.padded)
            return await asyncio.to_thread(read_page, fd, entry, buf, verify)
        finally:
            self._files.release(seg)  # closes it if evicted or removed meanwhile

    def _drop_corrupt(self, entry: IndexRecord, exc: CorruptPage) -> None:
        key = entry.meta.key
        self._counts["corrupt"] += 1
        log.warning("ssd page %s (segment %d, offset %d) failed verification and was dropped: "
                    "%s", key.hex(), entry.segment_id, entry.offset, exc)
        if self._index.get(key) is entry:
            del self._index[key]
            self._lmdb.forget(key)
            self._writer.release(entry)
