"""The ``quality-latent`` section of ``kvstore bench codecs`` at a tiny size: MLA latents stored
through a real ``Store`` as a latent group's pages; rows and errors, never timings."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from kvstore import codecs
from kvstore.bench.codecs import CODECS, run_codec_bench, size_notes
from kvstore.bench.latent import (
    KV_LORA_RANK,
    REAL_NOTE,
    SOFTMAX_SCALE,
    LatentSizes,
    absorbed_attention,
    latent_dataset,
    latent_group,
    latent_quality_row,
    stored_and_back,
)
from kvstore.config import DramConfig, KVStoreConfig, SsdConfig
from kvstore.errors import InvalidArgument
from kvstore.groups import CacheGroup, CacheSpec
from kvstore.keys import Namespace
from kvstore.store import Store

TINY = LatentSizes(num_layers=2, num_tokens=32, num_heads=2, num_queries=3, block_tokens=16,
                   outlier_channels=4)
ERROR_KEYS = ("c_kv_rel_l2", "k_rope_rel_l2", "max_abs_err", "attn_rel_err",
              "attn_rel_err_worst_layer")
LOSSY = ("fp8_e4m3", "nvfp4", "mxfp4", "int4", "int2")


@pytest.fixture(scope="module")
def data():
    return latent_dataset(TINY)


@pytest.fixture(scope="module")
def rows(data) -> dict[str, dict]:
    return {name: latent_quality_row(name, data) for name in ("raw", *LOSSY, "int4+zstd")}


def test_raw_is_exact(data, rows) -> None:
    """Raw pages give back the very latents, so the absorbed output is the reference."""
    back, blob_bytes = stored_and_back("raw", data)
    assert torch.equal(back, data.latents)
    assert blob_bytes > data.latents.numel() * 2
    assert all(rows["raw"][k] == 0 for k in ERROR_KEYS)


def test_lossy_errors_are_finite_and_ordered(rows) -> None:
    """Every lossy codec errs, finitely and below 1; fp8 (8 bits) errs least and int2 (2 bits)
    most; 4-bit codecs lie between; zstd adds no error to int4."""
    for name in LOSSY:
        row = rows[name]
        assert row["lossless"] is False and row["section"] == "quality-latent"
        assert all(math.isfinite(row[k]) for k in ERROR_KEYS), row
        assert 0 < row["attn_rel_err"] < 1 and 0 < row["c_kv_rel_l2"] < 1, row
    err = {name: rows[name]["attn_rel_err"] for name in LOSSY}
    assert err["fp8_e4m3"] < min(err["nvfp4"], err["mxfp4"], err["int4"])
    assert max(err["nvfp4"], err["mxfp4"], err["int4"]) < err["int2"]
    assert all(rows["int4+zstd"][k] == rows["int4"][k] for k in ERROR_KEYS)


def test_sizes_are_what_each_codec_states(rows) -> None:
    """Bytes per latent element match each codec's own count for the group's storage spec."""
    for name, row in rows.items():
        assert row["compression_ratio"] == pytest.approx(2 / row["bytes_per_element"])
        if "+zstd" in name:
            assert 0 < row["bytes_per_element"] <= row["nominal_bytes_per_element"] * 1.01
    assert not size_notes(list(rows.values()))
    assert rows["fp8_e4m3"]["bytes_per_element"] < rows["raw"]["bytes_per_element"]
    assert rows["int2"]["bytes_per_element"] < rows["int4"]["bytes_per_element"]


def test_absorbed_attention_equals_the_expanded_form(data) -> None:
    """The absorbed form is MLA's attention: expanding K = W_UK c_kv per head (with k_rope)
    and V = W_UV c_kv and attending with the un-absorbed query gives the same output."""
    gen = torch.Generator().manual_seed(1)
    layers, heads, queries = 1, 2, 3
    lat = data.latents[:layers]
    w_uk = torch.randn(layers, heads, 128, KV_LORA_RANK, generator=gen) * 0.02
    w_uv = data.w_uv[:layers, :heads]
    q_nope = torch.randn(layers, heads, queries, 128, generator=gen)
    q_rope = torch.randn(layers, heads, queries, 64, generator=gen)
    absorbed = absorbed_attention(lat, torch.einsum("lhqn,lhnc->lhqc", q_nope, w_uk), q_rope,
                                  w_uv)
    c_kv, k_rope = lat[..., :KV_LORA_RANK].float(), lat[..., KV_LORA_RANK:].float()
    k_nope = torch.einsum("lhnc,ltc->lhtn", w_uk, c_kv)
    k = torch.cat((k_nope, k_rope.unsqueeze(1).expand(-1, heads, -1, -1)), dim=-1)
    v = torch.einsum("lhvc,ltc->lhtv", w_uv, c_kv)
    q = torch.cat((q_nope, q_rope), dim=-1)
    expanded = torch.softmax(q @ k.transpose(-1, -2) * SOFTMAX_SCALE, dim=-1) @ v
    assert torch.allclose(absorbed, expanded, rtol=1e-4, atol=1e-5)


def test_the_store_refuses_lossy_codecs_on_an_fp8_latent(tmp_path) -> None:
    """What the section does not measure: a latent kept in fp8 by the engine (uint8 with a
    scale) is stored as bytes, and a lossy tier codec is refused with a clear error."""
    group = CacheGroup.latent(2, [("kv", KV_LORA_RANK, "float8_e4m3fn"), ("pe", 64, "bfloat16")])
    assert group.is_lossless_only and group.storage_spec(16).dtype == "uint8"
    gns = Namespace(model_id="m", spec=CacheSpec((group,), 16)).group(0)
    stored = torch.zeros(gns.spec.num_layers, 2, 16, gns.spec.num_kv_heads, gns.spec.head_dim,
                         dtype=torch.uint8)

    async def put() -> None:
        config = KVStoreConfig(dram=DramConfig(capacity_bytes=32 << 20, chunk_bytes=1 << 20,
                                               codec="fp8_e4m3"),
                               ssd=SsdConfig(path=str(tmp_path / "ssd"), enabled=False))
        async with Store(config) as store:
            await store.put(gns, list(range(16)), stored)

    with pytest.raises(InvalidArgument, match="lossy codec 'fp8_e4m3'"):
        asyncio.run(put())


def test_codec_bench_prints_the_latent_section() -> None:
    """The quick run has one latent row per codec chain, its params, and the note on the real
    source; --no-latent leaves it out."""
    report = run_codec_bench(quick=True, real=False, gpu=False)
    latent = [r for r in report.rows if r["section"] == "quality-latent"]
    assert [r["codec"] for r in latent] == list(CODECS)
    assert all(math.isfinite(r[k]) for r in latent for k in ERROR_KEYS)
    assert all(r["attn_rel_err"] == 0 for r in latent if codecs.get(r["codec"]).lossless)
    assert report.params["latent"]["storage_spec"]["head_dim"] == 288
    assert REAL_NOTE in report.notes
    assert latent_group(2).storage_spec(16).num_kv_heads == 1
    bare = run_codec_bench(quick=True, real=False, gpu=False, codec_names=("raw",),
                           latent=False)
    assert not any(r["section"] == "quality-latent" for r in bare.rows)


def test_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="multiple of block_tokens"):
        LatentSizes(1, 20, 1, 1, 16, 0)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        LatentSizes(1, 16, 0, 1, 16, 0)
