"""The staged path call by call: per process, single timings of the staged loads (nvfp4, mxfp4,
int4 pages in pinned host memory, 2 GiB of 2 MiB blocks, through a ``StagingRing`` of the default
chunk), a plain DMA of the same host pages, and the kernel reading them in place; one line with
medians and [fastest-slowest] per codec. Run several processes to tell a state of the process
from variance between calls. From the repository root on a CUDA machine:
PYTHONPATH=. python3 bench/gpu_staged_calls.py
"""

import functools
import statistics
import time

import torch

from kvstore.bench.gpu.rig import Rig, aligned, bench_ms, staged_load
from kvstore.client.staging import StagingRing
from kvstore.codecs.triton.engine import to_engine

rig = Rig(1024, torch.device("cuda"))
src = torch.empty(rig.engine_bytes, dtype=torch.uint8, device="cuda")
pinned = aligned(rig.engine_bytes, "cpu", pin=True)
h2d = rig.engine_bytes / (bench_ms(lambda: src.copy_(pinned, non_blocking=True)) * 1e6)


def timed(fn, reps: int = 12) -> list[float]:
    fn()  # compile, warm the ring
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def times_link(ms: list[float]) -> float:
    return rig.engine_bytes / (statistics.median(ms) * 1e6) / h2d


line = [f"h2d {h2d:.1f} GB/s"]
for codec in ("nvfp4", "mxfp4", "int4"):
    dev = rig.layouts[codec]
    host = rig.hosts[codec]
    ring = StagingRing(dev, rig.device)
    dst = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
    dma = timed(functools.partial(dst.copy_, host, non_blocking=True))
    staged = timed(functools.partial(staged_load, rig, codec, ring))
    addrs = rig.addrs(host, codec)
    in_place = timed(functools.partial(to_engine, rig.layout, dev, addrs, rig.ids, host=True))
    gb = host.numel() / 1e6
    line.append(f"{codec}: dma {gb / statistics.median(dma):.1f} GB/s "
                f"[{gb / max(dma):.1f}-{gb / min(dma):.1f}], staged {times_link(staged):.2f}x "
                f"[{min(staged):.1f}-{max(staged):.1f} ms], in place {times_link(in_place):.2f}x "
                f"[{min(in_place):.1f}-{max(in_place):.1f} ms]")
print(" | ".join(line), flush=True)
