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

import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Self

import numpy as np
import torch

from kvstore.bench.report import BenchReport, Column
from kvstore.codecs.device import SECTION_ALIGN, DeviceLayout, device_layout
from kvstore.errors import KVStoreError
from kvstore.spec import EngineLayout, KVSpec

SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16)  # 2 MiB a block
# The prefill model of the ready rows: an 8B dense model (2 x 8e9 FLOPs per token) with 32
# query heads of 128 over 32 layers for causal attention.
MODEL_FLOPS_PER_TOKEN = 2 * 8e9
CODECS = ("raw", "fp8_e4m3", "nvfp4", "mxfp4", "int4", "int2")
QUERY_HEADS = 32

COLUMNS = (
    Column("path", "path", justify="left"),
    Column("codec", "codec", justify="left"),
    Column("ms", "ms", 3),
    Column("gbps", "GB/s", 1),
    Column("ceiling", "ceiling", justify="left"),
    Column("ceiling_gbps", "ceiling GB/s", 1),
    Column("ratio", "ratio", 3),
    Column("aim", "aim", justify="left"),
)


def _bench(fn: Callable[[], None], reps: int = 20) -> float:
    """Median milliseconds of ``fn`` on the current stream (device events)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=max(reps, 50), return_mode="median"))


def _aligned(nbytes: int, device: str | torch.device, pin: bool = False) -> torch.Tensor:
    raw = torch.empty(nbytes + SECTION_ALIGN, dtype=torch.uint8, device=device,
                      pin_memory=pin)
    pad = -raw.data_ptr() % SECTION_ALIGN
    return raw[pad:pad + nbytes]


def _pages(codec: str, blocks: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The sections of each block's device page under ``codec`` (CPU reference encoders)."""
    from kvstore.codecs.fp4 import mxfp4_quantize_reference, nvfp4_quantize_reference
    from kvstore.codecs.fp8 import encode_fp8_reference

    out = []
    for block in blocks:
        if codec == "raw":
            out.append([block])
        elif codec == "fp8_e4m3":
            parts = encode_fp8_reference(block)
            out.append([parts.codes, parts.scales])
        elif codec == "nvfp4":
            out.append(nvfp4_quantize_reference(block).sections())
        elif codec == "mxfp4":
            out.append(mxfp4_quantize_reference(block).sections())
        else:
            from kvstore.codecs.kivi import encode_kivi_reference

            group = device_layout(codec, SPEC).group_size
            bits = 4 if codec == "int4" else 2
            out.append(encode_kivi_reference(block, bits, group).tensors())
    return out


