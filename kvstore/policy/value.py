"""Value-density eviction: keep the blocks whose expected saving per byte is highest.

A block's value in a tier is (how likely it is to be used again) x (seconds a hit here saves
against the next tier down or recompute) / (bytes it takes), the cost model's score (seed §8).

- The saving comes from the tier's owner through ``saved_s(footprint, depth)``: this order knows
  nothing of paths or prefill, only what a hit here is worth.
- The reuse estimate combines the block's own history, an exponentially decayed count of its
  uses (recency and frequency in one number, LRFU), with what this tier has learned about blocks
  in the same place of a chain: of the uses at this prefix depth (log2 buckets), as the tail of
  the chain or inside it, how many were followed by another use while the block was held.
- Scores are kept in log form, ``tau ln(sum of e^(t_use / tau))`` seconds plus ``tau`` times
  the log of the odds and the density, so comparing two blocks never needs the current time
  and a score changes only when its block is used: an indexed heap per size class holds them,
  O(log n) per use, and the coldest keys come out in O(k log k).
- A touched chain is scored from its tail up with a running maximum, so a parent never ranks
  below the children it was used with; once a chain has placed a block, its score never drops
  while it is held. A block only added (a demotion, before any chain touched it here) is
  scored by the time it arrived and the prior, so a chain moved tail first stays tail first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey
from kvstore.policy.base import EvictionOrder, Footprint
from kvstore.policy.heap import IndexedHeap, merge_ascending

SavedSeconds = Callable[[Footprint, "int | None"], float]
"""Seconds a hit in this tier saves for a block of this footprint at this chain depth (None:
not known yet) against the next tier down or recompute; <= 0 when the hit saves nothing."""

# A use counts half after this long. Chosen by `kvstore bench policy` (2026-12-01) over 5, 15,
# 30 and 60 s and a half-life following the tier's eviction age: 5 s loses doc-QA's frequency
# (tight: 982 vs 613 ms mean TTFT), 30-60 s keeps stale agent branches (134-196 vs 104 ms).
HALF_LIFE_S = 15.0
# A request's lookup, get and put of one block fall within its prefill (about a second for a
# 32k-token prompt on an 8B model at 4e14 FLOP/s): uses closer than this count once.
COALESCE_S = 1.0
NUM_DEPTH_BUCKETS = 16  # depth 0, 1, 2-3, 4-7, ..., >= 2**14 blocks
UNKNOWN_CLASS = 2 * NUM_DEPTH_BUCKETS  # a block added before any chain placed it
# Reuse statistics are halved after this many uses, so they follow a changing workload.
STATS_AGE_USES = 4096
# Beta(1, 1) prior on "a use is followed by another": a class starts at 1/2.
PRIOR_REUSES, PRIOR_USES = 1.0, 2.0
# A hit that saves nothing still keeps its block ordered by recency among such blocks.
FLOOR_SAVED_S = 1e-9


@dataclass(slots=True)
class _Held:
    footprint: Footprint
    use_s: float  # tau ln(sum over uses of exp(t_use / tau)): its uses as one moment
    last_use_s: float
    depth: int | None = None  # position in its chain, 0 = root
    klass: int = UNKNOWN_CLASS  # where its last use placed it (depth bucket, tail or not)


def use_class(depth: int, is_tail: bool) -> int:
    """The statistics class of a use at chain position ``depth``."""
    return 2 * min(depth.bit_length(), NUM_DEPTH_BUCKETS - 1) + is_tail


class ReuseStats:
    """Per use class: decayed counts of uses that were followed by another use while the block
    was held, and of uses that were its last before it left. Only settled uses count: a block
    just used has had no time to be used again, and counting it would rank new blocks low."""

    def __init__(self) -> None:
        self._reused = [0.0] * (UNKNOWN_CLASS + 1)
        self._lost = [0.0] * (UNKNOWN_CLASS + 1)
        self._num_since_aging = 0

    def settle(self, klass: int, was_reused: bool) -> None:
        (self._reused if was_reused else self._lost)[klass] += 1.0
        self._num_since_aging += 1
        if self._num_since_aging >= STATS_AGE_USES:
            self._reused = [r / 2 for r in self._reused]
            self._lost = [n / 2 for n in self._lost]
            self._num_since_aging = 0

    def ratio(self, klass: int) -> float:
        """Estimated chance that a use of this class is followed by another while held. A block
        no chain has placed keeps the prior: blocks arrive that way in runs (a demotion moves a
        chain tail first), and a learned value drifting within a run would rank a parent below
        the child that arrived just before it."""
        if klass == UNKNOWN_CLASS:
            return PRIOR_REUSES / PRIOR_USES
        reused = self._reused[klass]
        return (reused + PRIOR_REUSES) / (reused + self._lost[klass] + PRIOR_USES)


class ValueOrder(EvictionOrder):
    """Orders one tier's blocks by value density (module docstring).

    Args:
        saved_s: what a hit in this tier saves (``SavedSeconds``).
        clock: seconds, monotonic; the store's wall clock or a simulator's.
        half_life_s: time after which a use counts half.
        coalesce_s: uses of one block closer than this count as one.
    """

    def __init__(self, saved_s: SavedSeconds, clock: Callable[[], float] = time.monotonic,
                 half_life_s: float = HALF_LIFE_S, coalesce_s: float = COALESCE_S) -> None:
        if half_life_s <= 0 or coalesce_s < 0:
            raise InvalidArgument(f"half_life_s must be > 0 and coalesce_s >= 0, got "
                                  f"{half_life_s} and {coalesce_s}")
        self._saved_s = saved_s
        self._clock = clock
        self._tau_s = half_life_s / math.log(2.0)
        self._coalesce_s = coalesce_s
        self._held: dict[BlockKey, _Held] = {}
        self._heaps: dict[int, IndexedHeap[BlockKey]] = {}  # by size class
        self.stats = ReuseStats()

    # ------------------------------------------------------------------------- contract

    def add(self, key: BlockKey, footprint: Footprint) -> None:
        now = self._clock()
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = _Held(footprint, now, now)
        else:
            self._move_class(key, held, footprint)
            self._use(held, now, held.klass)
        self._file(key, held, self._score(held))

    def refile(self, key: BlockKey, footprint: Footprint) -> None:
        held = self._held.get(key)
        if held is not None:
            self._move_class(key, held, footprint)
            held.footprint = footprint

    def touch_chain(self, keys: Sequence[BlockKey]) -> None:
        now = self._clock()
        last = len(keys) - 1
        floor = -math.inf  # the best score among the children touched so far
        for depth in range(last, -1, -1):
            key = keys[depth]
            held = self._held.get(key)
            if held is None:
                continue
            # The first chain to place a block re-scores its add(); later scores never drop.
            is_placed = held.depth is not None
            held.depth = depth
            self._use(held, now, use_class(depth, depth == last))
            heap = self._heaps[held.footprint.size_class]
            # Just above its children: a tie would leave the order to filing numbers.
            floor = max(math.nextafter(floor, math.inf), self._score(held),
                        heap.score(key) if is_placed else -math.inf)
            heap.update(key, floor)

    def remove(self, key: BlockKey) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self.stats.settle(held.klass, was_reused=False)
            self._drop_from_class(key, held.footprint.size_class)

    def charge(self, key: BlockKey) -> int:
        held = self._held.get(key)
        return 0 if held is None else held.footprint.nbytes

    def coldest(self, nbytes: int, is_protected: Callable[[BlockKey], bool],
                size_class: int | None = None) -> list[BlockKey]:
        victims: list[BlockKey] = []
        freed = 0
        for key in self._ascending(size_class):
            if freed >= nbytes:
                break
            if not is_protected(key):
                victims.append(key)
                freed += self._held[key].footprint.nbytes
        return victims

    def __len__(self) -> int:
        return len(self._held)

    # ------------------------------------------------------------------------- scoring

    def value_score(self, key: BlockKey) -> float | None:
        """The key's rank score (higher: more valuable), or None if absent."""
        held = self._held.get(key)
        return None if held is None else self._heaps[held.footprint.size_class].score(key)

    def _score(self, held: _Held) -> float:
        saved = max(self._saved_s(held.footprint, held.depth), FLOOR_SAVED_S)
        density = saved / max(held.footprint.nbytes, 1)
        # In seconds (tau x the log value): the moment its uses amount to, shifted by its odds.
        return held.use_s + self._tau_s * (math.log(self.stats.ratio(held.klass))
                                           + math.log(density))

    def _use(self, held: _Held, now: float, klass: int) -> None:
        """Count a use (or, within the coalescing window, re-class the last one)."""
        if now - held.last_use_s >= self._coalesce_s:
            self.stats.settle(held.klass, was_reused=True)
            tau = self._tau_s
            held.use_s = tau * _log_add(held.use_s / tau, now / tau)
            held.last_use_s = now
        held.klass = klass

    def _file(self, key: BlockKey, held: _Held, score: float) -> None:
        heap = self._heaps.setdefault(held.footprint.size_class, IndexedHeap())
        if key in heap:
            score = max(score, heap.score(key))
        heap.push(key, score)

    def _move_class(self, key: BlockKey, held: _Held, footprint: Footprint) -> None:
        if footprint.size_class == held.footprint.size_class:
            held.footprint = footprint
            return
        score = self._heaps[held.footprint.size_class].score(key)
        self._drop_from_class(key, held.footprint.size_class)
        held.footprint = footprint
        self._heaps.setdefault(footprint.size_class, IndexedHeap()).push(key, score)

    def _drop_from_class(self, key: BlockKey, size_class: int) -> None:
        heap = self._heaps[size_class]
        heap.remove(key)
        if not heap:
            del self._heaps[size_class]

    def _ascending(self, size_class: int | None) -> Iterator[BlockKey]:
        if size_class is None:
            return merge_ascending(self._heaps.values())
        heap = self._heaps.get(size_class)
        return iter(()) if heap is None else heap.ascending()


def _log_add(a: float, b: float) -> float:
    """ln(e^a + e^b) without overflow."""
    hi, lo = (a, b) if a >= b else (b, a)
    return hi + math.log1p(math.exp(lo - hi))
