"""The EvictionOrder contract, run against every order: atomic eviction, chains given up from
their tail, refile keeping rank, size classes, and coldest costing what it returns."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvstore.keys import BlockKey
from kvstore.policy import ORDER_NAMES, build_order
from kvstore.policy.base import EvictionOrder
from kvstore.room import Footprint, RoomNeed


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def tick(self, seconds: float = 5.0) -> None:
        self.now_s += seconds


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def never(_: BlockKey) -> bool:
    return False


def saved_by_bytes(footprint: Footprint, depth: int | None) -> float:
    return footprint.nbytes / 55e9  # every hit saves a DRAM read of its bytes


@pytest.fixture(params=ORDER_NAMES)
def make(request) -> Callable[[], tuple[EvictionOrder, Clock]]:
    def build() -> tuple[EvictionOrder, Clock]:
        clock = Clock()
        return build_order(request.param, saved_by_bytes, clock), clock

    return build


def filled(make, n: int) -> tuple[EvictionOrder, Clock]:
    order, clock = make()
    for i in range(n):
        order.add(key(i), Footprint(8, 8))
        clock.tick()
    return order, clock


def test_evict_is_all_or_nothing(make):
    order, _ = filled(make, 4)
    assert order.evict(RoomNeed(nbytes=16), never) == [key(0), key(1)]
    assert order.evict(RoomNeed(nbytes=40), never) is None  # only 32 bytes exist
    assert len(order) == 4  # evict changes nothing; the caller removes victims
    pinned = {key(0), key(2)}
    assert order.evict(RoomNeed(nbytes=16), pinned.__contains__) == [key(1), key(3)]
    assert order.evict(RoomNeed(nbytes=17), pinned.__contains__) is None


def test_victims_come_from_the_class_that_frees_room(make):
    order, clock = make()
    for i, size in enumerate((4096, 8192, 4096)):
        order.add(key(i), Footprint(size_class=size, nbytes=size))
        clock.tick()
    assert order.evict(RoomNeed(nbytes=8192, size_class=8192), never) == [key(1)]
    assert order.evict(RoomNeed(nbytes=8192, size_class=4096), never) == [key(0), key(2)]
    assert order.evict(RoomNeed(nbytes=4096, size_class=12288), never) is None
    assert order.coldest(10_000, never) == [key(0), key(1)]  # stops once it has enough
    assert order.coldest(20_000, never) == [key(0), key(1), key(2)]


@pytest.mark.parametrize("num_touches", [1, 2, 3])
def test_a_touched_chain_is_evicted_from_its_tail(make, num_touches):
    order, clock = make()
    chain = [key(i) for i in range(4)]
    for k in chain:
        order.add(k, Footprint(0, 1))
    clock.tick()
    order.add(key(9), Footprint(0, 1))
    for _ in range(num_touches):
        clock.tick()
        order.touch_chain(chain)  # parents first: the root ends the most valuable
    victims = order.coldest(5, never)
    assert [v for v in victims if v in chain] == chain[::-1]
    order.remove(key(9))
    order.remove(key(9))  # idempotent
    assert order.charge(key(9)) == 0 and len(order) == 4


def test_a_parent_outranks_the_children_it_was_used_with(make):
    """Children used more often than their parent still go first once the chain is used."""
    order, clock = make()
    root, child = key(0), key(1)
    order.add(root, Footprint(0, 1))
    order.add(child, Footprint(0, 1))
    for _ in range(4):
        clock.tick(30)
        order.touch_chain([root, child])
        order.touch_chain([root, child, key(7)])  # a key the tier does not hold is skipped
    assert order.coldest(2, never) == [child, root]


def test_refile_moves_a_block_between_classes_and_keeps_its_rank(make):
    order, clock = make()
    order.add(key(0), Footprint(size_class=1, nbytes=10))
    clock.tick()
    order.add(key(1), Footprint(size_class=1, nbytes=10))
    order.refile(key(0), Footprint(size_class=2, nbytes=12))
    assert order.coldest(1, never) == [key(0)]  # still the least valuable overall
    assert order.evict(RoomNeed(nbytes=10, size_class=1), never) == [key(1)]
    assert order.evict(RoomNeed(nbytes=12, size_class=2), never) == [key(0)]
    assert order.charge(key(0)) == 12
    order.refile(key(5), Footprint(1, 1))  # unknown: ignored
    assert len(order) == 2


def test_coldest_costs_the_victims_not_the_keys_held(make):
    """Listing three victims past two pinned keys asks about a handful of keys, not 20000."""
    order, clock = make()
    for i in range(20_000):
        order.add(key(i), Footprint(0, 1))
        if i % 100 == 0:
            clock.tick()
    asked: list[BlockKey] = []
    pinned = {key(0), key(1)}

    def is_protected(k: BlockKey) -> bool:
        asked.append(k)
        return k in pinned

    victims = order.coldest(3, is_protected)
    assert len(victims) == 3 and not pinned & set(victims)
    assert len(asked) <= 3 + len(pinned) + 2


def test_removed_keys_are_never_victims(make):
    order, _ = filled(make, 6)
    for i in (0, 2, 4):
        order.remove(key(i))
    assert order.coldest(100, never) == [key(1), key(3), key(5)]
    assert order.evict(RoomNeed(nbytes=25), never) is None
