"""Large host copies spread over a few threads of kvstore's own, whatever the caller's torch
thread settings.

One thread copying between DRAM buffers moves 8-11 GB/s on the 2-core box, less than its
memory system can (2026-12-01: 32 MiB out of a memfd mapping in 3.0-3.6 ms on one thread,
2.1-3.0 ms split over two). ``copy_all`` shares a list of copies (a get's pages into the
caller's buffer) between the calling thread and ``threads - 1`` pool threads; numpy releases
the GIL while it copies, so the shares run side by side. Below ``MIN_SPLIT_BYTES`` the caller
copies alone: a pool hand-off (tens of microseconds) would cost more than the split saves.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.errors import InvalidArgument

MIN_SPLIT_BYTES = 4 << 20  # a share under 2 MiB saves less than its hand-off (one 2 MiB page)
MAX_COPY_THREADS = 4  # past this, one host's copies contend for its memory channels
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()
_on_pool = threading.local()  # is_set on the pool's own threads

Copy = tuple[np.ndarray, np.ndarray]  # (destination, source), same shape


def default_copy_threads() -> int:
    """Threads a large copy uses by default: the host's cores, at most ``MAX_COPY_THREADS``."""
    return max(1, min(MAX_COPY_THREADS, os.cpu_count() or 1))


def resolve_copy_threads(threads: int | None) -> int:
    """A client's ``copy_threads`` argument: None picks ``default_copy_threads``;
    InvalidArgument unless an int from 1 to ``MAX_COPY_THREADS``."""
    if threads is None:
        return default_copy_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or not (
            1 <= threads <= MAX_COPY_THREADS):
        raise InvalidArgument(f"copy_threads must be an int from 1 to {MAX_COPY_THREADS}, "
                              f"got {threads!r}")
    return threads


def copy_all(copies: Sequence[Copy], threads: int) -> None:
    """``np.copyto(dst, src)`` for each pair, shared between this thread and up to
    ``threads - 1`` pool threads when they move at least ``MIN_SPLIT_BYTES``; returns once
    every copy ended (the first error raised then)."""
    total = sum(dst.nbytes for dst, _ in copies)
    if threads <= 1 or total < MIN_SPLIT_BYTES:
        _run(copies)
        return
    shares = _shares(copies, min(threads, MAX_COPY_THREADS, total // (MIN_SPLIT_BYTES // 2)))
    run_shared([functools.partial(_run, share) for share in shares])


def run_shared(work: Sequence[Callable[[], object]]) -> None:
    """Run each of ``work`` (at most ``MAX_COPY_THREADS``, each releasing the GIL for most of
    its time: copies, hashes) side by side, the first on this thread and the rest on the pool;
    return once all ended (the first error raised then)."""
    if len(work) > MAX_COPY_THREADS:
        raise ValueError(f"at most {MAX_COPY_THREADS} shares run side by side, got {len(work)}")
    if getattr(_on_pool, "is_set", False):
        # A share that shares again runs it all itself: pool threads waiting on the pool
        # could wait on each other forever.
        for share in work:
            share()
        return
    pool = _copy_pool()
    futures = [pool.submit(share) for share in work[1:]]
    try:
        if work:
            work[0]()
    finally:
        # Even when this thread's share failed: the others use the caller's buffers, which
        # must not be handed back (or their source pages released) while one still runs.
        done, _ = concurrent.futures.wait(futures)
    for future in done:
        future.result()


def _run(copies: Sequence[Copy]) -> None:
    for dst, src in copies:
        np.copyto(dst, src)


def _shares(copies: Sequence[Copy], num_shares: int) -> list[list[Copy]]:
    """``copies`` cut into ``num_shares`` lists of about equal bytes, in order; a copy that
    straddles two shares is split along its first axis."""
    total = sum(dst.nbytes for dst, _ in copies)
    target = -(-total // num_shares)
    shares: list[list[Copy]] = [[]]
    room = target
    for dst, src in copies:
        rows = dst.shape[0] if dst.ndim else 1
        row_bytes = dst.nbytes // rows if rows else 0
        start = 0
        while start < rows:
            if room <= 0 and len(shares) < num_shares:
                shares.append([])
                room = target
            if row_bytes == 0 or len(shares) == num_shares:  # the last share takes the rest
                take = rows - start
            else:
                take = min(rows - start, max(1, -(-room // row_bytes)))
            if dst.ndim == 0 or (start == 0 and take == rows):
                shares[-1].append((dst, src))
            else:
                shares[-1].append((dst[start : start + take], src[start : start + take]))
            start += take
            room -= take * row_bytes
    return [share for share in shares if share]


def _mark_pool_thread() -> None:
    _on_pool.is_set = True


def _copy_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The pool, made on first use, and again in a forked child (which has none of its
    threads: work handed to the parent's pool there would never run)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = concurrent.futures.ThreadPoolExecutor(
                MAX_COPY_THREADS - 1, thread_name_prefix="kvstore-copy",
                initializer=_mark_pool_thread)
            _pool_pid = os.getpid()
        return _pool
