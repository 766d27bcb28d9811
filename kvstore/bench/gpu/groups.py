"""``kvstore bench gpu`` rows for the cache groups' kernels: MLA latents (bf16 through the
engine kernels, fp8 as bytes), fp8 pass-through of a dense cache, and state snapshot copies.

Each path moves a batch between device pages (a pool) and engine memory, loads and saves, and
is checked bit for bit before it is timed; its rate (bytes read plus written) is a ratio to a
plain device copy of the same bytes measured in the same run. On a GPU the shapes are the
models' (DeepSeek-V3's latent: 61 layers of 576 per token in 64-token blocks; Llama-8B's
cache: 32 layers, 8 heads of 128, 16-token blocks; Qwen3-Next's gated-delta-net state: 36
layers of a [32, 128, 128] float32 state and a [8192, 3] bf16 conv state); on the CPU (Triton's
interpreter) they are tiny, so CI checks the rows run and the paths are exact, nothing more.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstore.bench.gpu.rig import COLUMNS, aligned
from kvstore.bench.report import BenchReport
from kvstore.codecs.device import device_layout
from kvstore.codecs.triton.engine import from_engine, to_engine
from kvstore.codecs.triton.state import StateLayout, load_states, save_states
from kvstore.errors import KVStoreError
from kvstore.groups import CacheGroup
from kvstore.spec import EngineLayout, KVSpec


@dataclass(frozen=True, slots=True)
class Shapes:
    """The geometry of each path: full size on a GPU, tiny in the interpreter."""

    mla_layers: int
    mla_block: int
    dense: KVSpec
    state: CacheGroup
    state_block: int


GPU_SHAPES = Shapes(61, 64, KVSpec(32, 8, 128, 16, dtype="uint8"),
                    CacheGroup.state(36, {"conv": ((8192, 3), "bfloat16"),
                                          "ssm": ((32, 128, 128), "float32")}, name="gdn"), 64)
CPU_SHAPES = Shapes(2, 16, KVSpec(2, 2, 32, 16, dtype="uint8"),
                    CacheGroup.state(2, {"conv": ((16, 3), "bfloat16"),
                                         "ssm": ((2, 8, 8), "float32")}, name="gdn"), 16)
NOTE = ("each path moves its bytes between device pages and engine memory, checked bit for bit "
        "first; ratio: bytes read + written per second over a device copy's, same run")
LATENT = 576  # DeepSeek-V3: kv_lora_rank 512 + qk_rope_head_dim 64


def timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """Median ms of a callable: device events on a GPU, the wall clock in the interpreter."""
    if device.type == "cuda":
        from kvstore.bench.gpu.rig import bench_ms

        return bench_ms

    def wall_ms(fn: Callable[[], None]) -> float:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return wall_ms


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if dtype.itemsize == 1:
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device).view(dtype)
    return torch.randn(shape, device=device).to(dtype)


def _paged_rows(name: str, layout: EngineLayout, spec: KVSpec, n: int, ms, copy_gbps: float,
                ids: torch.Tensor) -> list[dict]:
    """Load and save rows of one engine cache through raw device pages, checked first."""
    dev = device_layout("raw", spec)
    pool = aligned(n * dev.nbytes, layout.device)
    addrs = torch.arange(n, dtype=torch.int64) * dev.nbytes + pool.data_ptr()
    want = [_picked(t, ids) for t in layout.tensors]
    from_engine(layout, dev, addrs, ids)
    for t in layout.tensors:
        t.view(torch.uint8).fill_(0xFF)
    to_engine(layout, dev, addrs, ids)
    _sync(layout.device)
    if any(not torch.equal(before, _picked(t, ids)) for before, t in zip(want, layout.tensors)):
        raise KVStoreError(f"bench gpu: {name} did not round-trip bit for bit")
    moved = 2 * n * spec.block_bytes  # every page byte is read once and written once
    load = ms(lambda: to_engine(layout, dev, addrs, ids))
    save = ms(lambda: from_engine(layout, dev, addrs, ids))
    return [_row(f"HBM pool -> engine, {name}", load, moved, copy_gbps),
            _row(f"engine -> HBM pool, {name} (save)", save, moved, copy_gbps)]


def _picked(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The bytes of engine pages ``ids`` of one layer's tensor (block dim first here)."""
    return t.view(torch.uint8).index_select(0, ids.to(t.device)).cpu()


