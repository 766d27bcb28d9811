"""Writes pages to an SsdTier until killed, printing each page's number once its write returned.

Run by tests/tiers/test_ssd.py as ``python ssd_crash_writer.py DIR FSYNC``; page ``i`` is
``crash_page(i)``, so the parent can check every printed page byte for byte after the kill.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import sys

from kvstore.config import SsdConfig
from kvstore.keys import BlockKey
from kvstore.page import PageMeta, encode_page
from kvstore.tiers.ssd.tier import SsdTier

PAGES_PER_ROUND = 4  # written concurrently, so the write-combining queue batches them


def crash_page(i: int) -> tuple[BlockKey, PageMeta, bytes]:
    """The deterministic key, meta and encoded page number ``i``."""
    key = BlockKey(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest())
    meta = PageMeta(key=key, namespace=b"crash-namespace!", parent=None, block_index=i,
                    tenant="crash", model_id="m", codec="raw", codec_id=1)
    rng = random.Random(i)
    return key, meta, encode_page(meta, rng.randbytes(rng.randrange(100, 40_000)))


async def write_forever(path: str, fsync: str) -> None:
    tier = SsdTier(SsdConfig(path=path, capacity_bytes=512 << 20, segment_bytes=1 << 20,
                             fsync=fsync, fsync_interval_s=0.01))
    await tier.open()
    i = 0
    while True:
        pages = [crash_page(i + j) for j in range(PAGES_PER_ROUND)]
        results = await asyncio.gather(
            *(tier.write(key, data, meta) for key, meta, data in pages))
        for j, stored in enumerate(results):
            if stored:
                print(i + j, flush=True)
        i += PAGES_PER_ROUND


if __name__ == "__main__":
    asyncio.run(write_forever(sys.argv[1], sys.argv[2]))
