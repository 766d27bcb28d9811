"""Engine kernels (device pages <-> an engine's paged cache) against torch references, on the
CPU through Triton's interpreter and on CUDA when there is one."""

from __future__ import annotations

import pytest
import torch

from kvstore.codecs.device import SECTION_ALIGN, device_layout
from kvstore.codecs.fp8 import decode_fp8_reference, encode_fp8_reference
from kvstore.codecs.parts import Fp8Parts
from kvstore.codecs.triton.common import kernels_runnable
from kvstore.errors import CodecError, InvalidArgument
from kvstore.spec import ENGINE_LAYOUTS, EngineLayout, KVSpec

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernels_runnable(DEVICE),
                                reason="needs CUDA or TRITON_INTERPRET=1")
NUM_PAGES = 9


def engine_cache(name: str, spec: KVSpec, dtype: torch.dtype, fused: bool):
    """Per-layer tensors (or one fused tensor) of layout ``name``, poisoned with NaN."""
    sizes = {"kv": 2, "block": NUM_PAGES, "token": spec.block_tokens,
             "head": spec.num_kv_heads, "dim": spec.head_dim, "kvdim": 2 * spec.head_dim}
    shape = [sizes[r] for r in ENGINE_LAYOUTS[name]]
    if fused:
        return torch.full([spec.num_layers, *shape], float("nan"), dtype=dtype, device=DEVICE)
    return [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
            for _ in range(spec.num_layers)]


def aligned_pool(nbytes: int) -> tuple[torch.Tensor, int]:
    raw = torch.empty(nbytes + SECTION_ALIGN, dtype=torch.uint8, device=DEVICE)
    pad = -raw.data_ptr() % SECTION_ALIGN
    return raw[pad:pad + nbytes], raw.data_ptr() + pad


def read_block(layout: EngineLayout, page: int) -> torch.Tensor:
    """The canonical [L, 2, bt, H, D] block held in engine page ``page`` (torch reference)."""
    out = []
    for layer in range(layout.num_layers):
        k, v = layout.block_view(layer, page)
        out.append(torch.stack([k, v]))
    return torch.stack(out)


