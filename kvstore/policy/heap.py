"""An indexed binary min-heap of keys by score: O(log n) push, update and remove by key, and
the smallest keys listed in order without changing the heap (O(k log k) for k of them)."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class IndexedHeap(Generic[K]):
    """Keys ordered by a float score, least first; ties go to the key filed first.

    Positions are tracked per key, so a key's score changes in place: no stale entries, and
    listing the coldest keys never wades through dead ones.
    """

    def __init__(self) -> None:
        self._keys: list[K] = []
        self._ranks: list[tuple[float, int]] = []  # (score, filing number) per slot
        self._pos: dict[K, int] = {}
        self._num_filed = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._pos

    def score(self, key: K) -> float:
        return self._ranks[self._pos[key]][0]

    def push(self, key: K, score: float) -> None:
        """File ``key`` (or re-score it, keeping its filing number, if present)."""
        i = self._pos.get(key)
        if i is not None:
            self.update(key, score)
            return
        self._num_filed += 1
        self._keys.append(key)
        self._ranks.append((score, self._num_filed))
        self._pos[key] = len(self._keys) - 1
        self._sift_up(len(self._keys) - 1)

    def update(self, key: K, score: float) -> None:
        i = self._pos[key]
        old = self._ranks[i]
        self._ranks[i] = (score, old[1])
        if (score, old[1]) < old:
            self._sift_up(i)
        else:
            self._sift_down(i)

    def remove(self, key: K) -> None:
        """Drop ``key`` (idempotent)."""
        i = self._pos.pop(key, None)
        if i is None:
            return
        last = len(self._keys) - 1
        if i != last:
            self._keys[i], self._ranks[i] = self._keys[last], self._ranks[last]
            self._pos[self._keys[i]] = i
        self._keys.pop()
        self._ranks.pop()
        if i < len(self._keys):
            moved = self._keys[i]
            self._sift_up(i)
            self._sift_down(self._pos[moved])

    def ascending(self) -> Iterator[K]:
        """Keys from the least score up, lazily; the heap must not change while iterating."""
        return merge_ascending((self,))

    def _sift_up(self, i: int) -> None:
        keys, ranks, pos = self._keys, self._ranks, self._pos
        key, rank = keys[i], ranks[i]
        while i > 0:
            parent = (i - 1) >> 1
            if ranks[parent] <= rank:
                break
            keys[i], ranks[i] = keys[parent], ranks[parent]
            pos[keys[i]] = i
            i = parent
        keys[i], ranks[i] = key, rank
        pos[key] = i

    def _sift_down(self, i: int) -> None:
        keys, ranks, pos = self._keys, self._ranks, self._pos
        n = len(keys)
        key, rank = keys[i], ranks[i]
        while True:
            child = 2 * i + 1
            if child >= n:
                break
            if child + 1 < n and ranks[child + 1] < ranks[child]:
                child += 1
            if rank <= ranks[child]:
                break
            keys[i], ranks[i] = keys[child], ranks[child]
            pos[keys[i]] = i
            i = child
        keys[i], ranks[i] = key, rank
        pos[key] = i


def merge_ascending(heaps: Iterable[IndexedHeap[K]]) -> Iterator[K]:
    """The keys of several heaps from the least score up, lazily: a frontier of candidate slots
    (each heap's root, then the children of every slot taken) so k keys cost O(k log k)."""
    frontier: list[tuple[tuple[float, int], int, int]] = []
    trees = [h for h in heaps if h._keys]
    for t, heap in enumerate(trees):
        frontier.append((heap._ranks[0], t, 0))
    heapq.heapify(frontier)
    while frontier:
        _, t, i = heapq.heappop(frontier)
        heap = trees[t]
        yield heap._keys[i]
        for child in (2 * i + 1, 2 * i + 2):
            if child < len(heap._keys):
                heapq.heappush(frontier, (heap._ranks[child], t, child))
