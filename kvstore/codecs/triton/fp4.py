"""Triton kernels of the nvfp4 and mxfp4 codecs: encode and decode.

The kernels produce the bytes of the torch references in ``kvstore.codecs.fp4`` exactly. Every
rounding step is integer arithmetic or a correctly rounded float operation (``div_rn``,
products), because Triton's interpreter rounds float32 -> float8e4nv and float32 -> bf16 casts
differently from the GPU (DESIGN.md, "Pitfalls already measured"); decoding to bf16 uses the
GPU's own rounding cast, and integer rounding under the interpreter.
"""

from __future__ import annotations

import torch

from kvstore.codecs.parts import (
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
    check_same_device,
    check_tensor,
    interpreter_enabled,
    on_device,
    tl,
    triton,
)
from kvstore.errors import CodecError

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Kernels read and write pairs of adjacent elements as one word: bf16/fp16 pairs as int32,
# float32 pairs as int64, so even/odd nibbles need no shuffles inside a program.
_WORDS = {torch.bfloat16: torch.int32, torch.float16: torch.int32, torch.float32: torch.int64}
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Tuned by sweeps on an NVIDIA H200 (triton 3.6, 2026-11-29) over a 1 GiB bf16 tensor as in
# kvstore.bench.kernels, against a 4.22 TB/s device copy: the kernels are ALU-bound, so few
# warps with many elements each win.
AMAX_ELEMENTS = 16384  # elements per program of nvfp4's slice-amax pass: 3.9 TB/s
AMAX_WARPS = 4
# (scale blocks per program, warps): encode nvfp4 1.89 TB/s (both passes), mxfp4 3.06 TB/s;
# decode nvfp4 3.38 TB/s, mxfp4 3.59 TB/s.
ENCODE_CONFIG = {NV_BLOCK: (128, 1), MX_BLOCK: (64, 1)}
DECODE_CONFIG = {NV_BLOCK: (256, 2), MX_BLOCK: (128, 1)}
# jit functions may only read module globals that are constexpr.
_SCALE_MIN = tl.constexpr(E4M3_MIN_SCALE)
_SCALE_MAX = tl.constexpr(E4M3_MAX)
_E2M1_MAX = tl.constexpr(E2M1_MAX)
_NAN_SCALE = tl.constexpr(E8M0_NAN)
_AMAX_TO_SCALE = tl.constexpr(E4M3_MAX * E2M1_MAX)
_TS_MIN = tl.constexpr(TENSOR_SCALE_MIN)
# 2 * e2m1 magnitude of codes 0-7 (0, 1, 2, 3, 4, 6, 8, 12) as nibbles of one int32
# (0xC8643210 written as the signed value of the same bits, to stay a 32-bit constant).
_TWICE_E2M1 = tl.constexpr(0xC8643210 - (1 << 32))


@triton.jit
def _slice_amax_kernel(x_ptr, amax_ptr, slice_numel, chunks_per_slice, ELEMENTS: tl.constexpr):
    """amax_ptr: int32 bits of float32 [num_slices], zeroed. NaN bits order above +inf."""
    pid = tl.program_id(0)
    slice_id = pid // chunks_per_slice
    offs = (pid % chunks_per_slice).to(tl.int64) * ELEMENTS + tl.arange(0, ELEMENTS)
    x = tl.load(x_ptr + slice_id.to(tl.int64) * slice_numel + offs, mask=offs < slice_numel,
                other=0.0).to(tl.float32)
    # |x| as int32 bits: non-negative floats order like their bits, so an integer max and an
    # integer atomic max are exact (and NaN wins, which flags the slice).
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.atomic_max(amax_ptr + slice_id, tl.max(bits, axis=0))


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
def _nv_scales(block_amax, ts, inv_six_ts):
    """e4m3 block-scale byte and 1 / dequantisation scale, as nvfp4_quantize_reference."""
    s = tl.minimum(tl.maximum(block_amax * inv_six_ts, _SCALE_MIN), _SCALE_MAX)
    byte, value = _e4m3_round(s)
    dequant = value * ts
    return byte, tl.math.div_rn(tl.full(dequant.shape, 1.0, tl.float32), dequant)


