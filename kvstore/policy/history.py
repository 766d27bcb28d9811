"""The access history the value orders of one tier chain share: each block's uses (recency and
frequency), where in a chain it was used, and what uses of its kind went on to.

One ``UseHistory`` per chain, so a block keeps its history when it moves down: a demoted block
is ranked in its new tier by when and how often it was really used, not by when it arrived (a
tier that ranked arrivals as fresh kept a demoted tail above the parent demoted after it and cut
chains in the middle). What it learns:

- per block, an exponentially decayed count of its uses in log form (LRFU): ``tau ln(sum of
  e^(t_use / tau))`` seconds, the moment its uses amount to;
- per use class (namespace, log2 prefix-depth bucket, tail of its chain or not): of the uses
  that settled, how many were followed by another use while some tier held the block or its
  ghost was remembered (``GHOST_TAUS`` time constants after it left the last tier);
- the time constant ``tau`` itself: of a grid of candidates, the one under which the reuses
  seen were most likely (``tau.TauLikelihood``: each use adds ``e^(-age / tau)`` to a block's
  reuse intensity, as in the score). It starts from a prior; the fit is looked at every
  ``REFIT_GAPS`` observed reuses, and tau moves at most once per as many reuses as blocks held.
  A move re-makes every block's moment under the new constant from its counts per candidate.

Chain order is kept in the history, not in each tier: at every use of a chain, a block's reuse
score (its moment plus ``tau`` times the log-odds of its class) and its reach (the deepest chain
position it led to) are raised to at least its child's, from the tail up, and never drop. A
child is only used together with its parents, so in every tier that ranks by these two numbers
a parent outranks its children, whenever and in whatever order they arrived there.

Orders given their chain position (``rank``) also learn which tiers hold each block: a copy
that a faster tier also holds is a backup (``is_backup``), and its order is told when that
changes.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey
from kvstore.policy.tau import TauLikelihood

# The time constant before any reuse gap is known: half-life 15 s, the value the bench picked
# by hand before tau was learned (2026-12-01).
PRIOR_TAU_S = 15.0 / math.log(2.0)
# tau stays within these bounds (seconds): a burst of one request's re-reads, or a trace of
# rare revisits, must not make the order pure LRU or pure LFU.
MIN_TAU_S, MAX_TAU_S = 2.0, 3600.0
REFIT_GAPS = 64  # observed reuses between two looks at the fit of tau
# A request's lookup, get and put of one block fall within its prefill (about a second for a
# 32k-token prompt on an 8B model at 4e14 FLOP/s): uses closer than this count once.
COALESCE_S = 1.0
NUM_DEPTH_BUCKETS = 16  # depth 0, 1, 2-3, 4-7, ..., >= 2**14 blocks
CLASSES_PER_GROUP = 2 * NUM_DEPTH_BUCKETS
MAX_GROUPS = 64  # namespaces with statistics of their own; later ones share the last
UNKNOWN_CLASS = -1  # a block no chain has used yet
# Blocks no tier holds whose history is remembered: as many as are held, at least this many.
MIN_GHOSTS = 1024
GHOST_TAUS = 4.0  # ... and for this many time constants after their last use
# Reuse statistics are halved after this many uses, so they follow a changing workload.
STATS_AGE_USES = 4096
# Beta(1, 1) prior on "a use is followed by another": a class starts at 1/2.
PRIOR_REUSES, PRIOR_USES = 1.0, 2.0
# A parent's reuse score is at least this far (seconds) above its child's: ties would leave the
# order to filing numbers.
CHAIN_STEP_S = 1e-6


def use_class(depth: int, is_tail: bool, group: int = 0) -> int:
    """The statistics class of a use at chain position ``depth`` in namespace group ``group``."""
    return (group * CLASSES_PER_GROUP + 2 * min(depth.bit_length(), NUM_DEPTH_BUCKETS - 1)
            + is_tail)


class ReuseStats:
    """Per use class: decayed counts of uses that were followed by another use, and of uses
    that were its last (settled when its ghost is forgotten). Only settled uses count: a block
    just used has had no time to be used again, and counting it would rank new blocks low."""

    def __init__(self) -> None:
        self._reused: dict[int, float] = {}
        self._lost: dict[int, float] = {}
        self._num_since_aging = 0

    def settle(self, klass: int, was_reused: bool) -> None:
        if klass == UNKNOWN_CLASS:
            return
        counts = self._reused if was_reused else self._lost
        counts[klass] = counts.get(klass, 0.0) + 1.0
        self._num_since_aging += 1
        if self._num_since_aging >= STATS_AGE_USES:
            self._reused = {c: r / 2 for c, r in self._reused.items()}
            self._lost = {c: n / 2 for c, n in self._lost.items()}
            self._num_since_aging = 0

    def ratio(self, klass: int) -> float:
        """Estimated chance that a use of this class is followed by another while held."""
        if klass == UNKNOWN_CLASS:
            return PRIOR_REUSES / PRIOR_USES
        reused = self._reused.get(klass, 0.0)
        return (reused + PRIOR_REUSES) / (reused + self._lost.get(klass, 0.0) + PRIOR_USES)


@dataclass(slots=True)
class BlockUses:
    """One block's history, whichever tiers hold it."""

    use_s: float  # tau ln(sum over uses of exp(t_use / tau)): its uses as one moment
    last_use_s: float
    reuse_s: float  # use_s + tau ln(odds of its class), never dropping, >= its children's
    reach: int | None = None  # deepest chain position its uses led to (None: never in a chain)
    klass: int = UNKNOWN_CLASS  # where its last use placed it
    num_holders: int = 0  # tiers holding it
    ranks: int = 0  # bit r set: the tier at chain position r holds it (orders given a rank)
    tau_counts: list[float] | None = None  # its decayed use counts per candidate tau (fitting)


