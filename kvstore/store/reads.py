"""Reads: verified gets into a tensor (failed reads redone), pinned in-place views of raw pages
(``PinnedKV``), the cost model's advice on how much to fetch, and read times observed."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstore.api import ModelProfile
from kvstore.codecs.base import unpack_blob
from kvstore.codecs.raw import RawCodec
from kvstore.keys import BlockKey, Namespace
from kvstore.madvise import fresh_tensor
from kvstore.page import Page
from kvstore.policy.cost import AdviceScan, PrefillModel
from kvstore.spec import KVSpec
from kvstore.store.decode import PageDecoder, decode_pages
from kvstore.store.directory import BlockDirectory, BlockEntry
from kvstore.store.placement import Link, Placement
from kvstore.store.reservations import page_bound
from kvstore.store.slices import LoopShare
from kvstore.tiers.base import Tier


@dataclass(slots=True)
class PinnedKV:
    """A stored prefix's K/V as views of its pages in place (``Store.get_in_place``): ``pieces``
    are, in order, the bytes of the canonical tensor of ``shape`` and ``dtype``; they stay valid
    until ``release()`` unpins the blocks (call it once, when done sending)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[memoryview]
    release: Callable[[], None]

    @property
    def nbytes(self) -> int:
        return sum(len(piece) for piece in self.pieces)


def canonical_pieces(sections: Sequence[memoryview], spec: KVSpec) -> list[memoryview]:
    """The byte runs of blocks' raw K/V sections (each ``[L, 2, bt, H, D]``, C order) in the
    order of the canonical tensor of all of them (``[L, 2, n * bt, H, D]``): for each layer
    and K/V, each block's run of ``bt`` tokens. A single block is one piece."""
    if len(sections) == 1:
        return [memoryview(sections[0]).cast("B")]
    views = [memoryview(section).cast("B") for section in sections]
    run = len(views[0]) // (spec.num_layers * 2)
    return [view[i * run : (i + 1) * run]
            for i in range(spec.num_layers * 2) for view in views]


