"""Each tenant's share of the store's loop: long requests done in bounded slices, few at once.

Every store verb runs on the daemon's one event loop, and a request over a long prompt (1M
tokens: 65,536 to 262,144 blocks) costs per block: its key hashed, probed in the directory,
counted per tier, sighted by the admission filters. Done in one go that is 0.2-0.7 s in which
no other tenant's call, health check or reply runs. Here it is done in slices of
``SLICE_BLOCKS`` blocks with a yield to the loop between them, and a tenant runs at most
``HEAVY_PER_TENANT`` such requests at once: the rest wait their turn behind their own tenant's,
never in front of another's, so a small call waits for a few slices, not for a flood.

Hashing stays on the loop: a worker thread hashing in Python holds the GIL as long as the loop
would (``chain_keys`` is a Python loop over 64-byte updates, below hashlib's 2 KiB GIL release),
and gives it back only every switch interval (5 ms), where a slice yields after about 1 ms.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from operator import attrgetter
from typing import TypeVar

import numpy as np

from kvstore.keys import BlockKey, Namespace, chain_keys
from kvstore.store.directory import BlockDirectory, BlockEntry

T = TypeVar("T")
_KEY_OF = attrgetter("meta.key")

# Blocks per slice: hashing a block's key costs about 0.5 us and probing and counting it less
# (block keys cost about 1 ms per 32k tokens, 2,048 blocks of 16 tokens, on the 2-core box,
# 2026-12-01), so a slice holds the loop near 1 ms.
SLICE_BLOCKS = 2048

# Heavy requests (over one slice) one tenant runs at once; more wait for a turn. Two keeps a
# tenant's own pipeline busy (one request's slices interleave with the next's) while another
# tenant's small call waits behind at most two slices of it.
HEAVY_PER_TENANT = 2


class LoopShare:
    """Slices of the store's per-block work and each tenant's turns at heavy requests. Used
    from the store's event loop only.

    Args:
        slice_blocks: blocks done between two yields to the loop.
        heavy_per_tenant: requests over one slice a tenant may run at once.
    """

    def __init__(self, slice_blocks: int = SLICE_BLOCKS,
                 heavy_per_tenant: int = HEAVY_PER_TENANT) -> None:
        if slice_blocks < 1 or heavy_per_tenant < 1:
            raise ValueError(f"slice_blocks and heavy_per_tenant must be >= 1, got "
                             f"{slice_blocks!r} and {heavy_per_tenant!r}")
        self.slice_blocks = slice_blocks
        self.heavy_per_tenant = heavy_per_tenant
        self.num_pauses = 0  # yields to the loop between slices, since the store opened
        self.num_waits = 0  # heavy requests that waited for their tenant's turn
        self._turns: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}

    def is_heavy(self, num_blocks: int) -> bool:
        return num_blocks > self.slice_blocks

    def num_heavy(self, tenant: str) -> int:
        """``tenant``'s heavy requests running or waiting for a turn now."""
        entry = self._turns.get(tenant)
        return 0 if entry is None else entry[1][0]

    @asynccontextmanager
    async def turn(self, tenant: str, num_blocks: int) -> AsyncIterator[None]:
        """Hold one of ``tenant``'s turns at heavy requests while the body runs (a request of
        at most one slice needs none)."""
        if not self.is_heavy(num_blocks):
            yield
            return
        gate, users = self._turns.get(tenant) or self._turns.setdefault(
            tenant, (asyncio.Semaphore(self.heavy_per_tenant), [0]))
        users[0] += 1
        try:
            if gate.locked():
                self.num_waits += 1
            async with gate:
                yield
        finally:
            users[0] -= 1
            if not users[0]:  # nobody holds or waits: tenants that come and go leave nothing
                del self._turns[tenant]

    async def pause(self) -> None:
        """Let the loop run whatever else is ready before the next slice."""
        self.num_pauses += 1
        await asyncio.sleep(0)

    async def keys(self, ns: Namespace, tokens: np.ndarray) -> list[BlockKey]:
        """``block_keys(ns, tokens)``, hashed a slice at a time (``tokens``: uint32 ids)."""
        data = memoryview(tokens).cast("B")
        block_bytes = ns.spec.block_tokens * tokens.itemsize
        step = self.slice_blocks * block_bytes
        keys: list[BlockKey] = []
        parent = ns.fingerprint
        for start in range(0, len(data), step):
            if start:
                await self.pause()
            part = chain_keys(parent, data[start:start + step], block_bytes)
            if not part:
                break
            keys += part
            parent = part[-1]
        return keys

    async def match_prefix(self, directory: BlockDirectory, keys: Sequence[BlockKey],
                           block_tokens: int) -> tuple[list[BlockEntry], dict[str, int]]:
        """``directory.match_prefix(keys)`` and its ``tokens_per_tier``, a slice at a time.
        A block evicted after its slice was probed stays in the answer: a lookup is advice
        (an acquire or get checks again), as it always was once its reply left."""
        entries: list[BlockEntry] = []
        per_tier: dict[str, int] = {}
        for start in range(0, len(keys), self.slice_blocks):
            if start:
                await self.pause()
            part = directory.match_prefix(keys[start:start + self.slice_blocks])
            for name, tokens in directory.tokens_per_tier(part, block_tokens).items():
                per_tier[name] = per_tier.get(name, 0) + tokens
            entries += part
            if len(part) < self.slice_blocks:
                break
        return entries, _in_chain_order(per_tier, directory)

    async def each(self, items: Sequence[T], visit: Callable[[Sequence[T]], object]) -> None:
        """``visit`` each slice of ``items`` in order, yielding between them."""
        for start in range(0, len(items), self.slice_blocks):
            if start:
                await self.pause()
            visit(items[start:start + self.slice_blocks])

    async def stored_keys(self, entries: Sequence[BlockEntry]) -> tuple[BlockKey, ...]:
        """The keys of ``entries`` (the directory's own key objects: whoever drops the tuple
        later frees no key; freeing 262,144 freshly hashed ones took 2-3 ms), gathered a
        slice at a time."""
        keys: list[BlockKey] = []
        await self.each(entries, lambda piece: keys.extend(map(_KEY_OF, piece)))
        heavy = self.is_heavy(len(keys))
        if heavy:
            await self.pause()
        stored = tuple(keys)
        if heavy:
            await self.pause()
        await self.truncate(keys, 0)
        return stored

    async def truncate(self, items: list, length: int) -> None:
        """Cut ``items`` down to its first ``length``, a slice at a time from the end: what
        goes may be freed with it (262,144 unmatched keys took 4 ms to free at once)."""
        while len(items) > length:
            del items[max(length, len(items) - self.slice_blocks):]
            if len(items) > length:
                await self.pause()

    async def joined(self, keys: Sequence[bytes]) -> bytes:
        """``b"".join(keys)``, joined a slice at a time (262,144 keys: 4 MiB, about 3 ms at
        once); the last join copies the slices' bytes once more."""
        if len(keys) <= self.slice_blocks:
            return b"".join(keys)
        parts: list[bytes] = []
        await self.each(keys, lambda piece: parts.append(b"".join(piece)))
        await self.pause()
        return b"".join(parts)


def _in_chain_order(per_tier: dict[str, int], directory: BlockDirectory) -> dict[str, int]:
    """``per_tier`` keyed in the chain's order, as ``tokens_per_tier`` returns it."""
    return {name: per_tier[name] for name in directory.tier_names if name in per_tier}
