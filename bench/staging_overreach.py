"""Staging memory a client makes its arena hold outside what was lent: a 64 MiB DRAM tier,
8 MiB of tenant acme's staging lent, a client process mapping the whole arena writable.

``once``: it reads every page once; the arena's memory right after, and after one sweep (and
how long the sweep took). ``loop``: it reads every page again and again for ``--seconds``
while the tier's sweeps run every ``SWEEP_S``; the arena's memory sampled every 10 ms (mean,
peak) and what was charged to the budget at worst.

From the repository root: ``PYTHONPATH=. python bench/staging_overreach.py [once|loop]`` (both
by default); one JSON line each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

from kvstore.config import DramConfig
from kvstore.tiers.dram.tier import DramTier

MiB = 1 << 20

_TOUCHER = """
import mmap, os, sys, time
fd, seconds = int(sys.argv[1]), float(sys.argv[2])
mapped = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
end = time.monotonic() + seconds
rounds = 0
while True:
    sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE))
    rounds += 1
    if time.monotonic() >= end:
        break
print(rounds, flush=True)
"""


def _touch(fd: int, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _TOUCHER, str(fd), str(seconds)],
                            pass_fds=[fd], stdout=subprocess.PIPE, text=True)


async def _lent_tier() -> tuple[DramTier, int, int]:
    tier = DramTier(DramConfig(capacity_bytes=64 * MiB, chunk_bytes=MiB))
    await tier.open()
    for _ in range(8):
        await tier.allocate_slot(MiB - 4096, "acme")
    fd = os.open(tier.arena_path("acme"), os.O_RDWR)
    return tier, fd, tier.stats().extra["staging_bytes"]


async def once() -> dict:
    tier, fd, lent = await _lent_tier()
    try:
        await asyncio.to_thread(_touch(fd, 0).wait)
        touched = os.fstat(fd).st_blocks * 512
        start = time.perf_counter()
        await tier._growth.overreach.sweep()
        took = time.perf_counter() - start
        return {"bench": "once", "lent_mib": lent / MiB, "touched_mib": touched / MiB,
                "after_sweep_mib": os.fstat(fd).st_blocks * 512 / MiB,
                "sweep_ms": round(took * 1e3, 2),
                "arena_bytes_mib": tier.stats().extra["arena_bytes"] / MiB}
    finally:
        os.close(fd)
        await tier.close()


async def loop(seconds: float) -> dict:
    tier, fd, lent = await _lent_tier()
    try:
        toucher = _touch(fd, seconds)
        samples, charged = [], 0
        while toucher.poll() is None:
            samples.append(os.fstat(fd).st_blocks * 512)
            charged = max(charged, tier.stats().extra["staging_outside_bytes"])
            await asyncio.sleep(0.01)
        rounds = int(toucher.stdout.read())
        await asyncio.sleep(1.0)  # the next sweep
        return {"bench": "loop", "seconds": seconds, "touch_rounds": rounds,
                "lent_mib": lent / MiB,
                "held_mean_mib": round(sum(samples) / len(samples) / MiB, 1),
                "held_peak_mib": max(samples) / MiB, "charged_peak_mib": charged / MiB,
                "held_after_mib": os.fstat(fd).st_blocks * 512 / MiB,
                "punched_mib": tier.stats().extra["staging_punched_bytes"] / MiB}
    finally:
        os.close(fd)
        await tier.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", nargs="*", default=["once", "loop"])
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    for which in args.which:
        result = asyncio.run(once() if which == "once" else loop(args.seconds))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