class Reads:
    """The store's reads out of the chain, and the prefill models that steer lookup advice.

    Args:
        directory: the store's block directory.
        placement: the store's placement over the chain (reading, fastest holders).
    """

    def __init__(self, directory: BlockDirectory, placement: Placement) -> None:
        self._dir = directory
        self._placement = placement
        # The cost model's recompute estimate, by (tenant, model id).
        self._prefill: dict[tuple[str, str], PrefillModel] = {}

    async def get(self, ns: Namespace, keys: list[BlockKey], front: torch.Tensor | None
                  ) -> tuple[torch.Tensor, list[BlockEntry]] | None:
        """The verified K/V of the longest stored prefix of ``keys`` (``Store.get`` says how),
        into ``front`` (a checked view of the caller's buffer) or a fresh tensor, and the
        entries served from below the fastest tier; None if no block could be served."""
        entries = self._dir.match_prefix(keys)
        if not entries:
            return None
        bt = ns.spec.block_tokens
        num_tokens = len(entries) * bt
        out = (fresh_tensor(ns.spec.shape(num_tokens), ns.spec.torch_dtype) if front is None
               else front[:, :, :num_tokens])
        outs = out.split(bt, dim=2)
        self._dir.pin(entries)
        started = time.perf_counter()
        try:
            async with PageDecoder(outs) as decoder:
                sources = await self._read_pages(entries, decoder.add)
            self._observe_read(entries, sources, time.perf_counter() - started)
            failed = [i for i in decoder.failed if i < len(sources)]  # after a miss: unused
            num_blocks = await self._redo_failed(entries, failed, sources, outs)
        finally:
            self._dir.unpin(entries)
        if num_blocks == 0:
            return None
        if num_blocks < len(entries):  # only the verified prefix is returned
            out = out[:, :, :num_blocks * bt]
            if front is None:  # a fresh result: copied, so the rest's memory goes
                out = out.clone()
        self._dir.touch(entries[:num_blocks])
        first = self._placement.links[0]
        below = [entry for entry, source in zip(entries[:num_blocks], sources)
                 if source is not first]
        return out, below

    async def in_place(self, ns: Namespace, keys: list[BlockKey]) -> PinnedKV | None:
        """The K/V of the longest stored prefix of ``keys`` as views of its raw pages in
        trusted memory of the fastest tier, pinned (``Store.get_in_place``); None if some
        block is not one, or nothing is stored."""
        entries = self._dir.match_prefix(keys)
        first = self._placement.links[0]
        if not entries or any(first.name not in entry.sizes for entry in entries):
            return None
        self._dir.pin(entries)
        try:
            sections = [await self._trusted_section(first.tier, entry, ns.spec)
                        for entry in entries]
        except BaseException:
            self._dir.unpin(entries)
            raise
        if any(section is None for section in sections):
            self._dir.unpin(entries)
            return None
        self._dir.touch(entries)
        return PinnedKV(ns.spec.shape(len(entries) * ns.spec.block_tokens), ns.spec.torch_dtype,
                        canonical_pieces(sections, ns.spec),
                        lambda: self._dir.unpin(entries))

    @staticmethod
    async def _trusted_section(tier: Tier, entry: BlockEntry, spec: KVSpec
                               ) -> memoryview | None:
        """The K/V bytes of ``entry``'s raw page of ``spec`` in place, if ``tier`` serves it
        from trusted memory; else None."""
        page = await tier.read(entry.meta.key, verify=False)
        if page is None or not page.is_trusted or page.meta.codec != RawCodec.name:
            return None
        parts = unpack_blob(page.payload, verify=False)
        if parts.dtype != spec.torch_dtype or parts.shape != spec.shape(spec.block_tokens):
            return None
        return parts.sections[0]

    async def _read_pages(self, entries: list[BlockEntry],
                          on_page: Callable[[int, Page], None]) -> list[Link]:
        """Read pinned entries concurrently from their fastest tiers, unverified, handing each
        page to ``on_page(index, page)`` as it arrives (the caller verifies it before any use);
        return the link each block came from, up to the first that could not be read (the
        prefix ends there)."""

        async def read(i: int, entry: BlockEntry) -> Link | None:
            page, source = await self._placement.read(entry, verify=False)
            if page is not None:
                on_page(i, page)
            return source

        sources = await asyncio.gather(*(read(i, e) for i, e in enumerate(entries)))
        return list(itertools.takewhile(lambda source: source is not None, sources))

    async def _redo_failed(self, entries: list[BlockEntry], failed: list[int],
                           sources: list[Link], outs: Sequence[torch.Tensor]) -> int:
        """Read the blocks at ``failed`` (ascending) again, verified, and decode them; return
        how many leading blocks hold verified K/V (``len(sources)`` when all read ones do)."""
        for i in failed:
            page, source = await self._placement.read(entries[i], verify=True)
            if page is None or await decode_pages([page], [outs[i]]):
                return i
            sources[i] = source
        return len(sources)

    async def advise(self, ns: Namespace, entries: list[BlockEntry], num_shared: int,
                     num_tokens: int, share: LoopShare) -> int | None:
        """The prefix worth fetching per the cost model, or None without a prefill model:
        ``entries`` held here, then ``num_shared`` blocks in the shared tier (sized by its
        codec's bound: their pages are not known here). Scanned a slice of ``share`` at a
        time: the model costs a few microseconds a block, over a second at 262,144."""
        prefill = self._prefill.get((ns.tenant, ns.model_id))
        if prefill is None or not (entries or num_shared):
            return None
        scan = AdviceScan(ns.spec.block_tokens, num_tokens,
                          {link.name: link.path for link in self._placement.links}, prefill)

        def feed(piece: Sequence[BlockEntry]) -> None:
            links = [self._placement.fastest_holder(e) for e in piece]
            scan.feed([link.name for link in links],
                      [e.sizes[link.name] for e, link in zip(piece, links)])

        await share.each(entries, feed)
        shared = self._placement.shared_link() if num_shared else None
        if shared is not None:
            bound = page_bound(shared.codec, ns.spec)
            for start in range(0, num_shared, share.slice_blocks):
                await share.pause()
                count = min(share.slice_blocks, num_shared - start)
                scan.feed([shared.name] * count, [bound] * count)
        return scan.best.fetch_tokens

    def _observe_read(self, entries: list[BlockEntry], sources: list[Link],
                      seconds: float) -> None:
        """Feed a get's read-and-decode time to the path model of the tier it came from (only
        when one tier served every block: then the time is that path's alone)."""
        if not sources or any(source is not sources[0] for source in sources):
            return
        link = sources[0]
        link.path.observe(sum(e.sizes.get(link.name, 0) for e in entries[:len(sources)]),
                          seconds)

    def set_model_profile(self, ns: Namespace, profile: ModelProfile) -> None:
        """What prefill of ``ns``'s model costs (``Store.set_model_profile``)."""
        key = (ns.tenant, ns.model_id)
        current = self._prefill.get(key)
        if current is None or current.profile != profile:
            self._prefill[key] = PrefillModel(profile)

    def report_prefill(self, ns: Namespace, new_tokens: int, cached_tokens: int,
                       seconds: float) -> None:
        model = self._prefill.get((ns.tenant, ns.model_id))
        if model is not None:
            model.observe(new_tokens, cached_tokens, seconds)

