"""``kvstore bench policy`` on tiny traces: the JSON layout, the oracle's floor, Mooncake files,
and a simulated chain that keeps the store's placement rules."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstore.bench import traces
from kvstore.bench.policy import POLICIES, SimConfig, Simulator, simulate, working_set_bytes
from kvstore.bench.report import PLOT_HINT
from kvstore.cli import app
from kvstore.errors import InvalidArgument

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_bench_policy_writes_every_trace_and_policy(tmp_path: Path) -> None:
    out = tmp_path / "policy.json"
    result = CliRunner().invoke(app, ["bench", "policy", "--quick", "--json", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "chat/tight" in result.stdout and "results written to" in result.stdout
    document = json.loads(out.read_text())
    assert document["bench"] == "policy"
    assert set(document["traces"]) == {"chat/tight", "chat/roomy", "doc-qa/tight",
                                       "doc-qa/roomy", "agentic/tight", "agentic/roomy",
                                       "no-reuse/tight"}
    for name, by_policy in document["traces"].items():
        assert set(by_policy) == {p.name for p in POLICIES}
        for summary in by_policy.values():
            assert {"ttft_mean_ms", "ttft_p99_ms", "hit_rate", "hit_rate_hbm",
                    "read_gib_dram"} <= set(summary)
            assert 0 <= summary["hit_rate"] <= 1 and summary["ttft_mean_ms"] > 0
        assert by_policy["kvstore"]["tau_s"] > 0 and "tau_s" not in by_policy["lru"]
        oracle, recompute = by_policy["oracle"], by_policy["always-recompute"]
        assert oracle["ttft_mean_ms"] <= recompute["ttft_mean_ms"] * (1 + 1e-9), name
        assert recompute["fetched_rate"] == 0
    no_reuse = document["traces"]["no-reuse/tight"]
    assert all(s["hit_rate"] == 0 for s in no_reuse.values())
    png = out.with_suffix(".png")
    if not HAS_MATPLOTLIB:  # the bench extra is not installed: the table and JSON only
        assert PLOT_HINT in result.stdout and not png.exists()
        return
    assert f"plot written to {png}" in result.stdout.replace("\n", "")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"  # a PNG, not a stub
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 600 and height >= 600


def test_bench_policy_without_matplotlib_says_how_to_get_the_plot(tmp_path: Path,
                                                                  monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    out = tmp_path / "policy.json"
    result = CliRunner().invoke(app, ["bench", "policy", "--quick", "--json", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["bench"] == "policy"
    assert PLOT_HINT in result.stdout and 'pip install "kvstore[bench]"' in result.stdout
    assert not out.with_suffix(".png").exists()


def test_a_mooncake_file_is_replayed_under_its_own_name(tmp_path: Path) -> None:
    lines = [{"timestamp": 1000 * i, "input_length": 1500, "output_length": 10,
              "hash_ids": [1, 2, 3 + i]} for i in range(6)]
    path = tmp_path / "mini.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    trace = traces.load_mooncake(path)
    assert trace.name == "mini.jsonl" and len(trace.requests) == 6
    assert trace.requests[2].arrival_s == 2.0
    # 1500 tokens in 256-token blocks: 5 full blocks, two from each 512-token unit, then one
    assert len(traces.block_keys(trace.requests[0], 256)) == 5
    config = SimConfig(capacities_bytes=(1 << 40,) * 3)
    results = simulate(trace, config)
    # Units 1 and 2 are shared: every request after the first matches them.
    assert results["lru"]["hit_rate"] == pytest.approx(5 * 1024 / (6 * 1500))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1}\n')
    with pytest.raises(InvalidArgument, match="bad.jsonl:1"):
        traces.load_mooncake(bad)


def test_a_small_chain_demotes_and_keeps_its_capacities() -> None:
    trace = traces.chat(num_sessions=20, seed=3)
    base = SimConfig(capacities_bytes=(0, 0, 0))
    working = working_set_bytes(trace, base)
    config = SimConfig(capacities_bytes=(working // 20, working // 5, working // 2))
    for policy in POLICIES:
        sim = Simulator(config, policy, trace)
        summary = sim.run()
        for tier in sim.tiers:
            assert tier.used_bytes <= tier.capacity_bytes
            assert tier.used_bytes == sum(tier.held.values()) and len(tier.order) == len(tier.held)
        assert sim.tiers[1].bytes_written > 0  # blocks moved down from the first tier
        assert summary["hit_rate"] >= summary["fetched_rate"]


def test_block_tokens_must_divide_the_trace_unit() -> None:
    with pytest.raises(InvalidArgument):
        Simulator(SimConfig(capacities_bytes=(1, 1, 1), block_tokens=300), POLICIES[0],
                  traces.no_reuse(num_requests=2))


def test_a_recomputed_block_left_on_ssd_is_lifted_and_then_moves_down_one_tier() -> None:
    """Regression: a block only the SSD held was never fetched (one block reads slower from
    this SSD than it prefills), so it was never promoted, and every later use recomputed it;
    and a copy evicted from the first tier while the SSD held another was dropped, not moved to
    DRAM. Now the put's copy goes up (the value policy's ``lifts``) and comes down one tier."""
    one_block = 512 * SimConfig(capacities_bytes=(0,)).kv_bytes_per_token

    def request(t: float, unit: int) -> traces.Request:
        return traces.Request(t, 512, 10, (unit,))

    # 1 goes down to the SSD behind 2 and 3, comes back (recomputed), then 4 pushes it out of
    # the first tier again.
    trace = traces.Trace("lift", tuple(request(float(t), u) for t, u in
                                       enumerate((1, 2, 3, 1, 4))))
    config = SimConfig(capacities_bytes=(one_block, one_block, 10 * one_block))
    kvstore = next(p for p in POLICIES if p.name == "kvstore")
    sim = Simulator(config, kvstore, trace)
    summary = sim.run()
    block = traces.block_keys(trace.requests[0], 512)[0]
    assert summary["hit_rate_ssd"] == pytest.approx(1 / 5)  # the fourth request matched it
    assert summary["fetched_rate"] == 0  # ... and recomputed it
    assert block in sim.tiers[1].held and block in sim.tiers[2].held  # lifted, moved down
