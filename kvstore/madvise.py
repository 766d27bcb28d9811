"""``madvise`` through libc, for the DRAM tier's arenas and the clients' mappings.

``mmap.madvise`` holds the GIL through the whole call (measured: a 90 ms stall of the event loop
populating 256 MiB); a ctypes call releases it. ``MADVISE`` is None where libc has no madvise.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable

# Python 3.11's mmap module does not name every constant: these are Linux's numbers.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # prefault writable (5.14+)
MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)  # frees a shmem range's pages (a punched hole)
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


MADVISE = _libc_madvise()
