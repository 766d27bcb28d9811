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
from kvstore.codecs.fp8 import E4M3_MAX, MIN_SCALE
from kvstore.codecs.triton.common import interpreter_enabled, kernels_runnable, on_device
from kvstore.codecs.triton.fp4 import _e2m1_scaled, _e4m3_value, _pack_words
from kvstore.codecs.triton.fp8 import _bf16_round, _e4m3_bits
from kvstore.errors import CodecError
from kvstore.spec import EngineLayout

RAW, FP8, NVFP4, MXFP4, INT4, INT2 = 0, 1, 2, 3, 4, 5  # DeviceLayout.engine_codec
ROWS = 32  # rows (one token x one kv head) per program
WARPS = 4
# (rows, warps) per codec, from a sweep on an H200 (triton 3.6, 2026-12-01, 2 GiB of 2 MiB
# blocks, bench/gpu_sweep.py): pages in device memory, and pages read from pinned host memory
# over the link, where more bytes in flight per program pay.
DEVICE_TILES = {"raw": (16, 4), "fp8_e4m3": (16, 4), "nvfp4": (32, 4), "mxfp4": (32, 4),
                "int4": (32, 4), "int2": (32, 4)}
HOST_TILES = {"raw": (128, 8), "fp8_e4m3": (64, 4), "nvfp4": (32, 4), "mxfp4": (32, 4),
              "int4": (32, 4), "int2": (32, 4)}

