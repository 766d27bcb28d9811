"""The scale benchmark runs end to end at tiny sizes (through the CLI) and reports every
operation at every size, its ratio to the first size, and the fill time."""

from __future__ import annotations

import importlib.util
import json

import pytest
from typer.testing import CliRunner

from kvstore.bench.report import PLOT_HINT
from kvstore.bench.scale import OPS, ScaleConfig, parse_sizes, run_scale_bench
from kvstore.cli import app
from kvstore.errors import InvalidArgument


def test_scale_bench_cli_writes_json_and_png(tmp_path):
    out = tmp_path / "scale.json"
    result = CliRunner().invoke(app, ["bench", "scale", "--sizes", "48,160", "--repeats", "3",
                                      "--dram-blocks", "256", "--prompt-blocks", "4",
                                      "--work-dir", str(tmp_path), "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["bench"] == "scale" and doc["params"]["sizes"] == [48, 160]
    latency = [r for r in doc["rows"] if r["section"] == "latency"]
    assert {(r["operation"], r["blocks"]) for r in latency} == {
        (op, size) for op in OPS for size in (48, 160)}
    for row in latency:
        assert {"p50_ms", "p99_ms", "p50_vs_first", "p99_vs_first", "samples"} <= set(row)
        if row["operation"] != "get_ssd":  # the smallest store may have no SSD-only prompt yet
            assert row["samples"] == 3 and 0 < row["p50_ms"] <= row["p99_ms"]
    first = {r["operation"]: r for r in latency if r["blocks"] == 48}
    for row in latency:
        if row["operation"] == "put":
            assert row["p50_vs_first"] == pytest.approx(
                row["p50_ms"] / first["put"]["p50_ms"])
    fill = [r for r in doc["rows"] if r["section"] == "fill"]
    assert [r["blocks"] for r in fill] == [48, 160]
    assert all(r["fill_s_per_10k"] > 0 for r in fill) and fill[0]["fill_vs_first"] == 1.0
    assert set(doc["raw"]["sizes"]) == {"48", "160"}
    stretches = doc["raw"]["fill_stretches"]
    assert [s["blocks"] for s in stretches] == [48, 160]  # the warm-up (24 blocks) untimed
    assert all(s["fill_s_per_10k"] > 0 for s in stretches)
    assert len(doc["raw"]["sizes"]["160"]["latency_ms"]["lookup_daemon"]) == 3
    png = out.with_suffix(".png")
    if importlib.util.find_spec("matplotlib") is None:  # no bench extra: no plot, a hint
        assert PLOT_HINT in result.stdout and not png.exists()
        return
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_scale_bench_serves_old_prompts_from_ssd(tmp_path):
    """Past the DRAM tier's size the old prompts are on the SSD only, and gets of them are
    timed."""
    config = ScaleConfig(sizes=(640,), repeats=2, prompt_blocks=4, dram_blocks=256)
    report, _ = run_scale_bench(config, str(tmp_path))
    row = next(r for r in report.rows if r.get("operation") == "get_ssd")
    assert row["samples"] == 2 and row["p50_ms"] > 0
    assert not list(tmp_path.iterdir())  # its temp dir is gone


@pytest.mark.parametrize(("text", "sizes"), [("1k,10k,300k", (1000, 10000, 300000)),
                                             ("64", (64,)), ("0.5k, 2k", (500, 2000)),
                                             ("1m", (1_000_000,))])
def test_parse_sizes(text, sizes):
    assert parse_sizes(text) == sizes


@pytest.mark.parametrize("text", ["", "10k,1k", "1k,1k", "lots", "0", "-5"])
def test_parse_sizes_rejects(text):
    with pytest.raises(InvalidArgument, match="sizes"):
        parse_sizes(text)


def test_bad_config_rejected():
    with pytest.raises(InvalidArgument, match="ascending"):
        ScaleConfig(sizes=(10, 5))
    with pytest.raises(InvalidArgument, match="repeats"):
        ScaleConfig(repeats=0)
