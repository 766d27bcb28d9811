"""The staging ring's chunk size, paired: pages of every codec in pinned host memory (2 GiB of
2 MiB blocks) loaded through rings of 32 pages a chunk and of ``StagingRing.CHUNK_BYTES`` a
chunk, alternating, against the pinned H2D link; and the kernel reading the pages in place.
Run from the repository root on a CUDA machine: PYTHONPATH=. python3 bench/gpu_staged.py [blocks]
(CHUNK_MIB=16,32 adds rings of those sizes).
"""

import functools
import os
import statistics
import sys

import torch

from kvstore.bench.gpu.rig import CODECS, Rig, aligned, bench_ms, staged_load
from kvstore.client.staging import StagingRing
from kvstore.codecs.triton.engine import to_engine

n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
rig = Rig(n, torch.device("cuda"))
src = torch.empty(rig.engine_bytes, dtype=torch.uint8, device="cuda")
pinned = aligned(rig.engine_bytes, "cpu", pin=True)
h2d = rig.engine_bytes / (bench_ms(lambda: src.copy_(pinned, non_blocking=True)) * 1e6)
print(f"h2d {h2d:.1f} GB/s")
for codec in CODECS:
    dev = rig.layouts[codec]
    rings = {"32 pages": StagingRing(dev, rig.device, 32), "by bytes": StagingRing(dev, rig.device)}
    for mib in os.environ.get("CHUNK_MIB", "").split(","):  # other chunk sizes, in MiB
        if mib:
            rings[f"{mib} MiB"] = StagingRing(dev, rig.device, max(1, (int(mib) << 20) // dev.span))
    got = {label: [] for label in rings}
    for rnd in range(4):
        for label in (list(rings) if rnd % 2 == 0 else list(rings)[::-1]):
            ms = bench_ms(functools.partial(staged_load, rig, codec, rings[label]), reps=10)
            got[label].append(rig.engine_bytes / (ms * 1e6) / h2d)
    addrs = rig.addrs(rig.hosts[codec], codec)
    load = functools.partial(to_engine, rig.layout, dev, addrs, rig.ids, host=True)
    direct = rig.engine_bytes / (bench_ms(load) * 1e6) / h2d
    print(f"{codec:9} " + "  ".join(
        f"{label} ({rings[label].chunk_pages} pages): median {statistics.median(v):.2f}x "
        f"[{min(v):.2f}-{max(v):.2f}]" for label, v in got.items())
        + f"  in place {direct:.2f}x", flush=True)
