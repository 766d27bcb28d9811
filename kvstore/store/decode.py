"""Get-side decoding: verify each page and decode it into its output view, on worker threads."""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Self

import numpy as np
import torch

from kvstore import codecs
from kvstore.codecs.base import as_array, check_out, unpack_blob
from kvstore.copies import copy_all, default_copy_threads
from kvstore.errors import CodecError, CorruptPage
from kvstore.page import Page, verify_page

# Decoding is memory-bound and torch copies release the GIL: a few threads fill a socket's
# bandwidth (a single thread reached 5-7 GB/s on the H200 host against 32 GB/s for 16).
DECODE_THREADS = max(1, min(8, os.cpu_count() or 1))
# Raw pages of at most this many bytes per get are verified and decoded on the event loop: a
# thread hop (asyncio.to_thread) took 110-170 us on the 2-core box, verifying and copying 64 KiB
# of raw pages 16-25 us, 128 KiB 20-40 us (2026-11-29). Lossy codecs took 200-270 us to decode
# 128 KiB there: their pages always go to threads.
INLINE_DECODE_BYTES = 128 << 10
# Raw pages in trusted memory (``Page.is_trusted``: no hash to check) are only a copy, done in
# numpy (one thread, the GIL released, no OpenMP team to wait on): up to this many bytes per
# get on the loop, so a one-block get of a 7-8B model (2 MiB) takes no thread hop. Measured on
# the 2-core box (2026-12-01): the hop there and back 100-170 us, the 2 MiB copy 80-150 us.
INLINE_TRUSTED_BYTES = (2 << 20) + (64 << 10)
# Decode threads split the cores between them for torch's own (OpenMP) threads. Measured with
# ``kvstore bench tiers`` (2026-11-29), 2 MiB pages: on the 2-core box prefix gets ran at 6.5 GB/s
# with a team of 2 per decode thread and 7.4 GB/s with 1; on the 16-core H200 host (8 decode
# threads) at 5.4-5.7 GB/s with 16 per thread, 5.8-6.7 with 1 and 5.6-7.4 with 2, and one-block
# gets at 2.3 GB/s with 16, 1.7-2.0 with 1 and 1.8-2.3 with 2 (the code before: 4.3 and 2.2).
OPENMP_THREADS_PER_DECODE_THREAD = max(1, (os.cpu_count() or 1) // DECODE_THREADS)
_OPENMP_NAMES = ("libgomp", "libiomp", "libomp")  # GNU, Intel and LLVM OpenMP runtimes

_executor: ThreadPoolExecutor | None = None
_executor_pid = 0


class PageDecoder:
    """Verifies and decodes pages into their output views as they are added, on up to
    ``DECODE_THREADS`` threads: decoding starts while later pages of a prefix are still read.

    Use it from the event loop: ``async with PageDecoder(outs) as decoder:``, ``decoder.add(i,
    page)`` for pages read with ``verify=False``, in any order; on leaving the block every added
    page has been verified (``verify_page``) and, if it passed, decoded into ``outs[i]``, and
    ``decoder.failed`` lists the indices that failed, ascending (their outputs are left as they
    were). Leaving the block waits for the threads even on an error, so no thread touches a
    page after it.

    A page is verified on the thread that decodes it, just before: the hash leaves it in cache,
    so verify-then-copy costs little more than the copy. No thread waits for pages: a thread
    drains what is queued and ends, and ``add`` starts another when fewer run than allowed, so a
    get waiting on the SSD holds no decode thread. Raw pages are done on the loop while the
    get's inline total stays within ``INLINE_DECODE_BYTES`` (less work than a thread hop).
    """

    def __init__(self, outs: Sequence[torch.Tensor]) -> None:
        self.failed: list[int] = []
        self._outs = outs
        self._pages: list[Page | None] = [None] * len(outs)
        self._todo: deque[int] = deque()
        self._lock = threading.Lock()  # guards _todo and _num_running against the threads
        self._num_running = 0
        self._inline_bytes = 0
        self._runs: list[asyncio.Future[list[int]]] = []

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        outcomes = await asyncio.gather(*self._runs, return_exceptions=True)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors and exc is None:
            raise errors[0]
        self.failed = sorted(self.failed + [i for o in outcomes if isinstance(o, list)
                                            for i in o])

    def add(self, i: int, page: Page) -> None:
        """Queue ``page`` (parsed, not yet verified) for ``outs[i]``."""
        self._pages[i] = page
        nbytes = len(page.data)
        inline_bytes = INLINE_TRUSTED_BYTES if page.is_trusted else INLINE_DECODE_BYTES
        if (page.meta.codec == codecs.RawCodec.name
                and self._inline_bytes + nbytes <= inline_bytes):
            self._inline_bytes += nbytes
            if not _verify_and_decode(page, self._outs[i]):
                self.failed.append(i)
            return
        with self._lock:
            self._todo.append(i)
            if self._num_running >= DECODE_THREADS:
                return  # a running thread takes it
            self._num_running += 1
        loop = asyncio.get_running_loop()
        self._runs.append(loop.run_in_executor(_decode_executor(), self._drain))

    def _drain(self) -> list[int]:
        """Take queued pages until none is left (runs on a decode thread)."""
        failed = []
        try:
            while True:
                with self._lock:
                    if not self._todo:
                        self._num_running -= 1
                        return failed
                    i = self._todo.popleft()
                if not _verify_and_decode(self._pages[i], self._outs[i]):
                    failed.append(i)
        except BaseException:
            with self._lock:
                self._num_running -= 1
            raise


async def decode_pages(pages: Sequence[Page], outs: Sequence[torch.Tensor]) -> list[int]:
    """Verify and decode ``pages`` (read with ``verify=False``) into ``outs`` with a
    ``PageDecoder``; return the indices that failed verification, ascending."""
    async with PageDecoder(outs) as decoder:
        for i, page in enumerate(pages):
            decoder.add(i, page)
    return decoder.failed


def _verify_and_decode(page: Page, out: torch.Tensor) -> bool:
    """Decode ``page`` into ``out`` if it verifies; False (``out`` untouched) if not."""
    try:
        verify_page(page)
    except CorruptPage:
        return False
    # The page checksum just verified covers the payload: the codec need not check it again.
    if page.meta.codec != codecs.RawCodec.name:
        codecs.decode(page.payload, out=out, verify=False)
        return True
    # A raw page is a copy: numpy's, on kvstore's own threads (a torch copy runs on an OpenMP
    # team, which on a busy host waits for cores; on the loop it stalls everything behind it).
    # A page of 4 MiB or more (a 128-token block) is shared with the copy pool: one page would
    # otherwise be one thread's copy however many cores are idle.
    parts = unpack_blob(page.payload, verify=False)
    if parts.codec_id != codecs.RawCodec.codec_id:
        raise CodecError(f"blob was written by codec id {parts.codec_id}, not raw")
    dst = as_array(check_out(out, parts.dtype, parts.shape))
    src = np.frombuffer(parts.sections[0], dtype=dst.dtype)  # no torch view: 20 us less a page
    if src.size != dst.size:
        raise CodecError(f"blob section holds {src.nbytes} bytes, expected {dst.nbytes}")
    copy_all([(dst, src.reshape(dst.shape))], default_copy_threads())
    return True


def _decode_executor() -> ThreadPoolExecutor:
    """The decode threads, made on first use (and again in a forked child, which has none)."""
    global _executor, _executor_pid
    if _executor is None or _executor_pid != os.getpid():
        _executor = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="kvstore-decode",
                                       initializer=_share_the_cores)
        _executor_pid = os.getpid()
    return _executor


def _share_the_cores() -> None:
    """Give this decode thread's torch ops ``OPENMP_THREADS_PER_DECODE_THREAD`` threads.

    Each torch copy on a decode thread otherwise starts an OpenMP team of
    ``torch.get_num_threads()`` (every core), one team per decode thread: more threads than
    cores. OpenMP's thread count is per calling thread, so other threads (the event loop's, an
    engine's) keep theirs.
    """
    torch.get_num_threads()  # torch sets this thread's OpenMP team size on first use: let it first
    for runtime in _openmp_runtimes():
        runtime.omp_set_num_threads(OPENMP_THREADS_PER_DECODE_THREAD)


def _openmp_runtimes() -> list[ctypes.CDLL]:
    """The OpenMP runtimes mapped into this process (torch's among them); none off Linux."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return []
    found = []
    for path in sorted(paths):
        if os.path.basename(path).startswith(_OPENMP_NAMES) and ".so" in path:
            try:
                lib = ctypes.CDLL(path)  # already loaded: the same library, not a second copy
            except OSError:
                continue
            if hasattr(lib, "omp_set_num_threads"):
                found.append(lib)
    return found
