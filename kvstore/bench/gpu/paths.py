"""``kvstore bench gpu``: the GPU path's kernels against the hardware they run on.

Every rate is a ratio to a ceiling measured in the same run: a device-to-device copy (bytes read
plus written) for paths inside the GPU, pinned host-to-device and device-to-host copies for
paths that cross the link. Engine bytes are the bf16 bytes that land in (or leave) the engine's
paged cache; a compressed page crossing the link delivers them faster than the link carries raw
bytes, so those rows report engine bytes per second over the link's rate. The naive way (one
copy per block per layer, as an engine's Python loop would) is the baseline for the gather.

Each path is checked before it is timed: pages decoded into the engine's cache match the
codec's torch reference. Rows of the "ready" section put the time to make a prefix ready from
each tier beside a full prefill at the bf16 matrix rate measured in the run.
"""

from __future__ import annotations

import torch

from kvstore.bench.gpu.groups import group_rows
from kvstore.bench.gpu.ready import ready_rows
from kvstore.bench.gpu.rig import (
    CODECS,
    COLUMNS,
    SPEC,
    Rig,
    aligned,
    bench_ms,
    copy_ms,
    staged_load,
)
from kvstore.bench.report import BenchReport
from kvstore.errors import KVStoreError


def _row(path: str, codec: str, ms: float, nbytes: float, ceiling: str, ceiling_gbps: float,
         aim: str = "", section: str = "paths") -> dict:
    gbps = nbytes / (ms * 1e6)
    return {"section": section, "path": path, "codec": codec, "ms": ms, "gbps": gbps,
            "ceiling": ceiling, "ceiling_gbps": ceiling_gbps, "ratio": gbps / ceiling_gbps,
            "aim": aim}



