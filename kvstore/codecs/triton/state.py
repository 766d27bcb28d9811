"""Copies of fixed-size per-sequence states (Mamba conv and SSM states, gated-delta-net states)
between an engine's state slots and device pages of a ``state`` cache group, in one launch.

An engine keeps, per layer, each part of the state as a tensor ``[num_slots, *shape]`` whose
slots are contiguous runs of bytes (a row per slot). A snapshot's page holds the group's bytes
(``kvstore.groups``, "bytes" storage): per layer, a region of ``layer_bytes`` with the parts
back to back from its start and zeros after them. ``save`` copies slots into pages (zeroing
the padding, so a page is byte for byte what ``CacheGroup.pack`` makes of the same state),
``load`` copies pages into slots. Nothing is decoded: states are stored bit for bit (an error
in a recurrent state compounds, so only raw and zstd pages take them).

CPU tensors run the kernel through Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvstore.codecs.device import SECTION_ALIGN
from kvstore.codecs.triton.common import kernels_runnable, on_device
from kvstore.codecs.triton.passthrough import _words
from kvstore.errors import CodecError
from kvstore.groups import CacheGroup, GroupKind

# Words a program moves: 1024 int64 words, 8 KiB, eight 16-byte loads a thread in flight. Not
# swept on a GPU yet: `kvstore bench gpu --groups`' state rows measure it against a device copy.
CHUNK_WORDS = 1024
WARPS = 4


@dataclass(frozen=True)
class StateLayout:
    """Where each part of each layer's state lives in an engine, and in a snapshot's page.

    Built by ``StateLayout.of`` from the engine's tensors, which must outlive it.
    """

    group: CacheGroup
    block_tokens: int  # the cache's block size (it sets the page's shape)
    num_slots: int
    device: torch.device
    ptrs: tuple[int, ...]  # [layer][part] base addresses, flattened
    slot_strides: tuple[int, ...]  # [layer][part] bytes from one slot to the next
    part_offsets: tuple[int, ...]  # bytes from a layer's region start, padding last
    part_bytes: tuple[int, ...]  # a slot's bytes of each part, padding last
    layer_bytes: int  # a page's bytes per layer
    page_bytes: int  # the whole page (the group's storage block)
    word: int  # bytes a thread moves at a time
    aligned: bool  # every address and size a multiple of 16 bytes
    tensors: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, group: CacheGroup, block_tokens: int,
           states: Sequence[Mapping[str, torch.Tensor]]) -> StateLayout:
        """``states[l][part]``: layer l's tensor ``[num_slots, *part.shape]`` of the part's
        dtype, each slot contiguous; every layer and part with the same slot count."""
        if group.kind is not GroupKind.STATE:
            raise CodecError(f"StateLayout takes a state group, got {group.label}")
        if len(states) != group.num_layers:
            raise CodecError(f"{len(states)} layers of states, the group has "
                             f"{group.num_layers}")
        spec = group.storage_spec(block_tokens)
        layer_bytes = 2 * block_tokens * spec.num_kv_heads * spec.head_dim
        ptrs, strides, tensors, devices, slots = [], [], [], set(), set()
        for layer, parts in enumerate(states):
            if not isinstance(parts, Mapping) or set(parts) != {p.name for p in group.parts}:
                raise CodecError(f"layer {layer}: state parts must be "
                                 f"{[p.name for p in group.parts]}")
            for part in group.parts:
                t = parts[part.name]
                if not isinstance(t, torch.Tensor) or t.dtype != part.torch_dtype or \
                        tuple(t.shape[1:]) != part.shape or t.dim() != 1 + len(part.shape):
                    raise CodecError(
                        f"layer {layer} part {part.name}: expected [num_slots, *{part.shape}] "
                        f"{part.dtype}, got {tuple(getattr(t, 'shape', ()))} "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
                if t.shape[0] and not t[0].is_contiguous():
                    raise CodecError(f"layer {layer} part {part.name}: a slot's state must be "
                                     f"contiguous, strides {t.stride()}")
                ptrs.append(t.data_ptr())
                strides.append(t.stride(0) * t.element_size())
                tensors.append(t)
                devices.add(t.device)
                slots.add(t.shape[0])
        if len(devices) != 1 or len(slots) != 1:
            raise CodecError(f"state tensors on {sorted(map(str, devices))} with slot counts "
                             f"{sorted(slots)}: they must share one device and one slot count")
        offsets, sizes, at = [], [], 0
        for part in group.parts:
            offsets.append(at)
            sizes.append(part.nbytes)
            at += part.nbytes
        offsets.append(at)
        sizes.append(layer_bytes - at)  # the padding, zeroed by saves
        values = (*ptrs, *strides, *offsets, *sizes, layer_bytes)
        word = 8
        for value in values:
            word = math.gcd(word, value) if value else word
        aligned = all(v % 16 == 0 for v in values)
        return cls(group, block_tokens, slots.pop(), devices.pop(), tuple(ptrs), tuple(strides),
                   tuple(offsets), tuple(sizes), layer_bytes, group.num_layers * layer_bytes,
                   word, aligned, tuple(tensors))

    def check_slots(self, slots: Sequence[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(slots, dtype=torch.int64).cpu()
        if ids.dim() != 1:
            raise CodecError(f"slots must be 1-D, got shape {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_slots):
            raise CodecError(f"slots span [{int(ids.min())}, {int(ids.max())}], the engine "
                             f"keeps {self.num_slots}")
        return ids


@triton.jit
def _state_kernel(table_ptr, num_pages, chunks_per_layer, NUM_LAYERS: tl.constexpr,
                  NUM_PARTS: tl.constexpr, LAYER_BYTES: tl.constexpr, CHUNK: tl.constexpr,
                  WORD: tl.constexpr, SAVE: tl.constexpr, ALIGNED: tl.constexpr):
    """One program per chunk of CHUNK words that has bytes to move: the chunks of a (page,
    layer) are those of its parts in order, then the padding's (saves only), as the table's
    cumulative chunk counts say. ALIGNED: every address is a multiple of 16 bytes (16-byte
    loads and stores)."""
    pid = tl.program_id(0).to(tl.int64)
    within = pid % chunks_per_layer
    layer = (pid // chunks_per_layer) % NUM_LAYERS
    b = pid // (chunks_per_layer * NUM_LAYERS)
    segs = NUM_LAYERS * NUM_PARTS
    # ptrs, strides [L * P]; offsets, sizes [P + 1] (bytes); first chunks [P + 2]
    meta = table_ptr + 2 * num_pages
    starts = meta + 2 * segs + 2 * (NUM_PARTS + 1)
    part = tl.zeros((), dtype=tl.int64)
    for p in tl.static_range(1, NUM_PARTS + 1):
        part += (within >= tl.load(starts + p)).to(tl.int64)
    chunk = within - tl.load(starts + part)
    size = tl.load(meta + 2 * segs + NUM_PARTS + 1 + part) // WORD
    if ALIGNED:  # whole 16-byte units: the mask is constant over a vector
        size = tl.multiple_of(size, 16 // WORD)
    words = chunk * CHUNK + tl.arange(0, CHUNK)
    live = words < size
    page = _words(tl.load(table_ptr + b) + layer * LAYER_BYTES
                  + tl.load(meta + 2 * segs + part), WORD, ALIGNED)
    if part == NUM_PARTS:  # the layer's padding: zeros in the page (saves only get here)
        tl.store(page + words, tl.zeros((CHUNK,), dtype=page.dtype.element_ty), mask=live)
    else:
        slot = tl.load(table_ptr + num_pages + b)
        seg = layer * NUM_PARTS + part
        engine = _words(tl.load(meta + seg) + slot * tl.load(meta + segs + seg), WORD,
                        ALIGNED)
        if SAVE:
            tl.store(page + words, tl.load(engine + words, mask=live), mask=live)
        else:
            tl.store(engine + words, tl.load(page + words, mask=live), mask=live)


def _launch(layout: StateLayout, addrs: torch.Tensor | Sequence[int],
            slots: torch.Tensor | Sequence[int], stream, save: bool) -> None:
    if not kernels_runnable(layout.device):
        raise CodecError(f"state kernels cannot run on {layout.device} here (need CUDA, or "
                         "TRITON_INTERPRET=1 for CPU tensors)")
    ids = layout.check_slots(slots)
    pages = torch.as_tensor(addrs, dtype=torch.int64).cpu()
    if pages.dim() != 1 or pages.numel() != ids.numel():
        raise CodecError(f"{pages.numel()} page addresses for {ids.numel()} slots")
    if pages.numel() and bool((pages % SECTION_ALIGN != 0).any()):
        raise CodecError(f"state page addresses must be {SECTION_ALIGN}-byte aligned")
    n = ids.numel()
    if n == 0:
        return
    w = layout.word
    chunks = [triton.cdiv(size // w, CHUNK_WORDS) for size in layout.part_bytes]
    if not save:
        chunks[-1] = 0  # a load leaves the padding alone
    starts = [0]
    for count in chunks:
        starts.append(starts[-1] + count)
    meta = torch.tensor([*layout.ptrs, *layout.slot_strides, *layout.part_offsets,
                         *layout.part_bytes, *starts], dtype=torch.int64)
    table = torch.cat([pages, ids, meta])
    with on_device(layout.device), _on_stream(layout, stream):
        if layout.device.type == "cuda":  # queued behind the stream's work (see engine.py)
            table = table.pin_memory().to(layout.device, non_blocking=True)
        grid = (n * layout.group.num_layers * starts[-1],)
        _state_kernel[grid](table, n, starts[-1], NUM_LAYERS=layout.group.num_layers,
                            NUM_PARTS=len(layout.group.parts), LAYER_BYTES=layout.layer_bytes,
                            CHUNK=CHUNK_WORDS, WORD=w, SAVE=save, ALIGNED=layout.aligned,
                            num_warps=WARPS)


def _on_stream(layout: StateLayout, stream):
    if stream is not None and layout.device.type == "cuda":
        return torch.cuda.stream(stream)
    return contextlib.nullcontext()


def save_states(layout: StateLayout, dst: torch.Tensor | Sequence[int],
                slots: torch.Tensor | Sequence[int], stream=None) -> None:
    """Copy the states in ``slots`` into the pages at byte addresses ``dst`` (one each,
    ``layout.page_bytes`` long, ``SECTION_ALIGN``-aligned), one launch on ``stream``."""
    _launch(layout, dst, slots, stream, save=True)


def load_states(layout: StateLayout, src: torch.Tensor | Sequence[int],
                slots: torch.Tensor | Sequence[int], stream=None) -> None:
    """Copy the pages at ``src`` into the states of ``slots``, one launch on ``stream``."""
    _launch(layout, src, slots, stream, save=False)


def state_page_reference(layout: StateLayout, slot: int) -> torch.Tensor:
    """The page ``save_states`` makes of ``slot``, by ``CacheGroup.pack`` (a torch reference):
    the group's canonical ``[L, 2, T, H, D]`` uint8 block."""
    parts = {}
    for i, part in enumerate(layout.group.parts):
        per_layer = layout.tensors[i::len(layout.group.parts)]
        parts[part.name] = torch.stack([t[slot].cpu() for t in per_layer])
    return layout.group.pack(parts, layout.block_tokens)
