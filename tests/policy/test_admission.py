"""FrequencySketch: count-min bounds, saturation and TinyLFU aging; the admission per order."""

from __future__ import annotations

import random

import pytest

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey
from kvstore.policy.admission import (
    MAX_COUNT,
    AdmitAll,
    FrequencyAdmission,
    FrequencySketch,
    ValueAdmission,
    admission_for,
)


def keys(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def test_width_is_a_power_of_two_sized_from_expected_keys():
    assert FrequencySketch(1000).width == 1024
    assert FrequencySketch(1024).width == 1024
    assert FrequencySketch(1).width == 64
    assert FrequencySketch(1000).sample_size == 10 * 1024
    with pytest.raises(InvalidArgument):
        FrequencySketch(0)
    with pytest.raises(InvalidArgument):
        FrequencySketch(10, sample_size=0)


def test_estimates_never_under_count_before_aging():
    sketch = FrequencySketch(512, sample_size=10**9)
    rng = random.Random(1)
    truth = {k: rng.randrange(1, 20) for k in keys(2000)}  # 4x more keys than counters
    order = [k for k, n in truth.items() for _ in range(n)]
    rng.shuffle(order)
    for k in order:
        sketch.add(k)
    errors = [sketch.estimate(k) - n for k, n in truth.items()]
    assert min(errors) >= 0
    assert sum(errors) / len(errors) < 10  # overloaded on purpose, still a useful signal
    assert sketch.estimate(b"never seen key!!") <= max(truth.values()) + max(errors)


def test_estimates_are_exact_when_the_sketch_is_roomy():
    sketch = FrequencySketch(1 << 14, sample_size=10**9)
    truth = {k: i % 7 for i, k in enumerate(keys(300))}
    for k, n in truth.items():
        for _ in range(n):
            sketch.add(k)
    assert sum(sketch.estimate(k) != n for k, n in truth.items()) <= 3


def test_counters_saturate():
    sketch = FrequencySketch(64, sample_size=10**9)
    for _ in range(MAX_COUNT + 50):
        sketch.add(b"hot")
    assert sketch.estimate(b"hot") == MAX_COUNT


def test_aging_halves_every_sample_size_increments():
    sketch = FrequencySketch(1024, sample_size=20)
    for _ in range(13):
        sketch.add(b"hot key")
    others = keys(6, seed=5)
    for k in others:
        sketch.add(k)
    assert sketch.num_agings == 0 and sketch.estimate(b"hot key") >= 13
    sketch.add(b"one more")  # the 20th increment ages the sketch
    assert sketch.num_agings == 1
    assert sketch.estimate(b"hot key") == 6  # 13 // 2
    assert all(sketch.estimate(k) == 0 for k in others)  # 1 // 2


def test_rejects_non_bytes_keys():
    with pytest.raises(InvalidArgument):
        FrequencySketch(64).add("text")  # type: ignore[arg-type]


def test_add_many_matches_add_key_by_key():
    import os

    keys = [os.urandom(16) for _ in range(500)]
    keys += keys[:50]  # some keys seen twice in one batch
    one, many = FrequencySketch(1024), FrequencySketch(1024)
    for key in keys:
        one.add(key)
    many.add_many(keys)
    # Conservative updates of a batch see the counts from before the batch, so colliding keys
    # may raise a few more cells than one-by-one updates would. Neither ever under-counts, and
    # with 4 rows of 1024 counters for 500 keys over-counts stay rare.
    over = 0
    for key in set(keys):
        true = keys.count(key)
        assert many.estimate(key) >= true and one.estimate(key) >= true
        over += many.estimate(key) - true
    assert over / len(set(keys)) < 0.1


def test_frequency_admission_admits_blocks_seen_twice():
    """Moved from the SSD tier: one-off blocks never reach a tier with a threshold of 2."""
    policy = FrequencyAdmission(threshold=2, expected_keys=1024)
    once, twice = keys(2, seed=5)
    policy.note([once, twice])
    policy.note([twice])
    assert not policy.admits(once) and policy.admits(twice)
    assert isinstance(admission_for(0, 1024), AdmitAll) and AdmitAll().admits(once)
    with pytest.raises(InvalidArgument):
        FrequencyAdmission(threshold=0, expected_keys=16)


def test_admits_many_answers_as_admits_key_by_key():
    """The demotion pass asks for its candidates in one pass; the answers are admits' own."""
    policy = FrequencyAdmission(threshold=2, expected_keys=1024)
    batch = keys(300, seed=9)
    policy.note(batch)
    policy.note(batch[::3])
    assert policy.admits_many(batch) == [policy.admits(key) for key in batch]
    assert all(policy.admits_many(batch[::3]))  # collisions may admit a few more, never fewer
    assert policy.admits_many([]) == [] and AdmitAll().admits_many(batch[:2]) == [True, True]
    with pytest.raises(InvalidArgument):
        policy.admits_many(["not bytes"])


def test_value_admission_takes_every_block_down_and_the_puts_copy_up():
    """Under the value order a tier takes what moves down (its order gives up the least
    valuable block for it) and a put's copy of a block held only further down; the baselines'
    admissions take no such copy (a put writes only blocks not stored yet)."""
    block = BlockKey(b"\x07" * 16)
    value = admission_for(2, 1024, "value")
    assert isinstance(value, ValueAdmission)
    assert value.admits(block) and value.lifts(block)  # never seen: still taken
    for baseline in (admission_for(0, 1024), admission_for(2, 1024, "lru"),
                     admission_for(2, 1024, "arc")):
        assert not baseline.lifts(block)
    assert isinstance(admission_for(2, 1024, "lru"), FrequencyAdmission)
