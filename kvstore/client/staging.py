"""Host-page staging for the engine's GPU path: pages in host memory (``HostPages``) moved over
the link in chunks through a device ring (``StagingRing``), each chunk decoded into the engine's
pages as it lands."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.api import BlockLocations
from kvstore.codecs.base import unpack_blob
from kvstore.codecs.device import SECTION_ALIGN, DeviceLayout
from kvstore.codecs.triton.engine import to_engine
from kvstore.errors import InvalidArgument
from kvstore.keys import KEY_BYTES
from kvstore.page import HEADER_BYTES, KEY_SLICE, META_LEN_SLICE, PAGE_MAGIC, parse_page
from kvstore.spec import EngineLayout

# A page's fixed header (kvstore.page): magic at 0, the block key at 28, the meta length at 60.
_PAGE_FIXED = HEADER_BYTES
_PAGE_MAGIC = np.frombuffer(PAGE_MAGIC, dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class HostPages:
    """Pages in host memory for a ``StagingRing``: page i is the ``DeviceLayout.span`` bytes
    of its packed sections at byte ``starts[i]`` of ``regions[index[i]]`` (1-D uint8 CPU
    tensors: arena mappings, pinned for the link's rate)."""

    regions: list[torch.Tensor]
    index: np.ndarray  # int per page
    starts: np.ndarray  # int64 per page

    def __len__(self) -> int:
        return len(self.starts)


class StagingRing:
    """Device staging for pages that cross the link: ``slots`` chunks of ``chunk_pages``
    device pages. ``load`` copies pages in chunks on a copy stream and decodes each chunk into
    the engine on the caller's stream as soon as it landed, so transfer and decode overlap
    (on an H200: 0.98 of the link for raw pages, 1.95x the link in engine bytes for fp8, 3.5x
    for nvfp4; 2026-12-01, BENCHMARKS.md).

    Pages that follow each other in host memory at whole multiples of ``SECTION_ALIGN`` apart,
    with a small gap between them (an arena's slab slots; see ``GAP_BYTES``), move in one copy,
    the gaps with them, and keep their distances in the slot: one copy per run instead of one
    per page."""

    # A copy issued from Python costs about 3 us beyond its bytes (4096 copies of 256 KiB ran
    # at 34.4 of 55.3 GB/s on an H200, DESIGN.md): about 160 KB at the link's rate. A gap up
    # to 64 KiB, or 1/16 of a page (an arena slot's slack is 4 KiB), is cheaper to carry.
    GAP_FRACTION = 1 / 16
    GAP_BYTES = 64 << 10

    # Bytes of pages a chunk carries unless told how many pages: the same bytes for every
    # codec, so compressed pages do not pay the host's work per chunk (copies, events, a
    # launch) more often per byte. On an H200 (bench/gpu_staged.py, 2026-12-01) 24 MiB matched
    # or beat 32 pages a chunk for every codec (nvfp4 3.54x the link against 3.52x, int2 3.99x
    # against 3.90x); 40 and 64 MiB lost 4-7% (the first chunk lands later).
    CHUNK_BYTES = 24 << 20
    MAX_CHUNK_PAGES = 128  # small pages: a chunk's gaps and pads stay a bounded allocation

    def __init__(self, dev: DeviceLayout, device: torch.device, chunk_pages: int | None = None,
                 slots: int = 3) -> None:
        self.dev = dev
        self.chunk_pages = chunk_pages or min(max(1, self.CHUNK_BYTES // dev.span),
                                              self.MAX_CHUNK_PAGES)
        self.max_gap = max(int(dev.span * self.GAP_FRACTION), self.GAP_BYTES)
        # Each page takes at most its span, the gap after it and one alignment pad.
        self.slot_bytes = self.chunk_pages * (dev.span + self.max_gap + SECTION_ALIGN)
        self.slots = [aligned(self.slot_bytes, device) for _ in range(slots)]
        cuda = device.type == "cuda"
        self._copy = torch.cuda.Stream(device) if cuda else None
        self._freed = [torch.cuda.Event() if cuda else None for _ in self.slots]
        self._used = [False] * slots

    def load(self, layout: EngineLayout, dev: DeviceLayout, pages: HostPages,
             ids: torch.Tensor, stream: torch.cuda.Stream | None = None) -> list[object]:
        """Decode ``pages`` into engine pages ``ids`` (an int64 CPU tensor); returns the event
        of the last chunk (None on the CPU)."""
        cuda = self._copy is not None
        compute = (stream or torch.cuda.current_stream(layout.device)) if cuda else None
        ids = torch.as_tensor(ids, dtype=torch.int64)
        runs = self._runs(pages)
        last = None
        for c, start in enumerate(range(0, len(pages), self.chunk_pages)):
            k = c % len(self.slots)
            stop = min(start + self.chunk_pages, len(pages))
            slot = self.slots[k]
            with _on(self._copy):
                if cuda and self._used[k]:
                    self._copy.wait_event(self._freed[k])
                at = _copy_runs(slot, pages, runs, start, stop, dev.span)
                landed = torch.cuda.Event() if cuda else None
                if cuda:
                    landed.record(self._copy)
            if cuda:
                compute.wait_event(landed)
            to_engine(layout, dev, torch.from_numpy(at + slot.data_ptr()), ids[start:stop],
                      compute)
            if cuda:
                self._freed[k].record(compute)
                self._used[k] = True
                last = self._freed[k]
        return [last]

    def _runs(self, pages: HostPages) -> np.ndarray:
        """Whether page i moves in one copy with page i - 1 (False for the first), for all
        pages at once."""
        step = np.diff(pages.starts)
        joined = np.zeros(len(pages), dtype=bool)
        joined[1:] = ((pages.index[1:] == pages.index[:-1]) & (step >= self.dev.span)
                      & (step - self.dev.span <= self.max_gap) & (step % SECTION_ALIGN == 0))
        return joined


def _copy_runs(slot: torch.Tensor, pages: HostPages, joined: np.ndarray, start: int,
               stop: int, span: int) -> np.ndarray:
    """Copy pages ``start:stop`` into ``slot``, one copy per run of joined pages; returns each
    page's byte offset in the slot (``SECTION_ALIGN``-aligned)."""
    cuda = slot.device.type == "cuda"
    firsts = np.flatnonzero(~joined[start + 1:stop]) + start + 1  # where later runs begin
    bounds = [start, *firsts.tolist(), stop]
    at = np.empty(stop - start, dtype=np.int64)
    cursor = 0
    for first, end in itertools.pairwise(bounds):
        base = int(pages.starts[first])
        nbytes = int(pages.starts[end - 1]) - base + span
        at[first - start:end - start] = pages.starts[first:end] - base + cursor
        source = pages.regions[int(pages.index[first])][base:base + nbytes]
        slot[cursor:cursor + nbytes].copy_(source, non_blocking=cuda)
        cursor = -(-(cursor + nbytes) // SECTION_ALIGN) * SECTION_ALIGN
    return at


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def aligned(nbytes: int, device: torch.device) -> torch.Tensor:
    raw = torch.empty(nbytes + SECTION_ALIGN, dtype=torch.uint8, device=device)
    pad = -raw.data_ptr() % SECTION_ALIGN
    return raw[pad:pad + nbytes]


def host_pages(maps, blocks: BlockLocations, dev: DeviceLayout,
               pin: Callable[[memoryview], None]) -> HostPages:
    """Where the section bytes of leased host pages lie in this client's mappings of their
    regions (each mapped once, and handed to ``pin``).

    The daemon verified the pages when it published them, nobody can change them since,
    and only their tenant maps them: they are parsed, not re-hashed (a 2 MiB hash costs
    more than its transfer). Pages of one namespace and codec share their framing: the
    first page of each (page length, meta length) is parsed in full, and every page whose
    header has its magic, names its key and has those lengths has its sections at the
    same offset, checked for the whole batch at once. A lease with a page that fails is
    refused, with what that page's full parse finds wrong.
    """
    regions, starts = [], np.empty(len(blocks), dtype=np.int64)
    keys = np.frombuffer(blocks.keys, dtype=np.uint8).reshape(-1, KEY_BYTES)
    offsets = blocks.offsets.astype(np.int64)
    lengths = blocks.lengths.astype(np.int64)
    for r, region in enumerate(blocks.regions):
        mine = np.flatnonzero(blocks.region_index == r)
        if not len(mine):
            regions.append(torch.empty(0, dtype=torch.uint8))
            continue
        view = maps.view(region, 0, int((offsets[mine] + lengths[mine]).max()))
        pin(view)
        memory = np.frombuffer(view, dtype=np.uint8)
        if bool((lengths[mine] < _PAGE_FIXED).any()):
            raise InvalidArgument(f"the daemon named a page of region {region} shorter "
                                  "than a page header")
        headers = memory[offsets[mine, None] + np.arange(_PAGE_FIXED)]  # [n, header]
        meta_len = headers[:, META_LEN_SLICE].copy().view("<u4")[:, 0].astype(np.int64)
        framed = ((headers[:, :4] == _PAGE_MAGIC).all(axis=1)
                  & (headers[:, KEY_SLICE] == keys[mine]).all(axis=1))
        if not framed.all():  # parsed in full, such a page says what is wrong with it
            _sections_at(view, blocks, int(mine[np.argmin(framed)]), dev)
            raise InvalidArgument(f"a page of region {region} has a header that does not "
                                  "name its block")
        _, first, which = np.unique(np.stack([lengths[mine], meta_len], axis=1),
                                    axis=0, return_index=True, return_inverse=True)
        start = np.array([_sections_at(view, blocks, int(mine[f]), dev)
                          for f in first], dtype=np.int64)
        starts[mine] = offsets[mine] + start[which.reshape(-1)]
        regions.append(torch.frombuffer(view, dtype=torch.uint8) if len(view)
                       else torch.empty(0, dtype=torch.uint8))
    return HostPages(regions, blocks.region_index.astype(np.intp), starts)

def _sections_at(view: memoryview, blocks: BlockLocations, i: int, dev: DeviceLayout
                 ) -> int:
    """Where block ``i``'s sections start in its page, from the page parsed in full."""
    offset, length = int(blocks.offsets[i]), int(blocks.lengths[i])
    page_view = view[offset:offset + length]
    key = blocks.key(i)
    page = parse_page(page_view, key)
    blob = unpack_blob(page.payload, verify=False)
    if [s.nbytes for s in blob.sections] != [s.nbytes for s in dev.sections]:
        raise InvalidArgument(f"page {bytes(key).hex()} is not a {dev.codec} block of this "
                              "namespace's shape")
    if not dev.packed:
        raise InvalidArgument(f"{dev.codec} pages of this shape have padded sections; they "
                              "load through get")
    return address_of(blob.sections[0]) - address_of(page_view)


def address_of(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0
