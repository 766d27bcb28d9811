"""Fetch or recompute: the cost model of the seed (§8, §10.6, §10.7), calibrated online.

- A transfer path (a tier read into host memory, host to GPU, ...) costs
  ``T_fetch = t_queue + t_0 + bytes / beta + t_convert``; ``PathModel`` keeps a moving estimate
  of ``t_0`` and ``beta`` from the transfers really done, starting from a prior, and the bytes
  already scheduled on the path give ``t_queue``.
- Prefill of ``P`` new tokens after ``C`` cached ones costs the linear term of the weights plus
  causal attention's quadratic term (``PrefillModel``), over a FLOP rate that the engine's
  reported prefill times correct online.
- ``advise`` picks the prefix worth fetching: the length that minimises fetch-of-the-head plus
  recompute-of-the-tail, which may stop before the end of the match.
- With layer-wise loading the prefix is ready after ``t_p + t_x + (L - 1) max(t_p, t_x)``
  (``pipelined_ready_s``) instead of ``L (t_p + t_x)`` (``serial_ready_s``).

Pure arithmetic: no I/O, no clocks; the store feeds it observations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.api import ModelProfile
from kvstore.errors import InvalidArgument

# Moving estimates weigh the newest observation this much (about the last ten transfers).
EWMA_WEIGHT = 0.1


def fetch_s(nbytes: float, bytes_per_s: float, fixed_s: float = 0.0, queue_s: float = 0.0,
            convert_s: float = 0.0) -> float:
    """``T_fetch = t_queue + t_0 + B / beta + t_convert`` (seed §8, §10.6)."""
    if bytes_per_s <= 0:
        raise InvalidArgument(f"bandwidth must be > 0 bytes/s, got {bytes_per_s}")
    return queue_s + fixed_s + nbytes / bytes_per_s + convert_s


def pipelined_ready_s(prefill_layer_s: float, transfer_layer_s: float, num_layers: int) -> float:
    """Readiness when each layer is sent as soon as it is produced (seed §10.7)."""
    return (prefill_layer_s + transfer_layer_s
            + (num_layers - 1) * max(prefill_layer_s, transfer_layer_s))


def serial_ready_s(prefill_layer_s: float, transfer_layer_s: float, num_layers: int) -> float:
    """Readiness when all layers are computed first, then sent."""
    return num_layers * (prefill_layer_s + transfer_layer_s)


class PathModel:
    """One transfer path: ``t(n) = t_0 + n / beta``, fitted online by exponentially weighted
    least squares over the transfers observed, from a prior until two sizes have been seen.

    Args:
        bytes_per_s: prior bandwidth (a start-up probe or a measured ceiling).
        fixed_s: prior fixed cost per transfer (submit, map, syscall).
    """

    def __init__(self, bytes_per_s: float, fixed_s: float = 0.0) -> None:
        if bytes_per_s <= 0 or fixed_s < 0:
            raise InvalidArgument(f"a path needs bandwidth > 0 and fixed cost >= 0, got "
                                  f"{bytes_per_s} B/s and {fixed_s} s")
        self._prior = (bytes_per_s, fixed_s)
        self._bytes_per_s, self._fixed_s = bytes_per_s, fixed_s
        self._sums = [0.0] * 5  # weighted n, t, n*n, n*t, weight
        self.num_observed = 0
        self.queued_bytes = 0  # scheduled on the path and not finished

    @property
    def bytes_per_s(self) -> float:
        return self._bytes_per_s

    @property
    def fixed_s(self) -> float:
        return self._fixed_s

    def observe(self, nbytes: int, seconds: float) -> None:
        """A transfer of ``nbytes`` took ``seconds``."""
        if nbytes <= 0 or seconds <= 0:
            return
        decay = 1.0 - EWMA_WEIGHT
        s = self._sums
        for i, value in enumerate((nbytes, seconds, nbytes * nbytes, nbytes * seconds, 1.0)):
            s[i] = s[i] * decay + EWMA_WEIGHT * value
        self.num_observed += 1
        mean_n, mean_t = s[0] / s[4], s[1] / s[4]
        var_n = s[2] / s[4] - mean_n * mean_n
        slope = (s[3] / s[4] - mean_n * mean_t) / var_n if var_n > (0.05 * mean_n) ** 2 else 0.0
        if slope > 0:  # sizes vary enough to separate the fixed cost from the bandwidth
            self._bytes_per_s = 1.0 / slope
            self._fixed_s = max(0.0, mean_t - slope * mean_n)
        else:  # one size so far: keep the fixed cost, fit the bandwidth to the mean
            self._fixed_s = min(self._fixed_s, mean_t / 2)
            self._bytes_per_s = mean_n / (mean_t - self._fixed_s)

    def queue_s(self) -> float:
        """Time until what is already scheduled on the path has moved."""
        return self.queued_bytes / self._bytes_per_s

    def time_s(self, nbytes: float, convert_s: float = 0.0, queued: bool = True) -> float:
        """Estimated time to move ``nbytes`` now (behind the queue, if ``queued``)."""
        return fetch_s(nbytes, self._bytes_per_s, self._fixed_s,
                       self.queue_s() if queued else 0.0, convert_s)


class PrefillModel:
    """Prefill time of ``P`` new tokens after ``C`` cached ones.

    FLOPs = 2 N P (the weights, per token) + 4 L d (P C + P^2 / 2) (causal attention: scores and
    values, each a multiply-add over the keys before each query), over the profile's rate.
    ``observe`` corrects the rate from prefill times the engine reports.
    """

    def __init__(self, profile: ModelProfile) -> None:
        self.profile = profile
        self._flops_per_s = profile.flops_per_s
        self.num_observed = 0

    @property
    def flops_per_s(self) -> float:
        return self._flops_per_s

    def flops(self, new_tokens: int, cached_tokens: int = 0) -> float:
        p = self.profile
        linear = 2.0 * p.num_params * new_tokens
        attention = 4.0 * p.num_layers * p.hidden_size * (
            new_tokens * cached_tokens + new_tokens * new_tokens / 2.0)
        return linear + attention

    def time_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.flops(new_tokens, cached_tokens) / self._flops_per_s if new_tokens else 0.0

    def observe(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        """The engine prefilled ``new_tokens`` after ``cached_tokens`` in ``seconds``."""
        if new_tokens <= 0 or seconds <= 0:
            return
        rate = self.flops(new_tokens, cached_tokens) / seconds
        self._flops_per_s += EWMA_WEIGHT * (rate - self._flops_per_s)
        self.num_observed += 1


@dataclass(frozen=True, slots=True)
class Advice:
    """What a lookup should load."""

    fetch_tokens: int  # the prefix worth fetching; the rest is recomputed
    fetch_s: float  # its estimated fetch time
    recompute_s: float  # estimated prefill time of the rest after it
    all_recompute_s: float  # estimated prefill time of the whole prompt (the baseline)


def advise(block_paths: Sequence[str], block_bytes: Sequence[int], block_tokens: int,
           num_tokens: int, paths: Mapping[str, PathModel], prefill: PrefillModel) -> Advice:
    """The matched prefix length (a multiple of ``block_tokens``) minimising the time to be
    ready: fetch blocks ``[0, k)`` over their paths, then prefill the remaining tokens after the
    ``k * block_tokens`` cached ones.

    Args:
        block_paths: the path each matched block would come over (its fastest tier), in order.
        block_bytes: encoded bytes of each matched block on that path.
        block_tokens: tokens per block.
        num_tokens: tokens in the prompt.
        paths: the path models by name.
        prefill: the namespace's prefill model.
    """
    scan = AdviceScan(block_tokens, num_tokens, paths, prefill)
    scan.feed(block_paths, block_bytes)
    return scan.best


class AdviceScan:
    """``advise`` over a chain fed in pieces, in order (a long chain's scan costs a few
    microseconds a block: its caller may yield between pieces)."""

    def __init__(self, block_tokens: int, num_tokens: int, paths: Mapping[str, PathModel],
                 prefill: PrefillModel) -> None:
        self._block_tokens = block_tokens
        self._num_tokens = num_tokens
        self._paths = paths
        self._prefill = prefill
        baseline = prefill.time_s(num_tokens, 0)
        self.best = Advice(0, 0.0, baseline, baseline)
        self._per_path: dict[str, float] = {}
        self._num_blocks = 0

    def feed(self, block_paths: Sequence[str], block_bytes: Sequence[int]) -> None:
        """The next blocks of the chain: the path each comes over and its bytes there."""
        if len(block_paths) != len(block_bytes):
            raise InvalidArgument("block_paths and block_bytes must be the same length")
        per_path, paths, prefill = self._per_path, self._paths, self._prefill
        num_tokens, best = self._num_tokens, self.best
        for k, (name, nbytes) in enumerate(zip(block_paths, block_bytes),
                                           start=self._num_blocks + 1):
            per_path[name] = per_path.get(name, 0.0) + nbytes
            # Paths move one after the other (a conservative sum); each pays its fixed cost
            # once.
            fetch = sum(paths[p].time_s(b) for p, b in per_path.items())
            cached = k * self._block_tokens
            recompute = prefill.time_s(max(0, num_tokens - cached), min(cached, num_tokens))
            if fetch + recompute < best.fetch_s + best.recompute_s:
                best = Advice(cached, fetch, recompute, best.all_recompute_s)
        self._num_blocks += len(block_paths)
        self.best = best
