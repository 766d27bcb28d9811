"""The value order's time constant, chosen by the likelihood of the reuse events it saw.

The value order ranks a block by an exponentially decayed count of its uses (LRFU): with time
constant ``tau`` its reuse intensity is taken to be ``p / tau * sum_j exp(-(t - t_j) / tau)``
over its past uses ``t_j`` (a self-exciting process: every use brings ``p`` more uses on
average, spread over about ``tau`` seconds after it). ``TauLikelihood`` scores a grid of
candidate time constants by the log-likelihood of the uses observed, with ``p`` fitted per
candidate, and picks the best. Of N reuse events after U uses, the log-likelihood is

    sum over events i of ln(sum_{j < i} exp(-(t_i - t_j) / tau) / tau) + N ln(p) - p C,
    C = sum over uses j of (1 - exp(-(now - t_j) / tau)),  p = min(1, N / C)

(C: how much of the uses' expected reuse has come due by now). A short ``tau`` wins where reuse
follows quickly on the last use (agentic steps); a long one where how often a block was used
predicts its next use better than when (documents of a stable popularity read again and again).
The mean gap between uses, the fit this replaces, saw only the last gap: 15.6 s on the bench's
Zipf document trace, where this fit settles at 64 s and the value order's mean TTFT with tau
held at 64-256 s is 8-12% lower than at 16 s (``kvstore bench policy``, 2026-12-01).
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
# A new time constant must beat the current one by this much log-likelihood per reuse event:
# where the likelihood is flat (long candidates on a document trace) the choice would otherwise
# swing between neighbours, and every move re-scores each tier.
MARGIN_PER_EVENT = 0.01


class TauLikelihood:
    """Decayed log-likelihood of the observed uses under each candidate ``tau``.

    Each block carries its decayed use count under every candidate (``new_counts``, updated by
    ``reuse``), so an event is scored against all its past uses in O(candidates). Called from
    the history's event loop.

    Args:
        candidates_s: the time constants to choose between (seconds, > 0).
        decay: weight left to the old sums at each use, in (0, 1].
    """

    def __init__(self, candidates_s: Sequence[float] = CANDIDATE_TAUS_S,
                 decay: float = DECAY) -> None:
        if not candidates_s or any(c <= 0 for c in candidates_s) or not 0 < decay <= 1:
            raise InvalidArgument(f"candidates must be > 0 s and decay in (0, 1], got "
                                  f"{list(candidates_s)} and {decay}")
        self.candidates_s = tuple(float(c) for c in candidates_s)
        self._decay = decay
        n = len(self.candidates_s)
        self._event_sums = [0.0] * n  # sum of ln(kernel / tau) over reuse events
        self._pending = [0.0] * n  # sum over uses of exp(-(now - t_j) / tau): not yet due
        self._num_uses = 0.0
        self._num_events = 0.0
        self._last_s: float | None = None

    @property
    def num_events(self) -> float:
        """Reuse events seen (decayed)."""
        return self._num_events

    def new_counts(self) -> list[float]:
        """A block's decayed use counts, one per candidate, right after its first use."""
        return [1.0] * len(self.candidates_s)

    def use(self, now: float) -> None:
        """Some block was used at ``now`` (its first use or a reuse; times never go back)."""
        d = self._decay
        if self._last_s is not None:
            elapsed = max(0.0, now - self._last_s)
            for i, tau in enumerate(self.candidates_s):
                self._pending[i] *= math.exp(-elapsed / tau)
        self._last_s = now
        self._pending = [p * d + 1.0 for p in self._pending]
        self._num_uses = self._num_uses * d + 1.0
        self._event_sums = [s * d for s in self._event_sums]
        self._num_events *= d

    def reuse(self, counts: list[float], gap_s: float) -> None:
        """The block whose decayed counts (at its previous use) are ``counts`` was used again
        ``gap_s`` seconds later; ``counts`` become those of now. Call ``use`` for it too."""
        if gap_s <= 0:
            raise InvalidArgument(f"a reuse comes after the use before it, got a gap of {gap_s}")
        self._num_events += 1.0
        for i, tau in enumerate(self.candidates_s):
            kernel = counts[i] * math.exp(-gap_s / tau)  # sum_j exp(-(t - t_j) / tau)
            # exp underflows to 0 only for gaps far beyond tau: the floor keeps the sum finite
            # and such a candidate hopeless.
            self._event_sums[i] += math.log(max(kernel, 1e-300) / tau)
            counts[i] = kernel + 1.0

    def log_likelihoods(self) -> tuple[float, ...]:
        """The decayed log-likelihood per candidate (same order as ``candidates_s``)."""
        n = self._num_events
        out = []
        for event_sum, pending in zip(self._event_sums, self._pending):
            due = max(self._num_uses - pending, 1e-12)
            # p, the reuses each use brings, fitted and at most 1 (reuse events are a subset
            # of uses): without the cap a long candidate explains a short history with a p
            # far above 1 whose mass is not due yet, and wins before the data can tell.
            p = min(1.0, n / due) if n > 0 else 1.0
            out.append(event_sum + (n * math.log(p) if n > 0 else 0.0) - p * due)
        return tuple(out)

    def best_s(self, current_s: float | None = None) -> float | None:
        """The most likely candidate, or None before any reuse. With ``current_s`` (the time
        constant in use), that one is kept unless the best beats it by ``MARGIN_PER_EVENT``
        per event (a current value off the grid is always replaced)."""
        if self._num_events <= 0:
            return None
        ll = self.log_likelihoods()
        best = max(range(len(ll)), key=ll.__getitem__)
        if current_s is not None and current_s in self.candidates_s:
            now = self.candidates_s.index(current_s)
            if ll[best] - ll[now] <= MARGIN_PER_EVENT * self._num_events:
                return current_s
        return self.candidates_s[best]