def assert_decoded(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-exact on a GPU; within one ulp in the interpreter, which truncates float32 to
    bf16/fp16 where torch rounds to nearest even."""
    if DEVICE.type == "cuda":
        assert torch.equal(got, want)
    else:
        ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 1


def spec_of(dtype: torch.dtype) -> KVSpec:
    return KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_tokens=4, dtype=dtype)


@pytest.mark.parametrize("name", sorted(ENGINE_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codec", ["raw", "fp8_e4m3"])
def test_round_trip_through_device_pages(name, dtype, codec):
    from kvstore.codecs.triton.engine import from_engine, page_tensors, to_engine

    spec = spec_of(dtype)
    fused = name in ("flash", "fused_hnd")
    src_cache = engine_cache(name, spec, dtype, fused)
    src = EngineLayout.of(src_cache, spec)
    assert src.name == name
    for t in src.tensors:
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(dtype))
    dev = device_layout(codec, spec)
    n = 5
    pool, base = aligned_pool(n * dev.nbytes)
    src_ids = torch.randperm(NUM_PAGES)[:n].tolist()
    slots = torch.randperm(n).tolist()
    addrs = [base + s * dev.nbytes for s in slots]
    from_engine(src, dev, addrs, src_ids)

    # The device pages hold exactly the reference encoding of each block.
    for i, page in enumerate(src_ids):
        block = read_block(src, page)
        got = page_tensors(pool, dev, slots[i] * dev.nbytes)
        if codec == "raw":
            assert torch.equal(got[0].view(torch.int16), block.contiguous().view(torch.int16))
        else:
            ref = encode_fp8_reference(block.cpu())
            assert torch.equal(got[0].cpu(), ref.codes)
            assert torch.equal(got[1].cpu().view(torch.int16), ref.scales.view(torch.int16))

    dst_cache = engine_cache(name, spec, dtype, fused)
    dst = EngineLayout.of(dst_cache, spec)
    dst_ids = torch.randperm(NUM_PAGES)[:n].tolist()
    to_engine(dst, dev, addrs, dst_ids)
    for i, page in enumerate(dst_ids):
        got = read_block(dst, page)
        want = read_block(src, src_ids[i])
        assert not torch.isnan(got).any(), "every element of a loaded page is written"
        if codec == "raw":
            assert torch.equal(got, want)
        else:
            parts = Fp8Parts(*(t.cpu() for t in page_tensors(pool, dev, slots[i] * dev.nbytes)))
            assert_decoded(got.cpu(), decode_fp8_reference(parts, dtype))
            rel = (got.float() - want.float()).norm() / want.float().norm()
            assert rel < 0.05
    untouched = [p for p in range(NUM_PAGES) if p not in dst_ids]
    for page in untouched:
        assert torch.isnan(read_block(dst, page)).all(), "other pages are left alone"
    wide = EngineLayout.of(engine_cache(name, spec, dtype, fused), spec)
    to_engine(wide, dev, addrs, dst_ids, host=True)  # the wide loads for host pages
    for page in dst_ids:
        assert torch.equal(read_block(wide, page), read_block(dst, page))


def test_layout_is_read_from_strides_not_assumed():
    """An engine that permutes memory under the logical shape (vLLM's stride order)."""
    from kvstore.codecs.triton.engine import from_engine, to_engine

    spec = spec_of(torch.bfloat16)
    dev = device_layout("raw", spec)
    # Logical [2, nb, bt, H, D], memory ordered [nb, H, 2, bt, D].
    caches = [torch.randn(NUM_PAGES, spec.num_kv_heads, 2, spec.block_tokens, spec.head_dim,
                          device=DEVICE).to(torch.bfloat16).permute(2, 0, 3, 1, 4)
              for _ in range(spec.num_layers)]
    layout = EngineLayout.of(caches, spec)
    pool, base = aligned_pool(2 * dev.nbytes)
    from_engine(layout, dev, [base, base + dev.nbytes], [3, 7])
    got = pool[:dev.sections[0].nbytes].view(torch.bfloat16).view(spec.block_shape)
    want = torch.stack([torch.stack([c[0, 3], c[1, 3]]) for c in caches])
    assert torch.equal(got, want)
    out = [torch.full_like(c, float("nan")) for c in caches]
    to_engine(EngineLayout.of(out, spec), dev, [base + dev.nbytes], [0])
    assert torch.equal(torch.stack([torch.stack([c[0, 0], c[1, 0]]) for c in out]),
                       torch.stack([torch.stack([c[0, 7], c[1, 7]]) for c in caches]))


def test_bad_inputs_name_what_is_wrong():
    from kvstore.codecs.triton.engine import to_engine

    spec = spec_of(torch.bfloat16)
    caches = engine_cache("flash", spec, torch.bfloat16, fused=False)
    layout = EngineLayout.of(caches, spec)
    dev = device_layout("raw", spec)
    _pool, base = aligned_pool(dev.nbytes)  # kept alive: the kernels read its address
    with pytest.raises(InvalidArgument, match="block_ids span"):
        to_engine(layout, dev, [base], [NUM_PAGES])
    with pytest.raises(CodecError, match="aligned"):
        to_engine(layout, dev, [base + 2], [0])
    with pytest.raises(CodecError, match="addresses for"):
        to_engine(layout, dev, [base, base], [0])
    with pytest.raises(CodecError, match="do not fit"):
        to_engine(layout, device_layout("raw", spec_of(torch.float16)), [base], [0])
    with pytest.raises(CodecError, match="no device kernels"):
        device_layout("fp8_e4m3+zstd", spec)
    with pytest.raises(CodecError, match="multiple of 8"):  # KIVI codes go in units of eight
        device_layout("int4", KVSpec(num_layers=1, num_kv_heads=1, head_dim=12, block_tokens=4))
    with pytest.raises(InvalidArgument, match="layers"):
        EngineLayout.of(caches[:2], spec)
    with pytest.raises(InvalidArgument, match="matches no known layout"):
        EngineLayout.of([c[..., :8] for c in caches], spec)
    square = KVSpec(num_layers=1, num_kv_heads=4, head_dim=16, block_tokens=4)
    with pytest.raises(InvalidArgument, match="pass layout="):
        EngineLayout.of([torch.zeros(2, 3, 4, 4, 16, dtype=torch.bfloat16)], square)
    assert EngineLayout.of([torch.zeros(2, 3, 4, 4, 16, dtype=torch.bfloat16)], square,
                           layout="flash_hnd").head_stride == 64


@pytest.mark.parametrize("codec", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.bfloat16, 64), (torch.float16, 64),
                                                 (torch.bfloat16, 96)])
