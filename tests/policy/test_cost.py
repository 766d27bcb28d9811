"""The cost model: the seed's worked examples, online calibration, and the fetch advice."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument
from kvstore.policy.cost import (
    ModelProfile,
    PathModel,
    PrefillModel,
    advise,
    fetch_s,
    pipelined_ready_s,
    serial_ready_s,
)

MiB, GiB = 1 << 20, 1 << 30


def prefill_taking(seconds: float, tokens: int) -> PrefillModel:
    """A prefill model whose FLOP rate makes ``tokens`` new tokens take ``seconds``."""
    profile = ModelProfile(num_params=8e9, num_layers=32, hidden_size=4096, flops_per_s=1.0)
    flops = PrefillModel(profile).flops(tokens)
    return PrefillModel(ModelProfile(8e9, 32, 4096, flops_per_s=flops / seconds))


def test_seed_worked_example_4k_prefix_over_25_gib_per_s():
    """Seed §8: 128 KiB/token bf16 GQA, a 4K prefix is 512 MiB; over 25 GiB/s it takes 20 ms."""
    assert fetch_s(4096 * 128 * 1024, 25 * GiB) == pytest.approx(0.020)
    path = {"dram": PathModel(bytes_per_s=25 * GiB)}
    worth = advise(["dram"], [512 * MiB], 4096, 4096, path, prefill_taking(0.030, 4096))
    assert worth.fetch_tokens == 4096 and worth.fetch_s == pytest.approx(0.020)
    not_worth = advise(["dram"], [512 * MiB], 4096, 4096, path, prefill_taking(0.015, 4096))
    assert not_worth.fetch_tokens == 0 and not_worth.recompute_s == pytest.approx(0.015)


def test_seed_layer_pipelined_readiness():
    """Seed §10.7: t_p + t_x + (L - 1) max(t_p, t_x) against L (t_p + t_x)."""
    assert pipelined_ready_s(1.0, 2.0, 32) == pytest.approx(3.0 + 31 * 2.0)
    assert serial_ready_s(1.0, 2.0, 32) == pytest.approx(96.0)
    assert pipelined_ready_s(2.0, 2.0, 1) == serial_ready_s(2.0, 2.0, 1)


def test_advice_fetches_the_fast_head_and_recomputes_the_slow_tail():
    """Four DRAM blocks then four SSD blocks: the SSD is so slow here that recomputing its part
    beats reading it, so the advice stops at the end of the DRAM part."""
    paths = {"dram": PathModel(bytes_per_s=20 * GiB), "ssd": PathModel(bytes_per_s=50 * MiB)}
    prefill = prefill_taking(0.100, 8 * 256)  # ~12 ms per 256-token block
    advice = advise(["dram"] * 4 + ["ssd"] * 4, [32 * MiB] * 8, 256, 8 * 256 + 7, paths, prefill)
    assert advice.fetch_tokens == 4 * 256
    assert advice.fetch_s + advice.recompute_s < advice.all_recompute_s
    everything = advise(["dram"] * 8, [32 * MiB] * 8, 256, 8 * 256, paths, prefill)
    assert everything.fetch_tokens == 8 * 256


def test_queued_bytes_delay_a_path():
    path = PathModel(bytes_per_s=1 * GiB, fixed_s=0.001)
    idle = path.time_s(64 * MiB)
    path.queued_bytes = 512 * MiB
    assert path.time_s(64 * MiB) == pytest.approx(idle + 0.5)
    assert path.time_s(64 * MiB, queued=False) == pytest.approx(idle)


def test_path_model_learns_bandwidth_and_fixed_cost_from_transfers():
    path = PathModel(bytes_per_s=100 * MiB, fixed_s=0.0)  # a poor prior
    true_bw, true_t0 = 5 * GiB, 0.0002
    for i in range(200):
        n = (1 + i % 8) * 2 * MiB
        path.observe(n, true_t0 + n / true_bw)
    assert path.bytes_per_s == pytest.approx(true_bw, rel=0.02)
    assert path.fixed_s == pytest.approx(true_t0, rel=0.05)
    same_size = PathModel(bytes_per_s=100 * MiB)
    for _ in range(50):
        same_size.observe(2 * MiB, 2 * MiB / true_bw)
    assert same_size.time_s(2 * MiB) == pytest.approx(2 * MiB / true_bw, rel=0.02)
    with pytest.raises(InvalidArgument):
        PathModel(bytes_per_s=0)


def test_prefill_model_counts_attention_and_learns_the_engine_rate():
    model = PrefillModel(ModelProfile(8e9, 32, 4096, flops_per_s=4e14))
    # The quadratic term: a 32k prompt costs more than 8x a 4k one.
    assert model.time_s(32768) > 8 * model.time_s(4096)
    # Cached tokens make the new ones attend further, but cost far less than recomputing them.
    assert model.time_s(1024, 8192) > model.time_s(1024)
    assert model.time_s(1024, 8192) < model.time_s(1024 + 8192)
    for _ in range(100):  # the engine is twice as slow as the profile says
        model.observe(2048, 0, 2 * PrefillModel(model.profile).time_s(2048))
    assert model.flops_per_s == pytest.approx(2e14, rel=0.01)
