"""UseHistory: one access history for the value orders of a chain, tau learned from reuses,
statistics per namespace."""

from __future__ import annotations

import random

import pytest

from kvstore.errors import InvalidArgument
from kvstore.policy.history import (
    GHOST_TAUS,
    MIN_TAU_S,
    PRIOR_TAU_S,
    REFIT_GAPS,
    UseHistory,
    use_class,
)
from kvstore.policy.value import ValueOrder
from kvstore.room import Footprint

from .test_orders import Clock, key, never


def uniform(footprint: Footprint, depth: int | None) -> float:
    return 0.02


def test_a_block_moved_down_keeps_its_history():
    """Regression: a tier ranked a demoted block by its arrival, so a chain's tail demoted
    after its parent outranked the parent there and the chain was cut in the middle (agentic
    traces: SSD blocks between DRAM ones, the rest recomputed)."""
    clock = Clock()
    history = UseHistory()
    upper, lower = ValueOrder(uniform, clock, history), ValueOrder(uniform, clock, history)
    parent, child, other = key(1), key(2), key(3)
    upper.add(child, Footprint(0, 1))
    lower.add(parent, Footprint(0, 1))
    for order in (upper, lower):
        order.touch_chain([parent, child])
    clock.tick(10)
    lower.add(other, Footprint(0, 1))
    lower.touch_chain([other])
    clock.tick(20)
    lower.add(child, Footprint(0, 1))  # demoted 30 s after its last use
    upper.remove(child)
    assert lower.coldest(3, never) == [child, parent, other]


def test_tau_is_learned_from_the_reuses_it_saw():
    """Reuse that follows quickly on a block's last use and then stops (agentic steps) gives a
    short time constant; steady reuse at rates of their own per block (documents of a stable
    popularity) a long one, under which the more popular block ranks higher."""
    clock = Clock()
    bursty = UseHistory()
    order = ValueOrder(uniform, clock, bursty)
    assert bursty.tau_s == PRIOR_TAU_S
    for i in range(4 * REFIT_GAPS):
        k = key(i)
        order.add(k, Footprint(0, 1))
        order.touch_chain([k])
        clock.tick(2.0)
        order.touch_chain([k])  # used once more, 2 s later, then never
        clock.tick(6.0)
        order.remove(k)
    assert bursty.tau_s <= 4.0 and bursty.epoch >= 1

    clock = Clock()
    steady = UseHistory()
    order = ValueOrder(uniform, clock, steady)
    rng = random.Random(5)
    blocks = [key(1000 + j) for j in range(8)]
    for k in blocks:
        order.add(k, Footprint(0, 1))
    weights = [1.0 / (j + 1) for j in range(len(blocks))]
    for _ in range(40 * REFIT_GAPS):
        clock.tick(rng.expovariate(1.0))
        order.touch_chain([rng.choices(blocks, weights)[0]])
    assert steady.tau_s >= 64.0
    assert order.value_score(blocks[0]) > order.value_score(blocks[-1])
    fixed = UseHistory(tau_s=MIN_TAU_S * 4, learn_tau=False)
    assert fixed.tau_s == MIN_TAU_S * 4


def test_a_move_of_tau_re_makes_every_moment_under_the_new_constant():
    """Regression: a block's moment made under one constant was kept after tau moved, so a
    block used six times under 1024 s kept about 1800 s over any block used since once tau was
    short (bench policy, chat/tight with tau at 1024 s and then 64 s: 66.5 against 60.7 ms)."""
    clock = Clock()
    history = UseHistory(tau_s=1024.0)
    order = ValueOrder(uniform, clock, history)
    veteran = key(1)
    order.add(veteran, Footprint(0, 1))
    for _ in range(5):
        clock.tick(3.0)
        order.touch_chain([veteran])
    for i in range(4 * REFIT_GAPS):  # quick single reuses: tau moves down
        k = key(100 + i)
        order.add(k, Footprint(0, 1))
        order.touch_chain([k])
        clock.tick(2.0)
        order.touch_chain([k])
        order.remove(k)
    assert history.tau_s <= 4.0 and history.epoch >= 1
    newcomer = key(2)
    order.add(newcomer, Footprint(0, 1))
    order.touch_chain([newcomer])
    assert order.coldest(1, never) == [veteran]
    uses = history.get(veteran)
    assert uses.use_s == pytest.approx(uses.last_use_s, abs=history.tau_s)


