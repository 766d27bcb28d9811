"""Policy contracts: which blocks to give up first when a tier needs room.

The store asks an ``EvictionOrder`` per tier for victims; it never reaches into tier internals.
Scores come from recency for now; the cost model (seed §8: value = reuse likelihood x time a
fetch saves / bytes) plugs in behind the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator

from kvstore.keys import BlockKey


class EvictionOrder(ABC):
    """Keeps the keys of one tier ordered from least to most valuable.

    Called only from the store's event loop; every method is O(1) or amortised O(1) except
    ``victims``, which yields lazily.
    """

    @abstractmethod
    def add(self, key: BlockKey) -> None:
        """A block entered the tier (counts as an access)."""

    @abstractmethod
    def touch_chain(self, keys: Iterable[BlockKey]) -> None:
        """A prefix chain (parents first) was used: every parent must rank at least as valuable
        as its children, so a chain is evicted from its tail and stays reachable."""

    @abstractmethod
    def remove(self, key: BlockKey) -> None:
        """The block left the tier (idempotent)."""

    @abstractmethod
    def victims(self, is_evictable: Callable[[BlockKey], bool]) -> Iterator[BlockKey]:
        """Keys from least to most valuable, skipping those ``is_evictable`` rejects."""

    @abstractmethod
    def __len__(self) -> int: ...