def _row(path: str, ms: float, nbytes: float, copy_gbps: float) -> dict:
    gbps = nbytes / (ms * 1e6)
    return {"section": "groups", "path": path, "codec": "raw", "ms": ms, "gbps": gbps,
            "ceiling": "device copy", "ceiling_gbps": copy_gbps, "ratio": gbps / copy_gbps,
            "aim": ">= 0.90 of copy"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def group_rows(device: torch.device, total_bytes: int) -> list[dict]:
    """The rows (see the module docstring), each path moving about ``total_bytes`` a pass;
    the first row is the device copy they are measured against."""
    shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    ms = timer(device)
    copy = _copy_ms(ms, total_bytes, device)
    copy_gbps = 2 * total_bytes / (copy * 1e6)
    rows = [{**_row("device copy (read + write)", copy, 2 * total_bytes, copy_gbps),
             "aim": "", "codec": "-"}]

    # vLLM's MLA cache [num_blocks, block_size, 576]: bf16 as the fused_nhd layout of one
    # head (vllm_kernels.MLA_LAYOUT), fp8 bytes as flashinfer halves (MLA_FP8_LAYOUT).
    for dtype, label in ((torch.bfloat16, "MLA latent bf16"), (torch.uint8, "MLA latent fp8")):
        spec = KVSpec(shapes.mla_layers, 1, LATENT // 2, shapes.mla_block,
                      dtype="bfloat16" if dtype == torch.bfloat16 else "uint8")
        n = max(2, total_bytes // spec.block_bytes)
        caches = [_random((2 * n, shapes.mla_block, LATENT), dtype, device)
                  for _ in range(shapes.mla_layers)]
        if dtype == torch.bfloat16:
            layout = EngineLayout.of([t.unsqueeze(2) for t in caches], spec, "fused_nhd")
        else:
            halves = [t.view(2 * n, 2, shapes.mla_block, 1, LATENT // 2) for t in caches]
            layout = EngineLayout.of(halves, spec, "flashinfer")
        ids = torch.randperm(2 * n)[:n]
        rows += _paged_rows(label, layout, spec, n, ms, copy_gbps, ids)
        del caches, layout

    # A dense fp8 cache in vLLM's CUDA layout (logical [B, H, N, 2D] over NHD memory).
    spec = shapes.dense
    n = max(2, total_bytes // spec.block_bytes)
    memory = (2 * n, spec.block_tokens, spec.num_kv_heads, 2 * spec.head_dim)
    caches = [_random(memory, torch.uint8, device).permute(0, 2, 1, 3)
              for _ in range(spec.num_layers)]
    layout = EngineLayout.of(caches, spec, "fused_hnd")
    rows += _paged_rows("fp8 pass-through", layout, spec, n, ms, copy_gbps,
                        torch.randperm(2 * n)[:n])
    del caches, layout
    rows += _state_rows(shapes, device, total_bytes, ms, copy_gbps)
    return rows


def _copy_ms(ms, nbytes: int, device: torch.device) -> float:
    """The ceiling: a plain device-to-device copy of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return ms(lambda: dst.copy_(src))


def _state_rows(shapes: Shapes, device: torch.device, total_bytes: int, ms,
                copy_gbps: float) -> list[dict]:
    group, bt = shapes.state, shapes.state_block
    per_slot = group.block_bytes_per_layer(bt) * group.num_layers
    n = max(2, total_bytes // per_slot)
    states = [{p.name: _random((2 * n, *p.shape), p.torch_dtype, device) for p in group.parts}
              for _ in range(group.num_layers)]
    layout = StateLayout.of(group, bt, states)
    page = -(-layout.page_bytes // 256) * 256
    pool = aligned(n * page, device)
    addrs = torch.arange(n, dtype=torch.int64) * page + pool.data_ptr()
    slots = torch.randperm(2 * n)[:n]
    want = [{k: _bytes_of(v[slots]) for k, v in layer.items()} for layer in states]
    save_states(layout, addrs, slots)
    for layer in states:
        for t in layer.values():
            t.view(torch.uint8).fill_(0xFF)
    load_states(layout, addrs, slots)
    _sync(device)
    for before, layer in zip(want, states):
        if any(not torch.equal(before[k], _bytes_of(v[slots])) for k, v in layer.items()):
            raise KVStoreError("bench gpu: state snapshots did not round-trip bit for bit")
    moved = 2 * n * per_slot
    load = ms(lambda: load_states(layout, addrs, slots))
    save = ms(lambda: save_states(layout, addrs, slots))
    return [_row("state pages -> engine slots", load, moved, copy_gbps),
            _row("engine slots -> state pages (snapshot)", save, moved, copy_gbps)]


def run_group_bench(*, total_bytes: int = 1 << 30, quick: bool = False) -> BenchReport:
    """The group rows alone: on CUDA, or on the CPU through Triton's interpreter (tiny
    sizes; ``total_bytes`` is capped at 64 KiB there)."""
    from kvstore.codecs.triton.common import kernels_runnable

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    if not kernels_runnable(device):
        raise KVStoreError("kvstore bench gpu --groups needs CUDA, or TRITON_INTERPRET=1 to "
                           "run the kernels on the CPU")
    if device.type == "cpu":
        total_bytes = min(total_bytes, 64 << 10)
    elif quick:
        total_bytes = min(total_bytes, 256 << 20)
    rows = group_rows(device, total_bytes)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, interpreter"
    return BenchReport(name="gpu-groups", title=f"Cache-group kernels ({name})", columns=COLUMNS,
                       rows=tuple(rows), params={"total_bytes": total_bytes,
                                                 "device": device.type},
                       notes=(NOTE,),
                       section_key="section")
