"""Time to make a prefix ready from each tier, beside a full prefill at the bf16 matrix rate
measured in the run: estimates from the measured paths (and an O_DIRECT read of the disk), and
``EngineCache.load`` end to end through a real daemon's HBM pool, DRAM arena and SSD."""

from __future__ import annotations

import math
import os
import tempfile
import time

import torch

from kvstore.bench.gpu.rig import SPEC, Rig, aligned, bench_ms
from kvstore.errors import KVStoreError

# The prefill model of the ready rows: an 8B dense model (2 x 8e9 FLOPs per token) with 32
# query heads of 128 over 32 layers for causal attention.
MODEL_FLOPS_PER_TOKEN = 2 * 8e9
QUERY_HEADS = 32



def ready_rows(rig: Rig, best_ms: dict[str, float], chunk_blocks: int, quick: bool,
               ssd_dir: str | None, notes: list[str]) -> list[dict]:
    """The "ready" section: estimates for 8k and 32k tokens from each tier (``best_ms``: the
    fastest pinned-DRAM load of each codec, ms per block; ``chunk_blocks``: the staging
    ring's chunk), the first layer from DRAM, then end-to-end loads through a daemon."""
    from kvstore.codecs.triton.engine import to_engine

    device, n, best, rows = rig.device, rig.n, best_ms, []
    # Time to make a prefix ready, beside a full prefill at the measured bf16 matrix rate.
    flops = matmul_flops(device)
    ssd_gbps = odirect_read_gbps(256 << 20 if quick else 1 << 30, ssd_dir)
    notes.append(f"bf16 matrix rate {flops / 1e12:.0f} TFLOP/s (8192^3); SSD O_DIRECT read "
                 f"{ssd_gbps:.2f} GB/s (16 MiB requests into pinned memory)")
    per_block_hbm = {}
    for codec in ("raw", "fp8_e4m3"):
        dev = rig.layouts[codec]
        addrs = rig.addrs(rig.pools[codec], codec)
        per_block_hbm[codec] = bench_ms(
            lambda dev=dev, addrs=addrs: to_engine(rig.layout, dev, addrs, rig.ids)) / n
    first_layer = {}
    for codec in ("raw", "fp8_e4m3"):
        dev = rig.layouts[codec]
        addrs = rig.addrs(rig.hosts[codec], codec)
        first_layer[codec] = bench_ms(lambda dev=dev, addrs=addrs: to_engine(
            rig.layout, dev, addrs, rig.ids, layers=range(1), host=True)) / n
    for tokens in (8192, 32768):
        blocks = tokens // SPEC.block_tokens
        prefill_ms = prefill_s(tokens, flops) * 1e3
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
        rows.extend(end_to_end_rows(e2e_tokens, prefill_s(e2e_tokens, flops) * 1e3, root))
    notes.append("ready rows: ceiling GB/s holds the full prefill's ms (ratio = prefill / "
                 "ready), or the whole prefix's ms for first-layer rows")
    return rows


def end_to_end_rows(tokens: int, prefill_ms: float, root: str, device: str = "cuda"
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
                write_through=True, admit_after_accesses=0, fsync="never",
                # every saved block must reach the SSD: a backlog as large as the tier
                write_through_queue_bytes=3 * nbytes + (1 << 30),
                write_through_queue_blocks=4 * blocks))
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



def matmul_flops(device: torch.device) -> float:
    """bf16 FLOP/s of an 8192^3 matrix product on random data."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / (bench_ms(lambda: a @ b) * 1e-3)


def prefill_s(tokens: int, flops_per_s: float) -> float:
    linear = MODEL_FLOPS_PER_TOKEN * tokens
    attention = 2 * 2 * SPEC.num_layers * QUERY_HEADS * SPEC.head_dim * tokens * tokens / 2
    return (linear + attention) / flops_per_s


def odirect_read_gbps(nbytes: int, directory: str | None) -> float:
    """O_DIRECT reads of a file of ``nbytes`` in 16 MiB requests into pinned memory."""
    chunk = 16 << 20
    buf = aligned(chunk, "cpu", pin=True)
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