_MAX = tl.constexpr(E4M3_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def _rows(table_ptr, num_blocks, layer0, num_slabs, kv_stride, block_stride, token_stride, head_stride,
          H: tl.constexpr, BT: tl.constexpr, R: tl.constexpr, FP16: tl.constexpr,
          ALIGNED: tl.constexpr):
    """This program's block, slab (layer, K/V) of the block, rows of the slab and their engine
    addresses; the launch covers ``num_slabs`` slabs from layer ``layer0`` (``layers_ptr`` from
    there). Programs run in source order: the chunks of a slab, the slabs of a block, then
    the next block, so a launch streams the device pages front to back."""
    pid = tl.program_id(0).to(tl.int64)
    chunks = (BT * H + R - 1) // R
    chunk = pid % chunks
    local = (pid // chunks) % num_slabs
    b = pid // (chunks * num_slabs)
    ids_ptr = table_ptr + num_blocks
    layers_ptr = table_ptr + 2 * num_blocks
    slab = layer0 * 2 + local
    rows = chunk * R + tl.arange(0, R)
    ok = rows < BT * H
    token = rows // H
    head = rows % H
    layer_addr = tl.multiple_of(tl.load(layers_ptr + local // 2), 16)
    if FP16:
        layer = layer_addr.to(tl.pointer_type(tl.float16))
    else:
        layer = layer_addr.to(tl.pointer_type(tl.bfloat16))
    page = tl.load(ids_ptr + b).to(tl.int64)
    eng = ((slab % 2) * kv_stride + page * block_stride + token.to(tl.int64) * token_stride
           + head.to(tl.int64) * head_stride)
    if ALIGNED:  # every stride is a multiple of 8 elements: rows start on 16 bytes
        eng = tl.multiple_of(eng, 8)
    return b, slab, rows, ok, layer, eng


@triton.jit
def _fp4_to_engine(src, scales_off, ts_off, slab, r, ok, layer, eng,
                   D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr,
                   IS_NV: tl.constexpr, FP16: tl.constexpr, EXACT: tl.constexpr,
                   ALIGNED: tl.constexpr, R: tl.constexpr):
    """Decode rows of e2m1 pairs (even element in the low nibble) into engine words."""
    half = tl.arange(0, D_PAD // 2)
    mask = ok[:, None] & (half < D // 2)[None, :]
    packed = tl.load(src.to(tl.pointer_type(tl.uint8)) + r[:, None] * (D // 2) + half[None, :],
                     mask=mask, other=0).to(tl.int32)
    scales = (src + scales_off).to(tl.pointer_type(tl.uint8)) + r[:, None] * (D // BLOCK)
    if D == D_PAD:  # one load per scale block, broadcast over its pairs in registers
        groups = tl.arange(0, D // BLOCK)
        byte = tl.load(scales + groups[None, :], mask=ok[:, None], other=0).to(tl.int32)
    else:  # a head_dim that is not a power of two: one (cached) load per pair
        byte = tl.load(scales + ((2 * half) // BLOCK)[None, :], mask=mask, other=0).to(tl.int32)
    if IS_NV:
        ts = tl.load((src + ts_off).to(tl.pointer_type(tl.float32)) + slab)
        half_scale = _e4m3_value(byte) * ts * 0.5
    else:  # 2^(byte - 128) as float32 bits, subnormal for bytes 0 and 1
        half_scale = tl.where(byte >= 2, (byte - 1) << 23,
                              0x200000 << tl.minimum(byte, 1)).to(tl.float32, bitcast=True)
    if D == D_PAD:
        half_scale = tl.reshape(tl.broadcast_to(half_scale[:, :, None],
                                                (R, D // BLOCK, BLOCK // 2)), (R, D // 2))
    even = _e2m1_scaled(packed & 0x0F, half_scale)
    odd = _e2m1_scaled(packed >> 4, half_scale)
    words = _pack_words(even, odd, 2 if FP16 else 1, EXACT)
    at = tl.multiple_of(eng // 2, 4) if ALIGNED else eng // 2  # in words of two elements
    dst = layer.to(tl.pointer_type(tl.int32), bitcast=True) + (at[:, None] + half[None, :])
    tl.store(dst, words.to(tl.int32), mask=mask)


@triton.jit
def _kivi_to_engine(src, slab, rows, ok, layer, eng, D: tl.constexpr, D_PAD: tl.constexpr,
                    H: tl.constexpr, BT: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                    TQ: tl.constexpr, K_META: tl.constexpr, K_RES: tl.constexpr,
                    V_CODES: tl.constexpr, V_META: tl.constexpr, FP16: tl.constexpr):
    """Decode rows of a KIVI page (kvstore.codecs.kivi: K per channel over groups of G tokens,
    the last BT - TQ tokens of K kept whole; V per token over groups of G channels)."""
    cols = tl.arange(0, D_PAD)
    mask = ok[:, None] & (cols < D)[None, :]
    layer_i = (slab // 2).to(tl.int64)
    token = (rows // H).to(tl.int64)
    head = (rows % H).to(tl.int64)
    packed = D * BITS // 8
    byte = (cols * BITS) // 8
    shift = (cols % (8 // BITS)) * BITS
    channel = head[:, None] * D + cols[None, :]  # the channel within the layer's H * D
    if slab % 2 == 0:  # K
        quantised = token < TQ
        qmask = mask & quantised[:, None]
        codes = tl.load(src.to(tl.pointer_type(tl.uint8)) + ((layer_i * TQ + token) * H + head)[
            :, None] * packed + byte[None, :], mask=qmask, other=0).to(tl.int32)
        meta = (src + K_META).to(tl.pointer_type(tl.float16))
        at = ((layer_i * (TQ // G) + token // G) * 2)[:, None] * (H * D) + channel
        scale = tl.load(meta + at, mask=qmask, other=0.0).to(tl.float32)
        zero = tl.load(meta + at + H * D, mask=qmask, other=0.0).to(tl.float32)
        x = ((codes >> shift[None, :]) & ((1 << BITS) - 1)).to(tl.float32) * scale + zero
        if BT > TQ:
            rmask = mask & (token >= TQ)[:, None]
            if FP16:
                residual = (src + K_RES).to(tl.pointer_type(tl.float16))
            else:
                residual = (src + K_RES).to(tl.pointer_type(tl.bfloat16))
            kept = tl.load(residual + ((layer_i * (BT - TQ) + token - TQ) * H + head)[:, None] * D
                           + cols[None, :], mask=rmask, other=0.0).to(tl.float32)
            x = tl.where(quantised[:, None], x, kept)
    else:  # V
        codes = tl.load((src + V_CODES).to(tl.pointer_type(tl.uint8)) + (
            (layer_i * BT + token) * H + head)[:, None] * packed + byte[None, :], mask=mask,
            other=0).to(tl.int32)
        meta = (src + V_META).to(tl.pointer_type(tl.float16))
        at = ((layer_i * BT + token) * 2)[:, None] * (H * D // G) + channel // G
        scale = tl.load(meta + at, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(meta + at + H * D // G, mask=mask, other=0.0).to(tl.float32)
        x = ((codes >> shift[None, :]) & ((1 << BITS) - 1)).to(tl.float32) * scale + zero
    tl.store(layer + eng[:, None] + cols[None, :], x.to(layer.dtype.element_ty), mask=mask)


@triton.jit
def _to_engine_kernel(table_ptr, num_blocks, layer0, num_slabs, scales_off,
                      kv_stride, block_stride, token_stride, head_stride,
                      H: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                      R: tl.constexpr, CODEC: tl.constexpr, FP16: tl.constexpr,
                      ALIGNED: tl.constexpr, TS_OFF: tl.constexpr = 0,
                      EXACT: tl.constexpr = False, BITS: tl.constexpr = 4, G: tl.constexpr = 1,
                      TQ: tl.constexpr = 0, K_META: tl.constexpr = 0, K_RES: tl.constexpr = 0,
                      V_CODES: tl.constexpr = 0, V_META: tl.constexpr = 0):
    b, slab, rows, ok, layer, eng = _rows(table_ptr, num_blocks, layer0, num_slabs, kv_stride, block_stride,
                                          token_stride, head_stride, H, BT, R, FP16, ALIGNED)
    if CODEC >= 4:
        src = tl.multiple_of(tl.load(table_ptr + b), 16)
        _kivi_to_engine(src, slab, rows, ok, layer, eng, D, D_PAD, H, BT, BITS, G, TQ, K_META,
                        K_RES, V_CODES, V_META, FP16)
        return
    if CODEC >= 2:
        src = tl.multiple_of(tl.load(table_ptr + b), 16)
        r = (slab * (BT * H) + rows).to(tl.int64)
        _fp4_to_engine(src, scales_off, TS_OFF, slab, r, ok, layer, eng, D, D_PAD,
                       16 if CODEC == 2 else 32, CODEC == 2, FP16, EXACT, ALIGNED, R)
        return
    cols = tl.arange(0, D_PAD)
    mask = ok[:, None] & (cols < D)[None, :]
    src = tl.multiple_of(tl.load(table_ptr + b), 16)
    r = (slab * (BT * H) + rows).to(tl.int64)  # the row in the canonical block
    if CODEC == 0:
        if FP16:
            base = src.to(tl.pointer_type(tl.float16))
        else:
            base = src.to(tl.pointer_type(tl.bfloat16))
        x = tl.load(base + r[:, None] * D + cols[None, :], mask=mask, other=0.0)
    else:
        codes = tl.load(src.to(tl.pointer_type(tl.uint8)) + r[:, None] * D + cols[None, :],
                        mask=mask, other=0)
        scale = tl.load((src + scales_off).to(tl.pointer_type(tl.bfloat16)) + r, mask=ok,
                        other=0.0).to(tl.float32)
        x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
    tl.store(layer + eng[:, None] + cols[None, :], x.to(layer.dtype.element_ty), mask=mask)


@triton.jit
def _from_engine_kernel(table_ptr, num_blocks, layer0, num_slabs, scales_off,
                        kv_stride, block_stride, token_stride, head_stride,
                        H: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                        R: tl.constexpr, CODEC: tl.constexpr, FP16: tl.constexpr,
                        ALIGNED: tl.constexpr, HW_ROUND: tl.constexpr):
    b, slab, rows, ok, layer, eng = _rows(table_ptr, num_blocks, layer0, num_slabs, kv_stride, block_stride,
                                          token_stride, head_stride, H, BT, R, FP16, ALIGNED)
    cols = tl.arange(0, D_PAD)
    mask = ok[:, None] & (cols < D)[None, :]
    dst = tl.multiple_of(tl.load(table_ptr + b), 16)
    r = (slab * (BT * H) + rows).to(tl.int64)
    x = tl.load(layer + eng[:, None] + cols[None, :], mask=mask, other=0.0)
    if CODEC == 0:
        if FP16:
            base = dst.to(tl.pointer_type(tl.float16))
        else:
            base = dst.to(tl.pointer_type(tl.bfloat16))
        tl.store(base + r[:, None] * D + cols[None, :], x, mask=mask)
    else:
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.maximum(_bf16_round(tl.math.div_rn(amax, tl.zeros_like(amax) + _MAX)),
                           _MIN_SCALE)
        inv = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
        y = tl.minimum(tl.maximum(x * inv[:, None], -_MAX), _MAX)
        if HW_ROUND:
            codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            codes = _e4m3_bits(y)
        tl.store(dst.to(tl.pointer_type(tl.uint8)) + r[:, None] * D + cols[None, :], codes,
                 mask=mask)
        tl.store((dst + scales_off).to(tl.pointer_type(tl.bfloat16)) + r,
                 scale.to(tl.bfloat16), mask=ok)


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
    if dev.shape != (layout.num_layers, 2, layout.block_tokens, layout.num_kv_heads,
                     layout.head_dim) or dev.dtype != layout.dtype:
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
            tile: tuple[int, int] | None = None, **extra) -> None:
    layers = range(layout.num_layers) if layers is None else layers
    with on_device(layout.device), _on_stream(layout, stream):
        table = _table(layout, dev, addrs, block_ids, layers)
        n = (table.numel() - len(layers)) // 2
        if n == 0 or not layers:
            return
        scales_off = dev.sections[1].offset if len(dev.sections) > 1 else 0
        rows, warps = tile or DEVICE_TILES.get(dev.codec, (ROWS, WARPS))
        chunks = triton.cdiv(layout.block_tokens * layout.num_kv_heads, rows)
        grid = (n * 2 * len(layers) * chunks,)
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
              layers: range | None = None, tile: tuple[int, int] | None = None) -> None:
    """Decode the device pages at addresses ``src`` into engine pages ``block_ids``: every
    layer (or the run ``layers``), K and V, in one launch on ``stream`` (None: current)."""
    extra = {}
    if dev.engine_codec >= INT4:
        k_codes, _, _, _, _ = dev.sections
        extra = {"BITS": 4 if dev.codec == "int4" else 2, "G": dev.group_size,
                 "TQ": k_codes.shape[1], "K_META": dev.sections[1].offset,
                 "K_RES": dev.sections[2].offset, "V_CODES": dev.sections[3].offset,
                 "V_META": dev.sections[4].offset, "enable_fp_fusion": False}
    elif dev.engine_codec >= NVFP4:
        extra = {"TS_OFF": dev.sections[2].offset if dev.engine_codec == NVFP4 else 0,
                 "EXACT": interpreter_enabled()}
    _launch(_to_engine_kernel, layout, dev, src, block_ids, stream, layers, tile, **extra)


def from_engine(layout: EngineLayout, dev: DeviceLayout, dst: torch.Tensor | list[int],
                block_ids: torch.Tensor | list[int], stream: torch.cuda.Stream | None = None,
                hw_round: bool | None = None, tile: tuple[int, int] | None = None) -> None:
    """Encode engine pages ``block_ids`` into device pages at ``dst``, one launch; fp8 pages
    are bit-identical to ``encode_fp8_reference`` (``hw_round``: see ``encode_fp8``)."""
    if dev.codec not in ENCODABLE:
        raise CodecError(f"the engine kernels decode {dev.codec} pages but do not encode them; "
                         f"saves take {list(ENCODABLE)}")
    if hw_round is None:
        hw_round = not interpreter_enabled()
    _launch(_from_engine_kernel, layout, dev, dst, block_ids, stream, None, tile, HW_ROUND=hw_round,
            enable_fp_fusion=False)


def page_tensors(pool: torch.Tensor, dev: DeviceLayout, offset: int) -> list[torch.Tensor]:
    """Views of the sections of the device page at byte ``offset`` of a uint8 ``pool``."""
    out = []
    for s in dev.sections:
        start = offset + s.offset
        out.append(pool[start:start + s.nbytes].view(s.dtype).view(s.shape))
    return out
