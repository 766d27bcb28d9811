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

from kvstore.groups import GroupKind
from kvstore.keys import BlockKey, Namespace, snapshot_keys
from kvstore.store.directory import BlockDirectory, BlockEntry
from kvstore.store.slices import LoopShare

# How far below the attention groups' match the fallback searches for a whole prefix, in
# blocks: a snapshot every few blocks is found at once, while a prompt whose snapshots are all
# gone stops after this many probes per group instead of hashing its whole length.
MAX_FALLBACK_BLOCKS = 4096


def window_blocks(n: int, window_tokens: int, block_tokens: int) -> range:
    """The blocks a window group needs for a prefix of ``n`` blocks: those holding any of its
    last ``window_tokens`` tokens."""
    first = max(0, n * block_tokens - window_tokens) // block_tokens
    return range(first, n)


class GroupMatch:
    """One lookup of a grouped namespace: each group's chain keys, its stored prefix or its
    snapshots, probed lazily as the search steps down."""

    def __init__(self, directory: BlockDirectory, ns: Namespace, chains: list[list[BlockKey]]
                 ) -> None:
        self._dir = directory
        self._ns = ns
        self._chains = chains
        self._snapshots: list[dict[int, BlockEntry | None]] = [{} for _ in chains]

    def _snapshot(self, group: int, block: int) -> BlockEntry | None:
        """The entry of group ``group``'s snapshot page at block ``block`` (None: missing)."""
        seen = self._snapshots[group]
        if block not in seen:
            key = snapshot_keys(self._ns.group(group), [self._chains[group][block]])[0]
            entry = self._dir.get(key)
            seen[block] = entry if entry is not None and entry.live else None
        return seen[block]

    def needs(self, n: int) -> list[list[BlockEntry]] | None:
        """The pages the window and state groups need for a prefix of ``n`` blocks, a list
        per group (empty for the others), or None when one is missing."""
        found: list[list[BlockEntry]] = [[] for _ in self._chains]
        bt = self._ns.spec.block_tokens
        for g, group in enumerate(self._ns.cache.groups):
            if group.kind is GroupKind.STATE:
                blocks: Sequence[int] = (n - 1,)
            elif group.kind is GroupKind.WINDOW:
                blocks = window_blocks(n, group.window_tokens, bt)
            else:
                continue
            for block in reversed(blocks):  # the newest first: it is the likeliest missing
                entry = self._snapshot(g, block)
                if entry is None:
                    return None
                found[g].append(entry)
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
    match = GroupMatch(directory, ns, chains)
    n, needed = 0, [[] for _ in chains]
    for candidate in range(upper, max(0, upper - MAX_FALLBACK_BLOCKS) - 1, -1):
        if candidate == 0:
            break
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
