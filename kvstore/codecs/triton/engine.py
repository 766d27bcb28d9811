"""Kernels between device pages (``kvstore.codecs.device``) and an engine's paged KV cache
(``kvstore.spec.EngineLayout``), through address tables: one launch moves a whole prefix.

``to_engine`` decodes block i's device page, at byte address ``src[i]``, into engine page
``block_ids[i]`` of every layer; ``from_engine`` encodes engine pages into device pages at
``dst[i]``. Addresses are raw: a GPU pool slot, a staging buffer, or pinned host memory that the
GPU reads over unified addressing. Every address must be ``SECTION_ALIGN``-aligned (the kernels
promise the compiler 16-byte alignment for wide loads).

CPU tensors run the same kernels through Triton's interpreter (TRITON_INTERPRET=1); fp8 encode
rounds with integer arithmetic there (the interpreter's float8 cast is wrong, see DESIGN.md).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from kvstore.codecs.device import ENCODABLE, SECTION_ALIGN, DeviceLayout
from kvstore.codecs.triton.common import interpreter_enabled, kernels_runnable, on_device
from kvstore.codecs.triton.fp4 import _e2m1_code, _e4m3_value, _mx_scales, _nv_scales
from kvstore.codecs.triton.fp8 import _quantise_rows
from kvstore.codecs.triton.passthrough import copy_rows
from kvstore.errors import CodecError
from kvstore.spec import EngineLayout

RAW, FP8, NVFP4, MXFP4, INT4, INT2 = 0, 1, 2, 3, 4, 5  # DeviceLayout.engine_codec
ROWS = 32  # rows (one token x one kv head) per program
WARPS = 4
# (rows, warps) per codec, from sweeps on an H200 (triton 3.6, 2026-12-01, 2 GiB of 2 MiB
# blocks, bench/gpu_sweep.py, ratios to a device copy or to the link): pages in device memory
# (loads and saves), and pages read from pinned host memory over the link, where more bytes in
# flight per program pay.
# KIVI pages run two tiles a program (a third number): int2 0.832 against 0.818 of a copy,
# int4 0.856 against 0.845 (one sweep; fp8 and raw pages gained nothing from it).
DEVICE_TILES = {"raw": (16, 4), "fp8_e4m3": (64, 8), "nvfp4": (32, 4), "mxfp4": (64, 4),
                "int4": (64, 4, 2), "int2": (64, 4, 2)}
# fp4 saves: one program per (block, layer, K/V) slab, its rows in chunks of this many, so
# nvfp4's tensor scale (one per slab) is known before the slab's first block is quantised.
FP4_SAVE_TILES = {"nvfp4": (32, 4), "mxfp4": (32, 4)}  # H200 sweep: 0.40 / 0.57 of a copy
_AMAX_TO_TS = tl.constexpr(448.0 * 6.0)  # nvfp4_tensor_scales: slab amax / (448 * 6)
_TS_MIN = tl.constexpr(2.0**-126)
HOST_TILES = {"raw": (128, 8), "fp8_e4m3": (128, 4), "nvfp4": (128, 4), "mxfp4": (64, 4),
              "int4": (128, 4), "int2": (128, 4)}


@triton.jit
def _at(addr, DTYPE: tl.constexpr, offset=0):
    """The int64 byte address ``addr`` (16-byte aligned) plus ``offset`` bytes (a multiple of
    16) as a pointer to DTYPE elements. The alignment is promised on pointers: promised on
    the integer, or on a pointer cast from a sum of integers, it is lost and every load and
    store goes scalar (seen in the PTX that triton 3.6 makes for sm_90)."""
    base = tl.multiple_of(addr.to(tl.pointer_type(tl.uint8)), 16) + offset
    return tl.multiple_of(base.to(tl.pointer_type(DTYPE), bitcast=True), 16)


@triton.jit
def _rows(pid, table_ptr, num_blocks, layer0, num_slabs, kv_stride, block_stride,
          token_stride, head_stride, H: tl.constexpr, BT: tl.constexpr, R: tl.constexpr,
          FP16: tl.constexpr, ALIGNED: tl.constexpr):
    """Tile ``pid``'s block, slab (layer, K/V) of the block, rows of the slab and their engine
    addresses; the launch covers ``num_slabs`` slabs from layer ``layer0`` (``layers_ptr`` from
    there). Tiles run in source order: the chunks of a slab, the slabs of a block, then
    the next block, so a launch streams the device pages front to back."""
    chunks = (BT * H + R - 1) // R
    chunk = pid % chunks
    local = (pid // chunks) % num_slabs
    b = pid // (chunks * num_slabs)
    rows = chunk * R + tl.arange(0, R)
    ok, layer, eng = _engine_rows(table_ptr, num_blocks, b, local, layer0 * 2 + local, rows,
                                  kv_stride, block_stride, token_stride, head_stride, H, BT,
                                  FP16, ALIGNED)
    return b, layer0 * 2 + local, rows, ok, layer, eng


@triton.jit
def _engine_rows(table_ptr, num_blocks, b, local, slab, rows, kv_stride, block_stride,
                 token_stride, head_stride, H: tl.constexpr, BT: tl.constexpr,
                 FP16: tl.constexpr, ALIGNED: tl.constexpr):
    """Which ``rows`` (token x head) of slab ``slab`` exist, the engine tensor of its layer
    (``local``: the slab's index in the launch) and their element offsets in it."""
    ids_ptr = table_ptr + num_blocks
    layers_ptr = table_ptr + 2 * num_blocks
    ok = rows < BT * H
    token = rows // H
    head = rows % H
    layer_addr = tl.multiple_of(tl.load(layers_ptr + local // 2), 16)
    if FP16:
        layer = _at(layer_addr, tl.float16)
    else:
        layer = _at(layer_addr, tl.bfloat16)
    page = tl.load(ids_ptr + b).to(tl.int64)
    eng = ((slab % 2) * kv_stride + page * block_stride + token.to(tl.int64) * token_stride
           + head.to(tl.int64) * head_stride)
    if ALIGNED:  # every stride is a multiple of 8 elements: rows start on 16 bytes
        eng = tl.multiple_of(eng, 8)
    return ok, layer, eng


@triton.jit
def _f16_at(bits):
    """float32 of the fp16 whose bits are the low 16 of int32 ``bits`` (exact)."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _store_rows(layer, eng, x, ok, D: tl.constexpr, D_PAD: tl.constexpr, EXACT: tl.constexpr):
    """Store float32 rows ``x`` [R, D_PAD] at engine element offsets ``eng`` of ``layer``.
    EXACT rounds to bf16 with integers (the interpreter's cast truncates)."""
    cols = tl.arange(0, D_PAD)
    mask = ok[:, None] & (cols < D)[None, :]
    ptr = layer + eng[:, None] + cols[None, :]
    if EXACT and layer.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        half = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
        tl.store(ptr, half.to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, x.to(layer.dtype.element_ty), mask=mask)


@triton.jit
def _units(src, offset, row_units, unit, live, BITS: tl.constexpr, WIDE: tl.constexpr):
    """Units of eight codes (int32 for 4-bit codes, int16 for 2-bit ones) ``unit`` of rows
    starting at unit ``row_units``, as int32. One unit a thread, whose eight outputs are one
    16-byte store, unless WIDE: from host memory, where the bytes in flight set the pace,
    16-byte loads pay for the trip through shared memory that meets the stores' layout."""
    at = row_units[:, None] + unit[None, :]
    if not WIDE:
        at = tl.max_contiguous(at, [1, 1])
    if BITS == 4:
        return tl.load(_at(src, tl.int32, offset) + at, mask=live, other=0)
    return tl.load(_at(src, tl.int16, offset) + at, mask=live, other=0).to(tl.int32)


@triton.jit
def _fp4_to_engine(src, scales_off, ts_off, slab, r, ok, layer, eng,
                   D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr,
                   IS_NV: tl.constexpr, EXACT: tl.constexpr, R: tl.constexpr,
                   WIDE: tl.constexpr):
    """Decode rows of e2m1 codes (even element in the low nibble) into the engine's rows.

    Each int32 of codes holds four pairs. A code's three magnitude bits moved to bits 9-11 of
    an fp16, its sign to bit 15, make the fp16 of its value times 2^-14 (code 1, 0.5, lands as
    the subnormal 2^-15): a few bit operations per two codes, an exact conversion, and products
    that round once, as the reference's do.
    """
    W: tl.constexpr = D_PAD // 8  # int32 words of codes per row
    word = tl.arange(0, W)
    live = ok[:, None] & (word < D // 8)[None, :]
    w = _units(src, 0, r * (D // 8), word, live, 4, WIDE)
    byte = tl.load(_at(src, tl.uint8, scales_off) + r[:, None] * (D // BLOCK)
                   + ((word * 8) // BLOCK)[None, :], mask=live, other=0).to(tl.int32)
    if IS_NV:
        ts = tl.load(_at(src, tl.float32, ts_off) + slab)
        scale = _e4m3_value(byte) * ts
    else:  # 2^(byte - 127) as float32 bits (subnormal for byte 0); byte 255 is NaN
        scale = tl.where(byte >= 1, byte << 23, 0x400000).to(tl.float32, bitcast=True)
        scale = tl.where(byte == 255, float("nan"), scale)
    scale = scale[:, :, None]
    sign: tl.constexpr = -(1 << 31) | 0x8000
    # fp16 pairs (pair k's element in half k // 2) of the even and the odd codes
    e02 = ((w << 9) & 0x0E000E00) | ((w << 12) & sign)
    e13 = ((w << 1) & 0x0E000E00) | ((w << 4) & sign)
    o02 = ((w << 5) & 0x0E000E00) | ((w << 8) & sign)
    o13 = ((w >> 3) & 0x0E000E00) | (w & sign)
    even = tl.join(tl.join(_f16_at(e02), _f16_at(e02 >> 16)),
                   tl.join(_f16_at(e13), _f16_at(e13 >> 16)))
    odd = tl.join(tl.join(_f16_at(o02), _f16_at(o02 >> 16)),
                  tl.join(_f16_at(o13), _f16_at(o13 >> 16)))
    # [R, W, 2, 2] holds pair 2 * a + b at [a, b]; the 2^14 goes back first, exactly
    even = tl.reshape(even, (R, W, 4)) * 16384.0 * scale
    odd = tl.reshape(odd, (R, W, 4)) * 16384.0 * scale
    x = tl.reshape(tl.join(even, odd), (R, D_PAD))
    _store_rows(layer, eng, x, ok, D, D_PAD, EXACT)


@triton.jit
def _kivi_to_engine(src, slab, rows, ok, layer, eng, D: tl.constexpr, D_PAD: tl.constexpr,
                    H: tl.constexpr, BT: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                    TQ: tl.constexpr, K_META: tl.constexpr, K_RES: tl.constexpr,
                    V_CODES: tl.constexpr, V_META: tl.constexpr, FP16: tl.constexpr,
                    EXACT: tl.constexpr, R: tl.constexpr, WIDE: tl.constexpr):
    """Decode rows of a KIVI page (kvstore.codecs.kivi: K per channel over groups of G tokens,
    the last BT - TQ tokens of K kept whole; V per token over groups of G channels), eight
    channels a unit of codes, low bits first. Per-channel operands are loaded as rows and seen
    as [R, units, 8], the codes' shape, without moving them."""
    W: tl.constexpr = D_PAD // 8  # units of codes per row
    unit = tl.arange(0, W)
    cols = tl.arange(0, D_PAD)
    live = ok[:, None] & (unit < D // 8)[None, :]
    at_cols = ok[:, None] & (cols < D)[None, :]
    shift = (tl.arange(0, 8) * BITS)[None, None, :]
    layer_i = (slab // 2).to(tl.int64)
    token = (rows // H).to(tl.int64)
    head = (rows % H).to(tl.int64)
    if slab % 2 == 0:  # K
        quantised = token < TQ
        w = _units(src, 0, ((layer_i * TQ + token) * H + head) * (D // 8), unit,
                   live & quantised[:, None], BITS, WIDE)
        meta = _at(src, tl.float16, K_META)
        k_at = ((layer_i * (TQ // G) + token // G) * 2 * (H * D) + head * D)[:, None] + cols[
            None, :]
        k_live = at_cols & quantised[:, None]
        k_scale = tl.reshape(tl.load(meta + k_at, mask=k_live, other=0.0), (R, W, 8))
        k_zero = tl.reshape(tl.load(meta + k_at + H * D, mask=k_live, other=0.0), (R, W, 8))
        x = ((w[:, :, None] >> shift) & ((1 << BITS) - 1)).to(tl.float32) * k_scale.to(
            tl.float32) + k_zero.to(tl.float32)
        if BT > TQ:
            if FP16:
                residual = _at(src, tl.float16, K_RES)
            else:
                residual = _at(src, tl.bfloat16, K_RES)
            r_at = (((layer_i * (BT - TQ) + token - TQ) * H + head) * D)[:, None] + cols[None, :]
            kept = tl.load(residual + r_at, mask=at_cols & (token >= TQ)[:, None], other=0.0)
            x = tl.where(quantised[:, None, None], x,
                         tl.reshape(kept, (R, W, 8)).to(tl.float32))
    else:  # V
        w = _units(src, V_CODES, ((layer_i * BT + token) * H + head) * (D // 8), unit, live,
                   BITS, WIDE)
        meta = _at(src, tl.float16, V_META)
        base = (layer_i * BT + token) * 2 * (H * D // G) + head * (D // G)
        if G >= 8:  # a unit's codes share their group: one scale and zero a unit
            v_at = base[:, None] + ((unit * 8) // G)[None, :]
            v_scale = tl.load(meta + v_at, mask=live, other=0.0).to(tl.float32)[:, :, None]
            v_zero = tl.load(meta + v_at + H * D // G, mask=live, other=0.0).to(tl.float32)[
                :, :, None]
        else:
            v_at = base[:, None] + (cols // G)[None, :]
            v_scale = tl.reshape(tl.load(meta + v_at, mask=at_cols, other=0.0),
                                 (R, W, 8)).to(tl.float32)
            v_zero = tl.reshape(tl.load(meta + v_at + H * D // G, mask=at_cols, other=0.0),
                                (R, W, 8)).to(tl.float32)
        x = ((w[:, :, None] >> shift) & ((1 << BITS) - 1)).to(tl.float32) * v_scale + v_zero
    _store_rows(layer, eng, tl.reshape(x, (R, D_PAD)), ok, D, D_PAD, EXACT)


@triton.jit
def _to_engine_kernel(table_ptr, num_blocks, layer0, num_slabs, scales_off,
                      kv_stride, block_stride, token_stride, head_stride,
                      H: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                      R: tl.constexpr, CODEC: tl.constexpr, FP16: tl.constexpr,
                      ALIGNED: tl.constexpr, TS_OFF: tl.constexpr = 0,
                      EXACT: tl.constexpr = False, BITS: tl.constexpr = 4, G: tl.constexpr = 1,
                      TQ: tl.constexpr = 0, K_META: tl.constexpr = 0, K_RES: tl.constexpr = 0,
                      V_CODES: tl.constexpr = 0, V_META: tl.constexpr = 0,
                      WIDE: tl.constexpr = False, STEPS: tl.constexpr = 1):
    """STEPS tiles a program, unrolled, so the loads of one are in flight beside another's."""
    first = tl.program_id(0).to(tl.int64) * STEPS
    tiles = num_blocks * num_slabs * ((BT * H + R - 1) // R)
    for step in tl.static_range(STEPS):
        if first + step < tiles:
            _tile_to_engine(first + step, table_ptr, num_blocks, layer0, num_slabs, scales_off,
                            kv_stride, block_stride, token_stride, head_stride, H, BT, D,
                            D_PAD, R, CODEC, FP16, ALIGNED, TS_OFF, EXACT, BITS, G, TQ, K_META,
                            K_RES, V_CODES, V_META, WIDE)


@triton.jit
def _tile_to_engine(pid, table_ptr, num_blocks, layer0, num_slabs, scales_off,
                    kv_stride, block_stride, token_stride, head_stride,
                    H: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                    R: tl.constexpr, CODEC: tl.constexpr, FP16: tl.constexpr,
                    ALIGNED: tl.constexpr, TS_OFF: tl.constexpr, EXACT: tl.constexpr,
                    BITS: tl.constexpr, G: tl.constexpr, TQ: tl.constexpr,
                    K_META: tl.constexpr, K_RES: tl.constexpr, V_CODES: tl.constexpr,
                    V_META: tl.constexpr, WIDE: tl.constexpr):
    b, slab, rows, ok, layer, eng = _rows(pid, table_ptr, num_blocks, layer0, num_slabs,
                                          kv_stride, block_stride, token_stride, head_stride,
                                          H, BT, R, FP16, ALIGNED)
    if CODEC >= 4:
        src = tl.multiple_of(tl.load(table_ptr + b), 16)
        _kivi_to_engine(src, slab, rows, ok, layer, eng, D, D_PAD, H, BT, BITS, G, TQ, K_META,
                        K_RES, V_CODES, V_META, FP16, EXACT, R, WIDE)
    elif CODEC >= 2:
        src = tl.multiple_of(tl.load(table_ptr + b), 16)
        r = (slab * (BT * H) + rows).to(tl.int64)
        _fp4_to_engine(src, scales_off, TS_OFF, slab, r, ok, layer, eng, D, D_PAD,
                       16 if CODEC == 2 else 32, CODEC == 2, EXACT, R, WIDE)
    else:
        _fp8_or_raw_to_engine(table_ptr, b, slab, rows, ok, layer, eng, scales_off, H, BT, D,
                              D_PAD, CODEC, FP16, WIDE)


@triton.jit
def _fp8_or_raw_to_engine(table_ptr, b, slab, rows, ok, layer, eng, scales_off,
                          H: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
                          D_PAD: tl.constexpr, CODEC: tl.constexpr, FP16: tl.constexpr,
                          WIDE: tl.constexpr):
    cols = tl.arange(0, D_PAD)
    mask = ok[:, None] & (cols < D)[None, :]
    src = tl.multiple_of(tl.load(table_ptr + b), 16)
    r = (slab * (BT * H) + rows).to(tl.int64)  # the row in the canonical block
    if CODEC == 0:
        if FP16:
            base = _at(src, tl.float16)
        else:
            base = _at(src, tl.bfloat16)
        x = tl.load(base + r[:, None] * D + cols[None, :], mask=mask, other=0.0)
    else:
        # Eight codes a thread, as many as its 16-byte store of outputs holds, unless WIDE
        # (see _units).
        at = r[:, None] * D + cols[None, :]
        if not WIDE:
            at = tl.max_contiguous(at, [1, 8])
        codes = tl.load(_at(src, tl.uint8) + at, mask=mask, other=0)
        scale = tl.load(_at(src, tl.bfloat16, scales_off) + r, mask=ok,
                        other=0.0).to(tl.float32)
        x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
    tl.store(layer + eng[:, None] + cols[None, :], x.to(layer.dtype.element_ty), mask=mask)


@triton.jit
def _from_engine_kernel(table_ptr, num_blocks, layer0, num_slabs, scales_off,
                        kv_stride, block_stride, token_stride, head_stride,
                        H: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                        R: tl.constexpr, CODEC: tl.constexpr, FP16: tl.constexpr,
                        ALIGNED: tl.constexpr, HW_ROUND: tl.constexpr):
    b, slab, rows, ok, layer, eng = _rows(tl.program_id(0).to(tl.int64), table_ptr, num_blocks,
                                          layer0, num_slabs, kv_stride, block_stride,
                                          token_stride, head_stride, H, BT, R, FP16, ALIGNED)
    cols = tl.arange(0, D_PAD)
    mask = ok[:, None] & (cols < D)[None, :]
    dst = tl.multiple_of(tl.load(table_ptr + b), 16)
    r = (slab * (BT * H) + rows).to(tl.int64)
    x = tl.load(layer + eng[:, None] + cols[None, :], mask=mask, other=0.0)
    if CODEC == 0:
        if FP16:
            base = _at(dst, tl.float16)
        else:
            base = _at(dst, tl.bfloat16)
        tl.store(base + r[:, None] * D + cols[None, :], x, mask=mask)
    else:
        codes, scale = _quantise_rows(x.to(tl.float32), HW_ROUND)
        at = tl.max_contiguous(r[:, None] * D + cols[None, :], [1, 8])  # as the loads above
        tl.store(_at(dst, tl.uint8) + at, codes, mask=mask)
        tl.store(_at(dst, tl.bfloat16, scales_off) + r,
                 scale.to(tl.bfloat16), mask=ok)


@triton.jit
def _fp4_from_engine_kernel(table_ptr, num_blocks, num_slabs, scales_off,
                            kv_stride, block_stride, token_stride, head_stride,
                            H: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
                            D_PAD: tl.constexpr, R: tl.constexpr, FP16: tl.constexpr,
                            ALIGNED: tl.constexpr, IS_NV: tl.constexpr, TS_OFF: tl.constexpr):
    """Encode one slab (layer, K/V) of one block into nvfp4 or mxfp4 device pages, bytes as
    ``kvstore.codecs.fp4``'s references make them for the block.

    nvfp4's tensor scale is the slab's amax / (448 * 6) (|x| as integer bits, so a NaN wins
    and marks the slab): the slab is read once for it and again, from cache, to quantise it
    (reading a slab once, held whole in one 128-row tile, was slower on an H200); mxfp4 reads
    it once.
    """
    CHUNKS: tl.constexpr = (BT * H + R - 1) // R
    pid = tl.program_id(0).to(tl.int64)
    local = pid % num_slabs
    b = pid // num_slabs
    dst = tl.multiple_of(tl.load(table_ptr + b), 16)
    strides = (kv_stride, block_stride, token_stride, head_stride)
    ts = 1.0
    if IS_NV:
        amax = tl.zeros((R,), dtype=tl.int32)
        for c in tl.static_range(CHUNKS):
            rows = c * R + tl.arange(0, R)
            x, _ = _slab_rows(table_ptr, num_blocks, b, local, rows, strides, H, BT, D, D_PAD,
                              FP16, ALIGNED)
            amax = tl.maximum(amax, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
        ts = _tensor_scale(tl.max(amax, axis=0), dst, local, TS_OFF)
    for c in tl.static_range(CHUNKS):
        rows = c * R + tl.arange(0, R)
        x, ok = _slab_rows(table_ptr, num_blocks, b, local, rows, strides, H, BT, D, D_PAD,
                           FP16, ALIGNED)
        _fp4_encode_rows(x, rows, ok, local, dst, scales_off, ts, H, BT, D, D_PAD, R, IS_NV)


@triton.jit
def _slab_rows(table_ptr, num_blocks, b, local, rows, strides, H: tl.constexpr,
               BT: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, FP16: tl.constexpr,
               ALIGNED: tl.constexpr):
    """Float32 ``rows`` [R, D_PAD] of slab ``local`` of block ``b`` from the engine's cache
    (0 where masked), and which rows exist."""
    kv_stride, block_stride, token_stride, head_stride = strides
    ok, layer, eng = _engine_rows(table_ptr, num_blocks, b, local, local, rows, kv_stride,
                                  block_stride, token_stride, head_stride, H, BT, FP16, ALIGNED)
    cols = tl.arange(0, D_PAD)
    mask = ok[:, None] & (cols < D)[None, :]
    return tl.load(layer + eng[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32), ok


@triton.jit
def _tensor_scale(amax_bits, dst, local, TS_OFF: tl.constexpr):
    """nvfp4's tensor scale of a slab from its amax (int32 bits of |x|: a NaN stays NaN),
    stored in the page."""
    ts = tl.math.div_rn(amax_bits.to(tl.float32, bitcast=True), _AMAX_TO_TS)
    ts = tl.where(ts < _TS_MIN, _TS_MIN, ts)
    tl.store(_at(dst, tl.float32, TS_OFF) + local, ts)
    return ts


@triton.jit
def _fp4_encode_rows(x, rows, ok, local, dst, scales_off, ts, H: tl.constexpr,
                     BT: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, R: tl.constexpr,
                     IS_NV: tl.constexpr):
    """Quantise float32 rows ``x`` [R, D_PAD] of slab ``local`` into the page at ``dst``."""
    BLOCK: tl.constexpr = 16 if IS_NV else 32
    NB: tl.constexpr = D_PAD // BLOCK  # scale blocks per row, padding included
    blocks = tl.reshape(x, (R, NB, BLOCK))
    if IS_NV:
        block_amax = tl.max(tl.abs(blocks), axis=2)
        byte, inv_scale = _nv_scales(block_amax, ts, tl.math.div_rn(1.0, ts * 6.0))
    else:
        bits = tl.max(blocks.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
        byte, inv_scale = _mx_scales(bits)
    even, odd = tl.split(tl.reshape(x, (R, NB, BLOCK // 2, 2)))
    codes = (_e2m1_code(even, inv_scale[:, :, None])
             | (_e2m1_code(odd, inv_scale[:, :, None]) << 4))
    r = (local * (BT * H) + rows).to(tl.int64)  # the row in the canonical block
    half = tl.arange(0, D_PAD // 2)
    tl.store(_at(dst, tl.uint8) + r[:, None] * (D // 2) + half[None, :],
             tl.reshape(codes, (R, D_PAD // 2)).to(tl.uint8),
             mask=ok[:, None] & (half < D // 2)[None, :])
    nb = tl.arange(0, NB)
    tl.store(_at(dst, tl.uint8, scales_off) + r[:, None] * (D // BLOCK) + nb[None, :],
             byte.to(tl.uint8), mask=ok[:, None] & (nb < D // BLOCK)[None, :])


def _host_ints(values: torch.Tensor | list[int], name: str) -> torch.Tensor:
    """``values`` as a 1-D int64 CPU tensor (a device tensor is copied back: a sync)."""
    t = torch.as_tensor(values, dtype=torch.int64)
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dim() != 1:
        raise CodecError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t


def _table(layout: EngineLayout, dev: DeviceLayout, addrs: torch.Tensor | list[int],
           block_ids: torch.Tensor | list[int], layers: range) -> torch.Tensor:
    """The launch's table on the cache's device, checked on the host first: page addresses,
    engine block ids, then the layers' base addresses, one int64 tensor, one async copy."""
    stored = torch.uint8 if layout.is_bytes else layout.dtype
    if dev.shape != (layout.num_layers, 2, layout.block_tokens, layout.num_kv_heads,
                     layout.head_dim) or dev.dtype != stored:
        raise CodecError(f"device pages of shape {dev.shape} {dev.dtype} do not fit an engine "
                         f"cache of {layout.num_layers} layers, {layout.block_tokens}-token "
                         f"pages, {layout.num_kv_heads} heads of {layout.head_dim}, "
                         f"{layout.dtype}")
    if not kernels_runnable(layout.device):
        raise CodecError(f"engine kernels cannot run on {layout.device} here (need CUDA, or "
                         "TRITON_INTERPRET=1 for CPU tensors)")
    if layers.step != 1 or layers.start < 0 or layers.stop > layout.num_layers:
        raise CodecError(f"layers {layers} are not a run of the cache's {layout.num_layers}")
    ids = _host_ints(block_ids, "block_ids")
    layout.check_block_ids(ids)
    table = _host_ints(addrs, "page addresses")
    if table.numel() != ids.numel():
        raise CodecError(f"{table.numel()} page addresses for {ids.numel()} engine blocks")
    if table.numel() and bool((table % SECTION_ALIGN != 0).any()):
        raise CodecError(f"device page addresses must be {SECTION_ALIGN}-byte aligned")
    pointers = torch.tensor(layout.layer_ptrs[layers.start:layers.stop], dtype=torch.int64)
    packed = torch.cat([table, ids, pointers])
    if layout.device.type != "cuda":
        return packed
    # Pinned, so the copy is queued behind the stream's work instead of waiting for it; the
    # caching host allocator keeps the buffer until the copy ran.
    return packed.pin_memory().to(layout.device, non_blocking=True)


def _launch(kernel, layout: EngineLayout, dev: DeviceLayout, addrs, block_ids,
            stream: torch.cuda.Stream | None, layers: range | None = None,
            tile: tuple[int, ...] | None = None, **extra) -> None:
    layers = range(layout.num_layers) if layers is None else layers
    with on_device(layout.device), _on_stream(layout, stream):
        table = _table(layout, dev, addrs, block_ids, layers)
        n = (table.numel() - len(layers)) // 2
        if n == 0 or not layers:
            return
        scales_off = dev.sections[1].offset if len(dev.sections) > 1 else 0
        rows, warps, *steps = tile or DEVICE_TILES.get(dev.codec, (ROWS, WARPS))
        if steps:  # tiles a program (the loads' kernel only)
            extra["STEPS"] = steps[0]
        chunks = triton.cdiv(layout.block_tokens * layout.num_kv_heads, rows)
        grid = (triton.cdiv(n * 2 * len(layers) * chunks, extra.get("STEPS", 1)),)
        strides = (layout.kv_stride, layout.block_stride, layout.token_stride,
                   layout.head_stride)
        aligned = all(s % 8 == 0 for s in strides) and all(
            p % 16 == 0 for p in layout.layer_ptrs)
        kernel[grid](table, n, layers.start, 2 * len(layers), scales_off, *strides,
                     H=layout.num_kv_heads, BT=layout.block_tokens, D=layout.head_dim,
                     ALIGNED=aligned, D_PAD=triton.next_power_of_2(layout.head_dim), R=rows,
                     CODEC=dev.engine_codec, FP16=layout.dtype == torch.float16,
                     num_warps=warps, **extra)


def _on_stream(layout: EngineLayout, stream: torch.cuda.Stream | None):
    if stream is not None and layout.device.type == "cuda":
        return torch.cuda.stream(stream)
    return contextlib.nullcontext()


def to_engine(layout: EngineLayout, dev: DeviceLayout, src: torch.Tensor | list[int],
              block_ids: torch.Tensor | list[int], stream: torch.cuda.Stream | None = None,
              layers: range | None = None, tile: tuple[int, int] | None = None,
              host: bool = False) -> None:
    """Decode the device pages at addresses ``src`` into engine pages ``block_ids``: every
    layer (or the run ``layers``), K and V, in one launch on ``stream`` (None: current).
    ``host``: the pages lie in pinned host memory, read over the link (other tiles, wider
    loads); ``tile`` (rows, warps) overrides the tile of either. A one-byte (fp8) cache
    takes raw pages only, copied as bytes (``passthrough``)."""
    if layout.is_bytes:
        _copy_bytes(layout, dev, src, block_ids, stream, layers, tile, to_engine=True)
        return
    extra = {"WIDE": host}
    if dev.engine_codec >= INT4:
        k_codes, _, _, _, _ = dev.sections
        extra |= {"BITS": 4 if dev.codec == "int4" else 2, "G": dev.group_size,
                 "TQ": k_codes.shape[1], "K_META": dev.sections[1].offset,
                 "K_RES": dev.sections[2].offset, "V_CODES": dev.sections[3].offset,
                 "V_META": dev.sections[4].offset, "EXACT": interpreter_enabled(),
                 "enable_fp_fusion": False}
    elif dev.engine_codec >= NVFP4:
        extra |= {"TS_OFF": dev.sections[2].offset if dev.engine_codec == NVFP4 else 0,
                 "EXACT": interpreter_enabled()}
    tile = tile or (HOST_TILES if host else DEVICE_TILES).get(dev.codec)
    _launch(_to_engine_kernel, layout, dev, src, block_ids, stream, layers, tile, **extra)


def from_engine(layout: EngineLayout, dev: DeviceLayout, dst: torch.Tensor | list[int],
                block_ids: torch.Tensor | list[int], stream: torch.cuda.Stream | None = None,
                hw_round: bool | None = None, tile: tuple[int, int] | None = None) -> None:
    """Encode engine pages ``block_ids`` into device pages at ``dst``, one launch; fp8 pages
    are bit-identical to ``encode_fp8_reference`` (``hw_round``: see ``encode_fp8``), nvfp4
    and mxfp4 pages to ``kvstore.codecs.fp4``'s references of each block. A one-byte (fp8)
    cache gives raw pages only, its bytes as they are (``passthrough``)."""
    if layout.is_bytes:
        _copy_bytes(layout, dev, dst, block_ids, stream, None, tile, to_engine=False)
        return
    if dev.codec not in ENCODABLE:
        raise CodecError(f"the engine kernels decode {dev.codec} pages but do not encode them; "
                         f"saves take {list(ENCODABLE)}")
    if tile is not None and len(tile) != 2:
        raise CodecError(f"a save's tile is (rows, warps), got {tile}")
    if dev.engine_codec in (NVFP4, MXFP4):
        _launch_fp4_save(layout, dev, dst, block_ids, stream, tile)
        return
    if hw_round is None:
        hw_round = not interpreter_enabled()
    _launch(_from_engine_kernel, layout, dev, dst, block_ids, stream, None, tile, HW_ROUND=hw_round,
            enable_fp_fusion=False)


def _copy_bytes(layout: EngineLayout, dev: DeviceLayout, addrs, block_ids,
                stream: torch.cuda.Stream | None, layers: range | None,
                tile: tuple[int, ...] | None, *, to_engine: bool) -> None:
    """A one-byte cache's pages: raw only (a lossy codec would re-quantise fp8 bytes, and
    their scales are the engine's), moved bit for bit."""
    if dev.codec != "raw":
        raise CodecError(f"codec {dev.codec} cannot {'decode into' if to_engine else 'encode'} "
                         f"an engine cache of {layout.dtype}: fp8 engine pages are stored raw "
                         "(or zstd on the host), bit for bit")
    layers = range(layout.num_layers) if layers is None else layers
    with on_device(layout.device), _on_stream(layout, stream):
        table = _table(layout, dev, addrs, block_ids, layers)
        n = (table.numel() - len(layers)) // 2
        copy_rows(layout, table, n, layers, to_engine=to_engine,
                  tile=tuple(tile[:2]) if tile else None)


def _launch_fp4_save(layout: EngineLayout, dev: DeviceLayout, dst, block_ids,
                     stream: torch.cuda.Stream | None, tile: tuple[int, int] | None) -> None:
    """One program per (block, layer, K/V) slab: ``_fp4_from_engine_kernel``."""
    layers = range(layout.num_layers)
    with on_device(layout.device), _on_stream(layout, stream):
        table = _table(layout, dev, dst, block_ids, layers)
        n = (table.numel() - len(layers)) // 2
        if n == 0:
            return
        rows, warps = tile or FP4_SAVE_TILES[dev.codec]
        strides = (layout.kv_stride, layout.block_stride, layout.token_stride,
                   layout.head_stride)
        aligned = all(s % 8 == 0 for s in strides) and all(
            p % 16 == 0 for p in layout.layer_ptrs)
        is_nv = dev.engine_codec == NVFP4
        _fp4_from_engine_kernel[(n * 2 * len(layers),)](
            table, n, 2 * len(layers), dev.sections[1].offset, *strides,
            H=layout.num_kv_heads, BT=layout.block_tokens, D=layout.head_dim,
            D_PAD=triton.next_power_of_2(layout.head_dim), R=rows,
            FP16=layout.dtype == torch.float16, ALIGNED=aligned, IS_NV=is_nv,
            TS_OFF=dev.sections[2].offset if is_nv else 0, num_warps=warps)


def page_tensors(pool: torch.Tensor, dev: DeviceLayout, offset: int) -> list[torch.Tensor]:
    """Views of the sections of the device page at byte ``offset`` of a uint8 ``pool``."""
    out = []
    for s in dev.sections:
        start = offset + s.offset
        out.append(pool[start:start + s.nbytes].view(s.dtype).view(s.shape))
    return out
