"""The namespace of a vLLM engine's blocks, read from its config: model, revision, dtype, KV
geometry or cache groups, block size, backend layout, tensor-parallel shard, the request's cache
salt and LoRA adapter, and an fp8 cache's flavour and scales."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.groups import CacheSpec
from kvstore.integrations.vllm_fp8 import fp8_cache_of
from kvstore.integrations.vllm_identity import salt_suffix
from kvstore.integrations.vllm_kernels import mla_namespace
from kvstore.keys import Namespace
from kvstore.spec import KVSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

CPU_LAYOUT = "cpu/LBHNC"  # the CPU backend's layout, whose per-layer tensors the connector copies
# Pages are canonical whatever the engine's layout; the device is in the namespace all the same,
# so K/V computed by a CPU backend and by a GPU one (different kernels, different rounding)
# are never mixed in one prompt.
GPU_SALT = "cuda"


def namespace_for(vllm_config: VllmConfig, cache_salt: str | None = None,
                  tp_rank: int = 0, adapter_id: str = "", cache: CacheSpec | None = None
                  ) -> Namespace:
    """The namespace of an engine's blocks: model, revision, dtype, KV geometry, block size,
    backend layout, tensor-parallel shard, and the request's cache salt and LoRA adapter
    (``vllm_identity.adapter_id``); ``cache``: the kv-cache groups (``vllm_groups``)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    fp8 = fp8_cache_of(vllm_config)  # None for a model-dtype cache
    layout = GPU_SALT if device_type(vllm_config) == "cuda" else CPU_LAYOUT
    common = {"model_id": model.model,
              "revision": str(extra.get("revision") or model.revision or "main"),
              "adapter_id": adapter_id, "tenant": str(extra.get("tenant", "default")),
              "tp_rank": tp_rank, "tp_size": parallel.tensor_parallel_size,
              "extra_salt": f"vllm/{layout}" + salt_suffix(cache_salt)}
    if cache is not None:
        return Namespace(spec=cache, **common)
    if is_mla(vllm_config):
        # the latent group's pages: one copy whatever the TP rank and size
        text = model.hf_text_config
        latent = mla_namespace(num_layers=model.get_num_layers(parallel),
                               kv_lora_rank=text.kv_lora_rank, rope_dim=text.qk_rope_head_dim,
                               block_tokens=vllm_config.cache_config.block_size,
                               dtype=model.dtype, fp8=fp8, **common)
        return (fp8.bind(latent) if fp8 else latent).group(0)
    spec = KVSpec(num_layers=model.get_num_layers(parallel),
                  num_kv_heads=model.get_num_kv_heads(parallel), head_dim=model.get_head_size(),
                  block_tokens=vllm_config.cache_config.block_size, dtype=model.dtype)
    ns = Namespace(spec=spec, **common)
    return fp8.bind(ns) if fp8 else ns  # fp8: the cache's bytes, flavour and scales


def is_mla(vllm_config: VllmConfig) -> bool:
    """Whether the model keeps MLA's latent cache (DeepSeek V2/V3 and the like)."""
    return bool(getattr(vllm_config.model_config, "use_mla", False))


def device_type(vllm_config: VllmConfig) -> str:
    return str(getattr(vllm_config.device_config, "device_type", "cpu") or "cpu")


def tp_rank_now() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()
