"""Least-recently-used eviction order, with prefix chains touched tail-first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from kvstore.keys import BlockKey
from kvstore.policy.base import EvictionOrder


class LruOrder(EvictionOrder):
    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def add(self, key: BlockKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch_chain(self, keys: Iterable[BlockKey]) -> None:
        # Children first, parents last: the parent ends up more recent than every child.
        for key in reversed(list(keys)):
            if key in self._order:
                self._order.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def victims(self, is_evictable: Callable[[BlockKey], bool]) -> Iterator[BlockKey]:
        for key in list(self._order):
            if key in self._order and is_evictable(key):
                yield key

    def __len__(self) -> int:
        return len(self._order)
