"""Writes of a put: claiming blocks, pages encoded or pending, stored or lifted, and the reused
buffers they are framed into (``WriteBuffers``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvstore.codecs.raw import RawCodec
from kvstore.errors import CapacityError
from kvstore.keys import BlockKey, Namespace
from kvstore.page import PageMeta, PendingPage
from kvstore.store.directory import BlockDirectory, BlockEntry
from kvstore.store.placement import Placement
from kvstore.tiers.base import InPlaceWrites


@dataclass(slots=True)
class _Encoded:
    meta: PageMeta
    data: memoryview  # the page, in a buffer of the put's ``WriteBuffers``


def _page_of(block: _Encoded | PendingPage) -> memoryview | PendingPage:
    return block if isinstance(block, PendingPage) else block.data


class WriteBuffers:
    """Buffers that in-process puts write their pages into, kept for the next put: puts to a
    fastest tier that takes finished pages only (one that frames them in place,
    ``InPlaceWrites``, needs none), and lifts.

    A fresh buffer costs a page fault per 4 KiB on its first write (on the 2-core box a 32 MiB
    put spent 62 ms encoding into fresh buffers against 4 ms for one copy into warm memory),
    so a put takes one, the tiers copy its pages out, and it comes back. A put that fails or
    is cancelled does not give its buffer back: a tier may still hold a view of it. Thread-safe
    (taken on encoding threads, given back on the loop).
    """

    MAX_KEPT = 4  # buffers kept: about as many as puts encode at once on a busy daemon
    MAX_KEPT_BYTES = 256 << 20  # 8 puts of 16 2-MiB blocks

    def __init__(self) -> None:
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        """A buffer of at least ``nbytes`` (the smallest kept one that fits, else a new one)."""
        with self._lock:
            fits = [b for b in self._free if len(b) >= nbytes]
            if fits:
                chosen = min(fits, key=len)
                self._free.remove(chosen)
                return chosen
        return bytearray(nbytes)

    def give(self, buf: bytearray) -> None:
        """Keep ``buf`` for a later put, dropping the smallest kept ones past the bounds."""
        if len(buf) > self.MAX_KEPT_BYTES:
            return
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=len, reverse=True)
            while (len(self._free) > self.MAX_KEPT
                   or sum(map(len, self._free)) > self.MAX_KEPT_BYTES):
                self._free.pop()


class Writes:
    """The store's puts: each block written once, however many puts of it run at once.

    Args:
        directory: the store's block directory.
        placement: the store's placement over the chain (storing, lifting).
    """

    def __init__(self, directory: BlockDirectory, placement: Placement) -> None:
        self._dir = directory
        self._placement = placement
        # Blocks an in-process put is writing; a put of the same block waits on it.
        self._writing: dict[BlockKey, asyncio.Future[None]] = {}
        self._buffers = WriteBuffers()

    async def put(self, ns: Namespace, keys: list[BlockKey], kv: torch.Tensor
                  ) -> list[BlockEntry]:
        """Store the blocks of ``keys`` not stored or being stored yet, from ``kv``, and lift
        those held only below a tier whose admission lifts them; return the entries newly
        stored, in order (``Store.put`` says what is kept)."""
        in_flight = [self._writing[k] for k in keys if k in self._writing]
        held = [e for e in map(self._dir.get, keys) if e is not None]
        todo = [i for i, k in enumerate(keys) if k not in self._dir and k not in self._writing]
        lifts = [i for i, e in enumerate(map(self._dir.get, keys))
                 if e is not None and self._placement.lift_target(e) is not None]
        claimed = self._claim_writes(keys[i] for i in todo)
        self._dir.pin(held)
        written = 0
        try:
            if todo:
                written = await self._store_blocks(ns, keys, kv, todo, held)
            if lifts:  # blocks held only further down: the engine's copy goes up (lift)
                await self._lift(ns, keys, kv, lifts)
        finally:
            self._release_writes(claimed)
            self._dir.unpin(held)
        if in_flight:  # another put is storing some of these blocks: return once it has
            await asyncio.gather(*(asyncio.shield(f) for f in in_flight))
        reachable = self._dir.match_prefix(keys)
        self._dir.touch(reachable, hit=False)
        # Only what a lookup reaches counts: a block behind one that another put failed to
        # store is stored but unreachable.
        return [entry for entry in held[len(held) - written:]
                if entry.meta.block_index < len(reachable)]

    def _claim_writes(self, keys: Iterable[BlockKey]) -> list[BlockKey]:
        """Mark blocks as being written so concurrent puts wait instead of writing twice."""
        loop = asyncio.get_running_loop()
        claimed = []
        for key in keys:
            self._writing[key] = loop.create_future()
            claimed.append(key)
        return claimed

    def _release_writes(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            future = self._writing.pop(key, None)
            if future is not None and not future.done():
                future.set_result(None)

    async def _store_blocks(self, ns: Namespace, keys: list[BlockKey], kv: torch.Tensor,
                            todo: list[int], held: list[BlockEntry]) -> int:
        """Place the put's new blocks at ``todo`` in order, pinning each into ``held``; return
        how many were stored (the put stops at the first that finds no room anywhere).

        A fastest tier that frames pages in place (``InPlaceWrites``) gets them pending: each
        page is copied and hashed once, into the memory it is served from. Otherwise the pages
        are framed into a reused buffer first (``_encode_blocks``) and the tier copies them.
        """
        buffer = None
        if isinstance(self._placement.links[0].tier, InPlaceWrites):
            blocks: list[_Encoded] | list[PendingPage] = await self._prepare(ns, keys, kv, todo)
        else:
            blocks, buffer = await asyncio.to_thread(self._encode_blocks, ns, keys, kv, todo)
        written = 0
        for block in blocks:
            try:
                entry = await self._placement.store_new(block.meta, _page_of(block))
            except CapacityError:
                if written == 0:
                    raise
                break  # the blocks after this one could never be matched
            self._dir.pin([entry])
            held.append(entry)
            written += 1
        del blocks, block  # the views into the buffer (or the caller's K/V), before its reuse
        if buffer is not None:
            self._buffers.give(buffer)  # every write has returned: no tier holds a view
        return written

    async def _prepare(self, ns: Namespace, keys: list[BlockKey], kv: torch.Tensor,
                       todo: list[int]) -> list[PendingPage]:
        """The pending pages of the blocks at ``todo``: raw ones of CPU K/V on the loop (views
        of ``kv``, a few microseconds a block, less than a thread hop), others on a thread (a
        lossy codec quantises here)."""
        codec = self._placement.links[0].codec
        if isinstance(codec, RawCodec) and kv.device.type == "cpu":
            return self._pending_pages(ns, keys, kv, todo)
        return await asyncio.to_thread(self._pending_pages, ns, keys, kv, todo)

    async def _lift(self, ns: Namespace, keys: list[BlockKey], kv: torch.Tensor,
                    lifts: list[int]) -> None:
        """Write the put's pages of blocks held only further down into faster tiers."""
        encoded, buffer = await asyncio.to_thread(self._encode_blocks, ns, keys, kv, lifts)
        for block in encoded:
            entry = self._dir.get(block.meta.key)
            if entry is not None and entry.live:
                await self._placement.lift(entry, block.data)
        del encoded
        self._buffers.give(buffer)

    def _encode_blocks(self, ns: Namespace, keys: list[BlockKey], kv: torch.Tensor,
                       todo: list[int]) -> tuple[list[_Encoded], bytearray]:
        """Encode the blocks at ``todo`` with the fastest tier's codec into pages, written
        straight into one reused buffer (``kvstore.page.write_page``: one pass that copies or
        quantises and hashes, no joins); return the pages and the buffer (runs in a worker
        thread)."""
        # Version 1 pages: tiers that copy pages in size their slots by its unpadded length
        # (the HBM tier's device pages).
        pages = self._pending_pages(ns, keys, kv, todo, aligned=False)
        buffer = self._buffers.take(sum(page.nbytes for page in pages))
        view = memoryview(buffer)
        out, pos = [], 0
        for page in pages:
            page.write_into(view[pos:pos + page.nbytes])
            out.append(_Encoded(page.meta, view[pos:pos + page.nbytes]))
            pos += page.nbytes
        return out, buffer

    def _pending_pages(self, ns: Namespace, keys: list[BlockKey], kv: torch.Tensor,
                       todo: list[int], aligned: bool = True) -> list[PendingPage]:
        """The blocks at ``todo`` prepared with the fastest tier's codec, as pages not framed
        yet (``aligned``: version 2, the payload hashed once, by its blob checksum)."""
        bt = ns.spec.block_tokens
        codec = self._placement.links[0].codec
        kv = kv.detach().cpu()
        pages = []
        for i in todo:
            meta = PageMeta.for_block(ns, keys[i], keys[i - 1] if i else None, i, codec)
            pages.append(PendingPage(meta, codec.prepare(kv[:, :, i * bt:(i + 1) * bt]),
                                     aligned))
        return pages
