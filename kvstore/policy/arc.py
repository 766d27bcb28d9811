"""Adaptive replacement (ARC, Megiddo and Modha, FAST'03), counted in bytes, as a baseline.

Blocks used once sit in T1, blocks used again in T2; B1 and B2 remember (as ghosts) what each
list gave up lately. A block coming back from B1 says T1 was too small and grows its target
``p`` (bytes); one coming back from B2 shrinks it. Victims come from T1 while it holds more
than ``p``, else from T2, each in LRU order. The cache size ARC adapts to is the most this
tier's order ever held (the order is not told the tier's capacity).

Prefix chains: a touched chain lands in one list, T2 as soon as any of its blocks is used again
or already there, children first, so within a list a parent is always more recent than its
children and a chain is given up from its tail. Uses of one block closer than ``coalesce_s``
(one request's lookup, get and put) count once.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvstore.keys import BlockKey
from kvstore.policy.base import EvictionOrder
from kvstore.policy.history import COALESCE_S
from kvstore.room import Footprint

RECENT, FREQUENT = 1, 2  # T1 and T2


@dataclass(slots=True)
class _List:
    """One of T1/T2: LRU order overall and per size class, and its bytes."""

    order: OrderedDict[BlockKey, None] = field(default_factory=OrderedDict)
    by_class: dict[int, OrderedDict[BlockKey, None]] = field(default_factory=dict)
    nbytes: int = 0

    def put(self, key: BlockKey, footprint: Footprint) -> None:
        self.order[key] = None
        self.order.move_to_end(key)
        same = self.by_class.setdefault(footprint.size_class, OrderedDict())
        same[key] = None
        same.move_to_end(key)
        self.nbytes += footprint.nbytes

    def drop(self, key: BlockKey, footprint: Footprint) -> None:
        self.order.pop(key, None)
        same = self.by_class[footprint.size_class]
        same.pop(key, None)
        if not same:
            del self.by_class[footprint.size_class]
        self.nbytes -= footprint.nbytes

    def oldest_first(self, size_class: int | None) -> Iterator[BlockKey]:
        return iter(self.order if size_class is None else self.by_class.get(size_class, ()))


@dataclass(slots=True)
class _Held:
    footprint: Footprint
    where: int  # RECENT or FREQUENT
    last_use_s: float


class ArcOrder(EvictionOrder):
    """ARC over one tier's blocks (module docstring).

    Args:
        clock: seconds, monotonic (the store's clock or a simulator's).
        coalesce_s: uses of one block closer than this count as one.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 coalesce_s: float = COALESCE_S) -> None:
        self._clock = clock
        self._coalesce_s = coalesce_s
        self._held: dict[BlockKey, _Held] = {}
        self._lists = {RECENT: _List(), FREQUENT: _List()}
        self._ghosts = {RECENT: OrderedDict[BlockKey, int](), FREQUENT: OrderedDict[BlockKey, int]()}
        self._ghost_bytes = {RECENT: 0, FREQUENT: 0}
        self.target_recent_bytes = 0.0  # ARC's p
        self.cache_bytes = 0  # ARC's c: the most this order held

    def add(self, key: BlockKey, footprint: Footprint) -> None:
        now = self._clock()
        held = self._held.get(key)
        if held is not None:
            self._lists[held.where].drop(key, held.footprint)
            held.footprint = footprint
            if now - held.last_use_s >= self._coalesce_s:
                held.where, held.last_use_s = FREQUENT, now
            self._lists[held.where].put(key, footprint)
            return
        where = RECENT
        for ghost in (RECENT, FREQUENT):
            if key in self._ghosts[ghost]:
                self._adapt(ghost, footprint.nbytes)
                self._forget(ghost, key)
                where = FREQUENT
        self._held[key] = _Held(footprint, where, now)
        self._lists[where].put(key, footprint)
        self.cache_bytes = max(self.cache_bytes, self._held_bytes())
        self._trim_ghosts()

    def refile(self, key: BlockKey, footprint: Footprint) -> None:
        held = self._held.get(key)
        if held is None:
            return
        lst = self._lists[held.where]
        lst.nbytes += footprint.nbytes - held.footprint.nbytes
        if footprint.size_class != held.footprint.size_class:
            same = lst.by_class[held.footprint.size_class]
            same.pop(key)
            if not same:
                del lst.by_class[held.footprint.size_class]
            lst.by_class.setdefault(footprint.size_class, OrderedDict())[key] = None
        held.footprint = footprint  # same place in its list's overall order

    def touch_chain(self, keys: Sequence[BlockKey], group: bytes | None = None) -> None:
        now = self._clock()
        chain = [(k, h) for k in reversed(keys) if (h := self._held.get(k)) is not None]
        is_frequent = any(h.where == FREQUENT or now - h.last_use_s >= self._coalesce_s
                          for _, h in chain)
        for key, held in chain:  # children first: the root ends up the most recent
            self._lists[held.where].drop(key, held.footprint)
            if is_frequent:
                held.where = FREQUENT
            if now - held.last_use_s >= self._coalesce_s:
                held.last_use_s = now
            self._lists[held.where].put(key, held.footprint)

    def remove(self, key: BlockKey) -> None:
        held = self._held.pop(key, None)
        if held is None:
            return
        self._lists[held.where].drop(key, held.footprint)
        self._ghosts[held.where][key] = held.footprint.nbytes
        self._ghost_bytes[held.where] += held.footprint.nbytes
        self._trim_ghosts()

    def charge(self, key: BlockKey) -> int:
        held = self._held.get(key)
        return 0 if held is None else held.footprint.nbytes

    def coldest(self, nbytes: int, is_protected: Callable[[BlockKey], bool],
                size_class: int | None = None) -> list[BlockKey]:
        recent = _unprotected(self._lists[RECENT].oldest_first(size_class), is_protected)
        frequent = _unprotected(self._lists[FREQUENT].oldest_first(size_class), is_protected)
        head = {RECENT: next(recent, None), FREQUENT: next(frequent, None)}
        source = {RECENT: recent, FREQUENT: frequent}
        recent_left = self._lists[RECENT].nbytes
        victims: list[BlockKey] = []
        freed = 0
        while freed < nbytes:
            prefer = RECENT if recent_left > self.target_recent_bytes else FREQUENT
            take = prefer if head[prefer] is not None else 3 - prefer
            key = head[take]
            if key is None:
                break
            charge = self._held[key].footprint.nbytes
            victims.append(key)
            freed += charge
            if take == RECENT:
                recent_left -= charge
            head[take] = next(source[take], None)
        return victims

    def __len__(self) -> int:
        return len(self._held)

    def _held_bytes(self) -> int:
        return self._lists[RECENT].nbytes + self._lists[FREQUENT].nbytes

    def _adapt(self, ghost: int, nbytes: int) -> None:
        """A ghost hit: grow T1's target after a B1 hit, shrink it after a B2 hit."""
        mine, other = self._ghost_bytes[ghost], self._ghost_bytes[3 - ghost]
        step = max(nbytes, nbytes * other / max(mine, 1))
        if ghost == RECENT:
            self.target_recent_bytes = min(self.cache_bytes, self.target_recent_bytes + step)
        else:
            self.target_recent_bytes = max(0.0, self.target_recent_bytes - step)

    def _forget(self, ghost: int, key: BlockKey) -> None:
        self._ghost_bytes[ghost] -= self._ghosts[ghost].pop(key)

    def _trim_ghosts(self) -> None:
        """|T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c, in bytes."""
        c = self.cache_bytes
        b1, b2 = self._ghosts[RECENT], self._ghosts[FREQUENT]
        while b1 and self._lists[RECENT].nbytes + self._ghost_bytes[RECENT] > c:
            self._forget(RECENT, next(iter(b1)))
        while b2 and self._held_bytes() + sum(self._ghost_bytes.values()) > 2 * c:
            self._forget(FREQUENT, next(iter(b2)))


def _unprotected(keys: Iterator[BlockKey], is_protected: Callable[[BlockKey], bool]
                 ) -> Iterator[BlockKey]:
    return (k for k in keys if not is_protected(k))
