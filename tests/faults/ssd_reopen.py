"""Opens an SsdTier on each directory in turn and reads back pages ``damage_page(0..N-1)``,
printing one JSON line per directory: blocks, index resets, how many pages came back
bit-exact, which did not.

Run by tests/faults/test_index_damage.py as ``python -m tests.faults.ssd_reopen N DIR...`` so
that a crash while opening (SIGBUS on a truncated LMDB map) shows as the child's exit status.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import sys

from kvstore.config import SsdConfig
from kvstore.keys import BlockKey
from kvstore.page import PageMeta, encode_page
from kvstore.tiers.ssd.tier import SsdTier

MiB = 1 << 20


def damage_page(i: int) -> tuple[BlockKey, PageMeta, bytes]:
    """The deterministic key, meta and encoded page number ``i`` (100 to 3,000 bytes)."""
    key = BlockKey(hashlib.blake2b(b"damage-%d" % i, digest_size=16).digest())
    meta = PageMeta(key=key, namespace=b"damage-namespace", parent=None, block_index=i,
                    tenant="acme", model_id="m", codec="raw", codec_id=1)
    rng = random.Random(i)
    return key, meta, encode_page(meta, rng.randbytes(rng.randrange(100, 3000)))


def tier_config(path: str) -> SsdConfig:
    return SsdConfig(path=path, capacity_bytes=256 * MiB, segment_bytes=MiB, fsync="never")


async def reopen(path: str, count: int) -> dict:
    tier = SsdTier(tier_config(path))
    await tier.open()
    try:
        pages = [damage_page(i) for i in range(count)]
        got = await asyncio.gather(*(tier.read(key) for key, _, _ in pages))
        missing = [i for i, (page, (_, _, data)) in enumerate(zip(got, pages))
                   if page is None or bytes(page.data) != data]
        stats = tier.stats()
        return {"num_blocks": stats.num_blocks, "index_resets": stats.extra["index_resets"],
                "exact": count - len(missing), "missing": missing, "corrupt": stats.corrupt}
    finally:
        await tier.close()


async def main(count: int, paths: list[str]) -> None:
    for path in paths:
        print(json.dumps({"path": path, **await reopen(path, count)}), flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(main(int(sys.argv[1]), sys.argv[2:]))
