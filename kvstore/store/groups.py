"""The lookup of a cache made of groups: the longest prefix at which every group is whole.

The rule (``kvstore.groups`` describes the format): a prefix of n blocks is a hit when every
attention and latent group holds all of its blocks below n, every window group the blocks
that cover the last ``window_tokens`` tokens of those n blocks, and every state group its
snapshot at n. The attention and latent groups bound n from above (their stored prefixes);
from there n steps down until the window and state groups are whole too, so a snapshot that
was evicted falls back to the last n that still has one. n = 0 is always whole.

One call, one answer: the daemon hashes each group's keys and probes its directory for all
groups in the same turn, so an engine pays one round trip for a lookup however many groups its
model has. With a shared tier (Redis/Valkey) in the chain, a prefix that other hosts stored goes
on past the local hit: the prefix groups' next keys are asked in one batched probe each, and
each candidate above the local hit in one probe for the window and state pages it lacks here,
the top ``MAX_SHARED_CANDIDATES`` candidates at most. The get then brings those pages in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvstore.groups import GroupKind, window_blocks
from kvstore.keys import BlockKey, Namespace, snapshot_keys
from kvstore.store.directory import BlockDirectory, BlockEntry
from kvstore.store.shared import Shared
from kvstore.store.slices import LoopShare

# How far below the attention groups' match the fallback searches for a whole prefix, in
# blocks: a snapshot every few blocks is found at once, while a prompt whose snapshots are all
# gone stops after this many candidates instead of probing its whole length.
MAX_FALLBACK_BLOCKS = 4096
# Blocks probed at once when the search steps below what it probed: a snapshot every block or
# every few blocks is found within one probe.
STEP_BLOCKS = 64
# Candidates above the local hit asked of the shared tier, one round trip each, from the top:
# a snapshot every block or every few blocks is found in the first.
MAX_SHARED_CANDIDATES = 8


class GroupMatch:
    """The window and state groups' pages of one lookup, probed from the top down as the
    search needs them: a hit at the top costs the pages of one window and one snapshot; each
    step down probes only what the step adds, a slice at a time. A candidate is checked with
    one numpy pass over its window's missing flags."""

    def __init__(self, directory: BlockDirectory, share: LoopShare, ns: Namespace,
                 chains: list[list[BlockKey]], upper: int) -> None:
        self._dir = directory
        self._share = share
        self._ns = ns
        self._chains = chains
        self._groups = [g for g, group in enumerate(ns.cache.groups) if not group.is_prefix]
        self._lo = {g: upper for g in self._groups}  # probed: blocks [lo, upper)
        self._entries: dict[int, list[BlockEntry | None]] = {g: [None] * upper
                                                             for g in self._groups}
        self._missing = {g: np.ones(upper, dtype=bool) for g in self._groups}

    def _blocks(self, g: int, n: int) -> range:
        return needed_blocks(self._ns, g, n)

    async def _probe_down(self, g: int, first: int) -> None:
        """Probe group ``g``'s pages down to block ``first`` (at least a slice at a time)."""
        lo = self._lo[g]
        if first >= lo:
            return
        gns = self._ns.group(g)
        step = self._share.slice_blocks
        # The first probe takes exactly what the top candidate needs; a step down below it
        # takes a few candidates' worth at once.
        new_lo = first if lo == len(self._missing[g]) else max(0, min(first, lo - STEP_BLOCKS))
        for start in range(lo - step, new_lo - step, -step):
            begin = max(start, new_lo)
            if begin < lo - step:
                await self._share.pause()
            end = min(start + step, lo)
            keys = snapshot_keys(gns, self._chains[g][begin:end])
            for i, entry in enumerate(map(self._dir.get, keys), begin):
                if entry is not None and entry.live:
                    self._entries[g][i] = entry
                    self._missing[g][i] = False
        self._lo[g] = new_lo

    async def needs(self, n: int) -> list[list[BlockEntry]] | None:
        """The pages the window and state groups need for a prefix of ``n`` blocks, a list
        per group (empty for the others), or None when one is missing."""
        found: list[list[BlockEntry]] = [[] for _ in self._ns.cache.groups]
        for g in self._groups:
            blocks = self._blocks(g, n)
            await self._probe_down(g, blocks.start)
            if self._missing[g][blocks.start:blocks.stop].any():
                return None
            found[g] = self._entries[g][blocks.start:blocks.stop]  # type: ignore[assignment]
        return found


