"""Triton kernels of fp8_e4m3: encode rows to e4m3 codes and bf16 scales, and decode them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.codecs.parts import E4M3_MAX, MIN_SCALE, Fp8Parts
from kvstore.codecs.triton.common import (
    check_same_device,
    check_tensor,
    interpreter_enabled,
    on_device,
)
from kvstore.errors import CodecError

# Rows (one token x one kv head each) and warps per program. Picked on an H200 (triton 3.6,
# 2026-11-29) from a sweep of 8/16/32/64 rows x 4/8 warps on a 1 GiB bf16 run (head_dim 128),
# in ratio to a device copy: encode 32 x 4 gave 1.02 (8 rows: 0.87), decode 16 x 4 gave 0.97.
ENCODE_ROWS = 32
ENCODE_WARPS = 4
DECODE_ROWS = 16
DECODE_WARPS = 4
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_MAX = tl.constexpr(E4M3_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def _bf16_round(x):
    """Round non-negative float32 to the nearest-even bf16 value, in integer arithmetic (the
    interpreter truncates float32 -> bf16 casts)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(y):
    """Nearest-even e4m3fn code of float32 ``y`` in [-448, 448], in integer arithmetic.

    Normal range (|y| >= 2^-6): round the 23-bit mantissa to 3 bits; the carry may bump the
    exponent, which the integer add does by itself; the code is then (bits >> 20) - (120 << 3).
    Below 2^-6 the code is round(|y| * 2^9): adding 2^23 rounds to an integer, nearest even.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960
    shifted = mag.to(tl.float32, bitcast=True) * 512.0 + 8388608.0
    subnormal = shifted.to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(mag >= 0x3C800000, normal, subnormal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _quantise_rows(x, HW_ROUND: tl.constexpr):
    """e4m3 codes (uint8) and float32 scales of the float32 rows ``x`` [R, D], one scale per
    row (amax / 448, rounded to bf16), as ``encode_fp8_reference``; masked-off columns must
    be 0."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(_bf16_round(tl.math.div_rn(amax, tl.zeros_like(amax) + _MAX)), _MIN_SCALE)
    inv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
    y = tl.minimum(tl.maximum(x * inv[:, None], -_MAX), _MAX)
    if HW_ROUND:
        codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        codes = _e4m3_bits(y)
    return codes, scale


@triton.jit
def _encode_kernel(src_ptr, codes_ptr, scales_ptr, num_rows,
                   D: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr,
                   HW_ROUND: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D_PAD)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols < D)[None, :]
    offs = rows[:, None] * D + cols[None, :]
    x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    codes, scale = _quantise_rows(x, HW_ROUND)
    tl.store(codes_ptr + offs, codes, mask=mask)
    tl.store(scales_ptr + rows, scale.to(tl.bfloat16), mask=row_ok)


