"""Least-recently-used eviction order, with prefix chains touched tail-first and one queue per
size class, so a tier that frees room one slot for one slot finds its victims directly."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvstore.keys import BlockKey
from kvstore.policy.base import EvictionOrder, Footprint


class LruOrder(EvictionOrder):
    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, Footprint] = OrderedDict()
        self._by_class: dict[int, OrderedDict[BlockKey, None]] = {}

    def add(self, key: BlockKey, footprint: Footprint) -> None:
        old = self._order.get(key)
        if old is not None and old.size_class != footprint.size_class:
            self._drop_from_class(key, old.size_class)
        self._order[key] = footprint
        self._order.move_to_end(key)
        same = self._by_class.setdefault(footprint.size_class, OrderedDict())
        same[key] = None
        same.move_to_end(key)

    def refile(self, key: BlockKey, footprint: Footprint) -> None:
        old = self._order.get(key)
        if old is None:
            return
        self._order[key] = footprint  # same place in the global order
        if old.size_class != footprint.size_class:
            # Its rank within the new class is approximate: it joins at the recent end, beside
            # the pages written with it.
            self._drop_from_class(key, old.size_class)
            self._by_class.setdefault(footprint.size_class, OrderedDict())[key] = None

    def touch_chain(self, keys: Sequence[BlockKey], group: bytes | None = None) -> None:
        # Children first, parents last: the parent ends up more recent than every child.
        for key in reversed(keys):
            footprint = self._order.get(key)
            if footprint is not None:
                self._order.move_to_end(key)
                self._by_class[footprint.size_class].move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        footprint = self._order.pop(key, None)
        if footprint is not None:
            self._drop_from_class(key, footprint.size_class)

    def charge(self, key: BlockKey) -> int:
        footprint = self._order.get(key)
        return 0 if footprint is None else footprint.nbytes

    def coldest(self, nbytes: int, is_protected: Callable[[BlockKey], bool],
                size_class: int | None = None) -> list[BlockKey]:
        queue = self._order if size_class is None else self._by_class.get(size_class, {})
        victims: list[BlockKey] = []
        freed = 0
        for key in queue:  # is_protected must not change the order: nothing mutates here
            if freed >= nbytes:
                break
            if not is_protected(key):
                victims.append(key)
                freed += self._order[key].nbytes
        return victims

    def __len__(self) -> int:
        return len(self._order)

    def _drop_from_class(self, key: BlockKey, size_class: int) -> None:
        same = self._by_class[size_class]
        same.pop(key, None)
        if not same:
            del self._by_class[size_class]