class UseHistory:
    """The history the value orders of one chain share (module docstring). Called from the
    store's event loop (or a simulator's); every method is O(1) per key.

    Args:
        coalesce_s: uses of one block closer than this count as one.
        tau_s: the starting time constant (seconds); learned from reuse gaps after that.
        learn_tau: False keeps ``tau_s`` fixed.
    """

    def __init__(self, coalesce_s: float = COALESCE_S, tau_s: float = PRIOR_TAU_S,
                 learn_tau: bool = True) -> None:
        if coalesce_s < 0 or not MIN_TAU_S <= tau_s <= MAX_TAU_S:
            raise InvalidArgument(f"coalesce_s must be >= 0 and tau_s in [{MIN_TAU_S}, "
                                  f"{MAX_TAU_S}] s, got {coalesce_s} and {tau_s}")
        self.coalesce_s = coalesce_s
        self.tau_s = tau_s
        self.epoch = 0  # bumped whenever tau moves: scores made before are stale
        self.stats = ReuseStats()
        self._learn_tau = learn_tau
        self._uses: dict[BlockKey, BlockUses] = {}
        self._ghosts: OrderedDict[BlockKey, BlockUses] = OrderedDict()  # oldest first
        self._refresh: dict[int, Callable[[BlockKey], None]] = {}  # by chain position
        self._groups: dict[bytes, int] = {}
        self.tau_fit = TauLikelihood()
        self._num_since_fit = self._num_since_move = 0

    def __len__(self) -> int:
        return len(self._uses)

    def get(self, key: BlockKey) -> BlockUses | None:
        return self._uses.get(key)

    # ------------------------------------------------------------------------- holders

    def register(self, rank: int, refresh: Callable[[BlockKey], None]) -> None:
        """The order of the tier at chain position ``rank`` (0 = fastest) is told through
        ``refresh(key)`` when a faster tier gains or loses a copy of a block it holds."""
        if rank < 0 or rank in self._refresh:
            raise InvalidArgument(f"chain position {rank} is negative or taken")
        self._refresh[rank] = refresh

    def is_backup(self, uses: BlockUses, rank: int | None) -> bool:
        """Whether a faster tier than ``rank`` also holds the block: a hit would be served
        there, and when that copy goes it moves down no further than this one, so this copy
        saves nothing until then."""
        return rank is not None and bool(uses.ranks & ((1 << rank) - 1))

    def hold(self, key: BlockKey, now: float, rank: int | None = None) -> BlockUses:
        """A tier took the block: its history (a new block's first use is now; a block that
        comes back while its ghost is remembered gets its old history back)."""
        uses = self._uses.get(key)
        if uses is None:
            uses = self._ghosts.pop(key, None)
            if uses is None:
                uses = BlockUses(now, now, now + self.tau_s * math.log(
                    self.stats.ratio(UNKNOWN_CLASS)))
                if self._learn_tau:
                    self.tau_fit.use(now)
            self._uses[key] = uses
        uses.num_holders += 1
        if rank is not None:
            uses.ranks |= 1 << rank
            self._tell_slower(key, uses, rank)
        return uses

    def release(self, key: BlockKey, now: float, rank: int | None = None) -> None:
        """A tier gave the block up. When the last one does, its history becomes a ghost: a use
        of it that follows still counts as a reuse of its last one, so the odds are learned
        from what uses go on to, not from what the tiers kept (an order that learns only from
        held blocks gives up a class sooner the less of it survives, and learns lower odds)."""
        uses = self._uses.get(key)
        if uses is None:
            return
        uses.num_holders -= 1
        if rank is not None:
            uses.ranks &= ~(1 << rank)
            self._tell_slower(key, uses, rank)
        if uses.num_holders <= 0:
            del self._uses[key]
            self._ghosts[key] = uses
        self._forget_ghosts(now)

    def _tell_slower(self, key: BlockKey, uses: BlockUses, rank: int) -> None:
        slower = uses.ranks >> (rank + 1)
        r = rank + 1
        while slower:
            if slower & 1 and r in self._refresh:
                self._refresh[r](key)
            slower >>= 1
            r += 1

    def _forget_ghosts(self, now: float) -> None:
        """Settle as lost the ghosts unused for ``GHOST_TAUS`` time constants (a use after
        that is a new life; under the exponential fit e^-4 = 2% of reuses come later) or past
        the count kept, oldest first."""
        ghosts, horizon_s = self._ghosts, GHOST_TAUS * self.tau_s
        while ghosts:
            key, oldest = next(iter(ghosts.items()))
            if len(ghosts) <= max(MIN_GHOSTS, len(self._uses)) and \
                    now - oldest.last_use_s <= horizon_s:
                break
            del ghosts[key]
            self.stats.settle(oldest.klass, was_reused=False)

    # ------------------------------------------------------------------------- uses

    def use(self, uses: BlockUses, now: float) -> None:
        """One use of a block outside a chain (a put of a block already held)."""
        self._count(uses, now, uses.klass)
        uses.reuse_s = max(uses.reuse_s, self._reuse_s(uses))

    def use_chain(self, keys: Sequence[BlockKey], now: float, group: bytes | None = None
                  ) -> None:
        """A prefix chain (parents first) was used at ``now``. Every tier's order calls this
        for the same use; within the coalescing window the repeats count once."""
        g = self._group(group)
        last = len(keys) - 1
        floor_s, reach = -math.inf, 0
        for depth in range(last, -1, -1):
            uses = self._uses.get(keys[depth])
            if uses is None:
                continue
            # The first chain to place a block re-scores its arrival: it may learn lower odds.
            kept_s = -math.inf if uses.klass == UNKNOWN_CLASS else uses.reuse_s
            self._count(uses, now, use_class(depth, depth == last, g))
            reach = max(reach, depth, uses.reach or 0)
            uses.reach = reach
            floor_s = max(floor_s + CHAIN_STEP_S, kept_s, self._reuse_s(uses))
            uses.reuse_s = floor_s

    def _count(self, uses: BlockUses, now: float, klass: int) -> None:
        """Count a use (or, within the coalescing window, re-class the last one)."""
        gap_s = now - uses.last_use_s
        if gap_s >= self.coalesce_s:
            self.stats.settle(uses.klass, was_reused=True)
            tau = self.tau_s
            uses.use_s = tau * _log_add(uses.use_s / tau, now / tau)
            self._observe_reuse(uses, now)
            uses.last_use_s = now
        uses.klass = klass

    def _reuse_s(self, uses: BlockUses) -> float:
        return uses.use_s + self.tau_s * math.log(self.stats.ratio(uses.klass))

    def _group(self, group: bytes | None) -> int:
        if group is None:
            return 0
        index = self._groups.get(group)
        if index is None:
            index = min(len(self._groups), MAX_GROUPS - 1)
            if len(self._groups) < MAX_GROUPS:
                self._groups[group] = index
        return index

    def _observe_reuse(self, uses: BlockUses, now: float) -> None:
        if not self._learn_tau:
            return
        if uses.tau_counts is None:
            uses.tau_counts = self.tau_fit.new_counts()
        self.tau_fit.reuse(uses.tau_counts, now - uses.last_use_s, now)
        self.tau_fit.use(now)
        self._num_since_fit += 1
        self._num_since_move += 1
        if self._num_since_fit < REFIT_GAPS:
            return
        self._num_since_fit = 0
        # At least as many reuses as blocks held between two moves: a move re-scores every
        # held block, so its cost stays O(1) per use, amortized.
        if self._num_since_move < len(self._uses):
            return
        fitted = self.tau_fit.best_s(self.tau_s) or self.tau_s
        fitted = min(MAX_TAU_S, max(MIN_TAU_S, fitted))
        if fitted != self.tau_s:
            self._move_tau(fitted)

    def _move_tau(self, tau_s: float) -> None:
        """Make every block's moment the one its uses amount to under ``tau_s`` (a candidate
        of the fit), from its decayed counts per candidate, keeping what its chain added to
        its reuse score. A moment carried over from another constant is off by as much as
        (old - new) ln(uses): after a move from 1024 s to 64 s a block used five times in the
        first minute kept about 1500 s over blocks used since, and chat's mean TTFT with tau
        at 1024 s for 300 s and then 64 s was 66.5 ms against 60.7 with 1024 s throughout
        (``kvstore bench policy``'s chat/tight, 2026-12-01)."""
        index = self.tau_fit.candidates_s.index(tau_s)
        blocks = list(self._uses.values()) + list(self._ghosts.values())
        added = [uses.reuse_s - self._reuse_s(uses) for uses in blocks]
        self.tau_s = tau_s
        for uses, chain_s in zip(blocks, added):
            counts = uses.tau_counts  # None: one use counted, its moment is that use
            uses.use_s = uses.last_use_s + (0.0 if counts is None else
                                            tau_s * math.log(counts[index]))
            uses.reuse_s = self._reuse_s(uses) + max(0.0, chain_s)
        self.epoch += 1
        self._num_since_move = 0


def _log_add(a: float, b: float) -> float:
    """ln(e^a + e^b) without overflow."""
    hi, lo = (a, b) if a >= b else (b, a)
    return hi + math.log1p(math.exp(lo - hi))
