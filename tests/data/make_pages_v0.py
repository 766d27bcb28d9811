"""Wrote tests/data/pages_v0 (run once, at the page format of 2026-12-05): an SSD tier and what a
get of it returned, read back by tests/store/test_stored_format.py after later changes."""
import asyncio
import os
import sys

import torch

from kvstore.config import DramConfig, KVStoreConfig, SsdConfig
from kvstore.keys import Namespace
from kvstore.spec import KVSpec
from kvstore.store import Store

OUT = sys.argv[1]
spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16, dtype="bfloat16")
g = torch.Generator().manual_seed(7)
kv = torch.randn(spec.shape(48), generator=g).to(torch.bfloat16)
tokens = list(range(100, 148))

async def main():
    for codec in ("raw", "fp8_e4m3+zstd"):
        ns = Namespace(model_id="golden/model", revision="r1", spec=spec, tenant="acme")
        cfg = KVStoreConfig(
            dram=DramConfig(capacity_bytes=8 << 20, chunk_bytes=1 << 20),
            ssd=SsdConfig(path=os.path.join(OUT, f"ssd_{codec.replace('+', '_')}"),
                          capacity_bytes=64 << 20, segment_bytes=1 << 20, codec=codec,
                          admit_after_accesses=0, fsync="always", o_direct=False))
        async with Store(cfg) as store:
            assert await store.put(ns, tokens, kv) == 48
        async with Store(cfg) as store:
            hit = await store.lookup(ns, tokens)
            print(codec, hit.matched_tokens, hit)
            got = await store.get(ns, tokens)
            torch.save(got, os.path.join(OUT, f"expected_{codec.replace('+', '_')}.pt"))
    torch.save({"tokens": tokens, "kv": kv}, os.path.join(OUT, "input.pt"))

asyncio.run(main())