@triton.jit
def _decode_kernel(codes_ptr, scales_ptr, out_ptr, table_ptr,
                   rows_per_slab, num_heads, page_tokens, out_slab_stride,
                   D: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr):
    # A slab is one (layer, K or V); row i of a slab is token i // num_heads, head i % num_heads.
    slab = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D_PAD)
    row_ok = i < rows_per_slab
    mask = row_ok[:, None] & (cols < D)[None, :]
    src_rows = slab * rows_per_slab + i
    codes = tl.load(codes_ptr + src_rows[:, None] * D + cols[None, :], mask=mask, other=0)
    scale = tl.load(scales_ptr + src_rows, mask=row_ok, other=0.0).to(tl.float32)
    x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
    token = i // num_heads
    page = tl.load(table_ptr + token // page_tokens, mask=row_ok, other=0).to(tl.int64)
    dst_rows = (page * page_tokens + token % page_tokens - token) * num_heads + i
    dst = out_ptr + slab * out_slab_stride + dst_rows[:, None] * D + cols[None, :]
    tl.store(dst, x.to(out_ptr.dtype.element_ty), mask=mask)


def _check_parts(parts: Fp8Parts) -> tuple[int, ...]:
    codes = check_tensor(parts.codes, "codes", (torch.uint8,), ndim=5)
    shape = tuple(codes.shape)
    if shape[1] != 2:
        raise CodecError(f"codes: shape {shape} is not [num_layers, 2, tokens, heads, dim]")
    check_tensor(parts.scales, "scales", (torch.bfloat16,), shape=shape[:-1])
    check_same_device(codes=parts.codes, scales=parts.scales)
    return shape


def encode_fp8(kv: torch.Tensor, out: Fp8Parts | None = None,
               hw_round: bool | None = None) -> Fp8Parts:
    """Quantise ``kv`` (canonical layout, bf16/fp16/fp32, finite) to e4m3 codes and scales.

    Args:
        kv: contiguous ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` tensor.
        out: preallocated sections of the right shapes, or None to allocate.
        hw_round: round with the GPU's float8 conversion (True) or with integer arithmetic
            (False; exact in the interpreter too). None: the conversion on a GPU, integers in
            the interpreter. Both round to nearest even and give the same codes; on an H200
            the conversion ran at 1.02 of copy, integer rounding at 0.78 (ALU-bound).

    Returns:
        The sections, on ``kv``'s device; bit-identical to ``encode_fp8_reference``.
    """
    check_tensor(kv, "kv", KV_DTYPES, ndim=5)
    if kv.shape[1] != 2 or kv.shape[-1] == 0:
        raise CodecError(f"kv: shape {tuple(kv.shape)} is not [num_layers, 2, tokens, heads, dim]")
    if out is None:
        out = Fp8Parts(torch.empty(kv.shape, dtype=torch.uint8, device=kv.device),
                       torch.empty(kv.shape[:-1], dtype=torch.bfloat16, device=kv.device))
    if _check_parts(out) != tuple(kv.shape):
        raise CodecError(f"out sections have shape {tuple(out.codes.shape)}, kv {tuple(kv.shape)}")
    device = check_same_device(kv=kv, codes=out.codes)
    head_dim = kv.shape[-1]
    num_rows = kv.numel() // head_dim
    if num_rows == 0:
        return out
    if hw_round is None:
        hw_round = not interpreter_enabled()
    with on_device(device):
        _encode_kernel[(triton.cdiv(num_rows, ENCODE_ROWS),)](
            kv, out.codes, out.scales, num_rows, D=head_dim,
            D_PAD=triton.next_power_of_2(head_dim), ROWS=ENCODE_ROWS, HW_ROUND=hw_round,
            num_warps=ENCODE_WARPS, enable_fp_fusion=False,
        )
    return out


def _launch_decode(parts: Fp8Parts, out: torch.Tensor, table: torch.Tensor, page_tokens: int,
                   out_slab_stride: int) -> None:
    num_layers, _, num_tokens, num_heads, head_dim = parts.codes.shape
    rows_per_slab = num_tokens * num_heads
    if rows_per_slab == 0 or num_layers == 0 or head_dim == 0:
        return
    grid = (triton.cdiv(rows_per_slab, DECODE_ROWS), num_layers * 2)
    with on_device(out.device):
        _decode_kernel[grid](
            parts.codes, parts.scales, out, table, rows_per_slab, num_heads, page_tokens,
            out_slab_stride, D=head_dim, D_PAD=triton.next_power_of_2(head_dim),
            ROWS=DECODE_ROWS, num_warps=DECODE_WARPS,
        )


def decode_fp8(parts: Fp8Parts, out: torch.Tensor) -> torch.Tensor:
    """Dequantise into ``out`` (contiguous, the run's shape, bf16/fp16/fp32) and return it."""
    shape = _check_parts(parts)
    check_tensor(out, "out", KV_DTYPES, shape=shape)
    check_same_device(codes=parts.codes, out=out)
    # A plain run is a paged cache of one page holding every token.
    table = torch.zeros(1, dtype=torch.int32, device=out.device)
    _launch_decode(parts, out, table, max(shape[2], 1), out[0, 0].numel())
    return out
