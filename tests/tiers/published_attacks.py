"""Every route a client holding the descriptor of a published region (the memfd of a DRAM step)
could take to change a byte of it, tried for real: each must be refused or leave the region as
it was."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
from collections.abc import Callable

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
MADV_REMOVE, MADV_DONTNEED = 9, 4
PAGE = mmap.PAGESIZE


def _address(mapped: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mapped))


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _write(fd: int, at: int) -> None:
    os.lseek(fd, at, os.SEEK_SET)
    os.write(fd, b"\xaa")


def _pwrite(fd: int, at: int) -> None:
    os.pwrite(fd, b"\xaa", at)


def _shared_writable_mapping(fd: int, at: int) -> None:
    with mmap.mmap(fd, at + 1, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
        m[at] ^= 0xFF


def _mprotect(fd: int, at: int) -> None:
    start = at // PAGE * PAGE
    with mmap.mmap(fd, start + PAGE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
        base = _address_readonly(m)
        _check(_libc.mprotect(base + start, PAGE, mmap.PROT_READ | mmap.PROT_WRITE), "mprotect")
        ctypes.c_char.from_address(base + at).value = b"\xaa"


def _address_readonly(m: mmap.mmap) -> int:
    # A read-only mmap exports no writable buffer: take its address through numpy.
    import numpy as np

    probe = np.frombuffer(m, dtype=np.uint8, count=1)
    address = probe.ctypes.data
    del probe
    return address


def _reopen_writable(fd: int, at: int) -> None:
    again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # a memfd's mode lets its owner reopen it
    try:
        refusals = []
        for attempt in (_pwrite, _shared_writable_mapping):
            try:
                attempt(again, at)
            except OSError as exc:
                refusals.append(exc)
        if len(refusals) == 2:
            raise refusals[0]
    finally:
        os.close(again)


def _proc_self_mem(fd: int, at: int) -> None:
    start = at // PAGE * PAGE
    with mmap.mmap(fd, start + PAGE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
        address = _address_readonly(m) + at
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(address)
            mem.write(b"\xaa")


def _ftruncate(fd: int, at: int) -> None:
    os.ftruncate(fd, 0)


def _punch_hole(fd: int, at: int) -> None:
    start = at // PAGE * PAGE
    _check(_libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, start, PAGE),
           "fallocate(PUNCH_HOLE)")


def _madvise_remove(fd: int, at: int) -> None:
    start = at // PAGE * PAGE
    with mmap.mmap(fd, start + PAGE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
        _check(_libc.madvise(_address_readonly(m) + start, PAGE, MADV_REMOVE), "madvise")


def _unseal(fd: int, at: int) -> None:
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)


def _private_mapping(fd: int, at: int) -> None:
    # Allowed, but copy-on-write: the write lands in this process's private copy only.
    with mmap.mmap(fd, at + 1, flags=mmap.MAP_PRIVATE,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
        m[at] ^= 0xFF


def _copy_file_range(fd: int, at: int) -> None:
    src = os.memfd_create("attacker")
    try:
        os.write(src, b"\xaa")
        os.copy_file_range(src, fd, 1, 0, at)
    finally:
        os.close(src)


ROUTES: dict[str, Callable[[int, int], None]] = {
    "write": _write,
    "pwrite": _pwrite,
    "a shared writable mapping": _shared_writable_mapping,
    "mprotect of a read-only mapping to writable": _mprotect,
    "a writable reopen through /proc/self/fd": _reopen_writable,
    "a write through /proc/self/mem into a read-only mapping": _proc_self_mem,
    "ftruncate": _ftruncate,
    "punching a hole": _punch_hole,
    "madvise(MADV_REMOVE)": _madvise_remove,
    "adding F_SEAL_WRITE": _unseal,
    "a private writable mapping": _private_mapping,
    "copy_file_range into it": _copy_file_range,
}


def attack(fd: int, at: int) -> dict[str, str]:
    """Try every route on byte ``at`` of the memfd ``fd``; return each route's outcome:
    ``refused: <errno>`` or ``no effect`` when the region's bytes stayed as they were, else
    ``CHANGED``."""
    size = os.fstat(fd).st_size
    before = os.pread(fd, size, 0)
    outcomes = {}
    for name, route in ROUTES.items():
        try:
            route(fd, at)
        except OSError as exc:
            outcome = f"refused: {errno.errorcode.get(exc.errno, exc.errno)}"
        else:
            outcome = "no effect"
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_size != size or os.pread(fd, size, 0) != before:
                outcome = "CHANGED"
        outcomes[name] = outcome
    return outcomes


def all_refused(outcomes: dict[str, str]) -> bool:
    return all(o == "no effect" or o.startswith("refused") for o in outcomes.values())
