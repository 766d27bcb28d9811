"""``madvise`` through libc, for the DRAM tier's arenas, the clients' mappings and fresh results.

``mmap.madvise`` holds the GIL through the whole call (measured: a 90 ms stall of the event loop
populating 256 MiB); a ctypes call releases it. ``MADVISE`` is None where libc has no madvise.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable

import torch

# Python 3.11's mmap module does not name every constant: these are Linux's numbers.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # prefault writable (5.14+)
MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)  # frees a shmem range's pages (a punched hole)
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
HUGE_PAGE_BYTES = 2 << 20
HUGE_ADVICE_MIN_BYTES = 4 << 20  # below this, at most one huge page fits inside a result


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


MADVISE = _libc_madvise()


def fresh_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor for a get's result, backed by transparent huge pages where
    the kernel gives them on request (``madvise`` mode).

    A large allocation is fresh memory each time (glibc maps and unmaps it), and faulting it in
    4 KiB at a time cost more than the copy into it: 57-72 ms against 18 ms with huge pages for
    32 MiB on the 2-core box (2026-12-01), where a copy into warm memory took 12 ms; a 16 MiB
    result 12-13 ms of faults against 1.2-1.6 ms for the copy into warm memory.
    """
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    if nbytes >= HUGE_ADVICE_MIN_BYTES and MADVISE is not None:
        start = -(-out.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        end = (out.data_ptr() + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if end > start:
            MADVISE(start, end - start, MADV_HUGEPAGE)  # advice only: refusals change nothing
    return out
