"""LruOrder: atomic eviction by size class, chains evicted from their tail, refiled footprints."""

from __future__ import annotations

from kvstore.keys import BlockKey
from kvstore.policy.base import Footprint, RoomNeed
from kvstore.policy.lru import LruOrder


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def never(_: BlockKey) -> bool:
    return False


def test_evict_is_all_or_nothing():
    order = LruOrder()
    for i in range(4):
        order.add(key(i), Footprint(size_class=8, nbytes=8))
    assert order.evict(RoomNeed(nbytes=16), never) == [key(0), key(1)]
    assert order.evict(RoomNeed(nbytes=40), never) is None  # only 32 bytes exist
    assert len(order) == 4  # evict changes nothing; the caller removes victims
    pinned = {key(0), key(2)}
    assert order.evict(RoomNeed(nbytes=16), pinned.__contains__) == [key(1), key(3)]
    assert order.evict(RoomNeed(nbytes=17), pinned.__contains__) is None


def test_victims_come_from_the_class_that_frees_room():
    order = LruOrder()
    order.add(key(0), Footprint(size_class=4096, nbytes=4096))
    order.add(key(1), Footprint(size_class=8192, nbytes=8192))
    order.add(key(2), Footprint(size_class=4096, nbytes=4096))
    assert order.evict(RoomNeed(nbytes=8192, size_class=8192), never) == [key(1)]
    assert order.evict(RoomNeed(nbytes=8192, size_class=4096), never) == [key(0), key(2)]
    assert order.evict(RoomNeed(nbytes=4096, size_class=12288), never) is None
    assert order.coldest(10_000, never) == [key(0), key(1)]  # stops once it has enough
    assert order.coldest(20_000, never) == [key(0), key(1), key(2)]


def test_a_touched_chain_is_evicted_from_its_tail():
    order = LruOrder()
    chain = [key(i) for i in range(3)]
    for k in chain:
        order.add(k, Footprint(0, 1))
    order.add(key(9), Footprint(0, 1))
    order.touch_chain(chain)  # parents first: the root ends most recent
    assert order.coldest(4, never) == [key(9), key(2), key(1), key(0)]
    order.remove(key(9))
    order.remove(key(9))  # idempotent
    assert order.charge(key(9)) == 0 and len(order) == 3
