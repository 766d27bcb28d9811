"""The lookup of a cache made of groups: the longest prefix at which every group is whole.

The rule (``kvstore.groups`` describes the format): a prefix of n blocks is a hit when every
attention and latent group holds all of its blocks below n, every window group the blocks
that cover the last ``window_tokens`` tokens of those n blocks, and every state group its
snapshot at n. The attention and latent groups bound n from above (their stored prefixes);
from there n steps down until the window and state groups are whole too, so a snapshot that
was evicted falls back to the last n that still has one. n = 0 is always whole.

One call, one answer: the daemon hashes each group's keys and probes its directory for all
groups in the same turn, so an engine pays one round trip for a lookup however many groups its
model has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvstore.groups import CacheGroup, GroupKind, window_blocks
from kvstore.keys import BlockKey, Namespace, snapshot_keys
from kvstore.store.directory import BlockDirectory, BlockEntry
from kvstore.store.slices import LoopShare

# How far below the attention groups' match the fallback searches for a whole prefix, in
# blocks: a snapshot every few blocks is found at once, while a prompt whose snapshots are all
# gone stops after this many probes per group instead of hashing its whole length.
MAX_FALLBACK_BLOCKS = 4096


def match_start(group: CacheGroup, n: int, block_tokens: int) -> int:
    """The first block whose page ``group`` needs for a prefix of ``n`` blocks."""
    if group.kind is GroupKind.STATE:
        return n - 1
    return window_blocks(n, group.window_tokens, block_tokens).start


class GroupMatch:
    """The window and state groups' pages of one lookup, probed once over the blocks the
    search can reach, so each candidate n is checked in constant time per group (a prefix
    count of the missing pages), however wide a window is."""

    def __init__(self, ns: Namespace) -> None:
        self._ns = ns
        self._lo = 0
        self._entries: dict[int, list[BlockEntry | None]] = {}
        self._missing: dict[int, np.ndarray] = {}  # group -> missing pages before each block

    async def probe(self, directory: BlockDirectory, share: LoopShare,
                    chains: list[list[BlockKey]], lo: int, hi: int) -> None:
        """Probe the snapshot pages of blocks ``[lo, hi)`` of every window and state group,
        a slice at a time (a page key is hashed per block, as the chain's own were)."""
        self._lo = lo
        for g, group in enumerate(self._ns.cache.groups):
            if group.is_prefix:
                continue
            gns = self._ns.group(g)
            found: list[BlockEntry | None] = []
            for start in range(lo, hi, share.slice_blocks):
                if start > lo:
                    await share.pause()
                keys = snapshot_keys(gns, chains[g][start:min(hi, start + share.slice_blocks)])
                found += [e if e is not None and e.live else None
                          for e in map(directory.get, keys)]
            self._entries[g] = found
            missing = np.fromiter((e is None for e in found), dtype=np.int64, count=len(found))
            self._missing[g] = np.concatenate(([0], np.cumsum(missing)))

    def _blocks(self, g: int, n: int) -> range:
        group = self._ns.cache.groups[g]
        if group.kind is GroupKind.STATE:
            return range(n - 1, n)
        return window_blocks(n, group.window_tokens, self._ns.spec.block_tokens)

    def needs(self, n: int) -> list[list[BlockEntry]] | None:
        """The pages the window and state groups need for a prefix of ``n`` blocks, a list
        per group (empty for the others), or None when one is missing or was not probed."""
        found: list[list[BlockEntry]] = [[] for _ in self._ns.cache.groups]
        for g, missing in self._missing.items():
            blocks = self._blocks(g, n)
            first, last = blocks.start - self._lo, blocks.stop - self._lo
            if first < 0 or missing[last] - missing[first]:
                return None
            found[g] = self._entries[g][first:last]  # type: ignore[assignment]  # none missing
        return found


async def match_groups(directory: BlockDirectory, share: LoopShare, ns: Namespace,
                       tokens: np.ndarray, note: Callable[[Sequence[BlockKey]], None]
                       ) -> tuple[int, list[list[BlockEntry]], list[BlockKey]]:
    """The longest whole prefix of ``tokens`` under grouped ``ns`` (the module docstring).

    Returns:
        (n blocks, the entries the hit needs, a list per group, the keys of the first prefix
        group's blocks below n, or of the first group's where there is none).
    """
    cache = ns.cache
    chains = [await share.keys(ns.group(g), tokens) for g in range(len(cache.groups))]
    num_blocks = len(chains[0])
    upper = num_blocks
    prefix_entries: list[list[BlockEntry]] = [[] for _ in chains]
    for g, group in enumerate(cache.groups):
        if group.is_prefix:
            entries, _ = await share.match_prefix(directory, chains[g], cache.block_tokens)
            prefix_entries[g] = entries
            upper = min(upper, len(entries))
    lowest = max(1, upper - MAX_FALLBACK_BLOCKS)
    match = GroupMatch(ns)
    if upper:  # the pages the lowest candidate needs lie at or after its window's start
        reach = min((match_start(group, lowest, cache.block_tokens) for group in cache.groups
                     if not group.is_prefix), default=lowest - 1)
        await match.probe(directory, share, chains, reach, upper)
    n, needed = 0, [[] for _ in chains]
    for candidate in range(upper, lowest - 1, -1):
        found = match.needs(candidate)
        if found is not None:
            n, needed = candidate, found
            break
    for g, entries in enumerate(prefix_entries):
        needed[g] += entries[:n]
    first = next((g for g, group in enumerate(cache.groups) if group.is_prefix), 0)
    keys = chains[first][:n]
    note(keys)
    return n, needed, keys
