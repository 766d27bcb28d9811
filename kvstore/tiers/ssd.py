"""The SSD tier: append-only segment files and an LMDB index committed after the data is durable.

Layout of ``config.path``: ``seg-000001.dat`` ... hold encoded pages back to back, each padded
to 4096 bytes (so O_DIRECT can read and write them); ``index/`` is an LMDB environment mapping a
16-byte block key to (segment, offset, length, codec id, checksum, page meta); ``LOCK`` keeps a
second process out. Writers queue pages; one writer task combines what is queued into one
append from a page-aligned buffer. Segment files are created, opened and removed with aiofiles;
appends and reads are positioned ``pwrite``/``preadv`` calls in worker threads, so an append can
be in flight while the next batch is copied, and reads run side by side (O_DIRECT where the
file system allows it, buffered otherwise).

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

Deletions reach the index with the next commit (at most one ``fsync_interval_s`` later); a
deletion lost in a crash only brings back a still valid page for its key. Compaction always
fdatasyncs the copies before committing their new places and only then removes the old file.

On open, index entries that point past a segment's end (or into a missing segment) are
dropped, and bytes past the last indexed page of a segment (a torn tail) are truncated.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import struct
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os
import lmdb
import numpy as np

from kvstore.config import SsdConfig
from kvstore.errors import (
    AlreadyRunning,
    CapacityError,
    CorruptPage,
    InvalidArgument,
    KVStoreError,
    Unavailable,
)
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.page import HEADER_BYTES, Page, PageMeta, decode_page
from kvstore.policy.admission import FrequencySketch
from kvstore.tiers.base import Tier, TierStats

log = logging.getLogger(__name__)

ALIGN_BYTES = 4096  # O_DIRECT alignment of offsets, lengths and buffers (logical block <= 4 KiB)
# One append is at most this big unless a single page is bigger. On the work disk, O_DIRECT `dd`
# ran at 2.7 GB/s with 1-2 MiB blocks but 1.9 GB/s with 16 MiB blocks (2026-11-29).
MAX_BATCH_BYTES = 4 << 20
NUM_BUFFERS = 2  # appends in flight: one copies its pages while the other is written
# "batch" flushes early once this much appended data waits, so appends go on while a group
# commits. 2 MiB pages, 8-64 in flight, work disk (2026-11-29): 4, 8 and 16 MiB all reached
# 0.85-0.9 of dd; 32 MiB stalled at 8 in flight (0.28 GB/s) until the next interval.
GROUP_COMMIT_BYTES = 8 << 20
_SEGMENT_RE = re.compile(r"^seg-(\d+)\.dat$")
_RECORD = struct.Struct("<BIQIIHQ16s16s")  # version, segment, offset, length, block, codec, xxh3
_RECORD_VERSION = 1
_NO_PARENT = bytes(KEY_BYTES)
_ZEROS = bytes(ALIGN_BYTES)
_CHECKSUM_OFFSET = HEADER_BYTES - 8  # the page header ends with its u64 checksum (kvstore.page)


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN_BYTES - 1) & ~(ALIGN_BYTES - 1)


def _aligned_buffer(nbytes: int) -> memoryview:
    """A fresh, writable, 4096-aligned buffer (numpy memory is reused by malloc, unlike mmap)."""
    raw = np.empty(nbytes + ALIGN_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN_BYTES
    return memoryview(raw[start:start + nbytes])


def _direct_opener(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_DIRECT, 0o644)


def _probe_o_direct(directory: Path) -> bool:
    """Whether this file system takes O_DIRECT writes of aligned blocks (tmpfs refuses them)."""
    probe = directory / ".o_direct_probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.write(fd, mmap.mmap(-1, ALIGN_BYTES))  # anonymous mappings are page-aligned
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError) as exc:  # AttributeError: no os.O_DIRECT on this OS
        log.info("O_DIRECT refused in %s (%s); using buffered I/O", directory, exc)
        return False
    finally:
        probe.unlink(missing_ok=True)


def _lock_directory(directory: Path) -> int:
    fd = os.open(directory / "LOCK", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AlreadyRunning(f"ssd directory {directory} is already open elsewhere") from None
    return fd


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # a new file's name is durable only once its directory is
    finally:
        os.close(fd)


def _scan_segments(directory: Path) -> dict[int, int]:
    """Segment id -> file size of every segment file in ``directory``."""
    sizes = {}
    with os.scandir(directory) as it:
        for item in it:
            match = _SEGMENT_RE.match(item.name)
            if match and item.is_file():
                sizes[int(match.group(1))] = item.stat().st_size
    return sizes


@dataclass(slots=True)
class _Entry:
    """Where a committed page lives, and its meta (for rebuilding the store's directory)."""

    meta: PageMeta
    segment_id: int
    offset: int
    length: int
    checksum: int

    @property
    def padded(self) -> int:
        return _aligned(self.length)

    def pack(self) -> bytes:
        m = self.meta
        fixed = _RECORD.pack(_RECORD_VERSION, self.segment_id, self.offset, self.length,
                             m.block_index, m.codec_id, self.checksum, m.namespace,
                             m.parent or _NO_PARENT)
        names = json.dumps({"t": m.tenant, "m": m.model_id, "c": m.codec}, separators=(",", ":"))
        return fixed + names.encode()

    @classmethod
    def unpack(cls, key: bytes, raw: bytes) -> _Entry:
        """Parse an index record; ValueError (or struct.error) if it is damaged."""
        (version, segment_id, offset, length, block_index, codec_id, checksum, namespace,
         parent) = _RECORD.unpack_from(raw)
        if version != _RECORD_VERSION or len(key) != KEY_BYTES:
            raise ValueError(f"index record version {version}, key of {len(key)} bytes")
        names = json.loads(raw[_RECORD.size:])
        meta = PageMeta(key=BlockKey(key), namespace=namespace,
                        parent=None if parent == _NO_PARENT else BlockKey(parent),
                        block_index=block_index, tenant=names["t"], model_id=names["m"],
                        codec=names["c"], codec_id=codec_id)
        return cls(meta, segment_id, offset, length, checksum)


@dataclass(eq=False, slots=True)
class _Segment:
    """One segment file; ``size_bytes`` includes space handed to appends still in flight."""

    segment_id: int
    path: Path
    handle: Any  # aiofiles binary file (AsyncFileIO)
    size_bytes: int
    live_bytes: int = 0
    keys: set[bytes] = field(default_factory=set)  # committed keys stored here
    num_inflight: int = 0  # appends placed here and not yet committed or failed
    num_readers: int = 0  # reads in worker threads that hold the file descriptor
    is_removed: bool = False
    is_broken: bool = False  # an append or fsync failed here: append no more
    is_compacting: bool = False

    @property
    def dead_bytes(self) -> int:
        return self.size_bytes - self.live_bytes


@dataclass(eq=False, slots=True)
class _Pending:
    """A page on its way to disk; ``future`` resolves when it is durable and indexed."""

    key: BlockKey
    data: memoryview
    meta: PageMeta
    checksum: int
    future: asyncio.Future[bool]
    relocate_from: _Entry | None = None  # set when compaction moves a committed page
    segment: _Segment | None = None
    offset: int = 0
    is_cancelled: bool = False  # deleted before it was committed: commit it as dead bytes

    @property
    def padded(self) -> int:
        return _aligned(len(self.data))


def _check_page(key: BlockKey, page: bytes | memoryview, meta: PageMeta
                ) -> tuple[memoryview, PageMeta, int]:
    """The page as bytes, its own meta and checksum; InvalidArgument if it does not verify."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise InvalidArgument(f"block key must be {KEY_BYTES} bytes, got {key!r}")
    if meta.key != key:
        raise InvalidArgument(f"meta is for key {meta.key.hex()}, not {key.hex()}")
    try:
        view = memoryview(page).cast("B")
        decoded = decode_page(view, expected_key=key)
    except (TypeError, CorruptPage) as exc:
        raise InvalidArgument(f"page for key {key.hex()} does not verify: {exc}") from None
    if len(decoded.data) != len(view) or len(view) >= 1 << 32:
        raise InvalidArgument(f"page for key {key.hex()} is {len(view)} bytes, its header "
                              f"says {len(decoded.data)} (at most 4 GiB)")
    return view, decoded.meta, struct.unpack_from("<Q", view, _CHECKSUM_OFFSET)[0]


def _read_page(fd: int, entry: _Entry) -> Page:
    """Read and verify one page (runs in a worker thread); CorruptPage on any fault."""
    buf = _aligned_buffer(entry.padded)
    try:
        nbytes = os.preadv(fd, [buf], entry.offset)
    except OSError as exc:
        raise CorruptPage(f"read failed: {exc.strerror}") from None
    page = decode_page(buf[:nbytes], expected_key=entry.meta.key)
    checksum = struct.unpack_from("<Q", buf, _CHECKSUM_OFFSET)[0]
    if len(page.data) != entry.length or checksum != entry.checksum:
        raise CorruptPage(f"page for key {entry.meta.key.hex()} is not the one indexed")
    return page


def _append(fd: int, buffer: mmap.mmap, batch: list[_Pending], nbytes: int) -> None:
    """Copy a batch's pages, each zero-padded, into an aligned buffer and write it at the
    batch's place in the segment: one pwrite (runs in a worker thread)."""
    target = buffer if nbytes <= len(buffer) else mmap.mmap(-1, nbytes)
    pos = 0
    for p in batch:
        end = pos + len(p.data)
        target[pos:end] = p.data
        target[end:pos + p.padded] = _ZEROS[:p.padded - len(p.data)]
        pos += p.padded
    view, done = memoryview(target)[:nbytes], 0
    while done < nbytes:
        written = os.pwrite(fd, view[done:], batch[0].offset + done)
        if written <= 0:
            raise OSError(errno.EIO, "segment append wrote nothing")
        done += written


class SsdTier(Tier):
    """Pages in append-only segment files, indexed by LMDB, bounded by ``capacity_bytes``.

    Called from one event loop. File I/O goes through aiofiles or worker threads, LMDB
    transactions through worker threads, one write transaction at a time (``_index_lock``).
    ``write`` admits a page only if the frequency sketch saw its key ``admit_after_accesses``
    times (``note_access``), unless ``force``. Space: a reserve of one segment's worth of live
    bytes (``(1 - compact_dead_fraction) * segment_bytes``) is kept for compaction, so
    compaction can always copy a victim's live pages forward.
    """

    name = "ssd"

    def __init__(self, config: SsdConfig) -> None:
        self._config = config
        self._dir = Path(config.path)
        self._sketch = FrequencySketch(config.admit_expected_keys)
        reserve = int((1.0 - config.compact_dead_fraction) * config.segment_bytes)
        self._reserve_bytes = min(_aligned(reserve), config.capacity_bytes // 2)
        self._index: dict[bytes, _Entry] = {}
        self._segments: dict[int, _Segment] = {}
        self._active: _Segment | None = None
        self._next_segment_id = 1
        self._used_bytes = 0  # segment sizes plus space reserved by queued writes
        self._queue: deque[_Pending] = deque()
        self._inflight: dict[bytes, _Pending] = {}
        self._unsynced: list[_Pending] = []  # appended, waiting for the "batch" flusher
        self._unsynced_bytes = 0
        self._journal: dict[bytes, bytes | None] = {}  # index changes not yet committed
        self._emptied: set[_Segment] = set()
        self._index_lock = asyncio.Lock()
        self._compact_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._flush_wake = asyncio.Event()
        self._buffers: asyncio.Queue[mmap.mmap] = asyncio.Queue()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writer_task: asyncio.Task[None] | None = None
        self._flusher_task: asyncio.Task[None] | None = None
        self._env: lmdb.Environment | None = None
        self._db: Any = None
        self._lock_fd: int | None = None
        self._is_closing = False  # refuse new calls
        self._is_stopping = False  # compaction drained: the writer and flusher may exit
        self._o_direct = False
        self._counts = dict.fromkeys(("hits", "misses", "corrupt", "rejected", "evictions",
                                      "bytes_read", "bytes_written", "compactions", "appends"), 0)


    @property
    def capacity_bytes(self) -> int:
        return self._config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def o_direct(self) -> bool:
        """Whether segments are read and written with O_DIRECT (decided at ``open``)."""
        return self._o_direct

    def contains(self, key: BlockKey) -> bool:
        return key in self._index

    def can_write(self, nbytes: int) -> bool:
        """Whether a page of ``nbytes`` fits now, possibly after compacting dead segments."""
        padded = _aligned(nbytes)
        if self._fits(padded):
            return True
        used = self._used_bytes
        for seg in self._compaction_candidates():
            if seg.live_bytes <= self.capacity_bytes - used:
                used -= seg.dead_bytes
        return used + padded <= self.capacity_bytes - self._reserve_bytes

    def note_access(self, key: BlockKey) -> None:
        """Record a sighting of ``key`` (a put or a lookup hit) for the admission filter."""
        self._sketch.add(key)

    def entries(self) -> Iterator[PageMeta]:
        for entry in list(self._index.values()):
            yield entry.meta

    def page_size(self, key: BlockKey) -> int | None:
        entry = self._index.get(key)
        return None if entry is None else entry.length

    def stats(self) -> TierStats:
        c = self._counts
        return TierStats(
            name=self.name, capacity_bytes=self.capacity_bytes, used_bytes=self._used_bytes,
            num_blocks=len(self._index), hits=c["hits"], misses=c["misses"],
            evictions=c["evictions"], corrupt=c["corrupt"], rejected=c["rejected"],
            bytes_read=c["bytes_read"], bytes_written=c["bytes_written"],
            extra={"segments": len(self._segments),
                   "dead_bytes": sum(s.dead_bytes for s in self._segments.values()),
                   "o_direct": int(self._o_direct), "compactions": c["compactions"],
                   "appends": c["appends"]})

    async def write(self, key: BlockKey, page: bytes | memoryview, meta: PageMeta, *,
                    force: bool = False) -> bool:
        """Store an encoded page; True once it is durable per ``config.fsync`` and indexed.

        Args:
            key: the block key; must match the page header and ``meta.key``.
            page: a complete encoded page (``kvstore.page.encode_page``); the page header is
                authoritative for the meta kept in the index.
            meta: the block's meta as the store knows it.
            force: skip the admission filter (e.g. a block no other tier can hold).

        Returns:
            False if the filter rejects the key or no room can be made without evicting.
        """
        self._check_open()
        if key in self._index:
            return True
        if key in self._inflight:
            return await asyncio.shield(self._inflight[key].future)
        if not force and self._sketch.estimate(key) < self._config.admit_after_accesses:
            self._counts["rejected"] += 1
            return False
        data, page_meta, checksum = _check_page(key, page, meta)
        padded = _aligned(len(data))
        if not self._fits(padded):
            await self._reclaim(padded)
            self._check_open()
            if key in self._index or key in self._inflight:  # written while we compacted
                return await self.write(key, page, meta, force=True)
            if not self._fits(padded):
                self._counts["rejected"] += 1
                return False
        pending = self._submit(key, data, page_meta, checksum)
        self._inflight[key] = pending
        return await asyncio.shield(pending.future)

    async def read(self, key: BlockKey) -> Page | None:
        self._check_open()
        entry = self._index.get(key)
        if entry is None:
            self._counts["misses"] += 1
            return None
        try:
            page = await self._read_entry(entry)
        except CorruptPage as exc:
            self._drop_corrupt(entry, exc)
            await self._remove_emptied()
            self._counts["misses"] += 1
            return None
        self._counts["hits"] += 1
        self._counts["bytes_read"] += entry.length
        return page

    async def delete(self, key: BlockKey) -> bool:
        self._check_open()
        pending = self._inflight.pop(key, None)
        if pending is not None:
            pending.is_cancelled = True  # its write still returns; a new write starts afresh
        entry = self._index.pop(key, None)
        if entry is None:
            return pending is not None
        self._journal[key] = None  # committed with the next flush: see the module docstring
        self._release(entry)
        self._counts["evictions"] += 1
        await self._remove_emptied()
        return True

    async def open(self) -> None:
        """Lock the directory, probe O_DIRECT, open the index and recover the segments."""
        if self._writer_task is not None:
            raise InvalidArgument(f"ssd tier at {self._dir} was opened before; make a new one")
        await aiofiles.os.makedirs(self._dir, exist_ok=True)
        self._lock_fd = await asyncio.to_thread(_lock_directory, self._dir)
        try:
            self._o_direct = self._config.o_direct and await asyncio.to_thread(
                _probe_o_direct, self._dir)
            self._env, self._db = await asyncio.to_thread(self._open_env)
            await self._recover()
        except BaseException:
            await self._release_resources()
            raise
        for _ in range(NUM_BUFFERS):
            self._buffers.put_nowait(mmap.mmap(-1, MAX_BATCH_BYTES))
        self._is_closing = self._is_stopping = False
        self._writer_task = asyncio.create_task(self._writer())
        self._flusher_task = asyncio.create_task(self._flusher())
        log.info("ssd tier open at %s: %d blocks in %d segments, %d bytes, o_direct=%s",
                 self._dir, len(self._index), len(self._segments), self._used_bytes,
                 self._o_direct)

    async def close(self) -> None:
        """Finish queued writes, make them durable and indexed, and release the files."""
        if self._env is None or self._is_closing:
            return
        self._is_closing = True
        async with self._compact_lock:  # a running compaction stops early and drains
            self._is_stopping = True
        self._wake.set()
        self._flush_wake.set()
        await asyncio.gather(self._writer_task, self._flusher_task)
        while self._tasks:  # appends and removals in flight
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self._flush()  # the last group commit
        await self._remove_emptied()
        await self._release_resources()

    def _open_env(self) -> tuple[lmdb.Environment, Any]:
        try:
            env = lmdb.open(str(self._dir / "index"), map_size=self._config.index_map_bytes,
                            max_dbs=1, lock=True, subdir=True, readahead=False,
                            sync=self._config.fsync != "never")
            return env, env.open_db(b"pages")
        except lmdb.Error as exc:
            raise KVStoreError(f"cannot open the ssd index in {self._dir}: {exc}") from None

    def _load_records(self) -> list[tuple[bytes, bytes]]:
        with self._env.begin(db=self._db) as txn:
            return list(txn.cursor())

    async def _recover(self) -> None:
        """Rebuild the in-memory index and segment accounting from LMDB and the files."""
        records = await asyncio.to_thread(self._load_records)
        sizes = await asyncio.to_thread(_scan_segments, self._dir)
        ends: dict[int, int] = {}
        for key, raw in records:
            try:
                entry = _Entry.unpack(key, raw)
            except (ValueError, KeyError, TypeError, struct.error):
                entry = None
            if entry is None or entry.offset + entry.padded > sizes.get(entry.segment_id, -1):
                self._journal[key] = None  # damaged, or past the end of its segment
                continue
            self._index[key] = entry
            ends[entry.segment_id] = max(ends.get(entry.segment_id, 0),
                                         entry.offset + entry.padded)
        if self._journal:
            log.warning("ssd index: dropped %d entries that point past their segment's end",
                        len(self._journal))
        for segment_id, size in sorted(sizes.items()):
            await self._recover_segment(segment_id, size, ends.get(segment_id, 0))
        for key, entry in self._index.items():
            seg = self._segments[entry.segment_id]
            seg.live_bytes += entry.padded
            seg.keys.add(key)
        self._next_segment_id = max(sizes, default=0) + 1
        await self._commit_journal()

    async def _recover_segment(self, segment_id: int, size: int, end: int) -> None:
        path = self._dir / f"seg-{segment_id:06d}.dat"
        if end == 0:
            await aiofiles.os.remove(path)  # nothing indexed in it
            return
        if size > end:
            log.warning("ssd segment %s: truncating %d bytes past its last indexed page",
                        path.name, size - end)
            await asyncio.to_thread(os.truncate, path, end)
        opener = _direct_opener if self._o_direct else None
        handle = await aiofiles.open(path, "rb", buffering=0, opener=opener)
        self._segments[segment_id] = _Segment(segment_id, path, handle, end)
        self._used_bytes += end

    async def _release_resources(self) -> None:
        while any(seg.num_readers for seg in self._segments.values()):
            await asyncio.sleep(0.001)  # reads in worker threads still hold descriptors
        for seg in list(self._segments.values()):
            await seg.handle.close()
        self._segments.clear()
        self._active = None
        if self._env is not None:
            await asyncio.to_thread(self._env.close)
            self._env = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # also drops the flock
            self._lock_fd = None

    def _check_open(self) -> None:
        if self._env is None or self._is_closing:
            raise Unavailable(f"ssd tier at {self._dir} is not open")

    def _submit(self, key: BlockKey, data: memoryview, meta: PageMeta, checksum: int,
                relocate_from: _Entry | None = None) -> _Pending:
        """Reserve space and queue a page for the writer (the caller checked that it fits)."""
        future = asyncio.get_running_loop().create_future()
        pending = _Pending(key, data, meta, checksum, future, relocate_from)
        self._used_bytes += pending.padded
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
                self._fail(batch, exc)
                continue
            self._spawn(self._write_batch(seg, batch, buffer))

    async def _next_batch(self) -> tuple[_Segment, list[_Pending]]:
        """Place the queued pages that fit one append in one segment."""
        limit = self._config.segment_bytes
        seg = self._active
        first = self._queue[0].padded
        if seg is None or seg.is_broken or (seg.size_bytes and seg.size_bytes + first > limit):
            seg = await self._open_segment()
        batch: list[_Pending] = []
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

    async def _open_segment(self) -> _Segment:
        segment_id = self._next_segment_id
        self._next_segment_id += 1
        path = self._dir / f"seg-{segment_id:06d}.dat"
        opener = _direct_opener if self._o_direct else None
        handle = await aiofiles.open(path, "x+b", buffering=0, opener=opener)
        if self._config.fsync != "never":
            await asyncio.to_thread(_sync_directory, self._dir)
        seg = _Segment(segment_id, path, handle, 0)
        self._segments[segment_id] = seg
        self._active = seg
        return seg

    async def _write_batch(self, seg: _Segment, batch: list[_Pending], buffer: mmap.mmap
                           ) -> None:
        """Fill the buffer, append it after the segment's previous batch, then commit."""
        nbytes = sum(p.padded for p in batch)
        try:
            await asyncio.to_thread(_append, seg.handle.fileno(), buffer, batch, nbytes)
        except OSError as exc:
            seg.is_broken = True
            log.error("ssd append of %d bytes to %s failed: %s", nbytes, seg.path.name, exc)
            self._fail(batch, exc)
            return
        finally:
            self._buffers.put_nowait(buffer)
        self._counts["bytes_written"] += nbytes
        self._counts["appends"] += 1
        await self._after_append(seg, batch, nbytes)

    async def _after_append(self, seg: _Segment, batch: list[_Pending], nbytes: int) -> None:
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
                await asyncio.to_thread(os.fdatasync, seg.handle.fileno())
            except OSError as exc:
                seg.is_broken = True  # after a failed fsync the file's state is unknown
                self._fail(batch, exc)
                return
        for p in batch:
            self._stage(p)
        await self._finish(batch)

    def _stage(self, p: _Pending) -> None:
        """Enter an appended page in the in-memory index and the journal (or count it dead)."""
        seg = p.segment
        seg.num_inflight -= 1
        old = self._index.get(p.key)
        if p.is_cancelled or (p.relocate_from is not None and old is not p.relocate_from):
            seg.live_bytes -= p.padded  # deleted meanwhile
            self._note_if_empty(seg)
            return
        if old is not None:
            self._release(old)  # a compaction victim is removed by its compactor, later
        entry = _Entry(p.meta, seg.segment_id, p.offset, len(p.data), p.checksum)
        self._index[p.key] = entry
        seg.keys.add(p.key)
        self._journal[p.key] = entry.pack()

    async def _commit_journal(self) -> None:
        """Apply the journal to LMDB in one write transaction (one at a time)."""
        async with self._index_lock:
            if not self._journal:
                return
            journal, self._journal = self._journal, {}
            try:
                await asyncio.to_thread(self._apply, journal)
            except lmdb.Error as exc:
                for key, value in journal.items():
                    self._journal.setdefault(key, value)  # retried with the next commit
                if isinstance(exc, lmdb.MapFullError):
                    raise CapacityError("ssd index is full: raise ssd.index_map_bytes") from None
                raise KVStoreError(f"ssd index commit failed: {exc}") from None

    def _apply(self, journal: dict[bytes, bytes | None]) -> None:
        with self._env.begin(write=True, db=self._db) as txn:
            for key, value in journal.items():
                if value is None:
                    txn.delete(key)
                else:
                    txn.put(key, value)

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
                await asyncio.to_thread(os.fdatasync, seg.handle.fileno())
            except OSError as exc:
                seg.is_broken = True
                failed = [p for p in batch if p.segment is seg]
                batch = [p for p in batch if p.segment is not seg]
                self._fail(failed, exc)
        for p in batch:
            self._stage(p)
        await self._finish(batch)

    async def _finish(self, batch: list[_Pending]) -> None:
        """Commit the journal (staged pages and deletions), then answer the batch's writers."""
        try:
            await self._commit_journal()
        except KVStoreError as exc:
            # The pages stay staged and the journal is retried by the next commit; the writers
            # learn that their pages are not indexed durably yet.
            log.error("ssd index commit failed: %s", exc)
            self._answer(batch, exc)
            return
        self._answer(batch, None)
        await self._remove_emptied()

    def _answer(self, batch: list[_Pending], exc: BaseException | None) -> None:
        for p in batch:
            if self._inflight.get(p.key) is p:
                del self._inflight[p.key]
            if p.future.done():
                continue
            if exc is None:
                p.future.set_result(True)
            else:
                p.future.set_exception(exc)

    def _fail(self, batch: list[_Pending], exc: BaseException) -> None:
        """Count unstaged pages' space as dead and raise ``exc`` in their writers."""
        for p in batch:
            if p.segment is None:
                self._used_bytes -= p.padded  # never placed in a segment
            else:
                p.segment.num_inflight -= 1
                p.segment.live_bytes -= p.padded
                self._note_if_empty(p.segment)
        self._answer(batch, exc)
        self._spawn(self._remove_emptied())

    def _fits(self, padded: int) -> bool:
        """Whether a page fits beside the space held back for compaction."""
        return self._used_bytes + padded <= self.capacity_bytes - self._reserve_bytes

    def _compaction_candidates(self) -> list[_Segment]:
        """Sealed, idle segments at least ``compact_dead_fraction`` dead, deadest first."""
        fraction = self._config.compact_dead_fraction
        found = [s for s in self._segments.values()
                 if s is not self._active and not s.is_compacting and s.num_inflight == 0
                 and s.size_bytes and s.dead_bytes >= fraction * s.size_bytes]
        return sorted(found, key=lambda s: s.dead_bytes, reverse=True)

    def _release(self, entry: _Entry) -> None:
        """A committed page left the index: its bytes are dead now."""
        seg = self._segments.get(entry.segment_id)
        if seg is not None:
            seg.live_bytes -= entry.padded
            seg.keys.discard(entry.meta.key)
            self._note_if_empty(seg)

    def _note_if_empty(self, seg: _Segment) -> None:
        if seg.live_bytes == 0 and seg.num_inflight == 0 and not seg.is_removed:
            self._emptied.add(seg)

    async def _remove_emptied(self) -> None:
        """Delete segments without live bytes (a compaction victim waits for its commit)."""
        for seg in list(self._emptied):
            if seg.is_compacting:
                continue
            self._emptied.discard(seg)
            if seg.live_bytes == 0 and seg.num_inflight == 0 and not seg.is_removed:
                await self._remove_segment(seg)

    async def _remove_segment(self, seg: _Segment) -> None:
        seg.is_removed = True
        self._segments.pop(seg.segment_id, None)
        if self._active is seg:
            self._active = None
        try:
            await aiofiles.os.remove(seg.path)
        except FileNotFoundError:
            pass
        self._used_bytes -= seg.size_bytes  # only now: the bytes never outlive the bound
        if seg.num_readers == 0:
            await seg.handle.close()  # else the last reader closes it

    async def _reclaim(self, padded: int) -> None:
        """Compact dead segments until a page of ``padded`` bytes fits, or nothing is left."""
        async with self._compact_lock:
            tried: set[_Segment] = set()
            while not self._fits(padded) and not self._is_closing:
                free = self.capacity_bytes - self._used_bytes
                victim = next((s for s in self._compaction_candidates()
                               if s not in tried and s.live_bytes <= free), None)
                if victim is None:
                    return
                tried.add(victim)
                await self._compact(victim)

    async def _compact(self, seg: _Segment) -> None:
        """Copy the live pages of ``seg`` into the active segment, then delete its file."""
        seg.is_compacting = True
        self._counts["compactions"] += 1
        before = seg.size_bytes
        try:
            moves: list[_Pending] = []
            for key in list(seg.keys):
                entry = self._index.get(key)
                if entry is None or entry.segment_id != seg.segment_id or self._is_closing:
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
        await self._remove_emptied()
        log.info("ssd compaction of %s: %d bytes, %d still live", seg.path.name, before,
                 seg.live_bytes)

    async def _move(self, entry: _Entry) -> list[_Pending] | None:
        """Queue a copy of a committed page; None when there is no room for it."""
        try:
            page = await self._read_entry(entry)
        except CorruptPage as exc:
            self._drop_corrupt(entry, exc)
            return []
        if self._index.get(entry.meta.key) is not entry:
            return []  # deleted while we read it
        if self._used_bytes + entry.padded > self.capacity_bytes:
            return None
        return [self._submit(entry.meta.key, page.data, entry.meta, entry.checksum, entry)]

    async def _await_moves(self, moves: list[_Pending]) -> None:
        results = await asyncio.gather(*(p.future for p in moves), return_exceptions=True)
        if failed := [r for r in results if isinstance(r, BaseException)]:
            log.error("ssd compaction: %d of %d copies failed: %s", len(failed), len(moves),
                      failed[0])

    async def _read_entry(self, entry: _Entry) -> Page:
        """Read and verify a committed page; CorruptPage on any fault."""
        seg = self._segments.get(entry.segment_id)
        if seg is None:
            raise CorruptPage(f"segment {entry.segment_id} is gone")
        seg.num_readers += 1
        try:
            return await asyncio.to_thread(_read_page, seg.handle.fileno(), entry)
        finally:
            seg.num_readers -= 1
            if seg.is_removed and seg.num_readers == 0:
                await seg.handle.close()

    def _drop_corrupt(self, entry: _Entry, exc: CorruptPage) -> None:
        key = entry.meta.key
        self._counts["corrupt"] += 1
        log.warning("ssd page %s (segment %d, offset %d) failed verification and was dropped: "
                    "%s", key.hex(), entry.segment_id, entry.offset, exc)
        if self._index.get(key) is entry:
            del self._index[key]
            self._journal[key] = None
            self._release(entry)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("ssd background task failed: %r", task.exception())
