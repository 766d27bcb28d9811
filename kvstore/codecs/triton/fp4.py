"""Triton kernels of the nvfp4 and mxfp4 codecs: encode, decode, paged decode and a benchmark.

The kernels produce the bytes of the torch references in ``kvstore.codecs.fp4`` exactly. Every
rounding step is explicit integer or correctly rounded float arithmetic (``div_rn``, products,
comparisons), because Triton's interpreter rounds float32 -> float8e4nv and float32 -> bf16 casts
differently from the GPU (DESIGN.md, "Pitfalls already measured").
"""

from __future__ import annotations

import torch

from kvstore.codecs.fp4 import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_SCALE,
    E8M0_NAN,
    MX_BLOCK,
    NV_BLOCK,
    TENSOR_SCALE_MIN,
    Fp4Parts,
)
from kvstore.codecs.triton.common import (
    check_paged_target,
    check_same_device,
    check_tensor,
    copy_gbps,
    on_device,
    tl,
    triton,
)
from kvstore.errors import CodecError

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Tuned on an NVIDIA H200 (triton 3.6): blocks per program and warps of each kernel.
ENCODE_CHUNK_BYTES = 16 << 20  # slices encoded per amax + encode pair: well inside 60 MB L2
AMAX_ELEMENTS = 8192  # elements per program of the slice-amax pass
AMAX_WARPS = 8
ENCODE_GROUPS = {NV_BLOCK: 64, MX_BLOCK: 32}  # scale blocks per encode program
ENCODE_WARPS = 4
DECODE_GROUPS = {NV_BLOCK: 128, MX_BLOCK: 64}  # scale blocks per decode program
DECODE_WARPS = 4
_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# jit functions may only read module globals that are constexpr.
_SCALE_MIN = tl.constexpr(E4M3_MIN_SCALE)
_SCALE_MAX = tl.constexpr(E4M3_MAX)
_E2M1_MAX = tl.constexpr(E2M1_MAX)
_NAN_SCALE = tl.constexpr(E8M0_NAN)
_AMAX_TO_SCALE = tl.constexpr(E4M3_MAX * E2M1_MAX)
_TS_MIN = tl.constexpr(TENSOR_SCALE_MIN)


@triton.jit
def _slice_amax_kernel(x_ptr, amax_ptr, slice_numel, chunks_per_slice, ELEMENTS: tl.constexpr):
    """amax_ptr: int32 view of float32 [num_slices], zeroed; NaN counts as +inf."""
    pid = tl.program_id(0)
    slice_id = pid // chunks_per_slice
    offs = (pid % chunks_per_slice).to(tl.int64) * ELEMENTS + tl.arange(0, ELEMENTS)
    x = tl.load(x_ptr + slice_id.to(tl.int64) * slice_numel + offs, mask=offs < slice_numel,
                other=0.0).to(tl.float32)
    ax = tl.abs(x)
    ax = tl.where(ax <= float("inf"), ax, float("inf"))  # only NaN fails <= inf
    # Non-negative floats order like their int32 bits, so an integer atomic max is exact.
    tl.atomic_max(amax_ptr + slice_id, tl.max(ax, axis=0).to(tl.int32, bitcast=True))


