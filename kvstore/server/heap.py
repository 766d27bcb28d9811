"""Giving freed request bodies back to the system: ``malloc_trim`` once large ones have ended.

The daemon keeps buffers up to 32 MiB in glibc's heap and trims it only above 1 GiB free
(``daemon.tune_malloc``: page faults halved put throughput). Bodies of Puts and results of Gets
are such buffers, so without a trim a burst of them stays resident after it ended: six
streamed 256 MiB Puts left 421-640 MiB held (issue 28). Once ``TRIM_AFTER_BYTES`` of bodies
have ended and none ended for ``QUIET_S``, the heap is trimmed on a worker thread: a steady
stream of puts keeps its warm heap, a burst gives its memory back when it is over.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Callable

_log = logging.getLogger("kvstore.server.heap")
TRIM_AFTER_BYTES = 64 << 20  # bodies ended since the last trim before one is worth it
QUIET_S = 1.0  # no body ended for this long: the burst is over
SECOND_PASS_S = 5.0  # then once more, for what was still referenced at the first trim


def _libc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc: its allocator returns memory its own way
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_MALLOC_TRIM = _libc_trim()


class HeapTrimmer:
    """Trims the process's heap after a burst of large bodies ended (one per process: the
    heap is the process's)."""

    def __init__(self) -> None:
        self._freed_bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self.num_trims = 0

    def note_freed(self, num_bytes: int) -> None:
        """A body of ``num_bytes`` was let go (its buffer has no other reference left)."""
        if _MALLOC_TRIM is None:
            return
        self._freed_bytes += num_bytes
        if self._timer is not None:
            self._timer.cancel()  # still busy: wait for quiet
        if self._freed_bytes >= TRIM_AFTER_BYTES:
            self._timer = asyncio.get_running_loop().call_later(QUIET_S, self._trim)

    def _trim(self, again: bool = True) -> None:
        self._timer = None
        self._freed_bytes = 0
        self.num_trims += 1
        loop = asyncio.get_running_loop()
        # a task nobody awaits: a trim that overlaps another only finds less to give back
        loop.run_in_executor(None, _trim_now)
        if again:  # buffers a call's last references (gRPC's, a thread's) let go after it
            self._timer = loop.call_later(SECOND_PASS_S, self._trim, False)


def _trim_now() -> None:
    if _MALLOC_TRIM is not None:  # walks every arena under its lock: off the event loop
        _MALLOC_TRIM(0)


HEAP = HeapTrimmer()