@pytest.mark.parametrize("host", [False, True])  # True: the wide loads for host pages
def test_fp4_pages_decode_into_the_engine(codec, dtype, head_dim, host):
    from kvstore.codecs.fp4 import (
        dequantize_reference,
        mxfp4_quantize_reference,
        nvfp4_quantize_reference,
    )
    from kvstore.codecs.parts import Fp4Parts
    from kvstore.codecs.triton.engine import page_tensors, to_engine

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=head_dim, block_tokens=4, dtype=dtype)
    dev = device_layout(codec, spec)
    quantize = nvfp4_quantize_reference if codec == "nvfp4" else mxfp4_quantize_reference
    n = 3
    pool, base = aligned_pool(n * dev.nbytes)
    # Magnitudes near the top and the bottom of the dtype's range too: block scales there must
    # neither overflow nor flush in the decode.
    big, small = (1e37, 1e-30) if dtype == torch.bfloat16 else (8e3, 1e-3)
    blocks = [(torch.randn(spec.block_shape) * m).to(dtype) for m in (1.0, big, small)]
    for i, block in enumerate(blocks):
        for view, section in zip(page_tensors(pool, dev, i * dev.nbytes),
                                 quantize(block).sections()):
            view.copy_(section.to(DEVICE))
    caches = engine_cache("flashinfer", spec, dtype, fused=False)
    layout = EngineLayout.of(caches, spec)
    ids = [4, 0, 7]
    to_engine(layout, dev, [base + i * dev.nbytes for i in range(n)], ids, host=host)
    for i, page in enumerate(ids):
        parts = Fp4Parts(*(t.cpu() for t in page_tensors(pool, dev, i * dev.nbytes)))
        assert_decoded(read_block(layout, page).cpu(), dequantize_reference(parts, dtype))


@pytest.mark.parametrize("codec", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("name", "dtype", "head_dim", "heads", "block_tokens"), [
    ("flashinfer", torch.bfloat16, 64, 2, 4),   # one chunk of rows, mostly masked
    ("flash", torch.float16, 96, 2, 4),         # fused; blocks of the padded head_dim masked
    ("flash_hnd", torch.bfloat16, 64, 4, 32),   # 128 rows: two chunks of a slab
])
def test_fp4_saves_encode_each_block_as_the_reference(codec, name, dtype, head_dim, heads,
                                                     block_tokens):
    """Engine pages encoded into nvfp4 / mxfp4 device pages are byte for byte the references'
    encoding of each block (nvfp4's tensor scale from that block's slab); a slab holding NaN
    marks its tensor scale (nvfp4) or its block's scale (mxfp4); the pages decode back."""
    from kvstore.codecs.fp4 import (
        dequantize_reference,
        mxfp4_quantize_reference,
        nvfp4_quantize_reference,
    )
    from kvstore.codecs.parts import E8M0_NAN, Fp4Parts
    from kvstore.codecs.triton.engine import from_engine, page_tensors, to_engine

    spec = KVSpec(num_layers=2, num_kv_heads=heads, head_dim=head_dim,
                  block_tokens=block_tokens, dtype=dtype)
    quantize = nvfp4_quantize_reference if codec == "nvfp4" else mxfp4_quantize_reference
    fused = name in ("flash", "fused_hnd")
    src = EngineLayout.of(engine_cache(name, spec, dtype, fused), spec)
    for t in src.tensors:
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(dtype))
    scales = {0: 1.0, 3: 1e30 if dtype == torch.bfloat16 else 1e3, 5: 1e-20 if
              dtype == torch.bfloat16 else 1e-3}
    for page, scale in scales.items():  # magnitudes near both ends of the dtype's range
        for layer in range(spec.num_layers):
            for half in src.block_view(layer, page):
                half.mul_(scale)
    k, _ = src.block_view(1, 6)
    k[0, 0, 3] = float("nan")  # page 6: layer 1's K slab holds a NaN
    dev = device_layout(codec, spec)
    ids = [3, 0, 5, 6, 8]
    pool, base = aligned_pool(len(ids) * dev.nbytes)
    addrs = [base + i * dev.nbytes for i in range(len(ids))]
    from_engine(src, dev, addrs, ids)
    for i, page in enumerate(ids):
        got = [t.cpu() for t in page_tensors(pool, dev, i * dev.nbytes)]
        want = quantize(read_block(src, page).cpu()).sections()
        if page == 6:
            if codec == "nvfp4":
                assert torch.isnan(got[2][1, 0]) and torch.isfinite(got[2][0]).all()
            else:
                assert int(got[1][1, 0, 0, 0, 0]) == E8M0_NAN
            continue
        for g, w in zip(got, want):
            assert torch.equal(g.view(torch.uint8), w.contiguous().view(torch.uint8))
    dst = EngineLayout.of(engine_cache(name, spec, dtype, fused), spec)
    to_engine(dst, dev, addrs[:3], [1, 2, 4])
    for i, page in enumerate([1, 2, 4]):
        parts = Fp4Parts(*(t.cpu() for t in page_tensors(pool, dev, i * dev.nbytes)))
        assert_decoded(read_block(dst, page).cpu(), dequantize_reference(parts, dtype))


