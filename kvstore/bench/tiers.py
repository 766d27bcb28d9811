"""``kvstore bench tiers``: put/get GB/s of the DRAM and SSD tiers against memcpy and ``dd``.

Each tier path moves 2 MiB blocks the way the store does: a put encodes the block (codec blob,
page header, checksum) and writes the page through the Tier API; a get reads and verifies the
page and decodes its payload into a torch tensor in the canonical layout. The baselines move the
same bytes in the same run: a loop of 2 MiB ``torch`` copies for DRAM, and ``dd`` with O_DIRECT
on the same directory for SSD (O_DIRECT because dropping the page cache needs root).
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstore import codecs
from kvstore.bench.report import BenchReport, Column
from kvstore.config import DramConfig, SsdConfig
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import BlockKey, Namespace, block_keys
from kvstore.page import PageMeta, encode_page
from kvstore.spec import KVSpec
from kvstore.tiers.base import Tier

# 32 layers x 2 x 16 tokens x 8 kv heads x 128 head dim x 2 bytes (bf16) = 2 MiB per block.
BENCH_SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16)
BLOCK_BYTES = BENCH_SPEC.block_bytes
# Gets decode into a ring of this many blocks (64 MiB): larger than a CPU's last-level cache,
# so copies stream to memory as a real get's output does, without a second full-size buffer.
RING_BLOCKS = 32
# 16 x 2 MiB = 32 MiB in flight: one SSD group commit's worth (ssd.GROUP_COMMIT_BYTES).
SSD_QUEUE_DEPTH = 16
MAX_QUEUE_DEPTH = 256
TARGETS = {("dram", "get"): 0.7, ("ssd", "put"): 0.8, ("ssd", "get"): 0.8}  # from the issue
TIERS = ("dram", "ssd")
_DD_RESULT = re.compile(r"^(\d+) bytes.*copied, ([0-9.]+) s", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Measurement:
    """Throughput of one operation over ``repeat`` passes."""

    num_bytes: int  # bytes moved per pass
    seconds: tuple[float, ...]  # each pass's wall time

    @property
    def best_gbps(self) -> float:
        return self.num_bytes / min(self.seconds) / 1e9

    @property
    def first_gbps(self) -> float:
        return self.num_bytes / self.seconds[0] / 1e9


@dataclass(slots=True)
class _Workload:
    """The blocks every path moves: one canonical K/V tensor, its keys and page metas."""

    num_blocks: int
    kv: torch.Tensor  # [layers, 2, num_blocks * block_tokens, heads, dim]
    metas: list[PageMeta] = field(default_factory=list)
    codec: codecs.Codec = field(default_factory=lambda: codecs.get("raw"))

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * BLOCK_BYTES

    def block(self, i: int) -> torch.Tensor:
        bt = BENCH_SPEC.block_tokens
        return self.kv[:, :, i * bt:(i + 1) * bt]

    def page(self, i: int) -> bytes:
        """Block ``i`` encoded as the store encodes it: codec blob inside a checksummed page."""
        return encode_page(self.metas[i], self.codec.encode(self.block(i)))


def make_workload(num_blocks: int) -> _Workload:
    """``num_blocks`` distinct blocks of random bf16 K/V, keyed as one chained prefix."""
    ns = Namespace(model_id="bench/model", spec=BENCH_SPEC, tenant="bench")
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(BENCH_SPEC.shape(num_blocks * BENCH_SPEC.block_tokens), generator=g,
                     dtype=torch.float32).to(torch.bfloat16)
    keys = block_keys(ns, list(range(num_blocks * BENCH_SPEC.block_tokens)))
    work = _Workload(num_blocks, kv)
    work.metas = [_meta(ns, keys, i, work.codec) for i in range(num_blocks)]
    return work


def _meta(ns: Namespace, keys: list[BlockKey], i: int, codec: codecs.Codec) -> PageMeta:
    return PageMeta(key=keys[i], namespace=ns.fingerprint, parent=keys[i - 1] if i else None,
                    block_index=i, tenant=ns.tenant, model_id=ns.model_id, codec=codec.name,
                    codec_id=codec.codec_id)


def _ring() -> torch.Tensor:
    ring = torch.empty(BENCH_SPEC.shape(RING_BLOCKS * BENCH_SPEC.block_tokens),
                       dtype=torch.bfloat16)
    ring.zero_()  # fault the pages in now, not inside a timed loop
    return ring


def _ring_slot(ring: torch.Tensor, i: int) -> torch.Tensor:
    bt = BENCH_SPEC.block_tokens
    j = i % RING_BLOCKS
    return ring[:, :, j * bt:(j + 1) * bt]


def memcpy_baseline(work: _Workload, repeat: int) -> Measurement:
    """A loop of plain 2 MiB ``copy_`` calls from the workload's memory into the ring."""
    src = work.kv.view(-1).view(torch.uint8).view(work.num_blocks, BLOCK_BYTES)
    dst = torch.zeros(RING_BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        for i in range(work.num_blocks):
            dst[i % RING_BLOCKS].copy_(src[i])
        seconds.append(time.perf_counter() - start)
    return Measurement(work.num_bytes, tuple(seconds))


WriteFn = Callable[[BlockKey, bytes, PageMeta], Awaitable[bool]]


async def _windowed(num_ops: int, queue_depth: int, op: Callable[[int], Awaitable[None]]
                    ) -> float:
    """Run ``op(0..num_ops-1)`` in order with at most ``queue_depth`` in flight; seconds taken."""
    start = time.perf_counter()
    started: list[asyncio.Future[None]] = []
    inflight: set[asyncio.Future[None]] = set()
    try:
        for i in range(num_ops):
            if len(inflight) >= queue_depth:
                done, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # re-raise the first failure
            started.append(asyncio.ensure_future(op(i)))
            inflight.add(started[-1])
        await asyncio.gather(*inflight)
    finally:
        for task in inflight:
            task.cancel()
        await asyncio.gather(*started, return_exceptions=True)  # reap every failure
    return time.perf_counter() - start


async def _put_pass(work: _Workload, write: WriteFn, tier_name: str, queue_depth: int) -> float:
    async def put(i: int) -> None:
        meta = work.metas[i]
        if not await write(meta.key, work.page(i), meta):
            raise KVStoreError(f"bench: the {tier_name} tier refused block {i} "
                               f"(capacity too small for {work.num_blocks} blocks?)")

    return await _windowed(work.num_blocks, queue_depth, put)


async def _get_pass(work: _Workload, tier: Tier, ring: torch.Tensor) -> float:
    """Read, verify and decode every block in order, one at a time, as ``Store.get`` does."""
    start = time.perf_counter()
    for i, meta in enumerate(work.metas):
        page = await tier.read(meta.key)
        if page is None:
            raise KVStoreError(f"bench: block {i} missing from the {tier.name} tier after put")
        codecs.decode(page.payload, out=_ring_slot(ring, i))
    return time.perf_counter() - start


def _check_ring(work: _Workload, ring: torch.Tensor, tier_name: str) -> None:
    """The last ring's worth of decoded blocks must equal what was put (untimed)."""
    for i in range(max(0, work.num_blocks - RING_BLOCKS), work.num_blocks):
        if not torch.equal(_ring_slot(ring, i), work.block(i)):
            raise KVStoreError(f"bench: block {i} read back from {tier_name} differs from the put")


async def bench_dram(work: _Workload, ring: torch.Tensor, repeat: int
                     ) -> tuple[Measurement, Measurement]:
    """Put then get every block, ``repeat`` times, through one DRAM tier (its arena stays
    grown between passes, so later passes show the steady state and the first shows growth)."""
    from kvstore.tiers.arena import SlabAllocator
    from kvstore.tiers.dram import DramTier

    chunk_bytes = DramConfig().chunk_bytes
    slot_bytes = SlabAllocator.slot_bytes_for(len(work.page(0)))
    tier = DramTier(DramConfig(capacity_bytes=work.num_blocks * slot_bytes + 2 * chunk_bytes,
                               chunk_bytes=chunk_bytes))
    puts, gets = [], []
    await tier.open()
    try:
        for _ in range(repeat):
            puts.append(await _put_pass(work, tier.write, tier.name, 1))
            gets.append(await _get_pass(work, tier, ring))
            _check_ring(work, ring, tier.name)
            for meta in work.metas:
                await tier.delete(meta.key)
    finally:
        await tier.close()
    return Measurement(work.num_bytes, tuple(puts)), Measurement(work.num_bytes, tuple(gets))


async def bench_ssd(work: _Workload, ring: torch.Tensor, directory: Path, repeat: int,
                    queue_depth: int) -> tuple[Measurement, Measurement]:
    """Put then get every block through a fresh SSD tier in a scratch directory per pass (so
    no pass pays for another's dead segments or compaction). Puts keep ``queue_depth`` blocks
    in flight: the tier batches queued pages into large appends and group-commits them, so one
    block at a time would wait a whole fsync interval per page. Gets go one at a time."""
    from kvstore.tiers.ssd import SsdTier

    page_bytes = len(work.page(0))
    defaults = SsdConfig()
    capacity = work.num_blocks * (page_bytes + 4096) + 2 * defaults.segment_bytes
    puts, gets = [], []
    for _ in range(repeat):
        scratch = Path(tempfile.mkdtemp(prefix="kvstore-bench-ssd-", dir=directory))
        tier = SsdTier(SsdConfig(path=str(scratch), capacity_bytes=capacity,
                                 persist_on_close=False))
        try:
            await tier.open()
            try:
                # force: skip the admission filter, which would refuse first sightings.
                puts.append(await _put_pass(work, functools.partial(tier.write, force=True),
                                            tier.name, queue_depth))
                gets.append(await _get_pass(work, tier, ring))
                _check_ring(work, ring, tier.name)
            finally:
                await tier.close()
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return Measurement(work.num_bytes, tuple(puts)), Measurement(work.num_bytes, tuple(gets))


def _run_dd(args: list[str]) -> tuple[int, float]:
    """Run ``dd`` and return (bytes, seconds) from its own summary line."""
    proc = subprocess.run(["dd", *args], capture_output=True, text=True,
                          env={**os.environ, "LC_ALL": "C"}, check=False)
    match = _DD_RESULT.search(proc.stderr)
    if proc.returncode != 0 or match is None:
        last = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise KVStoreError(f"dd {' '.join(args)} failed: {last[0]}")
    return int(match.group(1)), float(match.group(2))


def dd_baseline(directory: Path, num_blocks: int, repeat: int
                ) -> tuple[Measurement, Measurement]:
    """``dd`` O_DIRECT write then read of ``num_blocks`` x 2 MiB in ``directory``."""
    if shutil.which("dd") is None:
        raise KVStoreError("dd is not installed; it is the SSD baseline")
    target = directory / f".kvstore-bench-dd-{os.getpid()}.bin"
    bs = f"bs={BLOCK_BYTES}"
    writes, reads, num_bytes = [], [], num_blocks * BLOCK_BYTES
    try:
        for _ in range(repeat):
            nbytes, seconds = _run_dd(["if=/dev/zero", f"of={target}", bs, f"count={num_blocks}",
                                       "oflag=direct"])
            writes.append(seconds)
            nbytes, seconds = _run_dd([f"if={target}", "of=/dev/null", bs, "iflag=direct"])
            reads.append(seconds)
            num_bytes = nbytes
    finally:
        target.unlink(missing_ok=True)
    return Measurement(num_bytes, tuple(writes)), Measurement(num_bytes, tuple(reads))


def _row(path: str, op: str, measured: Measurement, baseline: str,
         base: Measurement | None, queue_depth: int) -> dict[str, object]:
    gbps = measured.best_gbps
    base_gbps = base.best_gbps if base is not None else None
    ratio = gbps / base_gbps if base_gbps else None
    target = TARGETS.get((path, op))
    return {
        "path": path, "op": op, "queue_depth": queue_depth, "gbps": gbps, "baseline": baseline,
        "baseline_gbps": base_gbps, "ratio": ratio, "target_ratio": target,
        "meets_target": None if target is None or ratio is None else ratio >= target,
        "first_pass_gbps": measured.first_gbps, "bytes": measured.num_bytes,
        "seconds": list(measured.seconds),
        "baseline_seconds": list(base.seconds) if base is not None else None,
    }


COLUMNS = (
    Column("path", "path", justify="left"),
    Column("op", "op", justify="left"),
    Column("queue_depth", "qd"),
    Column("gbps", "GB/s"),
    Column("baseline", "baseline", justify="left"),
    Column("baseline_gbps", "baseline GB/s"),
    Column("ratio", "ratio"),
    Column("target_ratio", "target"),
    Column("meets_target", "meets"),
)


def run_tier_bench(total_bytes: int = 1 << 30, ssd_path: str | os.PathLike[str] | None = None,
                   tiers: tuple[str, ...] = TIERS, repeat: int = 3,
                   queue_depth: int = SSD_QUEUE_DEPTH) -> BenchReport:
    """Measure the DRAM and SSD tiers and their baselines in one run.

    Args:
        total_bytes: bytes each pass moves (rounded down to whole 2 MiB blocks).
        ssd_path: directory for the SSD tier and ``dd`` (default: the configured SSD path).
        tiers: which of ``("dram", "ssd")`` to run.
        repeat: passes per measurement; the table shows the best, the JSON every pass.
        queue_depth: SSD puts in flight; DRAM puts and all gets go one block at a time, as the
            store's loops do.

    Returns:
        The report (rows: path, op, GB/s, baseline, baseline GB/s, ratio, target).
    """
    num_blocks = total_bytes // BLOCK_BYTES
    if num_blocks < 1:
        raise InvalidArgument(f"total bytes must be at least one {BLOCK_BYTES}-byte block, "
                              f"got {total_bytes}")
    if repeat < 1:
        raise InvalidArgument(f"repeat must be >= 1, got {repeat}")
    if not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
        raise InvalidArgument(f"queue depth must be in [1, {MAX_QUEUE_DEPTH}], got {queue_depth}")
    unknown = set(tiers) - set(TIERS)
    if unknown or not tiers:
        raise InvalidArgument(f"tiers must be among {TIERS}, got {list(tiers)}")
    directory = Path(ssd_path if ssd_path is not None else SsdConfig().path)
    work, ring = make_workload(num_blocks), _ring()
    rows: list[dict[str, object]] = []
    notes: list[str] = []
    if "dram" in tiers:
        memcpy = memcpy_baseline(work, repeat)
        put, get = asyncio.run(bench_dram(work, ring, repeat))
        rows += [_row("dram", "put", put, "memcpy", memcpy, 1),
                 _row("dram", "get", get, "memcpy", memcpy, 1)]
    if "ssd" in tiers:
        directory.mkdir(parents=True, exist_ok=True)
        dd_write = dd_read = None
        try:
            dd_write, dd_read = dd_baseline(directory, num_blocks, repeat)
        except KVStoreError as exc:
            notes.append(f"no SSD baseline: {exc}")
        put, get = asyncio.run(bench_ssd(work, ring, directory, repeat, queue_depth))
        rows += [_row("ssd", "put", put, "dd oflag=direct", dd_write, queue_depth),
                 _row("ssd", "get", get, "dd iflag=direct", dd_read, 1)]
    params = {"total_bytes": work.num_bytes, "block_bytes": BLOCK_BYTES,
              "num_blocks": num_blocks, "repeat": repeat, "ssd_put_queue_depth": queue_depth,
              "spec": BENCH_SPEC.to_dict(),
              "ssd_path": str(directory) if "ssd" in tiers else None, "codec": work.codec.name}
    return BenchReport(name="tiers", title=f"tier throughput, {num_blocks} x 2 MiB blocks, "
                       f"best of {repeat}", columns=COLUMNS, rows=tuple(rows), params=params,
                       notes=tuple(notes))