class Rig:
    """An engine cache, device pages of every codec in a GPU pool and in pinned host memory."""

    def __init__(self, num_blocks: int, device: torch.device) -> None:
        self.device = device
        self.n = num_blocks
        spec = SPEC
        pages = 2 * num_blocks
        self.caches = [torch.empty(2, pages, spec.block_tokens, spec.num_kv_heads,
                                   spec.head_dim, dtype=torch.bfloat16, device=device)
                       for _ in range(spec.num_layers)]
        for cache in self.caches:
            cache.normal_()
        self.layout = EngineLayout.of(self.caches, spec)
        self.ids = torch.randperm(pages)[:num_blocks]  # host tables: the launch copies them
        self.engine_bytes = num_blocks * spec.block_bytes
        # A few distinct random blocks repeated: the reference encoders run on the CPU.
        distinct = [torch.randn(spec.block_shape).to(torch.bfloat16) for _ in range(4)]
        self.blocks = distinct
        self.layouts: dict[str, DeviceLayout] = {}
        self.pools: dict[str, torch.Tensor] = {}
        self.hosts: dict[str, torch.Tensor] = {}
        for codec in CODECS:
            dev = device_layout(codec, spec)
            self.layouts[codec] = dev
            one = _aligned(dev.nbytes, "cpu")
            pool = _aligned(num_blocks * dev.nbytes, device)
            host = _aligned(num_blocks * dev.nbytes, "cpu", pin=True)
            encoded = _pages(codec, distinct)
            for i in range(num_blocks):
                if i < len(distinct):
                    for section, part in zip(dev.sections, encoded[i]):
                        flat = part.contiguous().view(-1).view(torch.uint8)
                        one[section.offset:section.offset + section.nbytes].copy_(flat)
                    host[i * dev.nbytes:(i + 1) * dev.nbytes].copy_(one)
                else:
                    src = (i % len(distinct)) * dev.nbytes
                    host[i * dev.nbytes:(i + 1) * dev.nbytes].copy_(
                        host[src:src + dev.nbytes])
            pool.copy_(host)
            self.pools[codec] = pool
            self.hosts[codec] = host

    def addrs(self, memory: torch.Tensor, codec: str, count: int | None = None) -> torch.Tensor:
        dev = self.layouts[codec]
        count = self.n if count is None else count
        base = memory.data_ptr()
        return torch.arange(count, dtype=torch.int64) * dev.nbytes + base

    def page_bytes(self, codec: str, count: int | None = None) -> int:
        dev = self.layouts[codec]
        return (self.n if count is None else count) * sum(s.nbytes for s in dev.sections)

    def check_loaded(self, codec: str, count: int | None = None) -> None:
        """Blocks landed in the engine's pages as the codec's reference decodes them."""
        from kvstore.codecs.fp4 import Fp4Parts, dequantize_reference
        from kvstore.codecs.fp8 import Fp8Parts, decode_fp8_reference
        from kvstore.codecs.triton.engine import page_tensors

        dev = self.layouts[codec]
        count = self.n if count is None else count
        for i in sorted({0, 1, 2, 3, count - 1}):
            if i >= count:
                continue
            parts = [t.cpu() for t in page_tensors(self.hosts[codec], dev,
                                                   (i % len(self.blocks)) * dev.nbytes)]
            if codec == "raw":
                want = parts[0]
            elif codec == "fp8_e4m3":
                want = decode_fp8_reference(Fp8Parts(*parts), torch.bfloat16)
            elif codec in ("nvfp4", "mxfp4"):
                want = dequantize_reference(Fp4Parts(*parts), torch.bfloat16)
            else:
                from kvstore.codecs.kivi import KiviParts, decode_kivi_reference

                bits = 4 if codec == "int4" else 2
                want = decode_kivi_reference(KiviParts(bits, dev.group_size, *parts),
                                             torch.bfloat16)
            page = int(self.ids[i])
            got = torch.stack([torch.stack(self.layout.block_view(layer, page))
                               for layer in range(SPEC.num_layers)]).cpu()
            if not torch.equal(got, want):
                bad = int((got != want).sum())
                raise KVStoreError(f"bench gpu: {codec} block {i} landed wrong ({bad} values)")

    def poison(self) -> None:
        for cache in self.caches:
            cache.fill_(float("nan"))


def _row(path: str, codec: str, ms: float, nbytes: float, ceiling: str, ceiling_gbps: float,
         aim: str = "", section: str = "paths") -> dict:
    gbps = nbytes / (ms * 1e6)
    return {"section": section, "path": path, "codec": codec, "ms": ms, "gbps": gbps,
            "ceiling": ceiling, "ceiling_gbps": ceiling_gbps, "ratio": gbps / ceiling_gbps,
            "aim": aim}


def _staged_load(rig: Rig, codec: str, ring) -> None:
    """Pinned host pages DMA'd chunk by chunk into a device ring and decoded on the current
    stream as each chunk lands: the engine client's own path (``StagingRing``)."""
    from kvstore.client.staging import HostPages

    dev = rig.layouts[codec]
    pages = HostPages([rig.hosts[codec]], np.zeros(rig.n, dtype=np.intp),
                      np.arange(rig.n, dtype=np.int64) * dev.nbytes)
    ring.load(rig.layout, dev, pages, rig.ids)