def test_kivi_pages_are_not_encoded_by_the_engine_kernels():
    from kvstore.codecs.triton.engine import from_engine

    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=16, block_tokens=4)
    layout = EngineLayout.of(engine_cache("flashinfer", spec, torch.bfloat16, False), spec)
    dev = device_layout("int4", spec)
    _, base = aligned_pool(dev.nbytes)
    with pytest.raises(CodecError, match="do not encode"):
        from_engine(layout, dev, [base], [0])


@pytest.mark.parametrize("codec", ["int4", "int2"])
# 12: four K tokens kept whole; 4: V groups of 4 channels, fewer than a unit of codes
@pytest.mark.parametrize("block_tokens", [4, 8, 12])
@pytest.mark.parametrize("host", [False, True])
def test_kivi_pages_decode_into_the_engine(codec, block_tokens, host):
    from kvstore.codecs import kivi
    from kvstore.codecs.triton.engine import page_tensors, to_engine

    dtype = torch.float16 if block_tokens == 12 else torch.bfloat16
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=block_tokens,
                  dtype=dtype)
    dev = device_layout(codec, spec)
    bits = 4 if codec == "int4" else 2
    n = 3
    pool, base = aligned_pool(n * dev.nbytes)
    for i in range(n):
        block = torch.randn(spec.block_shape).to(dtype)
        parts = kivi.encode_kivi_reference(block, bits, dev.group_size)
        for view, section in zip(page_tensors(pool, dev, i * dev.nbytes), parts.tensors()):
            view.copy_(section.to(DEVICE))
    caches = engine_cache("fused_nhd", spec, dtype, fused=False)
    layout = EngineLayout.of(caches, spec)
    ids = [2, 8, 5]
    to_engine(layout, dev, [base + i * dev.nbytes for i in range(n)], ids, host=host)
    for i, page in enumerate(ids):
        views = [t.cpu() for t in page_tensors(pool, dev, i * dev.nbytes)]
        want = kivi.decode_kivi_reference(kivi.KiviParts(bits, dev.group_size, *views), dtype)
        got = read_block(layout, page).cpu()
        assert not torch.isnan(got).any()
        assert_decoded(got, want)


@pytest.mark.parametrize("codec", ["raw", "fp8_e4m3", "nvfp4", "int2"])
def test_tiles_spread_over_fewer_programs_decode_the_same(codec):
    """A load that runs several tiles a program (7 here, which the 60 tiles of the launch do
    not divide) writes every element exactly as one tile a program does."""
    from kvstore.codecs.triton.engine import from_engine, to_engine

    spec = spec_of(torch.bfloat16)
    dev = device_layout(codec, spec)
    n = 5
    pool, base = aligned_pool(n * dev.nbytes)
    addrs = [base + i * dev.nbytes for i in range(n)]
    src = EngineLayout.of(engine_cache("flash", spec, torch.bfloat16, fused=True), spec)
    for t in src.tensors:
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(torch.bfloat16))
    if codec in ("raw", "fp8_e4m3", "nvfp4"):
        from_engine(src, dev, addrs, [0, 1, 2, 3, 4])
    else:
        from kvstore.codecs import kivi
        from kvstore.codecs.triton.engine import page_tensors

        for i in range(n):
            parts = kivi.encode_kivi_reference(read_block(src, i).cpu(), 2, dev.group_size)
            for view, section in zip(page_tensors(pool, dev, i * dev.nbytes), parts.tensors()):
                view.copy_(section.to(DEVICE))
    ids = [6, 2, 8, 0, 4]
    one, spread = (EngineLayout.of(engine_cache("flash", spec, torch.bfloat16, fused=True),
                                   spec) for _ in range(2))
    to_engine(one, dev, addrs, ids, tile=(4, 1))
    to_engine(spread, dev, addrs, ids, tile=(4, 1, 7))
    for page in range(NUM_PAGES):
        got, want = read_block(spread, page), read_block(one, page)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert not any(read_block(spread, page).isnan().any() for page in ids)


def test_device_pools_take_exactly_the_codecs_the_kernels_encode():
    from kvstore.codecs.device import ENCODABLE
    from kvstore.config import HBM_CODECS, HbmConfig
    from kvstore.errors import ConfigError

    assert HBM_CODECS == ENCODABLE
    assert HbmConfig(codec="nvfp4", device="cpu").codec == "nvfp4"
    with pytest.raises(ConfigError, match="hbm.codec must be one of"):
        HbmConfig(codec="int4", device="cpu")
