"""fp8 engine caches (one-byte elements) through the engine kernels: raw pages are the cache's
bytes in the canonical order, bit for bit, both ways; lossy codecs are refused by name. On the
CPU through Triton's interpreter, on CUDA when there is one."""

from __future__ import annotations

import pytest
import torch

from kvstore.codecs.device import SECTION_ALIGN, device_layout
from kvstore.codecs.triton.common import kernels_runnable
from kvstore.codecs.triton.engine import from_engine, page_tensors, to_engine
from kvstore.codecs.triton.passthrough import plan_rows
from kvstore.errors import CodecError, InvalidArgument
from kvstore.spec import ENGINE_LAYOUTS, EngineLayout, KVSpec

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernels_runnable(DEVICE),
                                reason="needs CUDA or TRITON_INTERPRET=1")
NUM_PAGES = 7
SENTINEL = 0xA5
FP8 = [torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2]


def spec_of(head_dim: int = 32) -> KVSpec:
    return KVSpec(num_layers=2, num_kv_heads=2, head_dim=head_dim, block_tokens=4, dtype="uint8")


def byte_cache(name: str, spec: KVSpec, dtype: torch.dtype, fill: int | None = None):
    """Per-layer tensors of layout ``name``: random bytes (every bit pattern, NaNs of both
    fp8 flavours included), or ``fill`` everywhere."""
    sizes = {"kv": 2, "block": NUM_PAGES, "token": spec.block_tokens,
             "head": spec.num_kv_heads, "dim": spec.head_dim, "kvdim": 2 * spec.head_dim}
    shape = [sizes[r] for r in ENGINE_LAYOUTS[name]]
    out = []
    for _ in range(spec.num_layers):
        raw = torch.full(shape, fill, dtype=torch.uint8) if fill is not None else \
            torch.randint(0, 256, shape, dtype=torch.uint8)
        out.append(raw.to(DEVICE).view(dtype))
    return out


def pool_of(nbytes: int) -> tuple[torch.Tensor, int]:
    raw = torch.zeros(nbytes + SECTION_ALIGN, dtype=torch.uint8, device=DEVICE)
    pad = -raw.data_ptr() % SECTION_ALIGN
    return raw[pad:pad + nbytes], raw.data_ptr() + pad


def canonical(layout: EngineLayout, page: int) -> torch.Tensor:
    """The [L, 2, bt, H, D] bytes of engine page ``page`` (torch reference)."""
    return torch.stack([torch.stack([x.view(torch.uint8) for x in layout.block_view(layer, page)])
                        for layer in range(layout.num_layers)])


@pytest.mark.parametrize("name", sorted(ENGINE_LAYOUTS))
@pytest.mark.parametrize("dtype", FP8)
def test_fp8_pages_round_trip_bit_exact(name, dtype):
    spec = spec_of()
    src = EngineLayout.of(byte_cache(name, spec, dtype), spec, name)
    assert src.is_bytes and src.dtype == dtype
    dev = device_layout("raw", spec)
    n = 4
    pool, base = pool_of(n * dev.nbytes)
    src_ids = [5, 0, 3, 6]
    addrs = [base + i * dev.nbytes for i in (2, 0, 3, 1)]
    from_engine(src, dev, addrs, src_ids)
    for addr, page in zip(addrs, src_ids):
        got = page_tensors(pool, dev, addr - base)[0]
        assert torch.equal(got, canonical(src, page))  # the cache's bytes, canonical order
    dst = EngineLayout.of(byte_cache(name, spec, dtype, SENTINEL), spec, name)
    dst_ids = [1, 4, 2, 0]
    to_engine(dst, dev, addrs, dst_ids)
    for a, b in zip(src_ids, dst_ids):
        assert torch.equal(canonical(dst, b), canonical(src, a))
    for page in (3, 5, 6):  # pages outside the load keep the sentinel
        assert bool((canonical(dst, page) == SENTINEL).all())


def test_layer_runs_and_odd_row_widths_move_only_their_bytes():
    """Rows of 6 bytes (int16 words) and a load of layer 1 only."""
    spec = spec_of(head_dim=6)
    src = EngineLayout.of(byte_cache("flash_hnd", spec, torch.uint8), spec)
    assert plan_rows(src).word == 2
    dev = device_layout("raw", spec)
    _pool, base = pool_of(2 * dev.nbytes)  # kept alive while the kernels use it
    addrs = [base, base + dev.nbytes]
    from_engine(src, dev, addrs, [2, 5])
    dst = EngineLayout.of(byte_cache("flash_hnd", spec, torch.uint8, SENTINEL), spec)
    to_engine(dst, dev, addrs, [0, 1], layers=range(1, 2))
    assert torch.equal(canonical(dst, 0)[1], canonical(src, 2)[1])
    assert bool((canonical(dst, 0)[0] == SENTINEL).all())


def test_a_contiguous_slab_is_cut_into_wide_rows():
    """vLLM's fp8 MLA cache seen as [nb, 2, bs, 1, 288]: each (layer, half) slab is one run."""
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=288, block_tokens=16, dtype="uint8")
    caches = [torch.randint(0, 256, (NUM_PAGES, 16, 576), dtype=torch.uint8, device=DEVICE)
              for _ in range(2)]
    views = [t.view(NUM_PAGES, 2, 16, 1, 288) for t in caches]
    layout = EngineLayout.of(views, spec, "flashinfer")
    plan = plan_rows(layout)
    assert (plan.heads, plan.rows, plan.word, plan.aligned) == (1, 16 * 288 // 256, 8, True)
    dev = device_layout("raw", spec)
    pool, base = pool_of(dev.nbytes)
    from_engine(layout, dev, [base], [4])
    page = page_tensors(pool, dev, 0)[0]
    assert torch.equal(page.reshape(2, -1), torch.stack([t[4].reshape(-1) for t in caches]))


@pytest.mark.parametrize("codec", ["fp8_e4m3", "nvfp4"])
def test_lossy_codecs_on_fp8_pages_are_refused_by_name(codec):
    spec = spec_of()
    layout = EngineLayout.of(byte_cache("flash", spec, torch.float8_e4m3fn), spec)
    dev = device_layout(codec, spec)
    _pool, base = pool_of(dev.nbytes)
    for move in (from_engine, to_engine):
        with pytest.raises(CodecError, match=f"codec {codec} .*torch.float8_e4m3fn"):
            move(layout, dev, [base], [0])


def test_an_fp8_cache_needs_a_uint8_spec():
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=4)
    with pytest.raises(InvalidArgument, match="spec's dtype must be uint8"):
        EngineLayout.of(byte_cache("flash", spec, torch.float8_e5m2), spec)