def run_gpu_bench(*, total_bytes: int = 2 << 30, quick: bool = False,
                  ssd_dir: str | None = None) -> BenchReport:
    """Measure the GPU path (see the module docstring). ``total_bytes``: raw bytes of the
    blocks moved per pass (2 MiB each); ``quick``: 64 blocks, for a smoke run."""
    if not torch.cuda.is_available():
        raise KVStoreError("kvstore bench gpu needs a CUDA device; none is visible here")
    from kvstore.codecs.triton.engine import from_engine, to_engine

    device = torch.device("cuda", torch.cuda.current_device())
    n = 64 if quick else max(16, total_bytes // SPEC.block_bytes)
    rig = Rig(n, device)
    rows: list[dict] = []
    notes: list[str] = []

    # Ceilings, same bytes as the paths.
    src = torch.empty(rig.engine_bytes, dtype=torch.uint8, device=device)
    device_copy_ms = copy_ms(src)
    copy_gbps = 2 * rig.engine_bytes / (device_copy_ms * 1e6)
    pinned = aligned(rig.engine_bytes, "cpu", pin=True)
    h2d_ms = bench_ms(lambda: src.copy_(pinned, non_blocking=True))
    d2h_ms = bench_ms(lambda: pinned.copy_(src, non_blocking=True))
    h2d = rig.engine_bytes / (h2d_ms * 1e6)
    d2h = rig.engine_bytes / (d2h_ms * 1e6)
    rows.append(_row("device copy (read + write)", "-", device_copy_ms, 2 * rig.engine_bytes,
                     "device copy", copy_gbps, section="ceilings"))
    rows.append(_row("pinned host -> device", "-", h2d_ms, rig.engine_bytes, "H2D", h2d,
                     section="ceilings"))
    rows.append(_row("device -> pinned host", "-", d2h_ms, rig.engine_bytes, "D2H", d2h,
                     section="ceilings"))

    # HBM pool -> engine layout, one launch for the whole prefix.
    aims = {"raw": ">= 0.92", "fp8_e4m3": ">= 0.90", "nvfp4": ">= 0.85", "mxfp4": ">= 0.85",
            "int4": ">= 0.85", "int2": ">= 0.85"}
    for codec in CODECS:
        dev = rig.layouts[codec]
        addrs = rig.addrs(rig.pools[codec], codec)
        rig.poison()
        to_engine(rig.layout, dev, addrs, rig.ids)
        torch.cuda.synchronize()
        rig.check_loaded(codec)
        ms = bench_ms(lambda dev=dev, addrs=addrs: to_engine(rig.layout, dev, addrs, rig.ids))
        rows.append(_row("HBM pool -> engine", codec, ms, rig.page_bytes(codec) + rig.engine_bytes,
                         "device copy", copy_gbps, f"{aims[codec]} of copy"))

    # The naive way: one copy per block per layer (K and V together), from the raw pool.
    naive_n = min(n, 128)
    raw = rig.layouts["raw"]
    views = [rig.pools["raw"][i * raw.nbytes:i * raw.nbytes + raw.sections[0].nbytes]
             .view(torch.bfloat16).view(SPEC.block_shape) for i in range(naive_n)]
    ids = rig.ids[:naive_n].tolist()

    def naive() -> None:
        for view, page in zip(views, ids):
            for layer in range(SPEC.num_layers):
                rig.caches[layer][:, page].copy_(view[layer])

    ms = bench_ms(naive, reps=5) * n / naive_n
    rows.append(_row("naive: a copy per block per layer", "raw", ms, 2 * rig.engine_bytes,
                     "device copy", copy_gbps, "baseline"))

    # Engine -> HBM pool (save, encode).
    save_aims = {"raw": "", "fp8_e4m3": ">= 0.85 of copy", "nvfp4": ">= 0.80 of copy",
                 "mxfp4": ""}
    for codec, aim in save_aims.items():
        dev = rig.layouts[codec]
        target = aligned(n * dev.nbytes, device)
        addrs = rig.addrs(target, codec)
        ms = bench_ms(lambda dev=dev, addrs=addrs: from_engine(rig.layout, dev, addrs, rig.ids))
        rows.append(_row("engine -> HBM pool (save)", codec, ms,
                         rig.page_bytes(codec) + rig.engine_bytes, "device copy", copy_gbps,
                         aim))
        del target

    # Pinned DRAM -> engine: the kernel reads host pages over unified addressing, or pages are
    # DMA'd in chunks into a device ring and decoded on the compute stream as they land.
    from kvstore.client.staging import StagingRing

    rings = {codec: StagingRing(rig.layouts[codec], device) for codec in rig.layouts}
    chunk_blocks = rings["fp8_e4m3"].chunk_pages  # the estimate of the SSD row below
    link_aims = {"raw": ">= 0.90 of H2D", "fp8_e4m3": ">= 1.85x H2D", "nvfp4": ">= 3.3x H2D",
                 "mxfp4": "", "int4": "", "int2": ""}
    best: dict[str, float] = {}
    for codec in CODECS:
        dev = rig.layouts[codec]
        addrs = rig.addrs(rig.hosts[codec], codec)
        rig.poison()
        to_engine(rig.layout, dev, addrs, rig.ids)
        torch.cuda.synchronize()
        rig.check_loaded(codec)
        direct = bench_ms(lambda dev=dev, addrs=addrs: to_engine(
            rig.layout, dev, addrs, rig.ids, host=True))
        rows.append(_row("pinned DRAM -> engine, kernel reads host", codec, direct,
                         rig.engine_bytes, "H2D", h2d, link_aims[codec]))
        rig.poison()
        staged_load(rig, codec, rings[codec])
        torch.cuda.synchronize()
        rig.check_loaded(codec)
        staged = bench_ms(lambda codec=codec: staged_load(rig, codec, rings[codec]))
        rows.append(_row("pinned DRAM -> engine, staged DMA + decode", codec, staged,
                         rig.engine_bytes, "H2D", h2d, link_aims[codec]))
        best[codec] = min(direct, staged) / n  # ms per block

    # Engine -> pinned DRAM (save): the kernel writes host pages over unified addressing.
    target = rig.hosts["raw"]
    addrs = rig.addrs(target, "raw")
    ms = bench_ms(lambda: from_engine(rig.layout, rig.layouts["raw"], addrs, rig.ids))
    rows.append(_row("engine -> pinned DRAM (save)", "raw", ms, rig.engine_bytes, "D2H", d2h,
                     ">= 0.90 of D2H"))
    # Compressed saves into pinned DRAM: engine bytes per second against the link. The pages
    # they write (the engine's blocks) stay valid pages for the rows after, which only time.
    for codec in ("fp8_e4m3", "nvfp4", "mxfp4"):
        addrs = rig.addrs(rig.hosts[codec], codec)
        ms = bench_ms(lambda codec=codec, addrs=addrs: from_engine(
            rig.layout, rig.layouts[codec], addrs, rig.ids))
        rows.append(_row("engine -> pinned DRAM (save, encode)", codec, ms, rig.engine_bytes,
                         "D2H", d2h, ""))

    rows += ready_rows(rig, best, chunk_blocks, quick, ssd_dir, notes)
    rig.pools.clear()  # room for the group rows' own buffers: MLA, fp8 pass-through, states
    rig.hosts.clear()
    rows += group_rows(device, min(total_bytes, 64 << 20 if quick else 1 << 30))
    notes.append(f"{n} blocks of {SPEC.block_bytes >> 20} MiB (32 layers, 8 KV heads, head dim "
                 "128, bf16, 16 tokens) scattered over an engine cache of twice as many pages")
    return BenchReport(name="gpu", title=f"GPU path ({torch.cuda.get_device_name(device)})",
                       columns=COLUMNS, rows=tuple(rows), notes=tuple(notes),
                       params={"blocks": n, "block_bytes": SPEC.block_bytes,
                               "spec": SPEC.to_dict(), "chunk_blocks": chunk_blocks},
                       section_key="section")


__all__ = ["run_gpu_bench"]
