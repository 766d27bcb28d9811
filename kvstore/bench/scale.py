"""``kvstore bench scale``: what put, reserve+commit, lookup and get cost as the store grows.

One store with a DRAM tier and an SSD tier (the DRAM tier holds a fixed number of blocks, so it
is full from the first size on and every new block pushes one down to the SSD) is filled with
prompts of fresh small blocks, up to each size of a sweep (1k, 10k, 100k, 300k blocks by
default). At each size the bench times, on the store's own event loop (in process):

- put of a new prompt; reserve, write the pages into the slots (as a same-host client does
  through its mapping) and commit a new prompt;
- lookup of a stored prompt; get of the prompt just put (DRAM) and of an old one (SSD);

and through the daemon's Unix socket (the same store, a ``Client`` in this thread), lookup of a
stored prompt. Each latency is reported with its ratio to the first size's (the aim: the last
within 1.3x of the first), and the fill time per 10k blocks of each stretch of the fill (a fill
linear in count is a flat line). ``kvstore bench scale`` prints the table, writes the JSON and a
PNG plot beside it.
"""

from __future__ import annotations

import mmap
import random
import tempfile
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstore import codecs
from kvstore.bench.report import BenchReport, Column
from kvstore.config import DramConfig, KVStoreConfig, ServerConfig, SsdConfig
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import Namespace
from kvstore.page import PageMeta, encode_page
from kvstore.spec import KVSpec

