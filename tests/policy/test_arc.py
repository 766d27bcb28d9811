"""ArcOrder: blocks used twice survive a scan of one-off blocks; ghost hits move the target."""

from __future__ import annotations

from kvstore.policy.arc import ArcOrder
from kvstore.room import Footprint

from .test_orders import Clock, key, never


def test_a_scan_gives_up_blocks_used_once_before_blocks_used_twice():
    clock = Clock()
    order = ArcOrder(clock)
    hot = [key(i) for i in range(4)]
    for k in hot:
        order.add(k, Footprint(0, 1))
    clock.tick()
    for k in hot:
        order.touch_chain([k])  # used again: T2
    for i in range(100, 104):  # a scan arrives after them
        clock.tick()
        order.add(key(i), Footprint(0, 1))
    assert order.coldest(4, never) == [key(i) for i in range(100, 104)]  # LRU would take hot


def test_ghost_hits_move_the_target_of_the_recent_list():
    clock = Clock()
    order = ArcOrder(clock)
    for i in range(4):
        order.add(key(i), Footprint(0, 10))
    assert order.cache_bytes == 40 and order.target_recent_bytes == 0
    order.remove(key(0))  # given up from T1: a ghost in B1
    clock.tick()
    order.add(key(0), Footprint(0, 10))  # back: T1 was too small
    assert order.target_recent_bytes > 0
    grown = order.target_recent_bytes
    order.touch_chain([key(1)])
    clock.tick()
    order.touch_chain([key(1)])
    order.remove(key(1))  # given up from T2: a ghost in B2
    order.add(key(1), Footprint(0, 10))
    assert order.target_recent_bytes < grown


def test_uses_within_the_coalescing_window_count_once():
    clock = Clock()
    order = ArcOrder(clock, coalesce_s=1.0)
    order.add(key(1), Footprint(0, 1))
    order.touch_chain([key(1)])  # the same request's put: still used once
    order.add(key(2), Footprint(0, 1))
    clock.tick()
    order.add(key(3), Footprint(0, 1))
    order.touch_chain([key(3)])
    order.touch_chain([key(2)])  # used again later: T2, given up after T1's keys
    assert order.coldest(3, never) == [key(1), key(3), key(2)]
