"""``kvstore bench``: runners imported on use, their options passed, their reports written."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from kvstore.bench.report import BenchReport, Column
from kvstore.cli.bench import load_runner
from kvstore.errors import KVStoreError

from .helpers import invoke


def test_load_runner_names_a_missing_module() -> None:
    with pytest.raises(KVStoreError, match="kvstore.bench.no_such_bench.*not part of this build"):
        load_runner("kvstore.bench.no_such_bench", "run", "kvstore bench x")


def test_bench_codecs_runs_the_module_it_finds(monkeypatch, tmp_path: Path) -> None:
    """The command imports kvstore.bench.codecs on use and publishes what it returns."""
    seen: dict[str, object] = {}

    def run_codec_bench(**kwargs: object) -> BenchReport:
        seen.update(kwargs)
        return BenchReport(name="codecs", title="codecs", rows=({"codec": "raw"},),
                           columns=(Column("codec", "codec", justify="left"),))

    fake = types.ModuleType("kvstore.bench.codecs")
    fake.run_codec_bench = run_codec_bench  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvstore.bench.codecs", fake)
    out = tmp_path / "codecs.json"
    result = invoke("bench", "codecs", "--quick", "--no-real", "--codec", "fp8_e4m3",
                    "--codec", "raw+zstd", "--no-latent", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert seen == {"quick": True, "real": False, "gpu": None, "minilm_dir": None,
                    "latent": False, "codec_names": ("fp8_e4m3", "raw+zstd")}
    written = json.loads(out.read_text())
    assert written["bench"] == "codecs" and written["rows"] == [{"codec": "raw"}]
    assert {"date", "host", "command", "environment", "params"} <= set(written)


def test_bench_rpc_passes_its_options(monkeypatch, tmp_path: Path) -> None:
    seen: dict[str, object] = {}

    def run_rpc_bench(**kwargs: object) -> BenchReport:
        seen.update(kwargs)
        return BenchReport(name="rpc", title="rpc", columns=(Column("value", "value"),),
                           rows=({"value": 1.5},))

    fake = types.ModuleType("kvstore.bench.rpc.run")
    fake.run_rpc_bench = run_rpc_bench  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvstore.bench.rpc.run", fake)
    out = tmp_path / "rpc.json"
    result = invoke("bench", "rpc", "--total-bytes", "64MiB", "--concurrency", "4",
                    "--json", str(out))
    assert result.exit_code == 0, result.output
    assert seen == {"total_bytes": 64 << 20, "lookup_repeats": 200, "small_call_s": 2.0,
                    "concurrency": 4}
    assert json.loads(out.read_text())["rows"] == [{"value": 1.5}]


def test_bench_without_its_module_is_a_clean_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "kvstore.bench.codecs", None)  # import raises
    result = invoke("bench", "codecs")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: `kvstore bench codecs`")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_bench_gpu_without_a_gpu_says_so() -> None:
    result = invoke("bench", "gpu", "--quick")
    assert result.exit_code == 1
    assert "needs a CUDA device" in result.stderr


def test_bench_remote_runs_against_a_throwaway_server(tmp_path) -> None:
    """A tiny pass of `kvstore bench remote` (it starts its own redis-server)."""
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server binary")
    out = tmp_path / "remote.json"
    result = invoke("bench", "remote", "--total-bytes", "8MiB", "--repeat", "1",
                    "--probe-repeat", "2", "--json", str(out))
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"].split(",")[0] for r in rows] == [
        "put 2 MiB pages", "get 2 MiB pages (verified)", "prefix probe", "prefix probe"]
    assert all(r["kvstore"] > 0 and r["raw"] > 0 for r in rows)
