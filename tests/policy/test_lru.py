"""LruOrder: atomic eviction by size class, chains evicted from their tail, refiled footprints."""

from __future__ import annotations

from kvstore.keys import BlockKey
from kvstore.policy.lru import LruOrder
from kvstore.room import Footprint, RoomNeed


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


def _per_key_touch(order: list[BlockKey], chain: list[BlockKey]) -> None:
    """The rule touch_chain implements, one key at a time: children first, parents last."""
    for k in reversed(chain):
        if k in order:
            order.remove(k)
            order.append(k)


def test_touch_chain_ranks_each_class_as_touching_key_by_key():
    """touch_chain moves a chain in C passes per size class; the ranks must be those of the
    per-key rule, in the whole order and in each class, with keys the tier does not hold."""
    import random

    rng = random.Random(7)
    order = LruOrder()
    classes = {key(i): rng.choice((4096, 8192, 16384)) for i in range(60)}
    expected: list[BlockKey] = []
    for k, size_class in classes.items():
        order.add(k, Footprint(size_class=size_class, nbytes=size_class))
        expected.append(k)
    for _ in range(40):
        start = rng.randrange(0, 70)
        chain = [key(i) for i in range(start, start + rng.randrange(1, 30))]  # some not held
        order.touch_chain(chain)
        _per_key_touch(expected, chain)
    assert order.coldest(10**9, never) == expected
    for size_class in (4096, 8192, 16384):
        assert order.coldest(10**9, never, size_class) == [
            k for k in expected if classes[k] == size_class]


def test_touch_chain_of_one_class_and_of_nothing_held():
    order = LruOrder()
    for i in range(5):
        order.add(key(i), Footprint(size_class=8, nbytes=8))
    order.touch_chain([key(1), key(3), key(7)])  # key 7 is not held
    assert order.coldest(100, never) == [key(0), key(2), key(4), key(3), key(1)]
    assert order.coldest(100, never, 8) == [key(0), key(2), key(4), key(3), key(1)]
    order.touch_chain([key(20), key(21)])  # nothing held: nothing moves
    assert order.coldest(100, never) == [key(0), key(2), key(4), key(3), key(1)]
