"""TauLikelihood: the time constant whose decayed-use intensity makes the observed reuses most
likely."""

from __future__ import annotations

import random

import pytest

from kvstore.errors import InvalidArgument
from kvstore.policy.tau import CANDIDATE_TAUS_S, MARGIN_PER_EVENT, TauLikelihood


def replay(fit: TauLikelihood, uses: list[tuple[float, int]]) -> None:
    """Feed ``(time, block)`` uses in time order, as the history does."""
    counts: dict[int, list[float]] = {}
    last: dict[int, float] = {}
    for t, block in uses:
        if block in counts:
            fit.reuse(counts[block], t - last[block])
        else:
            counts[block] = fit.new_counts()
        fit.use(t)
        last[block] = t


def test_quick_single_reuses_pick_a_short_tau():
    uses = []
    for i in range(500):
        uses += [(10.0 * i, i), (10.0 * i + 2.0, i)]  # used again 2 s later, then never
    fit = TauLikelihood()
    replay(fit, sorted(uses))
    assert fit.best_s() == 2.0


def test_stable_popularity_picks_a_long_tau():
    """Blocks drawn at Zipf rates: how often a block was used predicts its next use, when it
    was last used hardly does, so the longest candidates are the most likely."""
    rng = random.Random(3)
    t, uses = 0.0, []
    for _ in range(20_000):
        t += rng.expovariate(2.0)
        uses.append((t, rng.choices(range(20), [1 / (r + 1) for r in range(20)])[0]))
    fit = TauLikelihood()
    replay(fit, uses)
    assert fit.best_s() >= 256.0
    ll = fit.log_likelihoods()
    assert ll[CANDIDATE_TAUS_S.index(fit.best_s())] > ll[CANDIDATE_TAUS_S.index(8.0)]


def test_the_current_tau_is_kept_unless_clearly_beaten():
    fit = TauLikelihood()
    assert fit.best_s() is None and fit.best_s(32.0) is None  # no reuse seen yet
    uses = []
    for i in range(200):
        uses += [(10.0 * i, i), (10.0 * i + 4.0, i)]
    replay(fit, sorted(uses))
    ll = dict(zip(CANDIDATE_TAUS_S, fit.log_likelihoods()))
    best = fit.best_s()
    margin = MARGIN_PER_EVENT * fit.num_events
    for current in CANDIDATE_TAUS_S:
        kept = ll[best] - ll[current] <= margin
        assert fit.best_s(current) == (current if kept else best), current
    far = max(CANDIDATE_TAUS_S)
    assert fit.best_s(far) == best  # far off: beaten by more than the margin
    assert fit.best_s(21.6) == best  # off the grid: always replaced


@pytest.mark.parametrize("kwargs", [{"candidates_s": ()}, {"candidates_s": (0.0, 2.0)},
                                    {"decay": 0.0}, {"decay": 1.5}])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(InvalidArgument):
        TauLikelihood(**kwargs)


def test_a_reuse_must_come_after_the_use_before_it():
    fit = TauLikelihood()
    with pytest.raises(InvalidArgument, match="gap"):
        fit.reuse(fit.new_counts(), 0.0)