def needed_blocks(ns: Namespace, g: int, n: int) -> range:
    """The blocks window or state group ``g`` of grouped ``ns`` needs for a prefix of ``n``."""
    group = ns.cache.groups[g]
    if group.kind is GroupKind.STATE:
        return range(n - 1, n)
    return window_blocks(n, group.window_tokens, ns.spec.block_tokens)


async def _shared_match(directory: BlockDirectory, shared: Shared, ns: Namespace,
                        chains: list[list[BlockKey]], held: list[int], lower: int) -> int:
    """The longest whole prefix above ``lower`` blocks counting the shared tier's pages too
    (``held``: each prefix group's blocks held here); ``lower`` when there is none."""
    cache = ns.cache
    upper = len(chains[0])
    for g, group in enumerate(cache.groups):
        if group.is_prefix and upper > lower:
            have = min(held[g], upper)
            upper = have + await shared.extends(ns.group(g), chains[g][have:upper])
    for candidate in range(upper, max(lower, upper - MAX_SHARED_CANDIDATES), -1):
        missing: list[BlockKey] = []
        for g, group in enumerate(cache.groups):
            if group.is_prefix:
                continue
            picked = chains[g][needed_blocks(ns, g, candidate).start:candidate]
            for key in snapshot_keys(ns.group(g), picked):
                entry = directory.get(key)
                if entry is None or not entry.live:
                    missing.append(key)
        if await shared.holds_all(ns, missing):
            return candidate
    return lower


async def match_groups(directory: BlockDirectory, share: LoopShare, ns: Namespace,
                       tokens: np.ndarray, note: Callable[[Sequence[BlockKey]], None],
                       shared: Shared | None = None
                       ) -> tuple[int, list[list[BlockEntry]], list[BlockKey], int]:
    """The longest whole prefix of ``tokens`` under grouped ``ns`` (the module docstring).

    Returns:
        (n blocks, the entries held here that the hit needs, a list per group, the keys of the
        first prefix group's blocks below n, or of the first group's where there is none, and
        how many of the n blocks lie above what this host holds: the shared tier's).
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
    match = GroupMatch(directory, share, ns, chains, upper)
    n, needed = 0, [[] for _ in chains]
    for candidate in range(upper, lowest - 1, -1):
        found = await match.needs(candidate)
        if found is not None:
            n, needed = candidate, found
            break
    for g, entries in enumerate(prefix_entries):
        needed[g] += entries[:n]
    local = n
    if shared is not None and shared.present and n < num_blocks:
        held = [len(entries) for entries in prefix_entries]
        n = await _shared_match(directory, shared, ns, chains, held, local)
    first = next((g for g, group in enumerate(cache.groups) if group.is_prefix), 0)
    keys = chains[first][:n]
    note(keys)
    return n, needed, keys, n - local


def pin_order(ns: Namespace, needed: list[list[BlockEntry]]) -> list[BlockEntry]:
    """A grouped hit's pages as one pin: every group's, the page that names the pin last
    (``pin_key``'s: the first prefix group's block n-1, else group 0's last page)."""
    first = next((g for g, group in enumerate(ns.cache.groups) if group.is_prefix), 0)
    if not needed[first]:
        return []
    return [e for g, entries in enumerate(needed) if g != first for e in entries] + needed[first]


async def pin_keys(share: LoopShare, ns: Namespace, tokens: np.ndarray) -> list[BlockKey]:
    """The keys that may name a pin of a grouped prefix of ``tokens``: for each n, the key of
    the page ``pin_order`` puts last."""
    first = next((g for g, group in enumerate(ns.cache.groups) if group.is_prefix), None)
    if first is not None:
        return await share.keys(ns.group(first), tokens)
    return snapshot_keys(ns.group(0), await share.keys(ns.group(0), tokens))
