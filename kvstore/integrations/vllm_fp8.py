"""vLLM's fp8 KV caches (``cache_dtype`` fp8, fp8_e4m3, fp8_e5m2) as kvstore sees them: pages of
the cache's bytes under a namespace that names the fp8 flavour and where the scales come from.

vLLM keeps an fp8 cache in uint8 tensors of the layout it uses for bf16 (the attention
backends' ``[num_blocks, H, block_size, 2 * head_dim]``; MLA's ``[num_blocks, block_size,
kv_lora_rank + qk_rope_head_dim]``) and one K and one V scale per attention layer
(``layer._k_scale_float``; an MLA layer uses its K scale for the whole latent). Those scales are
static in vLLM 0.26-0.34: read from the checkpoint's ``k_scale``/``v_scale`` or 1.0, so the
model and revision the namespace already binds fix them (``Fp8Cache`` with no scales: "static").
The scheduler, which holds no layers, keys its lookups the same way. vLLM versions that can
compute scales from the first batch (``calculate_kv_scales``) give every instance its own: such a
cache is refused, since one instance's pages would be read under another's scales.

Other quantised cache dtypes (per-token-head scales, DeepSeek's ``fp8_ds_mla`` with scales
inside each row, int8, nvfp4) are refused by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvstore.engine_fp8 import FP8_CACHE_DTYPES, Fp8Cache
from kvstore.errors import InvalidArgument

if TYPE_CHECKING:
    from vllm.config import VllmConfig

FP8_CACHE_TENSOR_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_cache_of(vllm_config: VllmConfig) -> Fp8Cache | None:
    """The fp8 cache the config asks for (None: ``cache_dtype`` auto, the model's dtype);
    InvalidArgument for a cache dtype kvstore does not store."""
    cache = vllm_config.cache_config
    name = cache.cache_dtype
    if name in ("auto", None):
        return None
    if name not in FP8_CACHE_DTYPES:
        raise InvalidArgument(f"cache_dtype={name!r} is not supported; kvstore stores "
                              f"'auto' and {sorted(FP8_CACHE_DTYPES)} caches")
    if getattr(cache, "calculate_kv_scales", False):
        raise InvalidArgument(f"cache_dtype={name!r} with calculate_kv_scales: each engine "
                              "computes its own scales from its first batch, so no other "
                              "engine may read its pages; use scales from the checkpoint")
    return Fp8Cache(name, ())


def check_fp8_layers(named: list[tuple[str, torch.Tensor]], fp8: Fp8Cache | None) -> None:
    """An fp8 cache's layers are one-byte tensors (and a model-dtype cache's are not)."""
    for name, tensor in named:
        is_bytes = tensor.dtype in FP8_CACHE_TENSOR_DTYPES
        if fp8 is not None and not is_bytes:
            raise InvalidArgument(f"layer {name}: cache_dtype={fp8.dtype!r} but the registered "
                                  f"cache is {tensor.dtype} (a layer kept in the model's dtype: "
                                  "kv_cache_dtype_skip_layers is not supported)")
        if fp8 is None and is_bytes:
            raise InvalidArgument(f"layer {name}: cache is {tensor.dtype} but cache_dtype is "
                                  "'auto'")
