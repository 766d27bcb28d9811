"""The value order's time constant, chosen by the likelihood of the reuse events it saw.

The value order ranks a block by an exponentially decayed count of its uses (LRFU). Read as a
rate, a decayed count under time constant ``tau`` covers ``E(t) = tau (1 - exp(-(t - t0) /
tau))`` seconds of history (t0: where the history began): ``tau`` itself once the history is
much longer, the history's length while it is shorter. So a block's reuse intensity is taken to
be ``p / E(t) * sum_j exp(-(t - t_j) / tau)`` over its past uses ``t_j``, ``p`` the share of
that rate that goes on. ``TauLikelihood`` scores a grid of candidate time constants by the
log-likelihood of the reuses observed, with ``p`` fitted per candidate:

    sum over events i of ln(sum_{j < i} exp(-(t_i - t_j) / tau) / E(t_i)) + N ln(p) - p C,
    C = integral up to now of sum over uses j of exp(-(t - t_j) / tau) / E(t) dt,
    p = min(1, N / C)

(C, the compensator: the reuse expected so far, so a use whose next one has not come yet
counts only for the time it has waited). A short ``tau`` wins where reuse follows quickly on
the last use (agentic steps); a long one where how often a block was used predicts its next use
better than when (documents of a stable popularity read again and again). Dividing by ``tau``
instead of ``E(t)``, the fit this replaces, read a long constant over a short history as a rate
``tau / (t - t0)`` times too low: on the bench's Zipf document trace it preferred 16 s after 50
s of history and 64 s only after 141 s, while tau held at 256 s from the start gives a mean
TTFT 10% lower than that fit's (``kvstore bench policy``, doc-qa/roomy, 2026-12-01).

Where the history is shorter than several candidates they all count uses since it began and
score alike; of those within the margin, the shortest is taken: it forgets a wrong start
soonest, and a longer one wins as soon as the history tells them apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvstore.errors import InvalidArgument

# Candidates: powers of two from 2 s to 1024 s, within the history's bounds (2 s, 3600 s); a
# factor of two between neighbours is finer than the rankings tell apart.
CANDIDATE_TAUS_S = tuple(2.0 ** k for k in range(1, 11))
# Weight left to the old sums at each use, so the choice follows a changing workload: about
# the last 4096 uses count (the history's STATS_AGE_USES).
DECAY = 1.0 - 1.0 / 4096
# Candidates within this much log-likelihood per reuse event of the best are taken as equally
# likely: the current one is kept among them, else the shortest. Where the likelihood is flat
# (long candidates on a document trace) the choice would otherwise swing between neighbours,
# and every move re-scores each tier.
MARGIN_PER_EVENT = 0.01
# The history is taken to have begun this long before its first use (the shortest candidate):
# a count of one use over no history at all would be a rate without bound.
PRIOR_HISTORY_S = 2.0


class TauLikelihood:
    """Decayed log-likelihood of the observed uses under each candidate ``tau``.

    Each block carries its decayed use count under every candidate (``new_counts``, updated by
    ``reuse``), so an event is scored against all its past uses in O(candidates). Called from
    the history's event loop.

    Args:
        candidates_s: the time constants to choose between (seconds, > 0).
        decay: weight left to the old sums at each use, in (0, 1].
        prior_history_s: seconds of history taken to precede the first use (> 0).
    """

    def __init__(self, candidates_s: Sequence[float] = CANDIDATE_TAUS_S,
                 decay: float = DECAY, prior_history_s: float = PRIOR_HISTORY_S) -> None:
        if not candidates_s or any(c <= 0 for c in candidates_s) or not 0 < decay <= 1 \
                or prior_history_s <= 0:
            raise InvalidArgument(f"candidates must be > 0 s, decay in (0, 1] and "
                                  f"prior_history_s > 0, got {list(candidates_s)}, {decay} "
                                  f"and {prior_history_s}")
        self.candidates_s = tuple(float(c) for c in candidates_s)
        self._decay = decay
        self._prior_history_s = prior_history_s
        n = len(self.candidates_s)
        self._event_sums = [0.0] * n  # sum of ln(kernel / exposure) over reuse events
        self._kernels = [0.0] * n  # sum over uses of exp(-(now - t_j) / tau)
        self._due = [0.0] * n  # the compensator: expected reuses so far, integrated
        self._num_events = 0.0
        self._start_s: float | None = None  # where the exposure starts
        self._last_s = 0.0

    @property
    def num_events(self) -> float:
        """Reuse events seen (decayed)."""
        return self._num_events

    def new_counts(self) -> list[float]:
        """A block's decayed use counts, one per candidate, right after its first use."""
        return [1.0] * len(self.candidates_s)

    def use(self, now: float) -> None:
        """Some block was used at ``now`` (its first use or a reuse; times never go back)."""
        self._advance(now)
        d = self._decay
        self._kernels = [k * d + 1.0 for k in self._kernels]
        self._due = [c * d for c in self._due]
        self._event_sums = [s * d for s in self._event_sums]
        self._num_events *= d

    def reuse(self, counts: list[float], gap_s: float, now: float) -> None:
        """The block whose decayed counts (at its previous use) are ``counts`` was used again
        ``gap_s`` seconds later, at ``now``; ``counts`` become those of now. Call ``use`` for
        it too."""
        if gap_s <= 0:
            raise InvalidArgument(f"a reuse comes after the use before it, got a gap of {gap_s}")
        self._advance(now)
        self._num_events += 1.0
        for i, tau in enumerate(self.candidates_s):
            kernel = counts[i] * math.exp(-gap_s / tau)  # sum_j exp(-(t - t_j) / tau)
            # exp underflows to 0 only for gaps far beyond tau: the floor keeps the sum finite
            # and such a candidate hopeless.
            self._event_sums[i] += math.log(max(kernel, 1e-300) / self._exposure_s(tau, now))
            counts[i] = kernel + 1.0

    def log_likelihoods(self) -> tuple[float, ...]:
        """The decayed log-likelihood per candidate (same order as ``candidates_s``)."""
        n = self._num_events
        out = []
        for event_sum, due in zip(self._event_sums, self._due):
            due = max(due, 1e-12)
            # p, the share of the rate seen that goes on, fitted and at most 1 (reuse events
            # are a subset of uses).
            p = min(1.0, n / due) if n > 0 else 1.0
            out.append(event_sum + (n * math.log(p) if n > 0 else 0.0) - p * due)
        return tuple(out)

    def best_s(self, current_s: float | None = None) -> float | None:
        """The shortest candidate within ``MARGIN_PER_EVENT`` per event of the most likely, or
        None before any reuse. With ``current_s`` (the time constant in use), that one is kept
        while it is within the margin too (a current value off the grid is always replaced).

        Where the history is shorter than several candidates they all amount to counting uses
        since it began and the likelihood cannot tell them apart; the shortest of them is
        taken, as it forgets a wrong start soonest."""
        if self._num_events <= 0:
            return None
        ll = self.log_likelihoods()
        floor = max(ll) - MARGIN_PER_EVENT * self._num_events
        near = [c for c, score in zip(self.candidates_s, ll) if score >= floor]
        if current_s in near:
            return current_s
        return min(near)

    def _exposure_s(self, tau: float, now: float) -> float:
        """tau (1 - exp(-(now - start) / tau)): the seconds of history a decayed count under
        ``tau`` spans at ``now``; tau itself once the history is much longer."""
        start = now - self._prior_history_s if self._start_s is None else self._start_s
        return -tau * math.expm1(-(now - start) / tau)

    def _advance(self, now: float) -> None:
        """Integrate the intensity from the last use to ``now`` into the compensator and
        decay the kernels to ``now``."""
        if self._start_s is None:
            self._start_s, self._last_s = now - self._prior_history_s, now
            return
        elapsed = now - self._last_s
        if elapsed <= 0:
            return
        since = self._last_s - self._start_s
        for i, tau in enumerate(self.candidates_s):
            self._due[i] += self._kernels[i] * _integral(since / tau, elapsed / tau)
            self._kernels[i] *= math.exp(-elapsed / tau)
        self._last_s = now


def _integral(x: float, h: float) -> float:
    """The integral over s in (x, x + h) of exp(-(s - x)) / (1 - exp(-s)) ds (x, h > 0): a
    unit kernel at ``x`` time constants into the history, divided by the exposure, over the
    next ``h`` time constants; 1 - e^-h once x is large (the exposure is then tau itself).
    In closed form ln((1 - u_b) / (1 - u_a)) / u_a with u = e^-s, written to keep its
    precision for small h and large x."""
    gone = -math.expm1(-h)  # 1 - e^-h
    if x > 700.0:  # e^-x below double precision: the exposure is tau
        return gone
    z = gone / math.expm1(x)  # (u_a - u_b) / (1 - u_a)
    return gone / -math.expm1(-x) * (math.log1p(z) / z if z > 1e-12 else 1.0)
