"""How the staging ring's copies should be issued: merged runs, one copy per page, or one
copy per chunk, for raw and fp8 pages in pinned host memory (2 GiB of 2 MiB blocks)."""

import sys

import torch

from kvstore.bench.gpu import Rig, _bench
from kvstore.client import gpu

n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
rig = Rig(n, torch.device("cuda"))
h2d_src = rig.hosts["raw"]
print("host pinned:", h2d_src.is_pinned())
for codec in ("raw", "fp8_e4m3"):
    dev = rig.layouts[codec]
    host = rig.hosts[codec]
    pages = [host[i * dev.nbytes:i * dev.nbytes + dev.span] for i in range(n)]
    print(codec, "page pinned:", pages[0].is_pinned(), "span", dev.span, "nbytes", dev.nbytes)
    for label, runs in (("merged", gpu._runs), ("per page", lambda ps, s: enumerate(ps))):
        gpu._runs_impl = runs
        ring = gpu.StagingRing(dev, rig.device, 32)
        orig = gpu._runs
        gpu._runs = runs
        try:
            ms = _bench(lambda: ring.load(rig.layout, dev, pages, rig.ids.tolist()))
        finally:
            gpu._runs = orig
        print(f"{codec:9} {label:9} {ms:8.2f} ms  {rig.engine_bytes / (ms * 1e6):6.1f} GB/s engine",
              flush=True)
    for chunk in (8, 32, 128):
        ring = gpu.StagingRing(dev, rig.device, chunk)
        ms = _bench(lambda: ring.load(rig.layout, dev, pages, rig.ids.tolist()))
        print(f"{codec:9} chunk {chunk:3} {ms:8.2f} ms  {rig.engine_bytes / (ms * 1e6):6.1f} GB/s",
              flush=True)
