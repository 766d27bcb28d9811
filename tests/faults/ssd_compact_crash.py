"""Compacts an SsdTier while its index's file system is full, then dies without closing.

Run by tests/faults/test_disk_full.py as ``python -m tests.faults.ssd_compact_crash DIR``
(``DIR/index`` is a small file system of its own). Prints one JSON line, the numbers of the
pages that were acknowledged and not deleted, then exits at once, as a crash would: nothing
is flushed or closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

from kvstore.config import SsdConfig
from kvstore.errors import CapacityError
from kvstore.tiers.ssd.tier import SsdTier
from tests.faults.helpers import fill
from tests.tiers.test_ssd import make_page

MiB = 1 << 20
PAGE_BYTES = 100_000  # about ten to a 1 MiB segment


def tier_config(path: str) -> SsdConfig:
    return SsdConfig(path=path, capacity_bytes=4 * MiB, segment_bytes=MiB, fsync="always",
                     compact_dead_fraction=0.5)


async def compact_on_full_index(path: str) -> list[int]:
    tier = SsdTier(tier_config(path))
    await tier.open()
    live = []
    for i in range(34):  # most of the 3.5 MiB not held back for compaction
        key, meta, data = make_page(i, PAGE_BYTES)
        assert await tier.write(key, data, meta)
        live.append(i)
    for i in range(6):  # the first segment is now mostly dead: a compaction victim
        assert await tier.delete(make_page(i, PAGE_BYTES)[0])
        live.remove(i)
    fill(Path(path) / "index")
    key, meta, data = make_page(100, 3 * PAGE_BYTES)
    with contextlib.suppress(CapacityError):  # compacts; what the write itself says aside
        await tier.write(key, data, meta)
    assert tier.stats().extra["compactions"] > 0, "no compaction ran"
    return live


if __name__ == "__main__":
    print(json.dumps(asyncio.run(compact_on_full_index(sys.argv[1]))), flush=True)
    os._exit(0)
