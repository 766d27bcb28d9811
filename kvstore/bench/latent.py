"""The ``quality-latent`` section of ``kvstore bench codecs``: codecs on MLA latents, measured by
the error of MLA's absorbed attention output.

Construction (DeepSeek-V3's shapes, ``LatentSizes``):

- Latents: one bf16 row of ``kv_lora_rank + qk_rope_dim`` = 512 + 64 = 576 elements per token
  and layer (``c_kv``, after DeepSeek's kv_a_layernorm, and the rotated ``k_rope``). Gaussian
  with unit variance (what an RMS norm leaves), and ``outlier_channels`` random channels of the
  576 per layer scaled by 10x-20x, the fixed-channel outliers of the synthetic K case.
- Weights: ``W_UK`` ``[heads, qk_nope_dim, kv_lora_rank]`` and ``W_UV`` ``[heads, v_head_dim,
  kv_lora_rank]`` per layer (the two halves of ``kv_b_proj``), normal with std 0.02 (the
  model's ``initializer_range``). Queries ``q_nope`` and ``q_rope`` per head are standard normal.
- Absorbed attention per layer and head: ``q_abs = W_UK^T q_nope``; scores ``(q_abs . c_kv +
  q_rope . k_rope) * scale`` with DeepSeek-V3's ``scale = mscale^2 / sqrt(qk_nope_dim +
  qk_rope_dim)`` (yarn factor 40, mscale_all_dim 1); softmax over every token (not causal);
  output ``W_UV (sum_t p_t c_kv_t)``, float32. The error is the relative L2 of that output
  against the same computation on the bf16 latents.
- Storage: the latents go through a real in-process ``Store`` whose DRAM tier encodes with the
  codec under test, as the latent group of a grouped namespace (``CacheGroup.latent``, packed
  by ``CacheGroup.pack`` to its storage ``KVSpec``, put and got under ``Namespace.group(0)``,
  unpacked by ``CacheGroup.unpack``): the pages and the codec calls a client's ``GroupCache``
  save and load cause, block by block.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from kvstore import codecs
from kvstore.bench.codecs import BF16_BYTES, relative_l2
from kvstore.groups import CacheGroup, CacheSpec
from kvstore.keys import Namespace

KV_LORA_RANK = 512
QK_ROPE_DIM = 64
QK_NOPE_DIM = 128
V_HEAD_DIM = 128
INIT_STD = 0.02  # DeepSeek-V3's initializer_range
# DeepSeek-V3's yarn softmax scale: mscale = 0.1 * mscale_all_dim * ln(factor) + 1.
MSCALE = 0.1 * 1.0 * math.log(40) + 1.0
SOFTMAX_SCALE = MSCALE ** 2 / math.sqrt(QK_NOPE_DIM + QK_ROPE_DIM)
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class LatentSizes:
    """Shapes of one latent run."""

    num_layers: int
    num_tokens: int  # latents stored per layer (a multiple of block_tokens)
    num_heads: int  # query heads reading them (DeepSeek-V3: 128)
    num_queries: int  # query positions per head
    block_tokens: int  # tokens per stored page
    outlier_channels: int  # of the 576 per layer, scaled by 10x-20x

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "outlier_channels" else 1):
                raise ValueError(f"LatentSizes.{name} must be a positive int, got {value!r}")
        if self.num_tokens % self.block_tokens:
            raise ValueError("LatentSizes.num_tokens must be a multiple of block_tokens")
        if self.outlier_channels > KV_LORA_RANK + QK_ROPE_DIM:
            raise ValueError("LatentSizes.outlier_channels exceeds the 576 channels")


LATENT_FULL = LatentSizes(4, 512, 128, 32, 64, 4)
LATENT_QUICK = LatentSizes(2, 64, 4, 4, 16, 4)


@dataclass(frozen=True, slots=True)
class LatentDataset:
    """Latents ``[L, T, 576]`` bf16, the absorbed queries and weights that read them, and the
    float32 attention output on the original ``[L, heads, queries, v_head_dim]``."""

    latents: torch.Tensor
    q_abs: torch.Tensor  # [L, heads, queries, kv_lora_rank], W_UK already applied
    q_rope: torch.Tensor  # [L, heads, queries, qk_rope_dim]
    w_uv: torch.Tensor  # [L, heads, v_head_dim, kv_lora_rank]
    reference: torch.Tensor
    sizes: LatentSizes


def latent_dataset(sizes: LatentSizes, seed: int = 0) -> LatentDataset:
    """The module docstring's construction, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    row = KV_LORA_RANK + QK_ROPE_DIM
    layers, heads, queries = sizes.num_layers, sizes.num_heads, sizes.num_queries
    latents = torch.randn(layers, sizes.num_tokens, row, generator=gen)
    for layer in range(layers):
        channels = torch.randperm(row, generator=gen)[:sizes.outlier_channels]
        latents[layer, :, channels] *= 10 + 10 * torch.rand(len(channels), generator=gen)
    w_uk = torch.randn(layers, heads, QK_NOPE_DIM, KV_LORA_RANK, generator=gen) * INIT_STD
    w_uv = torch.randn(layers, heads, V_HEAD_DIM, KV_LORA_RANK, generator=gen) * INIT_STD
    q_nope = torch.randn(layers, heads, queries, QK_NOPE_DIM, generator=gen)
    q_rope = torch.randn(layers, heads, queries, QK_ROPE_DIM, generator=gen)
    q_abs = torch.einsum("lhqn,lhnc->lhqc", q_nope, w_uk)
    latents = latents.to(torch.bfloat16)
    return LatentDataset(latents, q_abs, q_rope, w_uv,
                         absorbed_attention(latents, q_abs, q_rope, w_uv), sizes)


