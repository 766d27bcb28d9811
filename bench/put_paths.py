"""Ways a shared-memory put could move a 32 MiB prompt (16 pages of 2 MiB) into memory no client
can write, each against one copy into an existing shared mapping (the issue's baseline), in the
same run:

- copy + check: what a commit does today once the client wrote its slots (a copy between
  memfds, xxh3 of the copy, the bf16 NaN/Inf check), on 1 to 16 threads and, beside them, as
  many processes (is the GIL what limits it on many cores?);
- handover: the client writes a memfd of its own (pwritev: no mapping to tear down) and the
  daemon seals it against every writer (F_SEAL_WRITE: no copy at all), maps it and checks it;
  into a fresh memfd and into one whose pages were allocated beforehand;
- cross-memory attach: the daemon reads the client's tensor straight out of its address space
  (process_vm_readv), one kernel copy and no client copy.

From the repository root: ``python bench/put_paths.py [--json out.json]``. Prints one line per
measurement, GB/s and the fraction of one copy.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import mmap
import multiprocessing as mp
import os
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
import xxhash

PAGE = 2 << 20
NUM_PAGES = 16
TOTAL = PAGE * NUM_PAGES
F_ADD_SEALS = 1033
SEALS = 1 | 2 | 4 | 8  # F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE
SCALE_PAGES = 256  # pages each thread-count round of copy + check moves (512 MiB)


def median_s(fn: Callable[[], object], reps: int = 15) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def shared(nbytes: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create("kvstore-bench", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    return fd, mmap.mmap(fd, nbytes, mmap.MAP_SHARED | mmap.MAP_POPULATE)


def check(view: np.ndarray) -> None:
    """What a commit checks a raw bf16 page for, on its copy: xxh3 and no NaN/Inf."""
    xxhash.xxh3_64_intdigest(view)
    bits = view.view(np.int16)
    if int(bits.max()) >= 0x7F80 or int(view.view(np.uint16).max()) >= 0xFF80:
        raise ValueError("NaN or Inf")


def job(src: mmap.mmap, dst: mmap.mmap, i: int) -> None:
    d = np.frombuffer(dst, np.uint8, PAGE, (i % SCALE_PAGES) * PAGE)
    np.copyto(d, np.frombuffer(src, np.uint8, PAGE, (i % SCALE_PAGES) * PAGE))
    check(d)


def on_threads(src: mmap.mmap, dst: mmap.mmap, num_threads: int) -> float:
    def run(first: int) -> None:
        for i in range(first, SCALE_PAGES, num_threads):
            job(src, dst, i)

    def once() -> None:
        threads = [threading.Thread(target=run, args=(k,)) for k in range(num_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return SCALE_PAGES * PAGE / median_s(once, 3) / 1e9


def _process(fds: tuple[int, int], num: int, first: int, barrier) -> None:
    src, dst = (mmap.mmap(fd, SCALE_PAGES * PAGE, mmap.MAP_SHARED | mmap.MAP_POPULATE)
                for fd in fds)
    for _ in range(3):
        barrier.wait()
        for i in range(first, SCALE_PAGES, num):
            job(src, dst, i)
        barrier.wait()


def on_processes(fds: tuple[int, int], num: int) -> float:
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(num + 1)
    procs = [ctx.Process(target=_process, args=(fds, num, k, barrier)) for k in range(num)]
    for p in procs:
        p.start()
    best = float("inf")
    for _ in range(3):
        barrier.wait()
        start = time.perf_counter()
        barrier.wait()
        best = min(best, time.perf_counter() - start)
    for p in procs:
        p.join()
    return SCALE_PAGES * PAGE / best / 1e9


def handover(pages: list[np.ndarray], preallocated: bool) -> float:
    """Client: its own memfd, written with pwritev; daemon: seal, map read-only, check."""
    fd = os.memfd_create("kvstore-put", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, TOTAL)
    if preallocated:
        os.posix_fallocate(fd, 0, TOTAL)  # not timed: the daemon would keep such memfds ready
    start = time.perf_counter()
    os.pwritev(fd, [memoryview(p) for p in pages], 0)
    fcntl.fcntl(fd, F_ADD_SEALS, SEALS)
    mapped = mmap.mmap(fd, TOTAL, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ)
    view = np.frombuffer(mapped, np.uint8)
    for i in range(NUM_PAGES):
        check(view[i * PAGE : (i + 1) * PAGE])
    seconds = time.perf_counter() - start
    del view
    mapped.close()
    os.close(fd)
    return seconds


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def cross_memory(pages: list[np.ndarray], dst: np.ndarray) -> float:
    """The daemon reads a child process's pages (its copy of ``pages``) into ``dst``."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the client: holds its pages until killed
        os.close(read_fd)
        os.write(write_fd, json.dumps([int(p.ctypes.data) for p in pages]).encode())
        time.sleep(600)
        os._exit(0)
    os.close(write_fd)
    addresses = json.loads(os.read(read_fd, 1 << 16))
    local = (_Iovec * NUM_PAGES)(*[_Iovec(int(dst.ctypes.data) + i * PAGE, PAGE)
                                   for i in range(NUM_PAGES)])
    remote = (_Iovec * NUM_PAGES)(*[_Iovec(a, PAGE) for a in addresses])

    def read() -> None:
        if libc.process_vm_readv(pid, local, NUM_PAGES, remote, NUM_PAGES, 0) != TOTAL:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        for i in range(NUM_PAGES):
            check(dst[i * PAGE : (i + 1) * PAGE])

    try:
        return median_s(read)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    pages = [rng.integers(0, 0x3F00, PAGE // 2, dtype=np.uint16).view(np.uint8)
             for _ in range(NUM_PAGES)]  # finite bf16 bits
    _, base_map = shared(TOTAL)
    base = np.frombuffer(base_map, np.uint8)

    def one_copy() -> None:
        for i, p in enumerate(pages):
            np.copyto(base[i * PAGE : (i + 1) * PAGE], p)

    copy_s = median_s(one_copy)
    results: dict[str, float] = {"one copy into shared memory": TOTAL / copy_s / 1e9}
    results["handover, fresh memfd"] = TOTAL / statistics.median(
        handover(pages, False) for _ in range(9)) / 1e9
    results["handover, memfd allocated ahead"] = TOTAL / statistics.median(
        handover(pages, True) for _ in range(9)) / 1e9
    results["cross-memory attach read + check"] = TOTAL / cross_memory(pages, base) / 1e9
    src_fd, src = shared(SCALE_PAGES * PAGE)
    dst_fd, dst = shared(SCALE_PAGES * PAGE)
    np.frombuffer(src, np.uint8)[:] = np.concatenate(pages * (SCALE_PAGES // NUM_PAGES))
    cpus = os.cpu_count() or 1
    for n in [n for n in (1, 2, 4, 8, 16) if n <= cpus]:
        results[f"copy + check, {n} threads"] = on_threads(src, dst, n)
        results[f"copy + check, {n} processes"] = on_processes((src_fd, dst_fd), n)
    baseline = results["one copy into shared memory"]
    for name, gbps in results.items():
        print(f"{name:40s} {gbps:7.2f} GB/s  {gbps / baseline:5.2f} of one copy")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": cpus, "gbps": results, "baseline": "one copy into shared memory",
                       "date": time.strftime("%Y-%m-%d")}, f, indent=1)


if __name__ == "__main__":
    main()