@triton.jit
def _mx_scales(amax_bits):
    """e8m0 byte 2^(floor(log2 amax) - 2) and its exact inverse; NaN byte for NaN/Inf blocks."""
    byte = tl.maximum(((amax_bits >> 23) & 0xFF) - 2, 0)
    byte = tl.where(amax_bits >= 0x7F800000, _NAN_SCALE, byte)
    inverse = ((254 - tl.minimum(byte, 254)) << 23).to(tl.float32, bitcast=True)
    return byte, inverse


@triton.jit
def _e2m1_code(x, inv_scale):
    """Signed e2m1 codes of x * inv_scale: nearest, ties to even mantissa, saturating, no -0."""
    mag = tl.abs(x * inv_scale)
    bits = mag.to(tl.int32, bitcast=True)
    # From 1 up, e2m1 is a float with one mantissa bit: round the float32 bits to that (nearest
    # even, in integers); bits >> 22 is then 2 * biased exponent + mantissa, 254 for 1.0.
    rounded = (bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22
    # Below 1 the code is 2 * mag rounded to an integer, nearest even: adding 2^23 leaves
    # exactly that integer in the low mantissa bits (mag * 2 is exact, so an FMA is too).
    small = (mag * 2.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(mag >= 1.0, tl.minimum(rounded - 252, 7), small)
    # The sign bit of x lands in bit 3 unless the code is 0 ((code + 7) & 8 is 8 for 1..7).
    return code | ((x.to(tl.int32, bitcast=True) >> 28) & (code + 7) & 8)


@triton.jit
def _e2m1_scaled(code, half_scale):
    """float32 value of signed e2m1 codes times 2 * half_scale (exact: 2 * |value| is an int)."""
    twice = (_TWICE_E2M1 >> ((code & 7) * 4)) & 15
    value = twice.to(tl.float32) * half_scale
    return tl.where(code >= 8, -value, value)


@triton.jit
def _unpack_words(words, KIND: tl.constexpr):
    """float32 (even, odd) elements of words holding two inputs, the even one in the low half."""
    if KIND == 1:
        even = (words << 16).to(tl.float32, bitcast=True)
        odd = (words & -65536).to(tl.float32, bitcast=True)
    elif KIND == 2:
        even = words.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        odd = (words >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        even = words.to(tl.int32).to(tl.float32, bitcast=True)
        odd = (words >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return even, odd


@triton.jit
def _half_bits(value, KIND: tl.constexpr, EXACT: tl.constexpr):
    """int32 holding the bf16 (KIND 1) or fp16 (2) bits of float32 value in its low 16 bits.

    EXACT rounds to nearest even with integers: the interpreter's bf16 cast truncates.
    """
    if KIND == 1 and EXACT:
        bits = value.to(tl.int32, bitcast=True)
        return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    elif KIND == 1:
        return value.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
    else:
        return value.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)


@triton.jit
def _pack_words(even, odd, KIND: tl.constexpr, EXACT: tl.constexpr):
    """Words of two outputs of dtype KIND (as _unpack_words reads them)."""
    if KIND == 0:
        low = even.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        return low | (odd.to(tl.int32, bitcast=True).to(tl.int64) << 32)
    else:
        low = _half_bits(even, KIND, EXACT) & 0xFFFF
        return low | (_half_bits(odd, KIND, EXACT) << 16)


@triton.jit
def _encode_kernel(words_ptr, amax_ptr, ts_ptr, packed_ptr, scales_ptr, groups_per_slice,
                   chunks_per_slice, HALF: tl.constexpr, GROUPS: tl.constexpr,
                   IS_NV: tl.constexpr, KIND: tl.constexpr):
    """One program quantises GROUPS scale blocks (2 * HALF elements each) of one slice.

    nvfp4: amax_ptr holds the float32 amax of each slice; the slice's first program stores
    its tensor scale to ts_ptr.
    """
    pid = tl.program_id(0)
    slice_id = pid // chunks_per_slice
    chunk = pid % chunks_per_slice
    # Scalar int64 bases and int32 offsets inside the program: no 64-bit math per element.
    first = slice_id.to(tl.int64) * groups_per_slice + chunk * GROUPS
    rows = tl.arange(0, GROUPS)
    live = rows < groups_per_slice - chunk * GROUPS
    offs = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]
    words = tl.load(words_ptr + first * HALF + offs, mask=live[:, None], other=0)
    even, odd = _unpack_words(words, KIND)
    if IS_NV:
        # A NaN here may be dropped by max: the slice amax pass has flagged its slice already.
        block_amax = tl.max(tl.maximum(tl.abs(even), tl.abs(odd)), axis=1)
        amax = tl.load(amax_ptr + slice_id)
        ts = tl.math.div_rn(amax, _AMAX_TO_SCALE)  # nvfp4_tensor_scales; a NaN amax stays NaN
        ts = tl.where(ts < _TS_MIN, _TS_MIN, ts)
        if chunk == 0:
            tl.store(ts_ptr + slice_id, ts)
        byte, inv_scale = _nv_scales(block_amax, ts, tl.math.div_rn(1.0, ts * _E2M1_MAX))
    else:
        # |x| as int32 bits: they order like the floats, and NaN above Inf flags the block.
        amax_bits = tl.max(tl.maximum(even.to(tl.int32, bitcast=True) & 0x7FFFFFFF,
                                      odd.to(tl.int32, bitcast=True) & 0x7FFFFFFF), axis=1)
        byte, inv_scale = _mx_scales(amax_bits)
    codes = _e2m1_code(even, inv_scale[:, None]) | (_e2m1_code(odd, inv_scale[:, None]) << 4)
    tl.store(packed_ptr + first * HALF + offs, codes.to(tl.uint8), mask=live[:, None])
    tl.store(scales_ptr + first + rows, byte.to(tl.uint8), mask=live)


@triton.jit
def _decode_kernel(packed_ptr, scales_ptr, ts_ptr, table_ptr, out_ptr, groups_per_page,
                   chunks_per_page, num_blocks, stride_layer, stride_kv, stride_page,
                   HALF: tl.constexpr, GROUPS: tl.constexpr, IS_NV: tl.constexpr,
                   PAGED: tl.constexpr, KIND: tl.constexpr, EXACT: tl.constexpr):
    """One program decodes GROUPS scale blocks of one page-run of one (layer, K/V) slice.

    A run of a slice is ``groups_per_page`` contiguous blocks both in the encoded tensor and in
    its target page; unpaged decoding is one run per slice that lands in page 0. Strides and
    out_ptr are in output words (pairs of elements).
    """
    pid = tl.program_id(0)
    run = pid // chunks_per_page
    slice_id = run // num_blocks
    page = tl.load(table_ptr + run % num_blocks).to(tl.int64) if PAGED else 0
    start = (pid % chunks_per_page) * GROUPS
    first = run.to(tl.int64) * groups_per_page + start
    rows = tl.arange(0, GROUPS)
    live = rows < groups_per_page - start
    offs = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]
    packed = tl.load(packed_ptr + first * HALF + offs, mask=live[:, None], other=0).to(tl.int32)
    byte = tl.load(scales_ptr + first + rows, mask=live, other=0).to(tl.int32)
    if IS_NV:
        half_scale = _e4m3_value(byte) * tl.load(ts_ptr + slice_id) * 0.5
    else:  # 2^(byte - 128) as float32 bits, subnormal for bytes 0 and 1
        half_scale = tl.where(byte >= 2, (byte - 1) << 23, 0x200000 << tl.minimum(byte, 1)).to(
            tl.float32, bitcast=True)
    even = _e2m1_scaled(packed & 0x0F, half_scale[:, None])
    odd = _e2m1_scaled(packed >> 4, half_scale[:, None])
    base = (slice_id // 2).to(tl.int64) * stride_layer + (slice_id % 2) * stride_kv
    base += page * stride_page + start * HALF
    tl.store(out_ptr + base + offs, _pack_words(even, odd, KIND, EXACT), mask=live[:, None])


def _check_input(x: torch.Tensor, block: int, name: str) -> tuple[int, int, int, int, int]:
    check_tensor(x, name, _INPUT_DTYPES, ndim=5)
    if x.shape[1] != 2 or x.shape[-1] % block:
        raise CodecError(
            f"{name}: shape {tuple(x.shape)} is not [num_layers, 2, num_tokens, num_kv_heads, "
            f"head_dim] with head_dim a multiple of {block}"
        )
    return tuple(x.shape)


def _encode(x: torch.Tensor, block: int, name: str) -> Fp4Parts:
    num_layers, _, _, _, head_dim = _check_input(x, block, name)
    lead, device, is_nv = x.shape[:-1], x.device, block == NV_BLOCK
    packed = torch.empty((*lead, head_dim // 2), dtype=torch.uint8, device=device)
    scales = torch.empty((*lead, head_dim // block), dtype=torch.uint8, device=device)
    ts = torch.empty((num_layers, 2), dtype=torch.float32, device=device) if is_nv else None
    num_slices = 2 * num_layers
    if x.numel() == 0:  # an empty run: all-zero slices, as the reference scales them
        if ts is not None:
            ts.fill_(TENSOR_SCALE_MIN)
        return Fp4Parts(packed, scales, ts)
    slice_numel = x.numel() // num_slices
    groups_per_slice = slice_numel // block
    groups, warps = ENCODE_CONFIG[block]
    chunks = triton.cdiv(groups_per_slice, groups)
    amax = torch.zeros(num_slices, dtype=torch.int32, device=device) if is_nv else scales
    with on_device(device):
        if is_nv:
            amax_chunks = triton.cdiv(slice_numel, AMAX_ELEMENTS)
            _slice_amax_kernel[(num_slices * amax_chunks,)](
                x, amax, slice_numel, amax_chunks, ELEMENTS=AMAX_ELEMENTS, num_warps=AMAX_WARPS)
        _encode_kernel[(num_slices * chunks,)](
            x.view(_WORDS[x.dtype]), amax.view(torch.float32) if is_nv else amax,
            ts if is_nv else scales, packed, scales, groups_per_slice, chunks, HALF=block // 2,
            GROUPS=groups, IS_NV=is_nv, KIND=_KINDS[x.dtype], num_warps=warps)
    return Fp4Parts(packed, scales, ts)


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
    groups, warps = DECODE_CONFIG[block]
    chunks = triton.cdiv(groups_per_page, groups)
    programs = num_layers * 2 * num_blocks * chunks
    if programs == 0:
        return
    words = target.view(_WORDS[target.dtype])
    strides = words.stride() if table is not None else (*words.stride()[:2], 0)
    is_nv = block == NV_BLOCK
    with on_device(target.device):
        _decode_kernel[(programs,)](
            parts.packed, parts.scales, parts.tensor_scales if is_nv else parts.scales,
            table if table is not None else parts.scales, words, groups_per_page, chunks,
            num_blocks, strides[0], strides[1], strides[2], HALF=block // 2, GROUPS=groups,
            IS_NV=is_nv, PAGED=table is not None, KIND=_KINDS[target.dtype],
            EXACT=interpreter_enabled(), num_warps=warps)


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


__all__ = [
    "mxfp4_decode",
    "mxfp4_encode",
    "nvfp4_decode",
    "nvfp4_encode",
]