def absorbed_attention(latents: torch.Tensor, q_abs: torch.Tensor, q_rope: torch.Tensor,
                       w_uv: torch.Tensor) -> torch.Tensor:
    """MLA's absorbed attention over ``latents`` ``[L, T, 576]``, float32: ``[L, heads,
    queries, v_head_dim]``."""
    c_kv = latents[..., :KV_LORA_RANK].float().unsqueeze(1)  # [L, 1, T, 512]
    k_rope = latents[..., KV_LORA_RANK:].float().unsqueeze(1)  # [L, 1, T, 64]
    scores = (q_abs @ c_kv.transpose(-1, -2) + q_rope @ k_rope.transpose(-1, -2)) * SOFTMAX_SCALE
    latent_out = torch.softmax(scores, dim=-1) @ c_kv  # [L, heads, queries, 512]
    return torch.einsum("lhqc,lhvc->lhqv", latent_out, w_uv)


def latent_group(num_layers: int) -> CacheGroup:
    """DeepSeek-V3's latent group: ``kv`` (512) and ``pe`` (64) in bf16, replicated."""
    return CacheGroup.latent(num_layers, [("kv", KV_LORA_RANK, "bfloat16"),
                                          ("pe", QK_ROPE_DIM, "bfloat16")], name="mla")


