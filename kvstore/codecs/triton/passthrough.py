"""Byte copies between device pages and an engine's paged cache of one-byte elements (fp8
caches, which engines keep as uint8 or float8 tensors): rows moved bit for bit as words.

Pages of such a cache are the cache's bytes in the canonical ``[L, 2, T, H, D]`` order
(``kvstore.spec.EngineLayout`` with a uint8 spec); nothing is decoded, so NaN payloads, both
fp8 flavours and any scale convention survive a round trip. A row is the ``D`` bytes of one
token and head; it moves as words of the widest type that every stride, row, and layer base
address is a multiple of (int64 where it can: a 128-byte fp8 head row is 16 words). Where a
(layer, K/V) slab of a block is contiguous in the engine's memory as in the page (vLLM's MLA
cache), rows are re-cut into ``SLAB_ROW_BYTES`` pieces of the slab, whatever ``D`` is.

The launch table is ``kvstore.codecs.triton.engine``'s: page addresses, engine block ids, then
the layers' base addresses, one int64 tensor on the cache's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvstore.errors import CodecError

# (rows, warps) of a launch: 64 rows of a 128-byte fp8 head row (16 int64 words) is 8 KiB a
# program, four 16-byte loads a thread in flight. Not swept on a GPU yet: `kvstore bench gpu
# --groups`' fp8 rows measure it against a device copy (tile= overrides it).
ROWS = 64
WARPS = 4
SLAB_ROW_BYTES = 256  # a contiguous slab is copied as rows of this many bytes
_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


@dataclass(frozen=True, slots=True)
class RowPlan:
    """How a launch cuts each slab into rows: ``rows`` of ``row_words`` words of ``word``
    bytes; row ``r`` is token ``r // heads``, head ``r % heads``; strides are in words;
    ``aligned``: every row starts on 16 bytes in the engine and in the page."""

    word: int
    heads: int
    rows: int  # per slab
    row_words: int
    kv_stride: int
    block_stride: int
    token_stride: int
    head_stride: int
    aligned: bool


def plan_rows(layout) -> RowPlan:
    """The row plan of an ``EngineLayout`` of one-byte elements (its strides are bytes)."""
    h, d, bt = layout.num_kv_heads, layout.head_dim, layout.block_tokens
    kv, block, token, head = (layout.kv_stride, layout.block_stride, layout.token_stride,
                              layout.head_stride)
    slab = bt * h * d
    if (head == d or h == 1) and (token == h * d or bt == 1) and slab % SLAB_ROW_BYTES == 0:
        # The slab is one run of bytes in the engine, as in the page: re-cut it.
        d, h, bt, token, head = SLAB_ROW_BYTES, 1, slab // SLAB_ROW_BYTES, SLAB_ROW_BYTES, 0
    values = (d, kv, block, token, head, *layout.layer_ptrs)
    word = 8
    for value in values:
        while value % word:
            word //= 2
    aligned = word == 8 and all(v % 16 == 0 for v in values)
    return RowPlan(word, h, bt * h, d // word, kv // word, block // word, token // word,
                   head // word, aligned)


@triton.jit
def _rows_kernel(table_ptr, num_blocks, layer0, num_slabs, kv_stride, block_stride,
                 token_stride, head_stride, HEADS: tl.constexpr, ROWS_PER_SLAB: tl.constexpr,
                 W: tl.constexpr, W_PAD: tl.constexpr, R: tl.constexpr, WORD: tl.constexpr,
                 TO_ENGINE: tl.constexpr, ALIGNED: tl.constexpr):
    """One program: ``R`` rows of one slab (layer, K/V) of one block, in source order."""
    pid = tl.program_id(0).to(tl.int64)
    chunks: tl.constexpr = (ROWS_PER_SLAB + R - 1) // R
    chunk = pid % chunks
    local = (pid // chunks) % num_slabs
    b = pid // (chunks * num_slabs)
    rows = chunk * R + tl.arange(0, R)
    ok = rows < ROWS_PER_SLAB
    token = (rows // HEADS).to(tl.int64)
    head = (rows % HEADS).to(tl.int64)
    page = tl.load(table_ptr + b)
    block = tl.load(table_ptr + num_blocks + b)
    layer = tl.load(table_ptr + 2 * num_blocks + local // 2)
    eng = (local % 2) * kv_stride + block * block_stride + token * token_stride \
        + head * head_stride
    slab = layer0 * 2 + local
    at = (slab * ROWS_PER_SLAB + rows.to(tl.int64)) * W
    cols = tl.arange(0, W_PAD)
    mask = ok[:, None] & (cols < W)[None, :]
    if ALIGNED:  # rows start on 16 bytes on both sides: 16-byte loads and stores
        at = tl.multiple_of(at, 16 // WORD)
        eng = tl.multiple_of(eng, 16 // WORD)
    page_ptr = _words(page, WORD, ALIGNED) + tl.max_contiguous(at[:, None] + cols[None, :],
                                                                [1, W_PAD])
    eng_ptr = _words(layer, WORD, ALIGNED) + tl.max_contiguous(eng[:, None] + cols[None, :],
                                                                [1, W_PAD])
    if TO_ENGINE:
        tl.store(eng_ptr, tl.load(page_ptr, mask=mask), mask=mask)
    else:
        tl.store(page_ptr, tl.load(eng_ptr, mask=mask), mask=mask)


@triton.jit
def _words(addr, WORD: tl.constexpr, ALIGNED: tl.constexpr):
    """The int64 byte address ``addr`` as a pointer to words of WORD bytes; ALIGNED promises
    16-byte alignment, on the pointers (promised on the integer it is lost, and every load
    goes scalar: see ``engine._at``)."""
    base = addr.to(tl.pointer_type(tl.uint8))
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    if WORD == 8:
        ptr = base.to(tl.pointer_type(tl.int64), bitcast=True)
    elif WORD == 4:
        ptr = base.to(tl.pointer_type(tl.int32), bitcast=True)
    elif WORD == 2:
        ptr = base.to(tl.pointer_type(tl.int16), bitcast=True)
    else:
        ptr = base.to(tl.pointer_type(tl.int8), bitcast=True)
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


def copy_rows(layout, table: torch.Tensor, num_blocks: int, layers: range, *,
              to_engine: bool, tile: tuple[int, int] | None = None) -> None:
    """Launch the copy of ``num_blocks`` blocks described by ``table`` (see the module
    docstring) for the run ``layers``, on the current stream of the cache's device."""
    if layout.dtype.itemsize != 1:
        raise CodecError(f"byte pass-through is for one-byte engine caches, not {layout.dtype}")
    if num_blocks == 0 or not layers:
        return
    plan = plan_rows(layout)
    rows, warps = tile or (ROWS, WARPS)
    rows = min(rows, triton.next_power_of_2(plan.rows))
    grid = (num_blocks * 2 * len(layers) * triton.cdiv(plan.rows, rows),)
    _rows_kernel[grid](table, num_blocks, layers.start, 2 * len(layers), plan.kv_stride,
                       plan.block_stride, plan.token_stride, plan.head_stride,
                       HEADS=plan.heads, ROWS_PER_SLAB=plan.rows, W=plan.row_words,
                       W_PAD=triton.next_power_of_2(plan.row_words), R=rows, WORD=plan.word,
                       TO_ENGINE=to_engine, ALIGNED=plan.aligned, num_warps=warps)
