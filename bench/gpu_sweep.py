"""Tile sweep of the engine kernels (rows per program x warps) on a CUDA machine, 2 GiB of
blocks: prints ratios to the device copy and the PCIe link, writes $OUT/sweep.json.
Run from the repository root: PYTHONPATH=. python3 bench/gpu_sweep.py [blocks]
(TILES=16x4,32x8 and CODECS=raw,nvfp4 narrow it)."""

import functools
import json
import os
import sys

import torch

from kvstore.bench.gpu.rig import Rig, aligned, bench_ms, copy_ms
from kvstore.codecs.device import ENCODABLE
from kvstore.codecs.triton.engine import from_engine, to_engine

n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
# rows x warps, or rows x warps x tiles a program (loads only)
tiles = [tuple(int(v) for v in t.split("x")) for t in os.environ.get(
    "TILES", "16x4,32x4,64x4,32x8,64x8,128x8").split(",")]
device = torch.device("cuda")
rig = Rig(n, device)
src = torch.empty(rig.engine_bytes, dtype=torch.uint8, device=device)
copy = 2 * rig.engine_bytes / (copy_ms(src) * 1e6)
pinned = aligned(rig.engine_bytes, "cpu", pin=True)
h2d = rig.engine_bytes / (bench_ms(lambda: src.copy_(pinned, non_blocking=True)) * 1e6)
d2h = rig.engine_bytes / (bench_ms(lambda: pinned.copy_(src, non_blocking=True)) * 1e6)
print(f"copy {copy:.0f} GB/s  h2d {h2d:.1f}  d2h {d2h:.1f}")
rows = []
for codec in os.environ.get("CODECS", "raw,fp8_e4m3,nvfp4,mxfp4,int4,int2").split(","):
    dev = rig.layouts[codec]
    pool = rig.addrs(rig.pools[codec], codec)
    host = rig.addrs(rig.hosts[codec], codec)
    target = aligned(n * dev.nbytes, device)
    tgt = rig.addrs(target, codec)
    for tile in tiles:
        r = {"codec": codec, "tile": tile}
        ms = bench_ms(functools.partial(to_engine, rig.layout, dev, pool, rig.ids, tile=tile))
        r["hbm_load"] = (rig.page_bytes(codec) + rig.engine_bytes) / (ms * 1e6) / copy
        ms = bench_ms(functools.partial(to_engine, rig.layout, dev, host, rig.ids, tile=tile,
                                      host=True))
        r["host_load_x_link"] = rig.engine_bytes / (ms * 1e6) / h2d
        ms = bench_ms(functools.partial(to_engine, rig.layout, dev, host, rig.ids, tile=tile))
        r["host_load_narrow_x_link"] = rig.engine_bytes / (ms * 1e6) / h2d
        if codec in ENCODABLE and len(tile) == 2:
            ms = bench_ms(functools.partial(from_engine, rig.layout, dev, tgt, rig.ids, tile=tile))
            r["hbm_save"] = (rig.page_bytes(codec) + rig.engine_bytes) / (ms * 1e6) / copy
        if codec in ("nvfp4", "mxfp4") and len(tile) == 2:
            ms = bench_ms(functools.partial(from_engine, rig.layout, dev, host, rig.ids, tile=tile))
            r["host_save_x_d2h"] = rig.engine_bytes / (ms * 1e6) / d2h
        if codec == "raw" and len(tile) == 2:
            ms = bench_ms(functools.partial(from_engine, rig.layout, dev, host, rig.ids, tile=tile))
            r["host_save_x_d2h"] = rig.engine_bytes / (ms * 1e6) / d2h
        rows.append(r)
        print(codec, tile, {k: round(v, 3) for k, v in r.items() if isinstance(v, float)},
              flush=True)
    del target
with open(os.path.join(os.environ.get("OUT", "."), "sweep.json"), "w") as f:
    json.dump({"copy_gbps": copy, "h2d_gbps": h2d, "d2h_gbps": d2h, "rows": rows}, f, indent=1)
