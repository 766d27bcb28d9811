"""ValueOrder: frequency against recency, the saving per byte, learned reuse by chain place."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey
from kvstore.policy.history import ReuseStats, use_class
from kvstore.policy.value import ValueOrder
from kvstore.room import Footprint

HALF_LIFE_S = 15.0

from .test_orders import Clock, key, never


def uniform(footprint: Footprint, depth: int | None) -> float:
    return 0.02


def test_frequent_use_outranks_one_later_use_until_it_fades():
    clock = Clock()
    order = ValueOrder(uniform, clock, half_life_s=HALF_LIFE_S)
    hot, once = key(1), key(2)
    order.add(hot, Footprint(0, 1))
    for _ in range(5):
        clock.tick(10)
        order.touch_chain([hot])
    clock.tick(5)
    order.add(once, Footprint(0, 1))
    assert order.coldest(1, never) == [once]  # five uses within a minute beat one use now
    clock.tick(5 * HALF_LIFE_S)
    order.touch_chain([once])
    assert order.coldest(1, never) == [hot]  # ... but not one five half-lives later


def test_the_block_that_saves_less_per_byte_goes_first():
    saved = {1: 0.001, 2: 0.010, 3: -0.5}  # seconds a hit saves, by size class

    def saved_s(footprint: Footprint, depth: int | None) -> float:
        return saved[footprint.size_class]

    clock = Clock()
    order = ValueOrder(saved_s, clock)
    for size_class in (2, 1, 3):
        order.add(key(size_class), Footprint(size_class, 1000))
    assert order.coldest(3000, never) == [key(3), key(1), key(2)]  # a loss counts as nothing
    order.add(key(4), Footprint(2, 100_000))  # same saving over 100x the bytes
    assert order.coldest(1, never) == [key(3)]
    assert order.coldest(2000, never)[1] == key(4)


def test_deeper_blocks_that_save_more_are_scored_by_depth():
    def saved_s(footprint: Footprint, depth: int | None) -> float:
        return 0.02 + 0.001 * (depth or 0)  # attention makes deep blocks dearer to recompute

    clock = Clock()
    order = ValueOrder(saved_s, clock)
    a, b = [key(i) for i in range(2)], [key(10 + i) for i in range(8)]
    for k in a + b:
        order.add(k, Footprint(0, 1))
    order.touch_chain(a)
    order.touch_chain(b)
    assert order.value_score(b[-1]) > order.value_score(a[-1])
    assert order.value_score(key(99)) is None


def test_tails_that_are_never_used_again_learn_a_low_reuse():
    """Many requests share a root and end in a unique tail: the tier learns that tails are not
    used again, so a fresh tail ranks below an interior block used at the same moment."""
    clock = Clock()
    order = ValueOrder(uniform, clock)
    root = key(0)
    order.add(root, Footprint(0, 1))
    for i in range(1, 200):
        clock.tick(2)
        tail = key(i)
        order.add(tail, Footprint(0, 1))
        order.touch_chain([root, tail])
        if i > 10:
            order.remove(key(i - 10))  # the tier gives up old tails unused
    stats = order.stats
    assert stats.ratio(use_class(1, True)) < 0.1
    assert stats.ratio(use_class(0, False)) > 0.9
    clock.tick(2)
    fresh_tail, inner = key(500), key(501)
    order.add(fresh_tail, Footprint(0, 1))
    order.add(inner, Footprint(0, 1))
    order.touch_chain([key(502), fresh_tail])
    order.touch_chain([key(503), inner, key(504)])
    assert order.value_score(fresh_tail) < order.value_score(inner)


def test_uses_within_the_coalescing_window_count_once():
    clock = Clock()
    order = ValueOrder(uniform, clock, coalesce_s=1.0)
    order.add(key(1), Footprint(0, 1))
    order.add(key(2), Footprint(0, 1))
    for _ in range(10):  # one request's lookup, get and put
        order.touch_chain([key(1)])
    assert order.value_score(key(1)) == order.value_score(key(2))


def test_stats_age_and_settle():
    stats = ReuseStats()
    assert stats.ratio(0) == 0.5  # the prior
    for _ in range(30):
        stats.settle(0, was_reused=False)
    assert stats.ratio(0) < 0.05
    assert stats.ratio(use_class(3, False)) == 0.5  # another class is untouched


@pytest.mark.parametrize("kwargs", [{"half_life_s": 0}, {"coalesce_s": -1}])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(InvalidArgument):
        ValueOrder(uniform, **kwargs)


def test_keys_are_block_keys():
    assert isinstance(key(1), bytes) and BlockKey is not None
