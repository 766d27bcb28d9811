"""``kvstore bench tiers`` end to end with a tiny total: the table and the JSON rows, no timings."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstore.bench.tiers import BLOCK_BYTES, run_tier_bench
from kvstore.cli import app
from kvstore.errors import InvalidArgument


def test_bench_tiers_writes_every_row(tmp_path: Path) -> None:
    out = tmp_path / "results" / "tiers.json"
    result = CliRunner().invoke(app, ["bench", "tiers", "--total-bytes", "8MiB", "--repeat", "1",
                                      "--ssd-path", str(tmp_path / "ssd"), "--json", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "memcpy" in result.stdout and "dd write" in result.stdout
    assert "encoding alone" in result.stdout
    report = json.loads(out.read_text())
    assert report["bench"] == "tiers" and report["command"]
    assert report["params"]["num_blocks"] == 4 and report["params"]["block_bytes"] == 2 << 20
    rows = {(r["path"], r["op"]): r for r in report["rows"]}
    assert set(rows) == {("dram", "put"), ("dram", "get"), ("dram", "get_prefix"),
                         ("ssd", "put"), ("ssd", "get"), ("ssd", "get_prefix")}
    for row in rows.values():
        assert row["bytes"] == 4 * BLOCK_BYTES and row["gbps"] > 0
        assert row["baseline_gbps"] > 0 and row["ratio"] > 0
    assert rows[("dram", "get")]["target_ratio"] == 0.7
    assert rows[("ssd", "put")]["baseline"].startswith("dd")
    assert list((tmp_path / "ssd").iterdir()) == []  # scratch segments and dd file removed


def test_bench_tiers_dram_only(tmp_path: Path) -> None:
    report = run_tier_bench(BLOCK_BYTES * 2, tiers=("dram",), repeat=2)
    assert [(r["path"], r["op"]) for r in report.rows] == [("dram", "put"), ("dram", "get"),
                                                         ("dram", "get_prefix")]
    assert all(len(r["round_gbps"]) == len(r["baseline_round_gbps"]) == 2 for r in report.rows)


@pytest.mark.parametrize("kwargs", [{"total_bytes": 1 << 20}, {"repeat": 0},
                                    {"tiers": ("tape",)}, {"queue_depth": 0}])
def test_bench_tiers_rejects_bad_arguments(kwargs) -> None:
    with pytest.raises(InvalidArgument):
        run_tier_bench(**{"total_bytes": BLOCK_BYTES, **kwargs})


def test_a_refused_put_stops_the_bench() -> None:
    """A tier that refuses a page fails the run with the block named, not a wrong number."""
    from kvstore.bench.tiers import _put_pass, make_workload
    from kvstore.errors import KVStoreError

    async def refuse(key, page, meta) -> bool:
        return meta.block_index != 1

    with pytest.raises(KVStoreError, match="refused block 1"):
        work = make_workload(3)
        asyncio.run(_put_pass(work, work.page, refuse, "dram", queue_depth=2))


def test_gpu_host_overhead_bench_runs_on_the_cpu_twin():
    """``kvstore bench gpu --host-overhead`` in miniature: every phase measured, the pages it
    loads checked against the ones saved (it raises otherwise)."""
    import torch

    from kvstore.bench.gpu.host import run_host_overhead_bench
    from kvstore.codecs.triton.common import kernels_runnable

    if not kernels_runnable(torch.device("cuda:0" if torch.cuda.is_available() else "cpu")):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    report = run_host_overhead_bench(blocks=4, repeat=1, rounds=1)
    assert [row["phase"] for row in report.rows] == [
        "save, HBM pool", "load, HBM pool", "load, DRAM arena"]
    assert all(row["host_ms"] > 0 and row["launches"] >= 1 for row in report.rows)