# 1 layer x 2 kv heads x 32 head dim x 16 tokens x K,V x bf16 = 4 KiB of K/V per block: 300k
# blocks take 2.4 GB of SSD segments (8 KiB aligned pages) and fill in 5-10 minutes on the
# 2-core box.
SCALE_SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_dim=32, block_tokens=16)
DEFAULT_SIZES = (1_000, 10_000, 100_000, 300_000)
QUICK_SIZES = (64, 256)
PROMPT_BLOCKS = 16  # blocks per put, reservation, lookup and get
DRAM_BLOCKS = 512  # the DRAM tier's capacity, in blocks (full from the first size on)
FILL_STRETCH_BLOCKS = 10_000  # the fill is timed per this many blocks
OPS = ("put", "reserve_commit", "lookup", "get_dram", "get_ssd", "lookup_daemon")
_SLOT_BYTES_GUESS = 8 << 10  # a 4 KiB block's raw page rounds up to an 8 KiB slab slot


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"1k,10k,300k"`` -> (1000, 10000, 300000); ascending, positive, InvalidArgument else."""
    sizes = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        scale = 1_000_000 if part.endswith("m") else 1_000 if part.endswith("k") else 1
        try:
            value = float(part.rstrip("km")) * scale
        except ValueError:
            raise InvalidArgument(f"--sizes: {part!r} is not a count like 1000, 10k or 0.3m"
                                  ) from None
        sizes.append(int(value))
    if not sizes or any(s < 1 for s in sizes) or sizes != sorted(set(sizes)):
        raise InvalidArgument(f"--sizes must be ascending positive block counts, got {text!r}")
    return tuple(sizes)


@dataclass(frozen=True, slots=True)
class ScaleConfig:
    """One run of the bench."""

    sizes: tuple[int, ...] = DEFAULT_SIZES  # stored blocks at which latencies are measured
    repeats: int = 200  # timed calls per operation and size
    prompt_blocks: int = PROMPT_BLOCKS
    dram_blocks: int = DRAM_BLOCKS
    eviction: str = "lru"  # both tiers' eviction order
    # 128 pages of 8 KiB (a 4 KiB block's page, aligned) per SSD segment, as a 256 MiB segment
    # holds 2 MiB blocks: 300k blocks are about 2300 segment files, as 600 GB of them would be.
    segment_bytes: int = 1 << 20
    spec: KVSpec = SCALE_SPEC

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise InvalidArgument(f"sizes must be ascending positive counts, got {self.sizes}")
        if self.repeats < 1 or self.prompt_blocks < 1 or self.dram_blocks < 1:
            raise InvalidArgument("repeats, prompt_blocks and dram_blocks must be >= 1")

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_blocks * self.spec.block_tokens


def store_config(config: ScaleConfig, root: Path) -> KVStoreConfig:
    """A DRAM tier of ``dram_blocks`` blocks over an SSD tier big enough for the largest size
    (admitting every block it is offered, so the store holds every block put)."""
    page_bytes = config.spec.block_bytes + 1024
    most = config.sizes[-1] + 4 * config.repeats * config.prompt_blocks + 1024
    dram_bytes = max(2 << 20, config.dram_blocks * _SLOT_BYTES_GUESS)  # staging needs a chunk
    return KVStoreConfig(
        dram=DramConfig(capacity_bytes=dram_bytes, chunk_bytes=1 << 20,
                        eviction=config.eviction),
        ssd=SsdConfig(path=str(root / "ssd"), capacity_bytes=2 * most * page_bytes + (64 << 20),
                      segment_bytes=config.segment_bytes, fsync="never", admit_after_accesses=0,
                      eviction=config.eviction, persist_on_close=False),
        server=ServerConfig(socket_path=str(root / "kv.sock"), log_level="WARNING"),
    )


class _Prompts:
    """Fresh prompts of random tokens and the K/V put with each (one tensor for all)."""

    def __init__(self, config: ScaleConfig, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self._tokens = config.prompt_tokens
        self.kv = torch.randn(config.spec.shape(config.prompt_tokens)).to(torch.bfloat16)

    def new(self) -> list[int]:
        return self.rng.integers(0, 1 << 31, self._tokens).tolist()


class _Slots:
    """Writes pages into reserved slots through mappings of the tier's regions, as a same-host
    client does (each region mapped once)."""

    def __init__(self, tier: Any) -> None:
        self._tier = tier
        self._maps: dict[str, mmap.mmap] = {}

    def write(self, ns: Namespace, reservation: Any, kv: torch.Tensor) -> None:
        codec = codecs.get(reservation.codec)
        bt = ns.spec.block_tokens
        for grant in reservation.blocks:
            meta = PageMeta.for_block(ns, grant.key, grant.parent, grant.block_index, codec)
            i = grant.block_index
            page = encode_page(meta, codec.encode(kv[:, :, i * bt:(i + 1) * bt]))
            arena = self._map(grant.region)
            arena[grant.offset:grant.offset + len(page)] = page

    def _map(self, region: str) -> mmap.mmap:
        found = self._maps.get(region)
        if found is None:
            path = self._tier.region_path(region)
            if path is None:
                raise KVStoreError(f"scale bench: region {region} is gone")
            with open(path, "r+b") as f:
                found = self._maps[region] = mmap.mmap(f.fileno(), 0)
        return found

    def close(self) -> None:
        for arena in self._maps.values():
            arena.close()
        self._maps.clear()


async def _ms(call: Awaitable[object]) -> float:
    """Milliseconds ``call`` takes to finish."""
    start = time.perf_counter()
    await call
    return (time.perf_counter() - start) * 1e3


class _Run:
    """The store-side half of the bench, run on the daemon's event loop."""

    def __init__(self, store: Any, config: ScaleConfig, ns: Namespace) -> None:
        self.store = store
        self.config = config
        self.ns = ns
        self.prompts = _Prompts(config)
        self.stored: list[list[int]] = []  # every prompt the fill put, oldest first
        self.num_blocks = 0  # blocks the fill put
        # (blocks stored after it, blocks it put, seconds) per timed stretch of the fill
        self.stretches: list[tuple[int, int, float]] = []
        self._slots = _Slots(store.tiers["dram"])
        self.rng = random.Random(1)

    async def fill(self, target: int, timed: bool = True) -> None:
        """Put fresh prompts until the fill has put ``target`` blocks, timing each stretch
        (unless not ``timed``: a warm-up)."""
        kv, bt = self.prompts.kv, self.config.spec.block_tokens
        while self.num_blocks < target:
            stretch = min(FILL_STRETCH_BLOCKS - self.num_blocks % FILL_STRETCH_BLOCKS,
                          target - self.num_blocks)
            done = 0
            start = time.perf_counter()
            while done < stretch:
                tokens = self.prompts.new()
                written = await self.store.put(self.ns, tokens, kv) // bt
                if written != self.config.prompt_blocks:
                    raise KVStoreError(f"scale bench: a fill put wrote {written} of "
                                       f"{self.config.prompt_blocks} blocks")
                self.stored.append(tokens)
                done += written
            self.num_blocks += done
            if timed:
                self.stretches.append((self.num_blocks, done, time.perf_counter() - start))

    async def measure(self) -> dict[str, list[float]]:
        """Every in-process operation, ``repeats`` times each, interleaved (a put, a
        reservation, a lookup, two gets) so drift on a busy box hits all alike."""
        ns, kv, store = self.ns, self.prompts.kv, self.store
        times: dict[str, list[float]] = {op: [] for op in OPS[:-1]}
        old = self._ssd_prompts(self.config.repeats)
        for i in range(self.config.repeats):
            fresh, reserved = self.prompts.new(), self.prompts.new()
            times["put"].append(await _ms(store.put(ns, fresh, kv)))
            times["reserve_commit"].append(await _ms(self.reserve_commit(reserved)))
            times["lookup"].append(await _ms(store.lookup(ns, self.rng.choice(self.stored))))
            times["get_dram"].append(await _ms(store.get(ns, fresh)))
            if i < len(old):
                times["get_ssd"].append(await _ms(store.get(ns, old[i])))
        return times

    async def reserve_commit(self, tokens: list[int]) -> None:
        reservation = await self.store.reserve(self.ns, tokens)
        if len(reservation.blocks) != self.config.prompt_blocks:
            await self.store.abort(reservation.reservation_id)
            raise KVStoreError(f"scale bench: a reservation got {len(reservation.blocks)} of "
                               f"{self.config.prompt_blocks} slots")
        self._slots.write(self.ns, reservation, self.prompts.kv)
        written = await self.store.commit(reservation.reservation_id)
        if written != self.config.prompt_tokens:
            raise KVStoreError(f"scale bench: a commit published {written} of "
                               f"{self.config.prompt_tokens} tokens")

    def _ssd_prompts(self, count: int) -> list[list[int]]:
        """Up to ``count`` distinct stored prompts only the SSD tier holds (the oldest half of
        the fill, asked of the tiers: a lookup would touch them)."""
        from kvstore.keys import block_keys

        dram, ssd = self.store.tiers["dram"], self.store.tiers["ssd"]
        candidates = self.stored[:max(1, len(self.stored) // 2)]
        self.rng.shuffle(candidates)
        chosen = []
        for tokens in candidates:
            keys = block_keys(self.ns, tokens)
            if all(ssd.contains(k) and not dram.contains(k) for k in keys):
                chosen.append(tokens)
                if len(chosen) == count:
                    break
        return chosen

    def close(self) -> None:
        self._slots.close()


def _percentiles(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


def _rows(results: Mapping[int, Mapping[str, list[float]]], fill: Mapping[int, float]
          ) -> list[dict[str, Any]]:
    """One row per operation and size: p50, p99 and their ratios to the first size's."""
    rows = []
    first = min(results)
    for op in OPS:
        base50, base99 = _percentiles(results[first][op])
        for size, times in results.items():
            p50, p99 = _percentiles(times[op])
            rows.append({"section": "latency", "operation": op, "blocks": size,
                         "samples": len(times[op]), "p50_ms": p50, "p99_ms": p99,
                         "p50_vs_first": p50 / base50 if p50 and base50 else None,
                         "p99_vs_first": p99 / base99 if p99 and base99 else None})
    base = fill[first]
    for size, seconds in fill.items():
        rows.append({"section": "fill", "operation": "fill per 10k blocks", "blocks": size,
                     "fill_s_per_10k": seconds, "fill_vs_first": seconds / base})
    return rows


def _fill_per_10k(stretches: Sequence[tuple[int, int, float]]) -> float:
    blocks = sum(b for _, b, _ in stretches)
    return sum(s for _, _, s in stretches) * FILL_STRETCH_BLOCKS / blocks


def _daemon_lookups(client: Any, ns: Namespace, stored: Sequence[list[int]], repeats: int,
                    rng: random.Random) -> list[float]:
    for _ in range(min(10, repeats)):
        client.lookup(ns, rng.choice(stored))
    times = []
    for _ in range(repeats):
        tokens = rng.choice(stored)
        start = time.perf_counter()
        client.lookup(ns, tokens)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def run_scale_bench(config: ScaleConfig | None = None, work_dir: str | None = None
                    ) -> tuple[BenchReport, dict[str, Any]]:
    """Fill a DRAM + SSD store through each size of ``config.sizes``, measuring at each.

    Args:
        config: sizes, repeats and shapes (defaults: the full sweep to 300k blocks).
        work_dir: where the SSD tier's files and the daemon's socket go (a temp dir under it,
            removed afterwards; default: the system's temp dir).

    Returns:
        The report (a latency table and a fill table) and the raw results: per size, every
        latency sample in ms and the fill stretches.
    """
    from kvstore.client import NO_RETRY, Client
    from kvstore.server.daemon import DaemonThread

    config = config or ScaleConfig()
    ns = Namespace(model_id="bench/scale", spec=config.spec, tenant="bench")
    results: dict[int, dict[str, list[float]]] = {}
    fill: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvss", dir=work_dir) as tmp:
        thread = DaemonThread(store_config(config, Path(tmp)))
        with thread as daemon, Client(daemon.unix_address, retry=NO_RETRY) as client:
            run = _Run(daemon.store, config, ns)
            try:
                # Fill the DRAM tier first (untimed): every timed block then pushes one down.
                thread.call(run.fill(min(config.dram_blocks, config.sizes[0] // 2), timed=False))
                for size in config.sizes:
                    before = len(run.stretches)
                    thread.call(run.fill(size))
                    fill[size] = _fill_per_10k(run.stretches[before:])
                    results[size] = thread.call(run.measure())
                    results[size]["lookup_daemon"] = _daemon_lookups(
                        client, ns, run.stored, config.repeats, run.rng)
            finally:
                run.close()
    raw = {"sizes": {str(size): {"latency_ms": times, "fill_s_per_10k": fill[size]}
                     for size, times in results.items()},
           "fill_stretches": [{"blocks": end, "fill_s_per_10k": seconds * FILL_STRETCH_BLOCKS / n}
                              for end, n, seconds in run.stretches]}
    return _report(config, _rows(results, fill)), raw


def _report(config: ScaleConfig, rows: list[dict[str, Any]]) -> BenchReport:
    columns = (Column("operation", "operation", justify="left"), Column("blocks", "blocks stored"),
               Column("samples", "samples"), Column("p50_ms", "p50 ms", 3),
               Column("p99_ms", "p99 ms", 3), Column("p50_vs_first", "p50 / first"),
               Column("p99_vs_first", "p99 / first"),
               Column("fill_s_per_10k", "fill s per 10k blocks", 2),
               Column("fill_vs_first", "fill / first"))
    spec = config.spec
    notes = ((f"Blocks of {spec.block_bytes} bytes ({spec.num_layers} layer x "
              f"{spec.num_kv_heads} kv heads x {spec.head_dim} x {spec.block_tokens} tokens); "
              f"every call moves a {config.prompt_blocks}-block prompt. DRAM holds about "
              f"{config.dram_blocks} blocks, the SSD the rest in {config.segment_bytes >> 10} KiB "
              f"segments (eviction {config.eviction})."),
             ("'/ first' is the ratio to the smallest size's figure (aim: within 1.3x); "
              "lookup_daemon goes through the daemon's Unix socket, the rest run on its loop."))
    return BenchReport(name="scale", title="Latency as the store grows (DRAM + SSD)",
                       columns=columns, rows=tuple(rows), section_key="section", notes=notes,
                       params={"sizes": list(config.sizes), "repeats": config.repeats,
                               "prompt_blocks": config.prompt_blocks,
                               "dram_blocks": config.dram_blocks, "eviction": config.eviction,
                               "segment_bytes": config.segment_bytes,
                               "spec": spec.to_dict()})


def write_scale_report(report: BenchReport, raw: Mapping[str, Any], path: Any = None, *,
                       console: Any = None, command: str | None = None) -> Path:
    """Print the tables, write the JSON (the report plus the raw samples) and a PNG plot beside
    it (where matplotlib is installed; else a line says how); returns the JSON's path."""
    from rich.console import Console

    from kvstore.bench.report import print_plot, write_report

    console = console or Console()
    target = write_report(report, path, console=console, command=command, extra={"raw": raw})
    print_plot(console, plot(report.rows, raw.get("fill_stretches", ()),
                             target.with_suffix(".png")))
    return target


def plot(rows: Sequence[Mapping[str, Any]], stretches: Sequence[Mapping[str, Any]],
         path: Any) -> Any:
    """Two panels over blocks stored: p50 and p99 latency per operation (log scales), and the
    fill time per 10k blocks of each stretch of the fill (linear: a linear fill is flat).
    Returns the path, or None where matplotlib is not installed."""
    from kvstore.bench.report import pyplot

    plt = pyplot()
    if plt is None:
        return None
    fig, (lat, fill) = plt.subplots(2, 1, figsize=(7.0, 7.0))
    for op in OPS:
        mine = [r for r in rows if r.get("operation") == op and r.get("p50_ms") is not None]
        if mine:
            line, = lat.plot([r["blocks"] for r in mine], [r["p50_ms"] for r in mine],
                             marker="o", label=f"{op} p50")
            lat.plot([r["blocks"] for r in mine], [r["p99_ms"] for r in mine], marker="x",
                     linestyle="--", color=line.get_color())
    lat.set_xscale("log")
    lat.set_yscale("log")
    lat.set_ylabel("latency ms (p50 solid, p99 dashed)")
    lat.set_xlabel("blocks stored")
    lat.legend(fontsize=7)
    fill.plot([r["blocks"] for r in stretches], [r["fill_s_per_10k"] for r in stretches],
              marker=".")
    fill.set_ylim(bottom=0)
    fill.set_ylabel("fill s per 10k blocks")
    fill.set_xlabel("blocks stored")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


SSD_FULL_SEGMENTS = (100, 1_000, 5_000)
SSD_FULL_SEGMENT_BYTES = 64 << 10  # sixteen 4 KiB pages to a segment
SSD_FULL_PAYLOAD = 3_500  # a page of payload + header that pads to one 4 KiB block


async def _ssd_full_run(root: Path, segments: int, puts: int, profile: Any = None
                        ) -> dict[str, float]:
    """Fill an SSD tier of ``segments`` segments' worth, then time ``puts`` puts into it as
    full, each making its room as the store does: delete the oldest page while ``room_for``
    says it does not fit (so every put asks ``room_for`` and reclaims)."""
    from kvstore.keys import BlockKey
    from kvstore.tiers.ssd.tier import SsdTier

    tier = SsdTier(SsdConfig(path=str(root), capacity_bytes=segments * SSD_FULL_SEGMENT_BYTES,
                             segment_bytes=SSD_FULL_SEGMENT_BYTES, fsync="never",
                             o_direct=False))
    await tier.open()
    payload = bytes(SSD_FULL_PAYLOAD)
    order: list[BlockKey] = []
    oldest = 0

    async def put(i: int) -> None:
        nonlocal oldest
        key = BlockKey(i.to_bytes(16, "little"))
        meta = PageMeta(key=key, namespace=bytes(16), parent=None, block_index=0,
                        tenant="bench", model_id="bench", codec="raw", codec_id=1)
        page = encode_page(meta, payload)
        while tier.room_for(len(page)) is not None and oldest < len(order):
            await tier.delete(order[oldest])
            oldest += 1
        if not await tier.write(key, page, meta):
            raise KVStoreError(f"ssd-full bench: page {i} was refused with room made")
        order.append(key)

    try:
        i = 0
        while tier.room_for(4096) is None:  # fill to capacity
            await put(i)
            i += 1
        for _ in range(puts // 4):  # warm: full, segments dying and compacting
            await put(i)
            i += 1
        stored = tier.stats().extra["segments"]
        if profile is not None:
            profile.enable()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(puts):
            await put(i)
            i += 1
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        if profile is not None:
            profile.disable()
        return {"segments": segments, "segments_held": stored, "puts": puts,
                "us_per_put": elapsed / puts * 1e6, "cpu_us_per_put": cpu / puts * 1e6,
                "compactions": tier.stats().extra["compactions"]}
    finally:
        await tier.close()


def run_ssd_full_bench(segment_counts: Sequence[int] = SSD_FULL_SEGMENTS, puts: int = 2_000,
                       work_dir: str | None = None, profile: bool = False
                       ) -> list[dict[str, float]]:
    """Per-put cost of a full SSD tier (4 KiB pages in 64 KiB segments) at each segment count;
    with ``profile``, the cProfile of the timed puts of the largest count is printed."""
    import asyncio
    import cProfile
    import pstats

    rows = []
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        for n, segments in enumerate(segment_counts):
            prof = cProfile.Profile() if profile and n == len(segment_counts) - 1 else None
            rows.append(asyncio.run(_ssd_full_run(Path(tmp) / f"ssd-{segments}", segments,
                                                  puts, prof)))
            print(rows[-1], flush=True)
            if prof is not None:
                pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
    return rows


def _main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvstore.bench.scale")
    parser.add_argument("--ssd-full", action="store_true", required=True,
                        help="time puts into a full SSD tier at several segment counts")
    parser.add_argument("--segments", default="100,1000,5000")
    parser.add_argument("--puts", type=int, default=2_000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    run_ssd_full_bench(parse_sizes(args.segments), args.puts, args.work_dir, args.profile)


__all__ = ["DEFAULT_SIZES", "OPS", "QUICK_SIZES", "SCALE_SPEC", "SSD_FULL_SEGMENTS",
           "ScaleConfig", "parse_sizes", "plot", "run_scale_bench", "run_ssd_full_bench",
           "store_config", "write_scale_report"]

if __name__ == "__main__":
    _main()
