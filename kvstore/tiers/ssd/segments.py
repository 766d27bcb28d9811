"""Segment files of the SSD tier: aligned buffers, O_DIRECT, private files and directories,
directory locks, page I/O."""

from __future__ import annotations

import errno
import fcntl
import heapq
import logging
import mmap
import os
import re
import stat
import struct
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from kvstore.errors import AlreadyRunning, ConfigError, CorruptPage, InvalidArgument
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.page import HEADER_BYTES, Page, PageMeta, decode_page, page_length, parse_page

log = logging.getLogger("kvstore.tiers.ssd")  # the SSD tier's logger: these are its messages

ALIGN_BYTES = 4096  # O_DIRECT alignment of offsets, lengths and buffers (logical block <= 4 KiB)
SEGMENT_RE = re.compile(r"^seg-(\d+)\.dat$")
_ZEROS = bytes(ALIGN_BYTES)
_CHECKSUM_OFFSET = HEADER_BYTES - 8  # the page header ends with its u64 checksum (kvstore.page)
# Cached K/V is tenants' data: only the daemon's user may read it or list it.
PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN_BYTES``."""
    return (nbytes + ALIGN_BYTES - 1) & ~(ALIGN_BYTES - 1)


def aligned_array(nbytes: int) -> np.ndarray:
    """A fresh, writable, 4096-aligned array of ``nbytes`` bytes."""
    raw = np.empty(nbytes + ALIGN_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN_BYTES
    return raw[start:start + nbytes]


@dataclass(eq=False, slots=True)
class _Kept:
    array: np.ndarray  # aligned; never handed out itself, only views of it
    lent: weakref.ref[np.ndarray] | None = None  # the view handed out last


class ReadBuffers:
    """Aligned buffers for page reads, each reused only once nothing refers to it any more.

    Why: a fresh buffer for every read costs page faults on every read (glibc hands large blocks
    back to the kernel when they are freed): 2 MiB O_DIRECT reads in worker threads took 2.1 ms
    into fresh numpy buffers against 0.8 ms into a reused one on the work disk (2026-11-29).

    Lifetime: ``take`` lends a buffer as a memoryview over a numpy view of the kept array. A page
    read into it is returned as views of that memoryview (``Page.data``, ``Page.payload``), and
    everything made from those (slices, numpy arrays, tensors, ``torch.frombuffer``) holds a
    reference to it. The pool keeps only a weak reference to the view it lent, and lends the
    buffer again only after that view is gone: so a caller sees its page's bytes unchanged for as
    long as it holds any part of it (compaction keeps a page until its copy is written; a get
    drops its pages once decoded). A buffer still lent is simply not reused; ``take`` makes
    another. At most ``max_bytes`` are kept for reuse. Called from one thread (the event loop).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._kept: list[_Kept] = []
        self._kept_bytes = 0

    @property
    def kept_bytes(self) -> int:
        """Bytes of buffers held for reuse (lent or free)."""
        return self._kept_bytes

    def take(self, nbytes: int) -> memoryview:
        """A writable, ``ALIGN_BYTES``-aligned buffer of ``nbytes`` that nothing else refers to."""
        kept = self._smallest_free(nbytes) or self._keep_new(nbytes)
        if kept is None:  # no room to keep another: a one-off buffer, freed with its last view
            return memoryview(aligned_array(nbytes))
        view = kept.array[:nbytes]
        kept.lent = weakref.ref(view)
        return memoryview(view)

    def _smallest_free(self, nbytes: int) -> _Kept | None:
        fits = [k for k in self._kept if k.array.nbytes >= nbytes and _is_free(k)]
        return min(fits, key=lambda k: k.array.nbytes, default=None)

    def _keep_new(self, nbytes: int) -> _Kept | None:
        """Keep a new buffer, first dropping free ones too small to serve ``nbytes``."""
        for k in [k for k in self._kept if _is_free(k)]:
            if self._kept_bytes + nbytes <= self.max_bytes:
                break
            self._kept.remove(k)
            self._kept_bytes -= k.array.nbytes
        if self._kept_bytes + nbytes > self.max_bytes:
            return None
        kept = _Kept(aligned_array(nbytes))
        self._kept.append(kept)
        self._kept_bytes += nbytes
        return kept