def stored_and_back(name: str, data: LatentDataset) -> tuple[torch.Tensor, int]:
    """The latents after a put and a get through a ``Store`` whose DRAM tier encodes with codec
    ``name``, and the bytes of the codec blobs of its pages."""
    from kvstore.config import DramConfig, KVStoreConfig, SsdConfig
    from kvstore.store import Store

    sizes = data.sizes
    group = latent_group(sizes.num_layers)
    ns = Namespace(model_id="deepseek-v3-latent-bench", tenant="bench",
                   spec=CacheSpec((group,), sizes.block_tokens))
    gns = ns.group(0)
    parts = {"kv": data.latents[..., :KV_LORA_RANK].contiguous(),
             "pe": data.latents[..., KV_LORA_RANK:].contiguous()}
    stored = group.pack(parts, sizes.block_tokens)
    tokens = list(range(1, sizes.num_tokens + 1))
    nbytes = stored.numel() * stored.element_size()
    codec = codecs.get(name)
    bt = sizes.block_tokens
    blob_bytes = sum(len(codec.encode(stored[:, :, i:i + bt]))
                     for i in range(0, sizes.num_tokens, bt))

    async def round_trip(path: str) -> torch.Tensor | None:
        config = KVStoreConfig(
            dram=DramConfig(capacity_bytes=max(64 * MiB, 4 * nbytes), chunk_bytes=MiB,
                            codec=name),
            ssd=SsdConfig(path=path, enabled=False))
        async with Store(config) as store:
            await store.put(gns, tokens, stored)
            return await store.get(gns, tokens)

    with tempfile.TemporaryDirectory(prefix="kvstore-latent-bench-") as path:
        got = asyncio.run(round_trip(path))
    if got is None or got.shape != stored.shape:
        raise RuntimeError(f"the store returned {None if got is None else tuple(got.shape)} "
                           f"for the {tuple(stored.shape)} latent pages it was given")
    back = group.unpack(got, sizes.block_tokens)
    return torch.cat((back["kv"], back["pe"]), dim=-1), blob_bytes


def latent_quality_row(name: str, data: LatentDataset) -> dict[str, Any]:
    """Size and error of codec ``name`` on the latents, stored and read back by a ``Store``."""
    codec = codecs.get(name)
    decoded, blob_bytes = stored_and_back(name, data)
    ref, err = data.latents.float(), decoded.float() - data.latents.float()
    out = absorbed_attention(decoded, data.q_abs, data.q_rope, data.w_uv)
    per_layer = [relative_l2(out[i] - data.reference[i], data.reference[i])
                 for i in range(out.shape[0])]
    bpe = blob_bytes / data.latents.numel()
    group = latent_group(data.sizes.num_layers)
    return {
        "section": "quality-latent", "codec": name,
        "lossless": codec.lossless, "blob_bytes": blob_bytes, "bytes_per_element": bpe,
        "nominal_bytes_per_element": codec.bytes_per_element(
            group.storage_spec(data.sizes.block_tokens)),
        "compression_ratio": BF16_BYTES / bpe,
        "c_kv_rel_l2": relative_l2(err[..., :KV_LORA_RANK], ref[..., :KV_LORA_RANK]),
        "k_rope_rel_l2": relative_l2(err[..., KV_LORA_RANK:], ref[..., KV_LORA_RANK:]),
        "max_abs_err": float(err.abs().max()),
        "attn_rel_err": relative_l2(out - data.reference, data.reference),
        "attn_rel_err_worst_layer": max(per_layer),
    }


def latent_params(sizes: LatentSizes) -> dict[str, Any]:
    """What the JSON's params say about the latent case."""
    return {
        "sizes": {f: getattr(sizes, f) for f in sizes.__dataclass_fields__},
        "row": {"kv_lora_rank": KV_LORA_RANK, "qk_rope_dim": QK_ROPE_DIM, "dtype": "bfloat16"},
        "storage_spec": latent_group(sizes.num_layers).storage_spec(
            sizes.block_tokens).to_dict(),
        "attention": (f"MLA absorbed, DeepSeek-V3 dims (qk_nope {QK_NOPE_DIM}, v_head "
                      f"{V_HEAD_DIM}), W_UK/W_UV ~ N(0, {INIT_STD}^2), softmax scale "
                      f"{SOFTMAX_SCALE:.4f}, full (non-causal), float32"),
    }


REAL_NOTE = ("quality-latent: synthetic only; the bench's real source (all-MiniLM-L6-v2) is "
             "multi-head attention with no MLA latent, so it does not apply")

__all__ = ["LATENT_FULL", "LATENT_QUICK", "REAL_NOTE", "LatentDataset", "LatentSizes",
           "absorbed_attention", "latent_dataset", "latent_group", "latent_params",
           "latent_quality_row", "stored_and_back"]
