"""Value-density eviction: keep the blocks whose expected saving per byte is highest.

A block's value in a tier is (how likely it is to be used again) x (seconds a hit here saves
against the next tier down or recompute) / (bytes it takes), the cost model's score (seed §8).

- The saving comes from the tier's owner through ``saved_s(footprint, depth)``: this order knows
  nothing of paths or prefill, only what a hit here is worth. A block is scored at its reach,
  the deepest chain position its uses led to: a hit on a parent is what lets its children hit.
- The reuse estimate is the chain's shared ``UseHistory`` (kvstore/policy/history.py): each
  block's decayed uses (recency and frequency, LRFU, with a time constant learned from the gaps
  between uses) and the learned odds that a use of its kind (namespace, prefix depth, tail or
  not) is followed by another.
- Scores are kept in log form, ``reuse_s + tau ln(density)`` seconds, so comparing two blocks
  never needs the current time and a score changes only when its block is used (or when the
  learned ``tau`` moves, which re-scores the tier): an indexed heap per size class holds them,
  O(log n) per use, and the coldest keys come out in O(k log k).
- A parent never ranks below its children in any tier: the history raises a parent's reuse
  score and reach to its child's at every use of the chain, and a touched chain is also filed
  from its tail up with a running maximum (pages of a chain may differ in size).
- A copy that a faster tier also holds saves nothing while that copy is there (a hit is served
  above, and when the faster copy goes it moves down no further than this one): it ranks with blocks
  whose hit saves nothing, by its uses, and back by its value once it is the fastest copy.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey
from kvstore.policy.base import EvictionOrder
from kvstore.policy.heap import IndexedHeap, merge_ascending
from kvstore.policy.history import COALESCE_S, BlockUses, ReuseStats, UseHistory
from kvstore.room import Footprint

SavedSeconds = Callable[[Footprint, "int | None"], float]
"""Seconds a hit in this tier saves for a block of this footprint at this chain depth (None:
not known yet) against the next tier down or recompute; <= 0 when the hit saves nothing."""

# A hit that saves nothing still keeps its block ordered by recency among such blocks.
FLOOR_SAVED_S = 1e-9


@dataclass(slots=True)
class _Held:
    footprint: Footprint
    uses: BlockUses


class ValueOrder(EvictionOrder):
    """Orders one tier's blocks by value density (module docstring).

    Args:
        saved_s: what a hit in this tier saves (``SavedSeconds``).
        clock: seconds, monotonic; the store's wall clock or a simulator's.
        history: the chain's shared history; None gives this order one of its own.
        half_life_s: with no ``history``: a fixed half-life instead of a learned one.
        coalesce_s: with no ``history``: uses of one block closer than this count as one.
        rank: the tier's position in its chain (0 = fastest), so that a copy a faster tier
            also holds is ranked as the backup it is; None: not known.
    """

    def __init__(self, saved_s: SavedSeconds, clock: Callable[[], float] = time.monotonic,
                 history: UseHistory | None = None, half_life_s: float | None = None,
                 coalesce_s: float = COALESCE_S, rank: int | None = None) -> None:
        if half_life_s is not None and half_life_s <= 0:
            raise InvalidArgument(f"half_life_s must be > 0, got {half_life_s}")
        if history is None:
            history = (UseHistory(coalesce_s) if half_life_s is None else
                       UseHistory(coalesce_s, half_life_s / math.log(2.0), learn_tau=False))
        self._saved_s = saved_s
        self._clock = clock
        self.history = history
        self._epoch = history.epoch
        self._held: dict[BlockKey, _Held] = {}
        self._heaps: dict[int, IndexedHeap[BlockKey]] = {}  # by size class
        self._rank = rank
        if rank is not None:
            history.register(rank, self._refresh)

    @property
    def stats(self) -> ReuseStats:
        return self.history.stats

    # ------------------------------------------------------------------------- contract

    def add(self, key: BlockKey, footprint: Footprint) -> None:
        now = self._clock()
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = _Held(footprint, self.history.hold(key, now, self._rank))
        else:
            self._move_class(key, held, footprint)
            self.history.use(held.uses, now)
        self._rescore_if_stale()
        self._file(key, held, self._score(held))

    def refile(self, key: BlockKey, footprint: Footprint) -> None:
        held = self._held.get(key)
        if held is not None:
            self._move_class(key, held, footprint)

    def touch_chain(self, keys: Sequence[BlockKey], group: bytes | None = None) -> None:
        self.history.use_chain(keys, self._clock(), group)
        self._rescore_if_stale()
        floor = -math.inf  # the best score among the children touched so far
        for key in reversed(keys):
            held = self._held.get(key)
            if held is None:
                continue
            score = self._score(held)
            if not self.history.is_backup(held.uses, self._rank):
                # Just above its children: a tie would leave the order to filing numbers.
                score = floor = max(math.nextafter(floor, math.inf), score)
            self._heaps[held.footprint.size_class].update(key, score)

    def remove(self, key: BlockKey) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self.history.release(key, self._clock(), self._rank)
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
        saved = FLOOR_SAVED_S if self.history.is_backup(held.uses, self._rank) else max(
            self._saved_s(held.footprint, held.uses.reach), FLOOR_SAVED_S)
        density = saved / max(held.footprint.nbytes, 1)
        # In seconds: the moment its uses amount to, shifted by its odds and its density.
        return held.uses.reuse_s + self.history.tau_s * math.log(density)

    def _refresh(self, key: BlockKey) -> None:
        """A faster tier gained or lost a copy of ``key``: it became or stopped being a
        backup here."""
        held = self._held.get(key)
        heap = None if held is None else self._heaps.get(held.footprint.size_class)
        if heap is not None and key in heap:
            heap.update(key, self._score(held))

    def _rescore_if_stale(self) -> None:
        """The learned time constant moved: every held score is re-made with it (rare: at most
        once per as many reuses as blocks held, see ``UseHistory``)."""
        if self._epoch == self.history.epoch:
            return
        self._epoch = self.history.epoch
        for key, held in self._held.items():
            heap = self._heaps.get(held.footprint.size_class)
            if heap is not None and key in heap:  # (add files its new key after this)
                heap.update(key, self._score(held))

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
