"""Background demotion: woken after writes and promotions, tiers above their high watermark
demote down to their low one."""

from __future__ import annotations

import asyncio

from kvstore.store.placement import Placement


class Demoter:
    """The store's demotion task over ``placement``'s chain: ``wake`` after anything that
    fills a tier, ``run`` in the background while the store is open."""

    def __init__(self, placement: Placement) -> None:
        self._placement = placement
        self._wakeup: asyncio.Event | None = None
        self._passing: asyncio.Lock | None = None  # one pass at a time

    def open(self) -> None:
        """Ready for ``wake`` and ``run`` (on the loop the store opens on)."""
        self._wakeup = asyncio.Event()
        self._passing = asyncio.Lock()

    async def settle(self) -> None:
        """Return after the pass running now, if any, and one more have ended: what a write
        woke has been done."""
        async with self._passing:
            await self._placement.demote_above_watermarks()

    def wake(self) -> None:
        """Start demoting if some tier but the last passed its high watermark."""
        if any(link.is_above_high_watermark() for link in self._placement.links[:-1]):
            self._wakeup.set()

    async def run(self) -> None:
        """Background: tiers above their high watermark demote down to their low one."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            async with self._passing:
                await self._placement.demote_above_watermarks()