def test_reuse_odds_are_learned_per_namespace():
    clock = Clock()
    history = UseHistory()
    order = ValueOrder(uniform, clock, history)
    root = {b"ns-a": key(0), b"ns-b": key(1)}
    for k in root.values():
        order.add(k, Footprint(0, 1))
    tails = {b"ns-a": key(100), b"ns-b": key(200)}
    for i in range(60):
        clock.tick(2)
        for ns in (b"ns-a", b"ns-b"):
            if ns == b"ns-a" or i % 2 == 0:  # ns-a: a new tail every time; ns-b: each twice
                order.remove(tails[ns])
                tails[ns] = key(1000 * (ns == b"ns-b") + 300 + i)
                order.add(tails[ns], Footprint(0, 1))
            order.touch_chain([root[ns], tails[ns]], ns)
    assert history.stats.ratio(use_class(1, True, 0)) < 0.1  # ns-a's tails: never again
    assert history.stats.ratio(use_class(1, True, 1)) > 0.35  # ns-b's: half the time


def test_a_block_that_comes_back_counts_as_reused_and_keeps_its_uses():
    """Regression: odds learned only from held blocks fed on themselves (a class given up early
    is seen reused less, so it is given up earlier): a use after the block left still counts,
    until its ghost is GHOST_TAUS time constants old."""
    clock = Clock()
    history = UseHistory()
    order = ValueOrder(uniform, clock, history)
    root = key(0)
    order.add(root, Footprint(0, 1))
    for i in range(1, 41):  # tails that leave as soon as used, each used five times
        tail = key(i)
        for _ in range(5):
            clock.tick(2)
            order.add(tail, Footprint(0, 1))
            order.touch_chain([root, tail])
            order.remove(tail)
    assert history.stats.ratio(use_class(1, True)) > 0.7  # four uses in five were reused


def test_a_block_that_comes_back_keeps_its_uses_until_its_ghost_is_forgotten():
    clock = Clock()
    history = UseHistory(tau_s=60.0, learn_tau=False)
    order = ValueOrder(uniform, clock, history)
    hot, fresh = key(1), key(2)
    order.add(hot, Footprint(0, 1))
    for _ in range(4):
        clock.tick(3)
        order.touch_chain([hot])
    order.remove(hot)
    clock.tick(3)
    order.add(hot, Footprint(0, 1))  # back: its five uses come with it
    order.add(fresh, Footprint(0, 1))
    order.touch_chain([hot])
    order.touch_chain([fresh])
    assert order.value_score(fresh) < order.value_score(hot)
    clock.tick(GHOST_TAUS * history.tau_s + 1)
    order.remove(hot)
    order.remove(fresh)  # releasing settles the ghosts past the horizon as lost
    order.add(hot, Footprint(0, 1))
    assert history.get(hot).use_s == clock.now_s  # a new life


def test_a_copy_a_faster_tier_also_holds_goes_first_until_that_copy_goes():
    """A hit is served by the fastest copy, and a copy that leaves while a slower one exists
    is dropped rather than moved down: the slower copy is a backup that saves nothing. Ranked
    by its own uses it kept the hottest blocks in two tiers (bench policy, doc-qa/roomy: 414
    against 396 ms mean TTFT; chat/tight 58.1 against 56.1)."""
    clock = Clock()
    history = UseHistory()
    fast = ValueOrder(uniform, clock, history, rank=0)
    slow = ValueOrder(uniform, clock, history, rank=1)
    old, hot = key(1), key(2)
    slow.add(old, Footprint(0, 1))
    clock.tick(30)
    slow.add(hot, Footprint(0, 1))
    fast.add(hot, Footprint(0, 1))  # promoted: a copy stays below
    slow.touch_chain([hot])
    fast.touch_chain([hot])
    assert slow.coldest(1, never) == [hot]
    fast.remove(hot)
    assert slow.coldest(1, never) == [old]  # the only copy again: ranked by its uses
    with pytest.raises(InvalidArgument):
        ValueOrder(uniform, clock, history, rank=1)  # one order per chain position


@pytest.mark.parametrize("kwargs", [{"coalesce_s": -1}, {"tau_s": 0.5}, {"tau_s": 1e6}])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(InvalidArgument):
        UseHistory(**kwargs)