def _end_to_end_rows(tokens: int, prefill_ms: float, root: str, device: str = "cuda"
                     ) -> list[dict]:
    """``EngineCache.save`` then ``load`` of a ``tokens`` prefix through a real daemon: from
    its HBM pool, from its DRAM tier (raw and fp8 pages) with no GPU tier above it, and from
    its SSD (fp8 pages) into a DRAM tier with room for one prefix and a fifth, two prefixes
    loaded in turns so each load reads most of its prefix back from the SSD."""
    from kvstore.client import Client
    from kvstore.client.engine import EngineCache
    from kvstore.config import (
        DramConfig,
        HbmConfig,
        KVStoreConfig,
        ServerConfig,
        SsdConfig,
        TierConfig,
    )
    from kvstore.keys import Namespace
    from kvstore.server.daemon import DaemonThread

    blocks = tokens // SPEC.block_tokens
    nbytes = blocks * SPEC.block_bytes
    rows = []
    setups = [("HBM pool", "raw"), ("DRAM arena", "raw"), ("DRAM arena", "fp8_e4m3"),
              ("SSD", "fp8_e4m3")]
    ns = Namespace(model_id="bench", spec=SPEC, tenant="default")
    shape = (2, 2 * blocks, SPEC.block_tokens, SPEC.num_kv_heads, SPEC.head_dim)
    for i, (tier, codec) in enumerate(setups):
        hbm = TierConfig("hbm", "hbm", HbmConfig(capacity_bytes=2 * nbytes, codec=codec,
                                                 device=device if device == "cpu" else "cuda"))
        dram = TierConfig("dram", "dram", DramConfig(capacity_bytes=2 * nbytes + (1 << 30),
                                                     chunk_bytes=256 << 20, codec=codec))
        server = ServerConfig(socket_path=f"{root}/e2e{i}.sock", log_level="WARNING")
        config = KVStoreConfig(tiers={"HBM pool": (hbm, dram), "DRAM arena": (dram,)}.get(
            tier, (dram,)), server=server)
        prompts = [list(range(tokens))]
        if tier == "SSD":
            # Saved through a daemon with DRAM to spare, kept on its SSD; loaded in turns by
            # another over the same SSD, whose DRAM holds one prefix and a fifth: the prefix
            # loaded last and a fifth of the one before, so each load reads its prefix from
            # the SSD.
            ssd = TierConfig("ssd", "ssd", SsdConfig(
                path=f"{root}/ssd{i}", capacity_bytes=3 * nbytes + (1 << 30), codec=codec,
                write_through=True, admit_after_accesses=0, fsync="never"))
            one = blocks * (SPEC.block_bytes // 2 + (8 << 10))  # fp8 pages, slot slack
            small = TierConfig("dram", "dram", DramConfig(
                capacity_bytes=one * 6 // 5, chunk_bytes=64 << 20, codec=codec))
            config = KVStoreConfig(tiers=(dram, ssd), server=server)
            loader = KVStoreConfig(tiers=(small, ssd), server=server)
            prompts += [list(range(k * tokens, (k + 1) * tokens)) for k in (1, 2)]
        caches = [torch.randn(shape, device=device).to(torch.bfloat16)
                  for _ in range(SPEC.num_layers)]
        with DaemonThread(config) as daemon, Client(daemon.unix_address) as client, \
                EngineCache(client, ns, caches) as engine:
            for prompt in prompts:
                if engine.save(prompt, torch.randperm(2 * blocks)[:blocks].tolist()) != tokens:
                    raise KVStoreError(f"bench gpu: the daemon's {tier} did not take a prefix")
            if device != "cpu":
                torch.cuda.synchronize()
            if tier == "SSD":
                _wait_for_ssd(client, 2 * blocks)
            else:
                times, source = _timed_loads(engine, prompts, blocks, 6)
        if tier == "SSD":
            with DaemonThread(loader) as daemon, Client(daemon.unix_address) as client, \
                    EngineCache(client, ns, caches) as engine:
                direct = client.stats().tiers["ssd"].extra.get("o_direct")
                times, from_ssd = [], []
                for rep in range(6):
                    prompt = prompts[rep % len(prompts)]
                    while client.stats().active_leases:  # the last load's, given back late
                        time.sleep(0.001)
                    hit = client.lookup(ns, prompt)
                    from_ssd.append(hit.tokens_per_tier.get("ssd", 0) / tokens)
                    more, source = _timed_loads(engine, [prompt], blocks, 1)
                    times += more
            source += (", O_DIRECT" if direct else ", buffered reads") + (
                f", {min(from_ssd[2:]):.0%}-{max(from_ssd[2:]):.0%} of each prefix read from "
                "the SSD")
        ms = sorted(times[2:])[len(times[2:]) // 2]  # the first loads pin the arena's memory
        rows.append({"section": "ready", "path": f"{tokens} tokens, EngineCache.load from "
                     f"the daemon's {tier} ({source})", "codec": codec, "ms": ms,
                     "gbps": nbytes / (ms * 1e6), "ceiling": "full prefill",
                     "ceiling_gbps": prefill_ms, "ratio": prefill_ms / ms, "aim": ""})
    return rows


def _wait_for_ssd(client, blocks: int) -> None:
    """Until the SSD holds ``blocks`` blocks (the write-through runs in the background)."""
    deadline = time.monotonic() + 120
    while client.stats().tiers["ssd"].num_blocks < blocks:
        if time.monotonic() > deadline:
            raise KVStoreError("bench gpu: the SSD tier never took the saved prefix")
        time.sleep(0.05)


def _timed_loads(engine, prompts: list[list[int]], blocks: int, reps: int
                 ) -> tuple[list[float], str]:
    """Wall ms of ``reps`` loads, of the prompts in turn, into random engine pages, and where
    they came from."""
    times, source = [], ""
    for rep in range(reps):
        prompt = prompts[rep % len(prompts)]
        target = torch.randperm(2 * blocks)[:blocks].tolist()
        start = time.perf_counter()
        handle = engine.load(prompt, target, advice=False)
        handle.wait()
        times.append((time.perf_counter() - start) * 1e3)
        source = handle.source
        if handle.matched_tokens != len(prompt):
            raise KVStoreError(f"bench gpu: end-to-end load matched {handle.matched_tokens} "
                               f"of {len(prompt)} tokens")
    return times, source


def _copy_ms(src: torch.Tensor) -> float:
    dst = torch.empty_like(src)
    return _bench(lambda: dst.copy_(src))


def _matmul_flops(device: torch.device) -> float:
    """bf16 FLOP/s of an 8192^3 matrix product on random data."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / (_bench(lambda: a @ b) * 1e-3)


def _prefill_s(tokens: int, flops_per_s: float) -> float:
    linear = MODEL_FLOPS_PER_TOKEN * tokens
    attention = 2 * 2 * SPEC.num_layers * QUERY_HEADS * SPEC.head_dim * tokens * tokens / 2
    return (linear + attention) / flops_per_s


def _odirect_read_gbps(nbytes: int, directory: str | None) -> float:
    """O_DIRECT reads of a file of ``nbytes`` in 16 MiB requests into pinned memory."""
    chunk = 16 << 20
    buf = _aligned(chunk, "cpu", pin=True)
    with tempfile.NamedTemporaryFile(dir=directory, delete=False) as f:
        path = f.name
        block = os.urandom(chunk)
        for _ in range(max(1, nbytes // chunk)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    try:
        flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
        try:
            fd = os.open(path, flags)
        except OSError:
            fd = os.open(path, os.O_RDONLY)
        view = memoryview(buf.numpy())
        start = time.perf_counter()
        total = 0
        try:
            while True:
                got = os.preadv(fd, [view], total)
                if got <= 0:
                    break
                total += got
        finally:
            os.close(fd)
        return total / (time.perf_counter() - start) / 1e9
    finally:
        os.unlink(path)


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
    copy_ms = _copy_ms(src)
    copy_gbps = 2 * rig.engine_bytes / (copy_ms * 1e6)
    pinned = _aligned(rig.engine_bytes, "cpu", pin=True)
    h2d_ms = _bench(lambda: src.copy_(pinned, non_blocking=True))
    d2h_ms = _bench(lambda: pinned.copy_(src, non_blocking=True))
    h2d = rig.engine_bytes / (h2d_ms * 1e6)
    d2h = rig.engine_bytes / (d2h_ms * 1e6)
    rows.append(_row("device copy (read + write)", "-", copy_ms, 2 * rig.engine_bytes,
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
        ms = _bench(lambda dev=dev, addrs=addrs: to_engine(rig.layout, dev, addrs, rig.ids))
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

    ms = _bench(naive, reps=5) * n / naive_n
    rows.append(_row("naive: a copy per block per layer", "raw", ms, 2 * rig.engine_bytes,
                     "device copy", copy_gbps, "baseline"))

    # Engine -> HBM pool (save, encode).
    save_aims = {"raw": "", "fp8_e4m3": ">= 0.85 of copy", "nvfp4": ">= 0.80 of copy",
                 "mxfp4": ""}
    for codec, aim in save_aims.items():
        dev = rig.layouts[codec]
        target = _aligned(n * dev.nbytes, device)
        addrs = rig.addrs(target, codec)
        ms = _bench(lambda dev=dev, addrs=addrs: from_engine(rig.layout, dev, addrs, rig.ids))
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
        direct = _bench(lambda dev=dev, addrs=addrs: to_engine(
            rig.layout, dev, addrs, rig.ids, host=True))
        rows.append(_row("pinned DRAM -> engine, kernel reads host", codec, direct,
                         rig.engine_bytes, "H2D", h2d, link_aims[codec]))
        rig.poison()
        _staged_load(rig, codec, rings[codec])
        torch.cuda.synchronize()
        rig.check_loaded(codec)
        staged = _bench(lambda codec=codec: _staged_load(rig, codec, rings[codec]))
        rows.append(_row("pinned DRAM -> engine, staged DMA + decode", codec, staged,
                         rig.engine_bytes, "H2D", h2d, link_aims[codec]))
        best[codec] = min(direct, staged) / n  # ms per block

    # Engine -> pinned DRAM (save): the kernel writes host pages over unified addressing.
    target = rig.hosts["raw"]
    addrs = rig.addrs(target, "raw")
    ms = _bench(lambda: from_engine(rig.layout, rig.layouts["raw"], addrs, rig.ids))
    rows.append(_row("engine -> pinned DRAM (save)", "raw", ms, rig.engine_bytes, "D2H", d2h,
                     ">= 0.90 of D2H"))
    # Compressed saves into pinned DRAM: engine bytes per second against the link. The pages
    # they write (the engine's blocks) stay valid pages for the rows after, which only time.
    for codec in ("fp8_e4m3", "nvfp4", "mxfp4"):
        addrs = rig.addrs(rig.hosts[codec], codec)
        ms = _bench(lambda codec=codec, addrs=addrs: from_engine(
            rig.layout, rig.layouts[codec], addrs, rig.ids))
        rows.append(_row("engine -> pinned DRAM (save, encode)", codec, ms, rig.engine_bytes,
                         "D2H", d2h, ""))

    # Time to make a prefix ready, beside a full prefill at the measured bf16 matrix rate.
    flops = _matmul_flops(device)
    ssd_gbps = _odirect_read_gbps(256 << 20 if quick else 1 << 30, ssd_dir)
    notes.append(f"bf16 matrix rate {flops / 1e12:.0f} TFLOP/s (8192^3); SSD O_DIRECT read "
                 f"{ssd_gbps:.2f} GB/s (16 MiB requests into pinned memory)")
    per_block_hbm = {}
    for codec in ("raw", "fp8_e4m3"):
        dev = rig.layouts[codec]
        addrs = rig.addrs(rig.pools[codec], codec)
        per_block_hbm[codec] = _bench(
            lambda dev=dev, addrs=addrs: to_engine(rig.layout, dev, addrs, rig.ids)) / n
    first_layer = {}
    for codec in ("raw", "fp8_e4m3"):
        dev = rig.layouts[codec]
        addrs = rig.addrs(rig.hosts[codec], codec)
        first_layer[codec] = _bench(lambda dev=dev, addrs=addrs: to_engine(
            rig.layout, dev, addrs, rig.ids, layers=range(1), host=True)) / n
    for tokens in (8192, 32768):
        blocks = tokens // SPEC.block_tokens
        prefill_ms = _prefill_s(tokens, flops) * 1e3
        ready = [("HBM", "raw", per_block_hbm["raw"] * blocks),
                 ("HBM", "fp8_e4m3", per_block_hbm["fp8_e4m3"] * blocks),
                 ("DRAM", "raw", best["raw"] * blocks),
                 ("DRAM", "fp8_e4m3", best["fp8_e4m3"] * blocks),
                 ("DRAM", "nvfp4", best["nvfp4"] * blocks),
                 ("SSD -> DRAM -> engine", "fp8_e4m3",
                  rig.page_bytes("fp8_e4m3", 1) * blocks / (ssd_gbps * 1e6)
                  + best["fp8_e4m3"] * min(blocks, chunk_blocks))]
        for tier, codec, ms in ready:
            rows.append({"section": "ready", "path": f"{tokens} tokens from {tier}",
                         "codec": codec, "ms": ms, "gbps": tokens * SPEC.block_bytes
                         / SPEC.block_tokens / (ms * 1e6), "ceiling": "full prefill",
                         "ceiling_gbps": prefill_ms, "ratio": prefill_ms / ms,
                         "aim": ">= 20x prefill" if (tier, codec, tokens) == (
                             "DRAM", "fp8_e4m3", 32768) else ""})
        for codec in ("raw", "fp8_e4m3"):
            layer_ms = first_layer[codec] * blocks
            full_ms = best[codec] * blocks
            # Layer-pipelined readiness (seed 10.7): the first layer lands after one layer's
            # transfer; the rest overlap the engine's own layer compute.
            rows.append({"section": "ready", "path": f"{tokens} tokens, first layer from DRAM",
                         "codec": codec, "ms": layer_ms, "gbps": math.nan,
                         "ceiling": "whole prefix", "ceiling_gbps": full_ms,
                         "ratio": full_ms / layer_ms, "aim": ""})
    with tempfile.TemporaryDirectory(dir=ssd_dir) as root:  # the SSD tier's segments too
        e2e_tokens = 256 if quick else 8192
        rows.extend(_end_to_end_rows(e2e_tokens, _prefill_s(e2e_tokens, flops) * 1e3, root))
    notes.append("ready rows: ceiling GB/s holds the full prefill's ms (ratio = prefill / "
                 "ready), or the whole prefix's ms for first-layer rows")
    notes.append(f"{n} blocks of {SPEC.block_bytes >> 20} MiB (32 layers, 8 KV heads, head dim "
                 "128, bf16, 16 tokens) scattered over an engine cache of twice as many pages")
    return BenchReport(name="gpu", title=f"GPU path ({torch.cuda.get_device_name(device)})",
                       columns=COLUMNS, rows=tuple(rows), notes=tuple(notes),
                       params={"blocks": n, "block_bytes": SPEC.block_bytes,
                               "spec": SPEC.to_dict(), "chunk_blocks": chunk_blocks},
                       section_key="section")


# --- host overhead ------------------------------------------------------------------------

# ``--host-overhead``: the host's share of EngineCache.save and load of a 512-block prefix
# through a daemon, with the kernels' own time taken out, so it runs on the 2-core box too
# (HbmTier(device="cpu") and Triton's interpreter run the same code as on the GPU). On the
# CPU one layer of one head of 128 (8 KiB blocks) keeps the interpreted kernels to seconds:
# what is measured is per block, not per byte. On a GPU, SPEC (2 MiB blocks). On the CPU the
# kernels run in the warm-up pass, whose pages are checked, and are skipped in the timed ones
# (still counted as launches): interpreted, 512 blocks take seconds a launch.
HOST_SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=128, block_tokens=16)
HOST_COLUMNS = (
    Column("phase", "phase", justify="left"),
    Column("code", "code", justify="left"),
    Column("wall_ms", "wall ms", 2),
    Column("kernel_ms", "kernel ms", 2),
    Column("host_ms", "host ms", 2),
    Column("host_min_ms", "host min ms", 2),
    Column("launches", "launches", 0),
    Column("vs_baseline", "host vs baseline", 2),
)


class _KernelClock:
    """Every Triton kernel of ``kvstore.codecs.triton.engine`` wrapped so the time spent in
    its launches adds up (device events on a GPU, the interpreter's wall time on the CPU)."""

    def __init__(self) -> None:
        from kvstore.codecs.triton import engine

        self._engine = engine
        self.skip = False  # interpreted launches are counted, not run
        # The launched kernels (``kernel[grid](...)``), not the device functions they call.
        self._saved = {name: value for name, value in vars(engine).items()
                       if name.endswith("_kernel") and hasattr(value, "__getitem__")}
        if not self._saved:
            raise KVStoreError("bench gpu: kvstore.codecs.triton.engine has no *_kernel to time")
        self.seconds = 0.0
        self.launches = 0
        self._events: list[tuple[object, object]] = []

    def __enter__(self) -> Self:
        for name, kernel in self._saved.items():
            setattr(self._engine, name, _Timed(kernel, self))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for name, kernel in self._saved.items():
            setattr(self._engine, name, kernel)

    def reset(self) -> None:
        self.seconds, self.launches, self._events = 0.0, 0, []

    def total_s(self) -> float:
        """Kernel seconds since ``reset`` (synchronises the device first)."""
        if self._events:
            torch.cuda.synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events = []
        return self.seconds


class _Timed:
    def __init__(self, kernel, clock: _KernelClock) -> None:
        self._kernel, self._clock = kernel, clock

    def __getitem__(self, grid):
        launch = self._kernel[grid]

        def timed(*args, **kwargs):
            clock = self._clock
            clock.launches += 1
            on_gpu = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
            if on_gpu:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                begin.record()
                launch(*args, **kwargs)
                end.record()
                clock._events.append((begin, end))
                return
            start = time.perf_counter()
            if not clock.skip:
                launch(*args, **kwargs)
            clock.seconds += time.perf_counter() - start

        return timed


def _host_overhead_samples(blocks: int, repeat: int, root: str) -> dict[str, list[list]]:
    """Per phase: ``[wall s, kernel s, launches]`` of each of ``repeat`` passes after a
    warm-up. Uses only the public client API, so the same function measures another checkout
    of kvstore (``baseline``)."""
    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    spec = SPEC if cuda else HOST_SPEC
    threads = torch.get_num_threads()
    if not cuda:
        # Copies of a few hundred KiB split over torch's threads wait on busy cores on a shared
        # 2-core box: a DRAM load measured 277 ms with two threads, 18 ms with one (2026-12-01).
        torch.set_num_threads(1)
    try:
        return _passes(spec, device, blocks, repeat, root)
    finally:
        torch.set_num_threads(threads)


def _passes(spec: KVSpec, device: str, blocks: int, repeat: int, root: str
            ) -> dict[str, list[list]]:
    from kvstore.client import Client
    from kvstore.client.engine import EngineCache
    from kvstore.config import DramConfig, HbmConfig, KVStoreConfig, ServerConfig, TierConfig
    from kvstore.keys import Namespace
    from kvstore.server.daemon import DaemonThread

    cuda = device != "cpu"
    bt = spec.block_tokens
    nbytes = blocks * spec.block_bytes
    ns = Namespace(model_id="bench-host", spec=spec, tenant="default")
    shape = (2, 2 * blocks, bt, spec.num_kv_heads, spec.head_dim)
    samples: dict[str, list[list]] = {}
    with _KernelClock() as clock:
        def timed(phase: str, fn: Callable[[], object], keep: bool) -> object:
            if cuda:
                torch.cuda.synchronize()
            clock.reset()
            clock.skip = keep and not cuda
            start = time.perf_counter()
            out = fn()
            wall = time.perf_counter() - start
            kernel = clock.total_s()
            if keep:
                samples.setdefault(phase, []).append([wall, kernel, clock.launches])
            return out

        for tier in ("HBM pool", "DRAM arena"):
            hbm = TierConfig("hbm", "hbm", HbmConfig(capacity_bytes=4 * nbytes + (64 << 20),
                                                     device=device))
            dram = TierConfig("dram", "dram", DramConfig(
                capacity_bytes=(repeat + 2) * 2 * nbytes + (256 << 20), chunk_bytes=64 << 20))
            config = KVStoreConfig(tiers=(hbm, dram) if tier == "HBM pool" else (dram,),
                                   server=ServerConfig(socket_path=f"{root}/{tier[:4]}.sock",
                                                       log_level="WARNING",
                                                       lease_timeout_s=600.0))
            with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
                caches = [torch.randn(shape, device=device).to(torch.bfloat16)
                          for _ in range(spec.num_layers)]
                with EngineCache(client, ns, caches) as engine:
                    for rep in range(repeat + 1):
                        prompt = list(range(rep * 10 * blocks * bt,
                                            rep * 10 * blocks * bt + blocks * bt))
                        pages = torch.randperm(2 * blocks)[:blocks].tolist()
                        if tier == "HBM pool":
                            want = [c[:, pages].cpu() for c in caches]
                            saved = timed("save, HBM pool", lambda p=prompt, ids=pages:
                                          engine.save(p, ids), rep > 0)
                        else:  # the DRAM tier's save is the client's put: not this path
                            kv = torch.randn(spec.shape(blocks * bt)).to(torch.bfloat16)
                            want = list(kv.view(spec.num_layers, 2, blocks, bt,
                                                *kv.shape[3:]))
                            saved = client.put(ns, prompt, kv)
                        if saved != blocks * bt:
                            raise KVStoreError(f"bench gpu: saved {saved} of {blocks * bt} "
                                               "tokens")
                        target = torch.randperm(2 * blocks)[:blocks].tolist()
                        handle = timed(f"load, {tier}", lambda p=prompt, ids=target:
                                       _load(engine, p, ids), rep > 0)
                        if handle.matched_tokens != blocks * bt:
                            raise KVStoreError(f"bench gpu: loaded {handle.matched_tokens} of "
                                               f"{blocks * bt} tokens from the {tier}")
                        if rep == 0 and not all(torch.equal(c[:, target].cpu(), w)
                                                for c, w in zip(caches, want)):
                            raise KVStoreError(f"bench gpu: pages loaded from the {tier} are "
                                               "not the ones saved")
    return samples


def _summary(phase: str, got: list[list]) -> dict:
    host = sorted((wall - kernel) * 1e3 for wall, kernel, _ in got)
    return {"phase": phase, "wall_ms": _median([w * 1e3 for w, _, _ in got]),
            "kernel_ms": _median([k * 1e3 for _, k, _ in got]), "host_ms": _median(host),
            "host_min_ms": host[0], "launches": _median([n for _, _, n in got]),
            "passes": len(got)}


def _load(engine, prompt: list[int], target: list[int]):
    handle = engine.load(prompt, target, advice=False)
    handle.wait()
    return handle


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else math.nan


def _baseline_samples(baseline: str, blocks: int, repeat: int, root: str
                      ) -> dict[str, list[list]]:
    """``_host_overhead_samples`` of this file run against the kvstore package under
    ``baseline`` (another checkout), in a child process."""
    import json
    import subprocess
    import sys

    if not os.path.isdir(os.path.join(baseline, "kvstore")):
        raise KVStoreError(f"bench gpu: --baseline {baseline} holds no kvstore package")
    code = ("import json, runpy, sys; sys.path.insert(0, sys.argv[1]); "
            "m = runpy.run_path(sys.argv[2]); "
            "print('SAMPLES ' + json.dumps(m['_host_overhead_samples']("
            "*map(int, sys.argv[3:5]), sys.argv[5])))")
    os.makedirs(f"{root}/base", exist_ok=True)
    done = subprocess.run([sys.executable, "-c", code, os.path.abspath(baseline), __file__,
                           str(blocks), str(repeat), f"{root}/base"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [os.path.abspath(baseline), *filter(None, [os.environ.get(
                                  "PYTHONPATH")])])}, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("SAMPLES ")]
    if done.returncode or not lines:
        raise KVStoreError(f"bench gpu: the baseline run failed: {done.stderr[-2000:]}")
    return json.loads(lines[-1][len("SAMPLES "):])


def run_host_overhead_bench(*, blocks: int = 512, repeat: int = 5, rounds: int = 3,
                            baseline: str | None = None) -> BenchReport:
    """The host's share of ``EngineCache.save``/``load`` of ``blocks`` blocks through a daemon
    (see ``HOST_SPEC``), ``repeat`` passes in each of ``rounds`` rounds. ``baseline``: another
    kvstore checkout measured the same way in a child process, its rounds taking turns with
    this code's (first one, then the other), each phase's host ms compared with it."""
    from kvstore.codecs.triton.common import kernels_runnable

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if not kernels_runnable(device):
        raise KVStoreError("kvstore bench gpu --host-overhead needs a CUDA device or "
                           "TRITON_INTERPRET=1 (the kernels run in Triton's interpreter)")
    if min(blocks, repeat, rounds) < 1:
        raise KVStoreError(f"bench gpu: blocks, repeat and rounds must be positive, got "
                           f"{blocks}, {repeat} and {rounds}")
    this: dict[str, list[list]] = {}
    base: dict[str, list[list]] = {}
    with tempfile.TemporaryDirectory(prefix="kvsh", dir="/tmp") as root:
        for r in range(rounds):
            turns = [(this, None)] + ([(base, baseline)] if baseline else [])
            for into, checkout in (turns if r % 2 else turns[::-1]):
                where = f"{root}/{r}{'b' if checkout else 't'}"
                os.makedirs(where)
                got = (_baseline_samples(checkout, blocks, repeat, where) if checkout
                       else _host_overhead_samples(blocks, repeat, where))
                for phase, passes in got.items():
                    into.setdefault(phase, []).extend(passes)
    out: list[dict] = []
    for phase, passes in this.items():
        row = _summary(phase, passes)
        old = _summary(phase, base[phase]) if phase in base else None
        if old is not None:
            out.append({**old, "code": "baseline", "vs_baseline": 1.0})
        out.append({**row, "code": "this",
                    "vs_baseline": row["host_ms"] / old["host_ms"] if old else math.nan})
    spec = SPEC if device.type == "cuda" else HOST_SPEC
    notes = ((f"{blocks} blocks of {spec.block_bytes >> 10} KiB ({spec.num_layers} layers, "
              f"{spec.num_kv_heads} KV heads of {spec.head_dim}, {spec.block_tokens} tokens): "
              f"{blocks * spec.block_tokens} tokens a phase; medians of {rounds} x {repeat} "
              "passes, each round after a warm-up pass"),
             ("host ms = wall - kernel ms: the kernels' own time (interpreted on the CPU, device "
              "events on a GPU) taken out; a load's wall holds Acquire (no Lookup), the lease "
              "parse and Release; a DRAM load's also its page copies"),
             *([f"baseline: {baseline}, rounds taking turns with this code's"]
               if baseline else ()))
    return BenchReport(name="gpu-host", title=f"EngineCache host overhead ({device.type})",
                       columns=HOST_COLUMNS, rows=tuple(out), notes=notes,
                       params={"blocks": blocks, "repeat": repeat, "rounds": rounds,
                               "spec": spec.to_dict(), "baseline": baseline or ""})


__all__ = ["run_gpu_bench", "run_host_overhead_bench"]
