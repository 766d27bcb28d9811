"""Triton kernels of the int4/int2 KIVI codecs: encode K and V, and decode them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.codecs.parts import KiviParts, run_shape, section_shapes
from kvstore.codecs.triton.common import (
    check_same_device,
    check_tensor,
    on_device,
)
from kvstore.errors import CodecError

# Values per program and warps per program of each kernel: K tiles are group_size tokens x
# tile / group_size channels, V tiles tile consecutive values (whole channel groups). Picked
# on an H200 (triton 3.6, 2026-11-29) from sweeps of tiles 2048-8192 x 1-8 warps on a 1 GiB
# bf16 run, group 32, each kernel alone, in ratio to a device copy. K encode reduces over
# tokens, across warps when there are several: one warp gave 0.82 of copy (int4; int2 0.77),
# two warps on 4096 0.64, four 0.25.
K_ENCODE_TILE, K_ENCODE_WARPS = 2048, 1
V_ENCODE_TILE, V_ENCODE_WARPS = 4096, 2  # 0.83 (int4); 8192 x 2 warps spills: 0.49
K_DECODE_TILE, K_DECODE_WARPS = 8192, 2  # 0.86; 4096 x 4 warps: 0.72
V_DECODE_TILE, V_DECODE_WARPS = 4096, 2  # 0.93 (int4), 0.88 (int2)
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _group_params(low, high, BITS: tl.constexpr):
    """fp16-rounded (scale, zero) as float32, and 1/scale (0 where scale is 0)."""
    zero = low.to(tl.float16).to(tl.float32)
    span = tl.maximum(high - zero, 0.0)
    scale = (span * (1.0 / (2**BITS - 1))).to(tl.float16).to(tl.float32)
    # scale >= 2^-24 (fp16's smallest step) where it is not 0; the floor only avoids 1/0.
    safe = tl.maximum(scale, 2.0**-24)
    inv = tl.where(scale > 0, tl.math.div_rn(tl.zeros_like(scale) + 1.0, safe), 0.0)
    return scale, zero, inv


@triton.jit
def _quantize(x, zero, inv, BITS: tl.constexpr):
    y = tl.minimum(tl.maximum((x - zero) * inv, 0.0), 2**BITS - 1)
    return (y + 0.5).to(tl.int32)  # truncating a non-negative value: round half up


@triton.jit
def _pack(q, BITS: tl.constexpr):
    """int32 codes [R, C] -> uint8 [R, C * BITS / 8], element 2i (4i) in the low bits."""
    R: tl.constexpr = q.shape[0]
    C: tl.constexpr = q.shape[1]
    if BITS == 4:
        lo, hi = tl.split(tl.reshape(q, (R, C // 2, 2)))
        packed = lo | (hi << 4)
    else:
        even, odd = tl.split(tl.reshape(q, (R, C // 4, 2, 2)))
        e0, e2 = tl.split(even)
        e1, e3 = tl.split(odd)
        packed = e0 | (e1 << 2) | (e2 << 4) | (e3 << 6)
    return packed.to(tl.uint8)


@triton.jit
def _unpack(packed, BITS: tl.constexpr):
    """uint8 [R, CB] -> float32 codes [R, CB * 8 / BITS], the inverse of ``_pack``."""
    R: tl.constexpr = packed.shape[0]
    CB: tl.constexpr = packed.shape[1]
    p = packed.to(tl.int32)
    if BITS == 4:
        codes = tl.reshape(tl.join(p & 15, p >> 4), (R, CB * 2))
    else:
        even = tl.join(p & 3, (p >> 4) & 3)
        odd = tl.join((p >> 2) & 3, p >> 6)
        codes = tl.reshape(tl.join(even, odd), (R, CB * 4))
    return codes.to(tl.float32)


@triton.jit
def _encode_k_kernel(src_ptr, codes_ptr, meta_ptr, num_tokens, num_full, HD,
                     BITS: tl.constexpr, G: tl.constexpr, BLOCK_C: tl.constexpr):
    # One program: G tokens (one group) x BLOCK_C channels of one layer's K.
    layer = tl.program_id(2).to(tl.int64)
    group = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    tokens = group * G + tl.arange(0, G)
    col_ok = cols < HD
    src = src_ptr + layer * 2 * num_tokens * HD + tokens[:, None] * HD + cols[None, :]
    x = tl.load(src, mask=col_ok[None, :], other=0.0).to(tl.float32)
    scale, zero, inv = _group_params(tl.min(x, axis=0), tl.max(x, axis=0), BITS)
    packed = _pack(_quantize(x, zero[None, :], inv[None, :], BITS), BITS)
    PB: tl.constexpr = 8 // BITS
    bcols = tl.program_id(0) * (BLOCK_C // PB) + tl.arange(0, BLOCK_C // PB)
    dst = codes_ptr + (layer * num_full + tokens[:, None]) * (HD // PB) + bcols[None, :]
    tl.store(dst, packed, mask=(bcols < HD // PB)[None, :])
    meta = meta_ptr + (layer * (num_full // G) + group) * 2 * HD + cols
    tl.store(meta, scale.to(tl.float16), mask=col_ok)
    tl.store(meta + HD, zero.to(tl.float16), mask=col_ok)


@triton.jit
def _encode_v_kernel(src_ptr, codes_ptr, meta_ptr, num_tokens, HD,
                     BITS: tl.constexpr, G: tl.constexpr, GROUPS: tl.constexpr):
    # One program: GROUPS consecutive channel groups of one layer's V (whole tokens' rows).
    layer = tl.program_id(1).to(tl.int64)
    per_token = HD // G
    groups = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    ok = groups < num_tokens * per_token
    slab = src_ptr + (layer * 2 + 1) * num_tokens * HD
    PB: tl.constexpr = 8 // BITS
    cb = tl.arange(0, G // PB)
    if BITS == 4:
        x = tl.load(slab + groups[:, None] * G + tl.arange(0, G)[None, :], mask=ok[:, None],
                    other=0.0).to(tl.float32)
        scale, zero, inv = _group_params(tl.min(x, axis=1), tl.max(x, axis=1), BITS)
        packed = _pack(_quantize(x, zero[:, None], inv[:, None], BITS), BITS)
    else:
        # 2 bits: a [groups, bytes, 4] tile packed by an in-thread sum beat reshape/split by
        # 1.15x on an H200 (0.89 against 0.77 of copy for this kernel, 2026-11-29).
        j = tl.arange(0, PB)
        offs = groups[:, None, None] * G + cb[None, :, None] * PB + j[None, None, :]
        x = tl.load(slab + offs, mask=ok[:, None, None], other=0.0).to(tl.float32)
        low = tl.min(tl.min(x, axis=2), axis=1)
        high = tl.max(tl.max(x, axis=2), axis=1)
        scale, zero, inv = _group_params(low, high, BITS)
        q = _quantize(x, zero[:, None, None], inv[:, None, None], BITS)
        packed = tl.sum(q << (j * BITS)[None, None, :], axis=2).to(tl.uint8)
    dst = codes_ptr + layer * num_tokens * (HD // PB) + groups[:, None] * (G // PB)
    tl.store(dst + cb[None, :], packed, mask=ok[:, None])
    # meta [L, T, 2, HD / G]: token t's scales, then its zero points
    token = groups // per_token
    meta = meta_ptr + layer * 2 * num_tokens * per_token + groups + token * per_token
    tl.store(meta, scale.to(tl.float16), mask=ok)
    tl.store(meta + per_token, zero.to(tl.float16), mask=ok)


@triton.jit
def _page_rows(table_ptr, tokens, page_tokens, mask):
    """Row (page * page_tokens + slot) in a cache slab of each token of the run."""
    page = tl.load(table_ptr + tokens // page_tokens, mask=mask, other=0).to(tl.int64)
    return page * page_tokens + tokens % page_tokens


@triton.jit
def _decode_k_kernel(codes_ptr, meta_ptr, out_ptr, table_ptr, num_full, HD, page_tokens,
                     out_slab_stride, BITS: tl.constexpr, G: tl.constexpr,
                     BLOCK_C: tl.constexpr):
    layer = tl.program_id(2).to(tl.int64)
    group = tl.program_id(1)
    PB: tl.constexpr = 8 // BITS
    bcols = tl.program_id(0) * (BLOCK_C // PB) + tl.arange(0, BLOCK_C // PB)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    tokens = group * G + tl.arange(0, G)
    src = codes_ptr + (layer * num_full + tokens[:, None]) * (HD // PB) + bcols[None, :]
    codes = _unpack(tl.load(src, mask=(bcols < HD // PB)[None, :], other=0), BITS)
    col_ok = cols < HD
    meta = meta_ptr + (layer * (num_full // G) + group) * 2 * HD + cols
    scale = tl.load(meta, mask=col_ok, other=0.0).to(tl.float32)
    zero = tl.load(meta + HD, mask=col_ok, other=0.0).to(tl.float32)
    x = codes * scale[None, :] + zero[None, :]
    rows = _page_rows(table_ptr, tokens, page_tokens, tokens < num_full)
    dst = out_ptr + layer * 2 * out_slab_stride + rows[:, None] * HD + cols[None, :]
    tl.store(dst, x.to(out_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit
def _decode_v_kernel(codes_ptr, meta_ptr, out_ptr, table_ptr, num_tokens, HD, page_tokens,
                     out_slab_stride, BITS: tl.constexpr, G: tl.constexpr,
                     GROUPS: tl.constexpr):
    layer = tl.program_id(1).to(tl.int64)
    per_token = HD // G
    groups = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    ok = groups < num_tokens * per_token
    PB: tl.constexpr = 8 // BITS
    src = codes_ptr + layer * num_tokens * (HD // PB) + groups[:, None] * (G // PB)
    codes = _unpack(tl.load(src + tl.arange(0, G // PB)[None, :], mask=ok[:, None], other=0), BITS)
    token = groups // per_token
    meta = meta_ptr + layer * 2 * num_tokens * per_token + groups + token * per_token
    scale = tl.load(meta, mask=ok, other=0.0).to(tl.float32)
    zero = tl.load(meta + per_token, mask=ok, other=0.0).to(tl.float32)
    x = codes * scale[:, None] + zero[:, None]
    rows = _page_rows(table_ptr, token, page_tokens, ok)
    col0 = (groups - token * per_token) * G
    dst = out_ptr + (layer * 2 + 1) * out_slab_stride + rows * HD + col0
    tl.store(dst[:, None] + tl.arange(0, G)[None, :], x.to(out_ptr.dtype.element_ty),
             mask=ok[:, None])


@triton.jit
def _copy_residual_kernel(src_ptr, out_ptr, table_ptr, num_residual, first_token, HD,
                          page_tokens, out_slab_stride, BLOCK: tl.constexpr):
    # One program: one residual K token of one layer (a row of HD values), in BLOCK chunks.
    layer = tl.program_id(1).to(tl.int64)
    token = tl.program_id(0)
    row = _page_rows(table_ptr, first_token + token, page_tokens, True)
    src = src_ptr + (layer * num_residual + token) * HD
    dst = out_ptr + layer * 2 * out_slab_stride + row * HD
    for start in range(0, HD, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(src + cols, mask=cols < HD)
        tl.store(dst + cols, x.to(out_ptr.dtype.element_ty), mask=cols < HD)


def _tile(group_size: int, elements: int, bits: int) -> int:
    """Channels (K) or groups (V) per tile for ``elements`` values per program."""
    return max(8 // bits, elements // group_size)


def _check_parts(parts: KiviParts) -> tuple[int, ...]:
    if parts.v_codes.dim() != 4 or parts.k_residual.dim() != 4:
        raise CodecError("KiviParts: v_codes and k_residual must be 4-D")
    shape = run_shape(parts)
    expected = section_shapes(shape, parts.bits, parts.group_size)
    dtypes = [(torch.uint8,), (torch.float16,), KV_DTYPES, (torch.uint8,), (torch.float16,)]
    names = ["k_codes", "k_meta", "k_residual", "v_codes", "v_meta"]
    for tensor, name, dtype, shp in zip(parts.tensors(), names, dtypes, expected, strict=True):
        check_tensor(tensor, name, dtype, shape=shp)
    check_same_device(**dict(zip(names, parts.tensors(), strict=True)))
    return shape


def encode_kivi(kv: torch.Tensor, bits: int, group_size: int) -> KiviParts:
    """Quantise ``kv`` (canonical, contiguous, finite, within fp16 range) on its device.

    Returns:
        The sections, bit-identical to ``encode_kivi_reference``.
    """
    check_tensor(kv, "kv", KV_DTYPES, ndim=5)
    shapes = section_shapes(tuple(kv.shape), bits, group_size)
    layers, _, tokens, heads, dim = kv.shape
    full, hd = shapes[0][1], heads * dim
    dtypes = [torch.uint8, torch.float16, kv.dtype, torch.uint8, torch.float16]
    k_codes, k_meta, _, v_codes, v_meta = (
        torch.empty(s, dtype=d, device=kv.device) for s, d in zip(shapes, dtypes, strict=True))
    residual = kv[:, 0, full:].contiguous()
    block_c = min(triton.next_power_of_2(hd), _tile(group_size, K_ENCODE_TILE, bits))
    groups = _tile(group_size, V_ENCODE_TILE, bits)
    with on_device(kv.device):
        if full and layers:
            _encode_k_kernel[(triton.cdiv(hd, block_c), full // group_size, layers)](
                kv, k_codes, k_meta, tokens, full, hd, BITS=bits, G=group_size,
                BLOCK_C=block_c, num_warps=K_ENCODE_WARPS, enable_fp_fusion=False)
        if tokens and layers:
            _encode_v_kernel[(triton.cdiv(tokens * hd // group_size, groups), layers)](
                kv, v_codes, v_meta, tokens, hd, BITS=bits, G=group_size, GROUPS=groups,
                num_warps=V_ENCODE_WARPS, enable_fp_fusion=False)
    return KiviParts(bits, group_size, k_codes, k_meta, residual, v_codes, v_meta)


def _launch_decode(parts: KiviParts, out: torch.Tensor, table: torch.Tensor, page_tokens: int,
                   out_slab_stride: int) -> None:
    layers, full, heads, _ = parts.k_codes.shape
    tokens, g, bits = parts.v_codes.shape[1], parts.group_size, parts.bits
    hd = heads * parts.k_residual.shape[-1]
    if layers == 0 or tokens == 0:
        return
    block_c = min(triton.next_power_of_2(hd), _tile(g, K_DECODE_TILE, bits))
    groups = _tile(g, V_DECODE_TILE, bits)
    common = {"BITS": bits, "G": g, "enable_fp_fusion": False}
    with on_device(out.device):
        if full:
            _decode_k_kernel[(triton.cdiv(hd, block_c), full // g, layers)](
                parts.k_codes, parts.k_meta, out, table, full, hd, page_tokens,
                out_slab_stride, BLOCK_C=block_c, num_warps=K_DECODE_WARPS, **common)
        if tokens > full:
            _copy_residual_kernel[(tokens - full, layers)](
                parts.k_residual, out, table, tokens - full, full, hd, page_tokens,
                out_slab_stride, BLOCK=min(triton.next_power_of_2(hd), 1024))
        _decode_v_kernel[(triton.cdiv(tokens * hd // g, groups), layers)](
            parts.v_codes, parts.v_meta, out, table, tokens, hd, page_tokens, out_slab_stride,
            GROUPS=groups, num_warps=V_DECODE_WARPS, **common)


def decode_kivi(parts: KiviParts, out: torch.Tensor) -> torch.Tensor:
    """Dequantise into ``out`` (contiguous, the run's shape, bf16/fp16/fp32) and return it."""
    shape = _check_parts(parts)
    check_tensor(out, "out", KV_DTYPES, shape=shape)
    check_same_device(k_codes=parts.k_codes, out=out)
    # A plain run is a paged cache of one page holding every token.
    table = torch.zeros(1, dtype=torch.int32, device=out.device)
    _launch_decode(parts, out, table, max(shape[2], 1), out[0, 0].numel())
    return out