@triton.jit
def _pow2(exponent):
    """float32 2^exponent for int32 exponents in the normal range."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_round(s):
    """e4m3fn byte and value of float32 s in [2^-9, 448], rounded to nearest even in integers."""
    bits = s.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    quantum = tl.maximum(exponent, -6) - 3  # log2 of the e4m3 step at s (subnormal below 2^-6)
    shift = 23 + quantum - exponent  # 20..23
    full = (bits & 0x7FFFFF) | 0x800000
    steps = (full + (1 << (shift - 1)) - 1 + ((full >> shift) & 1)) >> shift  # 1..16
    # 8 * (quantum + 9) + steps is the byte: a carry to 16 steps lands in the next exponent.
    return 8 * quantum + 72 + steps, steps.to(tl.float32) * _pow2(quantum)


@triton.jit
def _e4m3_value(byte):
    """float32 value of e4m3fn bytes 0..0x7E."""
    exponent = (byte >> 3) & 15
    mantissa = byte & 7
    steps = tl.where(exponent == 0, mantissa, mantissa + 8)
    return steps.to(tl.float32) * _pow2(tl.maximum(exponent, 1) - 10)


@triton.jit
def _nv_scales(block_amax, ts):
    """e4m3 block-scale byte and 1 / dequantisation scale, as nvfp4_quantize_reference."""
    s = tl.math.div_rn(block_amax, ts * _E2M1_MAX)
    s = tl.minimum(tl.maximum(s, _SCALE_MIN), _SCALE_MAX)
    byte, value = _e4m3_round(s)
    dequant = value * ts
    return byte, tl.math.div_rn(tl.full(dequant.shape, 1.0, tl.float32), dequant)


@triton.jit
def _mx_scales(block_amax):
    """e8m0 byte 2^(floor(log2 amax) - 2) and its exact inverse; NaN byte for a non-finite block."""
    biased = (block_amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    byte = tl.maximum(biased - 2, 0)
    byte = tl.where(block_amax == float("inf"), _NAN_SCALE, byte)
    inverse = ((254 - tl.minimum(byte, 254)) << 23).to(tl.float32, bitcast=True)
    return byte, inverse


@triton.jit
def _e2m1_code(x, inv_scale):
    """Signed e2m1 codes of x * inv_scale (ties to even mantissa, saturating, no -0)."""
    mag = tl.abs(x) * inv_scale
    code = (mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
    code += (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
    code += (mag > 5.0).to(tl.int32)
    return tl.where((x < 0) & (code != 0), code | 8, code)


@triton.jit
def _e2m1_value(code):
    """float32 value of signed e2m1 codes: 2 * |value| = m, or (2 + m) << (e - 1)."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    twice = tl.where(exponent == 0, mantissa, (2 + mantissa) << tl.maximum(exponent - 1, 0))
    magnitude = twice.to(tl.float32) * 0.5
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _store_as(ptr, value, mask, OUT_KIND: tl.constexpr):
    """Store float32 ``value`` as float32 (0), bf16 (1, nearest even in integers) or fp16 (2)."""
    if OUT_KIND == 1:
        bits = value.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        tl.store(ptr, (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
    elif OUT_KIND == 2:
        tl.store(ptr, value.to(tl.float16), mask=mask)
    else:
        tl.store(ptr, value, mask=mask)


@triton.jit
def _encode_kernel(x_ptr, amax_ptr, ts_ptr, packed_ptr, scales_ptr, num_groups,
                   groups_per_slice, BLOCK: tl.constexpr, GROUPS: tl.constexpr,
                   IS_NV: tl.constexpr):
    """One program quantises GROUPS consecutive BLOCK-element scale blocks (nvfp4: amax_ptr
    holds the float32 amax of each slice, ts_ptr receives the tensor scales)."""
    group = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    live = group < num_groups
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + group[:, None] * BLOCK + cols[None, :], mask=live[:, None],
                other=0.0).to(tl.float32)
    ax = tl.abs(x)
    block_amax = tl.max(tl.where(ax <= float("inf"), ax, float("inf")), axis=1)
    if IS_NV:
        # The tensor scale of nvfp4_tensor_scales, from the slice amax; each slice's first
        # group stores it.
        slice_id = group // groups_per_slice
        amax = tl.load(amax_ptr + slice_id, mask=live, other=1.0)
        ts = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, _AMAX_TO_SCALE, tl.float32)),
                        _TS_MIN)
        tl.store(ts_ptr + slice_id, ts, mask=live & (group % groups_per_slice == 0))
        byte, inv_scale = _nv_scales(block_amax, ts)
    else:
        byte, inv_scale = _mx_scales(block_amax)
    code = _e2m1_code(x, inv_scale[:, None])
    low, high = tl.split(tl.reshape(code, (GROUPS, BLOCK // 2, 2)))
    half = tl.arange(0, BLOCK // 2)
    tl.store(packed_ptr + group[:, None] * (BLOCK // 2) + half[None, :],
             (low | (high << 4)).to(tl.uint8), mask=live[:, None])
    tl.store(scales_ptr + group, byte.to(tl.uint8), mask=live)


@triton.jit
def _decode_kernel(packed_ptr, scales_ptr, ts_ptr, table_ptr, out_ptr, groups_per_page,
                   chunks_per_page, num_blocks, stride_layer, stride_kv, stride_page,
                   BLOCK: tl.constexpr, GROUPS: tl.constexpr, IS_NV: tl.constexpr,
                   PAGED: tl.constexpr, OUT_KIND: tl.constexpr):
    """One program decodes GROUPS scale blocks of one page-run of one (layer, K/V) slice.

    A run of a slice is ``groups_per_page`` contiguous blocks both in the encoded tensor and in
    its target page; unpaged decoding is one run per slice that lands in page 0.
    """
    pid = tl.program_id(0)
    run = pid // chunks_per_page
    slice_id = run // num_blocks
    page = tl.load(table_ptr + run % num_blocks).to(tl.int64) if PAGED else 0
    local = (pid % chunks_per_page) * GROUPS + tl.arange(0, GROUPS)
    live = local < groups_per_page
    group = run.to(tl.int64) * groups_per_page + local
    half = tl.arange(0, BLOCK // 2)
    packed = tl.load(packed_ptr + group[:, None] * (BLOCK // 2) + half[None, :],
                     mask=live[:, None], other=0).to(tl.int32)
    byte = tl.load(scales_ptr + group, mask=live, other=0).to(tl.int32)
    if IS_NV:
        dequant = _e4m3_value(byte) * tl.load(ts_ptr + slice_id)
    else:
        dequant = tl.where(byte == 0, 0x00400000, byte << 23).to(tl.float32, bitcast=True)
    code = tl.reshape(tl.join(packed & 0x0F, packed >> 4), (GROUPS, BLOCK))
    value = _e2m1_value(code) * dequant[:, None]
    base = (slice_id // 2).to(tl.int64) * stride_layer + (slice_id % 2) * stride_kv
    dst = base + page * stride_page + local[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    _store_as(out_ptr + dst, value, live[:, None], OUT_KIND)


def _check_input(x: torch.Tensor, block: int, name: str) -> tuple[int, int, int, int, int]:
    check_tensor(x, name, _INPUT_DTYPES, ndim=5)
    if x.shape[1] != 2 or x.shape[-1] % block:
        raise CodecError(
            f"{name}: shape {tuple(x.shape)} is not [num_layers, 2, num_tokens, num_kv_heads, "
            f"head_dim] with head_dim a multiple of {block}"
        )
    return tuple(x.shape)


def _encode_slices(x: torch.Tensor, amax: torch.Tensor, parts: Fp4Parts, block: int) -> None:
    """Encode whole (layer, K/V) slices: x, amax, parts are views of the same slices."""
    num_slices = amax.numel()
    slice_numel = x.numel() // num_slices
    chunks = triton.cdiv(slice_numel, AMAX_ELEMENTS)
    is_nv = block == NV_BLOCK
    if is_nv and chunks:
        _slice_amax_kernel[(num_slices * chunks,)](
            x, amax, slice_numel, chunks, ELEMENTS=AMAX_ELEMENTS, num_warps=AMAX_WARPS)
    num_groups = parts.scales.numel()
    if num_groups:
        groups = ENCODE_GROUPS[block]
        _encode_kernel[(triton.cdiv(num_groups, groups),)](
            x, amax.view(torch.float32), parts.tensor_scales if is_nv else amax, parts.packed,
            parts.scales, num_groups, num_groups // num_slices, BLOCK=block, GROUPS=groups,
            IS_NV=is_nv, num_warps=ENCODE_WARPS)


def _encode(x: torch.Tensor, block: int, name: str) -> Fp4Parts:
    num_layers, _, _, _, head_dim = _check_input(x, block, name)
    lead, device = x.shape[:-1], x.device
    parts = Fp4Parts(
        torch.empty((*lead, head_dim // 2), dtype=torch.uint8, device=device),
        torch.empty((*lead, head_dim // block), dtype=torch.uint8, device=device),
        torch.empty((num_layers, 2), dtype=torch.float32, device=device)
        if block == NV_BLOCK else None,
    )
    num_slices = 2 * num_layers
    if x.numel() == 0:  # an empty run: all-zero slices, as the reference scales them
        if parts.tensor_scales is not None:
            parts.tensor_scales.fill_(TENSOR_SCALE_MIN)
        return parts
    # Slices are encoded in chunks of about ENCODE_CHUNK_BYTES so that the second read of a
    # chunk (after its amax pass) hits L2 instead of HBM.
    slice_bytes = x[0, 0].numel() * x.element_size()
    step = max(1, ENCODE_CHUNK_BYTES // max(slice_bytes, 1))
    amax = torch.zeros(num_slices, dtype=torch.int32, device=device)  # float32 bits
    flat = [t.view(num_slices, -1) for t in (x, parts.packed, parts.scales)]
    with on_device(device):
        for first in range(0, num_slices, step):
            part = slice(first, first + step)
            ts = None if parts.tensor_scales is None else parts.tensor_scales.view(-1)[part]
            _encode_slices(flat[0][part], amax[part], Fp4Parts(flat[1][part], flat[2][part], ts),
                           block)
    return parts


def nvfp4_encode(x: torch.Tensor) -> Fp4Parts:
    """Quantise a canonical K/V tensor to nvfp4 parts on its device.

    Args:
        x: contiguous ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` bf16/fp16/fp32,
            head_dim a multiple of 16, on CUDA (or the CPU under TRITON_INTERPRET=1).

    Returns:
        Parts on x's device. A slice holding NaN/Inf gets a non-finite tensor scale (its
        values are then meaningless); ``NvFp4Codec`` checks for that and raises.
    """
    return _encode(x, NV_BLOCK, "nvfp4_encode")


def mxfp4_encode(x: torch.Tensor) -> Fp4Parts:
    """Quantise a canonical K/V tensor to mxfp4 parts on its device (head_dim % 32 == 0).

    A block holding NaN/Inf gets the NaN scale byte 255 (OCP MX); ``MxFp4Codec`` raises on it.
    """
    return _encode(x, MX_BLOCK, "mxfp4_encode")


def _check_parts(parts: Fp4Parts, block: int, name: str) -> tuple[int, int, int, int, int]:
    if not isinstance(parts, Fp4Parts):
        raise CodecError(f"{name}: expected Fp4Parts, got {type(parts).__name__}")
    packed = check_tensor(parts.packed, f"{name} packed", (torch.uint8,), ndim=5)
    lead, head_dim = tuple(packed.shape[:-1]), 2 * packed.shape[-1]
    if lead[1] != 2 or head_dim % block:
        raise CodecError(f"{name}: packed shape {tuple(packed.shape)} is not a canonical run")
    check_tensor(parts.scales, f"{name} scales", (torch.uint8,), (*lead, head_dim // block))
    tensors = {"packed": packed, "scales": parts.scales}
    if block == NV_BLOCK:
        if parts.tensor_scales is None:
            raise CodecError(f"{name}: nvfp4 parts need tensor_scales")
        check_tensor(parts.tensor_scales, f"{name} tensor_scales", (torch.float32,), lead[:2])
        tensors["tensor_scales"] = parts.tensor_scales
    elif parts.tensor_scales is not None:
        raise CodecError(f"{name}: mxfp4 parts carry no tensor_scales")
    check_same_device(**tensors)
    return (*lead, head_dim)


def _launch_decode(parts: Fp4Parts, block: int, target: torch.Tensor, num_blocks: int,
                   page_tokens: int, table: torch.Tensor | None) -> None:
    num_layers, num_kv_heads = parts.packed.shape[0], parts.packed.shape[3]
    head_dim = 2 * parts.packed.shape[-1]
    groups_per_page = page_tokens * num_kv_heads * head_dim // block
    groups = DECODE_GROUPS[block]
    chunks = triton.cdiv(groups_per_page, groups)
    programs = num_layers * 2 * num_blocks * chunks
    if programs == 0:
        return
    strides = target.stride() if table is not None else (*target.stride()[:2], 0)
    is_nv = block == NV_BLOCK
    with on_device(target.device):
        _decode_kernel[(programs,)](
            parts.packed, parts.scales, parts.tensor_scales if is_nv else parts.scales,
            table if table is not None else parts.scales, target, groups_per_page, chunks,
            num_blocks, strides[0], strides[1], strides[2], BLOCK=block, GROUPS=groups,
            IS_NV=is_nv, PAGED=table is not None, OUT_KIND=_OUT_KINDS[target.dtype],
            num_warps=DECODE_WARPS)


def _decode(parts: Fp4Parts, out: torch.Tensor, block: int, name: str) -> torch.Tensor:
    shape = _check_parts(parts, block, name)
    check_tensor(out, f"{name} out", _INPUT_DTYPES, shape)
    check_same_device(packed=parts.packed, out=out)
    _launch_decode(parts, block, out, 1, shape[2], None)
    return out


def nvfp4_decode(parts: Fp4Parts, out: torch.Tensor) -> torch.Tensor:
    """Dequantise nvfp4 parts into ``out`` (contiguous canonical bf16/fp16/fp32, same device)."""
    return _decode(parts, out, NV_BLOCK, "nvfp4_decode")


def mxfp4_decode(parts: Fp4Parts, out: torch.Tensor) -> torch.Tensor:
    """Dequantise mxfp4 parts into ``out`` (contiguous canonical bf16/fp16/fp32, same device)."""
    return _decode(parts, out, MX_BLOCK, "mxfp4_decode")


def _decode_paged(parts: Fp4Parts, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  block: int, name: str) -> None:
    shape = _check_parts(parts, block, name)
    page_tokens = check_paged_target(kv_cache, block_table, shape)
    check_tensor(kv_cache, f"{name} kv_cache", (torch.bfloat16, torch.float16), ndim=6)
    check_same_device(packed=parts.packed, kv_cache=kv_cache)
    _launch_decode(parts, block, kv_cache, block_table.numel(), page_tokens, block_table)


def decode_paged_nvfp4(parts: Fp4Parts, kv_cache: torch.Tensor, block_table: torch.Tensor
                       ) -> None:
    """Decode an nvfp4 run straight into an engine's paged cache.

    Args:
        parts: nvfp4 parts of a run of ``num_blocks * page_tokens`` tokens, on kv_cache's device.
        kv_cache: contiguous ``[num_layers, 2, num_pages, page_tokens, num_kv_heads, head_dim]``
            bf16/fp16; token t lands in page ``block_table[t // page_tokens]``, slot
            ``t % page_tokens``; other pages are untouched.
        block_table: int32 ``[num_blocks]``, entries in ``[0, num_pages)`` (checked: one sync).
    """
    _decode_paged(parts, kv_cache, block_table, NV_BLOCK, "decode_paged_nvfp4")


def decode_paged_mxfp4(parts: Fp4Parts, kv_cache: torch.Tensor, block_table: torch.Tensor
                       ) -> None:
    """Decode an mxfp4 run straight into an engine's paged cache (as ``decode_paged_nvfp4``)."""
    _decode_paged(parts, kv_cache, block_table, MX_BLOCK, "decode_paged_mxfp4")


def _bench_codec(name: str, x: torch.Tensor, copy: float) -> list[dict]:
    """Rows for one codec: encode, decode and paged decode (16-token pages, shuffled table)."""
    from triton.testing import do_bench

    encode, decode = globals()[f"{name}_encode"], globals()[f"{name}_decode"]
    paged = globals()[f"decode_paged_{name}"]
    parts = encode(x)
    moved = x.numel() * x.element_size() + sum(t.numel() * t.element_size()
                                               for t in parts.sections())
    out = torch.empty_like(x)
    num_layers, _, num_tokens, num_kv_heads, head_dim = x.shape
    page_tokens = 16
    num_blocks = num_tokens // page_tokens  # benchmark() makes num_tokens a multiple of 16
    cache = torch.empty(num_layers, 2, num_blocks, page_tokens, num_kv_heads, head_dim,
                        dtype=x.dtype, device=x.device)
    table = torch.randperm(num_blocks, device=x.device).to(torch.int32)
    ops = {"encode": lambda: encode(x), "decode": lambda: decode(parts, out),
           "decode_paged": lambda: paged(parts, cache, table)}
    rows = []
    for op, fn in ops.items():
        gbps = moved / (do_bench(fn, return_mode="median") * 1e6)
        rows.append({"codec": name, "op": op, "gbps": gbps, "copy_gbps": copy,
                     "ratio": gbps / copy})
    return rows


def benchmark(nbytes: int = 1 << 30) -> list[dict]:
    """Encode, decode and paged-decode GB/s (bytes read + written) of nvfp4 and mxfp4 on a
    bf16 canonical tensor of about ``nbytes`` on CUDA (32 layers, 8 kv heads, head_dim 128),
    with a device-to-device copy of it measured in the same run.

    Returns:
        Rows ``{"codec", "op", "gbps", "copy_gbps", "ratio"}``; ratio = gbps / copy_gbps.
    """
    if not torch.cuda.is_available():
        raise CodecError("fp4 benchmark needs a CUDA device")
    num_layers, num_kv_heads, head_dim = 32, 8, 128
    num_tokens = max(16, nbytes // (2 * num_layers * 2 * num_kv_heads * head_dim) // 16 * 16)
    x = torch.randn(num_layers, 2, num_tokens, num_kv_heads, head_dim, device="cuda",
                    dtype=torch.bfloat16)
    copy = copy_gbps(x)
    return [row for name in ("nvfp4", "mxfp4") for row in _bench_codec(name, x, copy)]


__all__ = [
    "benchmark",
    "decode_paged_mxfp4",
    "decode_paged_nvfp4",
    "mxfp4_decode",
    "mxfp4_encode",
    "nvfp4_decode",
    "nvfp4_encode",
]
