"""Admission for cold tiers: a TinyLFU-style count-min frequency sketch with aging.

``FrequencyAdmission`` admits a block once the sketch saw it ``threshold`` times; ``AdmitAll``
admits everything (a tier without a filter); ``ValueAdmission`` is the admission of tiers ranked
by the value order.

A block earns a place on SSD by being seen often enough; one-off blocks would only wear the
device. The sketch answers "about how often was this key seen lately" in constant memory: four
rows of 8-bit saturating counters, each row indexed by its own 32 bits of a 128-bit hash. The
estimate is the minimum over the rows, so before aging it never under-counts (collisions only
add). Every ``sample_size`` increments all counters are halved, so old popularity fades
(TinyLFU's reset, Einziger et al. 2017).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey
from kvstore.policy.base import AdmissionPolicy

NUM_ROWS = 4
MAX_COUNT = 255  # uint8 counters saturate here
MIN_WIDTH = 64
SAMPLE_FACTOR = 10  # TinyLFU ages after W = 10 x (sketch width) increments


class FrequencySketch:
    """Approximate access counts per key, with periodic halving.

    Called from one event loop; every method is O(1) and does no I/O.

    Args:
        expected_keys: distinct keys the sketch should tell apart; each row is the next power
            of two at or above this (at least 64 counters).
        sample_size: increments between two agings; default ``10 * width``.
    """

    def __init__(self, expected_keys: int, sample_size: int | None = None) -> None:
        if not isinstance(expected_keys, int) or expected_keys < 1:
            raise InvalidArgument(f"expected_keys must be an int >= 1, got {expected_keys!r}")
        width = max(MIN_WIDTH, 1 << (expected_keys - 1).bit_length())
        if sample_size is None:
            sample_size = SAMPLE_FACTOR * width
        if not isinstance(sample_size, int) or sample_size < 1:
            raise InvalidArgument(f"sample_size must be an int >= 1, got {sample_size!r}")
        self._mask = np.uint32(width - 1)
        self._table = np.zeros((NUM_ROWS, width), dtype=np.uint8)
        self._rows = np.arange(NUM_ROWS)
        self._sample_size = sample_size
        self._num_additions = 0
        self._num_agings = 0

    @property
    def width(self) -> int:
        """Counters per row."""
        return self._table.shape[1]

    @property
    def sample_size(self) -> int:
        """Increments between two agings."""
        return self._sample_size

    @property
    def num_agings(self) -> int:
        """How many times the counters were halved."""
        return self._num_agings

    def _columns(self, key: bytes) -> np.ndarray:
        if not isinstance(key, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"sketch keys are bytes, got {type(key).__name__}")
        lanes = np.frombuffer(xxhash.xxh3_128_digest(key), dtype=np.uint32)
        return lanes & self._mask  # one independent 32-bit lane per row

    def add(self, key: bytes) -> None:
        """Record one sighting of ``key``."""
        cols = self._columns(key)
        counts = self._table[self._rows, cols]
        low = counts.min()
        if low < MAX_COUNT:
            # Conservative update: raise only the rows at the minimum. The minimum still grows
            # by one, so estimates never under-count, and collisions inflate other keys less.
            at_min = counts == low
            self._table[self._rows[at_min], cols[at_min]] += 1
        self._num_additions += 1
        if self._num_additions >= self._sample_size:
            self._age()

    def add_many(self, keys: Sequence[bytes]) -> None:
        """Record one sighting of each key (a whole prefix at once: one numpy pass instead of a
        Python-level update per key). Same conservative update as ``add``."""
        if not keys:
            return
        if not all(isinstance(k, (bytes, bytearray)) for k in keys):
            raise InvalidArgument("sketch keys are bytes")
        digests = b"".join(map(xxhash.xxh3_128_digest, keys))
        cols = np.frombuffer(digests, dtype=np.uint32).reshape(-1, NUM_ROWS) & self._mask
        counts = self._table[self._rows, cols]  # [num_keys, NUM_ROWS]
        low = counts.min(axis=1, keepdims=True)
        at_min = (counts == low) & (low < MAX_COUNT)
        flat = (self._rows * self.width + cols)[at_min].astype(np.int64)
        cells, hits = np.unique(flat, return_counts=True)  # a key seen twice adds two
        table = self._table.reshape(-1)
        table[cells] = np.minimum(table[cells].astype(np.int64) + hits, MAX_COUNT)
        self._num_additions += len(keys)
        if self._num_additions >= self._sample_size:
            self._age()

    def estimate_many(self, keys: Sequence[bytes]) -> np.ndarray:
        """``estimate`` of each key, in one numpy pass (a demotion pass's candidates)."""
        if not keys:
            return np.zeros(0, dtype=np.uint8)
        if not all(isinstance(k, (bytes, bytearray)) for k in keys):
            raise InvalidArgument("sketch keys are bytes")
        digests = b"".join(map(xxhash.xxh3_128_digest, keys))
        cols = np.frombuffer(digests, dtype=np.uint32).reshape(-1, NUM_ROWS) & self._mask
        return self._table[self._rows, cols].min(axis=1)

    def estimate(self, key: bytes) -> int:
        """Estimated sightings of ``key`` since it was last aged out (never below the truth
        until the counters are halved or saturate)."""
        return int(self._table[self._rows, self._columns(key)].min())

    def _age(self) -> None:
        self._table >>= 1
        self._num_additions = 0
        self._num_agings += 1

    def clear(self) -> None:
        """Forget every sighting."""
        self._table.fill(0)
        self._num_additions = 0


class AdmitAll(AdmissionPolicy):
    """Every block may enter."""

    def note(self, keys: Iterable[BlockKey]) -> None:
        return None

    def admits(self, key: BlockKey) -> bool:
        return True


class FrequencyAdmission(AdmissionPolicy):
    """Admits a block seen at least ``threshold`` times lately (a put or lookup hit each).

    Args:
        threshold: sightings a block needs; 1 admits any block seen once.
        expected_keys: distinct keys the sketch is sized for (``FrequencySketch``).
    """

    def __init__(self, threshold: int, expected_keys: int) -> None:
        if threshold < 1:
            raise InvalidArgument(f"admission threshold must be >= 1, got {threshold}")
        self.threshold = threshold
        self.sketch = FrequencySketch(expected_keys)

    def note(self, keys: Iterable[BlockKey]) -> None:
        self.sketch.add_many(list(keys))

    def admits(self, key: BlockKey) -> bool:
        return self.sketch.estimate(key) >= self.threshold

    def admits_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        return (self.sketch.estimate_many(keys) >= self.threshold).tolist()


class ValueAdmission(AdmissionPolicy):
    """Admission for a tier ranked by the value order (kvstore/policy/value.py).

    - Every block moving down may enter: what the tier gives up for it is its least valuable
      block by the same value, so a filter in front only loses hits. (The frequency filter kept
      a chat turn's new blocks, seen once when evicted from DRAM, out of the SSD: 2-3 points of
      token hit rate below LRU's once the learned time constant was long, 2026-12-01.)
    - A put's copy of a block that only slower tiers hold enters like a new block
      (``lifts``): the engine recomputed the block because fetching it from below was slower,
      and without a faster copy it would be recomputed again at every use (a document or a
      system prompt left on a disk slower than prefill, never fetched, so never promoted).
    """

    def note(self, keys: Iterable[BlockKey]) -> None:
        return None

    def admits(self, key: BlockKey) -> bool:
        return True

    def lifts(self, key: BlockKey) -> bool:
        return True


def admission_for(threshold: int, expected_keys: int, eviction: str = "lru") -> AdmissionPolicy:
    """The policy a tier's settings ask for: ``ValueAdmission`` for a tier under the value
    order; otherwise the frequency filter, or everything with a threshold of 0."""
    if eviction == "value":
        return ValueAdmission()
    return AdmitAll() if threshold == 0 else FrequencyAdmission(threshold, expected_keys)