def _is_free(kept: _Kept) -> bool:
    return kept.lent is None or kept.lent() is None


def segment_path(directory: Path, segment_id: int) -> Path:
    return directory / f"seg-{segment_id:06d}.dat"


def private_directory(path: Path, what: str) -> None:
    """Create ``path`` with mode 0700 (and its parents as needed), or make an existing one of
    ours 0700; ConfigError naming ``what`` and the path if it is no directory or another user
    owns it. A symlink to a directory (say, on another disk) is followed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)
    except FileExistsError:
        pass
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{what} {path} is owned by uid {st.st_uid}, not by this process's "
                          f"uid {os.geteuid()}; refusing to keep cached data there")
    if stat.S_IMODE(st.st_mode) != PRIVATE_DIR_MODE:  # the umask, or an older version
        os.chmod(path, PRIVATE_DIR_MODE)


def make_private(fd: int) -> None:
    """Give an open file mode 0600 unless it has it (whatever the umask left at creation)."""
    if stat.S_IMODE(os.fstat(fd).st_mode) != PRIVATE_FILE_MODE:
        os.fchmod(fd, PRIVATE_FILE_MODE)


def private_opener(o_direct: bool) -> Callable[[str, int], int]:
    """An ``open()`` opener for segment files: mode 0600, with O_DIRECT if ``o_direct``."""
    extra = os.O_DIRECT if o_direct else 0

    def opener(path: str, flags: int) -> int:
        fd = os.open(path, flags | extra, PRIVATE_FILE_MODE)
        try:
            make_private(fd)
        except OSError:
            os.close(fd)
            raise
        return fd

    return opener


def probe_o_direct(directory: Path) -> bool:
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


def lock_directory(directory: Path) -> int:
    """Take the directory's ``LOCK`` file (flock); AlreadyRunning if another process holds it."""
    fd = os.open(directory / "LOCK", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
    try:
        make_private(fd)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AlreadyRunning(f"ssd directory {directory} is already open elsewhere") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # a new file's name is durable only once its directory is
    finally:
        os.close(fd)


def scan_segments(directory: Path) -> dict[int, int]:
    """Segment id -> file size of every segment file in ``directory``."""
    sizes = {}
    with os.scandir(directory) as it:
        for item in it:
            match = SEGMENT_RE.match(item.name)
            if match and item.is_file():
                sizes[int(match.group(1))] = item.stat().st_size
    return sizes


@dataclass(frozen=True, slots=True)
class FoundPage:
    """A page found, and verified, by reading a segment file from its start."""

    offset: int
    length: int
    checksum: int
    meta: PageMeta


def find_pages(path: Path) -> list[FoundPage]:
    """Every page in a segment file that verifies, in file order (in a worker thread).

    Pages start on ``ALIGN_BYTES`` boundaries and describe themselves (``kvstore.page``), so
    the segments alone can rebuild a lost index. Where no page verifies (a torn append, a
    damaged page) the scan moves on one ``ALIGN_BYTES`` block at a time.
    """
    found = []
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        offset = 0
        while offset + HEADER_BYTES <= size:
            page = _page_at(fd, offset, size)
            if page is None:
                offset += ALIGN_BYTES
                continue
            found.append(page)
            offset += aligned(page.length)
    finally:
        os.close(fd)
    return found


def _page_at(fd: int, offset: int, size: int) -> FoundPage | None:
    try:
        length = page_length(os.pread(fd, HEADER_BYTES, offset))
        # Whole with its padding, as every append writes it; index records hold u32 lengths.
        if aligned(length) > size - offset or length >= 1 << 32:
            return None
        data = os.pread(fd, length, offset)
        page = decode_page(data)
    except (CorruptPage, OSError):  # OSError: an unreadable block is no page either
        return None
    checksum = struct.unpack_from("<Q", data, _CHECKSUM_OFFSET)[0]
    return FoundPage(offset, length, checksum, page.meta)


@dataclass(eq=False, slots=True)
class Segment:
    """One segment file; ``size_bytes`` includes space handed to appends still in flight."""

    segment_id: int
    path: Path
    size_bytes: int
    live_bytes: int = 0
    keys: set[bytes] = field(default_factory=set)  # committed keys stored here
    num_inflight: int = 0  # appends placed here and not yet committed or failed
    fd: int | None = None  # open while in ``SegmentFiles``' cache, or while in use
    num_users: int = 0  # calls in worker threads holding ``fd`` (``SegmentFiles.acquire``)
    is_removed: bool = False
    is_broken: bool = False  # an append or fsync failed here: append no more
    is_compacting: bool = False

    @property
    def dead_bytes(self) -> int:
        return self.size_bytes - self.live_bytes


class DeadOrder:
    """The segments ordered by dead bytes, deadest first: a max-heap with lazy invalidation.

    Why: a full tier asks for the deadest segment on every page it is offered (``room_for``,
    reclaim); walking and sorting every segment made that O(segments) per page, ~2300 segments
    at 600 GB of 256 MiB ones. ``note(seg)`` is called whenever a segment's dead bytes may have
    changed (its live bytes dropped) and pushes a fresh entry; entries whose recorded dead bytes
    are no longer the segment's are dropped when they surface. The heap is rebuilt once stale
    entries outnumber the live ones, so each note costs amortised O(log n).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int]] = []  # (-dead bytes, segment id)
        self._dead: dict[int, int] = {}  # segment id -> dead bytes of its valid entry
        self._segments: dict[int, Segment] = {}

    def __len__(self) -> int:
        return len(self._segments)

    def note(self, seg: Segment) -> None:
        """Record ``seg``'s dead bytes as they are now (a removed segment leaves)."""
        if seg.is_removed:
            self.discard(seg)
            return
        dead = seg.dead_bytes
        if self._dead.get(seg.segment_id) == dead and seg.segment_id in self._segments:
            return
        self._segments[seg.segment_id] = seg
        self._dead[seg.segment_id] = dead
        heapq.heappush(self._heap, (-dead, seg.segment_id))
        if len(self._heap) > 2 * len(self._dead) + 64:
            self._heap = [(-d, i) for i, d in self._dead.items()]
            heapq.heapify(self._heap)

    def discard(self, seg: Segment) -> None:
        self._segments.pop(seg.segment_id, None)
        self._dead.pop(seg.segment_id, None)

    def first(self, accept: Callable[[Segment], bool]) -> Segment | None:
        """The deadest segment that ``accept`` takes (ties: the lowest id), or None. Costs
        O((k + 1) log n) for the k segments passed over, which stay in the order."""
        passed: list[tuple[int, int]] = []
        found = None
        try:
            while self._heap:
                item = heapq.heappop(self._heap)
                dead, segment_id = -item[0], item[1]
                if self._dead.get(segment_id) != dead:
                    continue  # stale: the segment's dead bytes changed, or it left
                passed.append(item)
                seg = self._segments[segment_id]
                if seg.dead_bytes != dead:  # changed without a note: take it as it is now
                    passed.pop()
                    self._dead.pop(segment_id)
                    self.note(seg)
                    continue
                if accept(seg):
                    found = seg
                    break
        finally:
            for item in passed:
                heapq.heappush(self._heap, item)
        return found


class SegmentFiles:
    """Open file descriptors of segments, at most ``max_open`` of them kept (least recently used
    closed first) and reopened on demand.

    Why: a segment kept its descriptor open for its lifetime, ~2300 at 600 GB of 256 MiB
    segments, past a 1024 soft limit. ``acquire`` hands out a segment's descriptor (opening it,
    one open(2) on the caller's thread, microseconds) and holds it until ``release``: a
    descriptor in use by a read, append or fdatasync in a worker thread is never closed under
    it; the cache may stay over its bound while more than ``max_open`` are in use. Segments with
    appends not yet committed (``num_inflight``) keep theirs too, so an fdatasync runs on the
    descriptor that wrote (one that sees the writeback errors of those appends). Called from
    one thread (the event loop).
    """

    def __init__(self, max_open: int, o_direct: bool) -> None:
        if max_open < 1:
            raise InvalidArgument(f"max_open must be >= 1, got {max_open}")
        self.max_open = max_open
        self._opener = private_opener(o_direct)
        self._open: dict[int, Segment] = {}  # segment id -> segment, least recently used first
        self.opens = 0  # descriptors opened, creations included

    @property
    def num_open(self) -> int:
        return len(self._open)

    def create(self, seg: Segment) -> None:
        """Create ``seg``'s file (it must not exist) and keep its descriptor open."""
        seg.fd = self._opener(str(seg.path), os.O_RDWR | os.O_CREAT | os.O_EXCL)
        self.opens += 1
        self._kept(seg)

    def acquire(self, seg: Segment) -> int:
        """``seg``'s descriptor, open until ``release(seg)``; OSError if it cannot be opened."""
        if seg.is_removed:
            raise FileNotFoundError(errno.ENOENT, "segment was removed", str(seg.path))
        if seg.fd is None:
            seg.fd = self._opener(str(seg.path), os.O_RDWR)
            self.opens += 1
        seg.num_users += 1
        self._kept(seg)
        return seg.fd

    def release(self, seg: Segment) -> None:
        seg.num_users -= 1
        if seg.is_removed:
            self._close_if_unused(seg)
        else:
            self._trim()

    def forget(self, seg: Segment) -> None:
        """``seg`` was removed: close its descriptor now, or when its last user releases it."""
        self._open.pop(seg.segment_id, None)
        self._close_if_unused(seg)

    def close_all(self) -> None:
        """Close every descriptor (callers wait for users to finish first)."""
        for seg in list(self._open.values()):
            self._open.pop(seg.segment_id)
            self._close_if_unused(seg)

    def _kept(self, seg: Segment) -> None:
        self._open.pop(seg.segment_id, None)
        self._open[seg.segment_id] = seg  # most recently used last
        self._trim()

    def _trim(self) -> None:
        excess = len(self._open) - self.max_open
        if excess <= 0:
            return
        victims = []
        for seg in self._open.values():  # least recently used first; passes over those in use
            if seg.num_users == 0 and seg.num_inflight == 0:
                victims.append(seg)
                if len(victims) == excess:
                    break
        for seg in victims:
            del self._open[seg.segment_id]
            self._close_if_unused(seg)

    @staticmethod
    def _close_if_unused(seg: Segment) -> None:
        if seg.fd is not None and seg.num_users == 0:
            fd, seg.fd = seg.fd, None
            os.close(fd)


class AppendItem(Protocol):
    """A page placed in a segment (the writer's queue entries)."""

    data: memoryview
    offset: int

    @property
    def padded(self) -> int: ...


def check_page(key: BlockKey, page: bytes | memoryview, meta: PageMeta
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


class PagePlace(Protocol):
    """Where a committed page lives and what it must be (the index's records)."""

    meta: PageMeta
    offset: int
    length: int
    checksum: int


def read_page(fd: int, record: PagePlace, buf: memoryview, verify: bool = True) -> Page:
    """Read and verify one page into ``buf`` (``record.padded`` aligned bytes; the page views
    it), in a worker thread; CorruptPage on any fault.

    ``verify=False`` checks everything but the page checksum (header, meta, length and the
    checksum field against the index), for a caller that verifies the page itself.
    """
    try:
        nbytes = os.preadv(fd, [buf], record.offset)
    except OSError as exc:
        raise CorruptPage(f"read failed: {exc.strerror}") from None
    parse = decode_page if verify else parse_page
    page = parse(buf[:nbytes], expected_key=record.meta.key)
    checksum = struct.unpack_from("<Q", buf, _CHECKSUM_OFFSET)[0]
    if len(page.data) != record.length or checksum != record.checksum:
        raise CorruptPage(f"page for key {record.meta.key.hex()} is not the one indexed")
    return page


def append(fd: int, buffer: mmap.mmap, batch: Sequence[AppendItem], nbytes: int) -> None:
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
