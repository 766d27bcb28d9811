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
            fit.reuse(counts[block], t - last[block], t)
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
    fit = TauLikelihood()
    replay(fit, zipf_uses(10_000.0))
    assert fit.best_s() >= 256.0
    ll = fit.log_likelihoods()
    assert ll[CANDIDATE_TAUS_S.index(fit.best_s())] > ll[CANDIDATE_TAUS_S.index(8.0)]


def zipf_uses(duration_s: float, seed: int = 3) -> list[tuple[float, int]]:
    """Uses of 20 blocks at Zipf rates, 2 a second, for ``duration_s``."""
    rng = random.Random(seed)
    t, uses = 0.0, []
    while t < duration_s:
        t += rng.expovariate(2.0)
        uses.append((t, rng.choices(range(20), [1 / (r + 1) for r in range(20)])[0]))
    return uses


def test_a_history_shorter_than_the_candidate_does_not_count_against_it():
    """Regression: the intensity was divided by tau, not by the history a count under tau
    covers, so over a history shorter than a candidate its rate read too low and a stable
    popularity picked 64 s after 600 s (doc-qa ran a third of its trace on 16-32 s)."""
    fit = TauLikelihood()
    replay(fit, zipf_uses(600.0))
    assert fit.best_s() >= 256.0


def test_candidates_the_history_cannot_tell_apart_give_the_shortest():
    fit = TauLikelihood()
    replay(fit, zipf_uses(30.0))  # every candidate above 30 s counts uses since the start
    ll = fit.log_likelihoods()
    floor = max(ll) - MARGIN_PER_EVENT * fit.num_events
    near = [c for c, score in zip(CANDIDATE_TAUS_S, ll) if score >= floor]
    assert len(near) > 1
    assert fit.best_s() == min(near) < CANDIDATE_TAUS_S[ll.index(max(ll))]


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
        kept = max(ll.values()) - ll[current] <= margin
        assert fit.best_s(current) == (current if kept else best), current
    far = max(CANDIDATE_TAUS_S)
    assert fit.best_s(far) == best  # far off: beaten by more than the margin
    assert fit.best_s(21.6) == best  # off the grid: always replaced


@pytest.mark.parametrize("kwargs", [{"candidates_s": ()}, {"candidates_s": (0.0, 2.0)},
                                    {"decay": 0.0}, {"decay": 1.5},
                                    {"prior_history_s": 0.0}])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(InvalidArgument):
        TauLikelihood(**kwargs)


def test_a_reuse_must_come_after_the_use_before_it():
    fit = TauLikelihood()
    with pytest.raises(InvalidArgument, match="gap"):
        fit.reuse(fit.new_counts(), 0.0, 1.0)
