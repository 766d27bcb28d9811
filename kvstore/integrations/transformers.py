"""Hugging Face transformers adapter: ``generate`` that loads a prompt's stored prefix into a
``DynamicCache``, prefills only the rest and saves every block it completes.

Supported: transformers 5.24 and later 5.x (``generate(..., cache=...)``; 4.x named it
``past_key_values`` and built ``DynamicCache`` differently), decoder-only models whose cache is a
``DynamicCache`` of per-layer ``[batch, kv_heads, seq, head_dim]`` K/V (Llama, Qwen2, Qwen3,
Mistral and the like, grouped-query attention included). Batches of one prompt without padding.

Why it is built the way it is:

- K is cached after rotary encoding, so a block is only valid at the absolute positions it was
  computed at. Block keys chain from the first token, so a hit is always a prefix starting at
  position 0, and the rope settings are part of the namespace.
- The attention mask given to ``generate`` covers past plus new tokens (the whole prompt): a
  mask of the suffix alone gives silently wrong logits.
- Sliding-window models: a ``DynamicCache`` built from the config keeps only the window, and a
  window cannot be stored as a prefix (its positions shift). The adapter hands ``generate`` a
  config-less ``DynamicCache``, whose layers keep full-length K/V; the model's own sliding mask
  still limits what each query sees, so the logits are the same.
- At least one prompt token is always prefilled: the first generated token needs its logits.
"""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from kvstore.client import Client
from kvstore.errors import InvalidArgument
from kvstore.keys import Namespace
from kvstore.spec import KVSpec

DEFAULT_BLOCK_TOKENS = 16
# Config fields that change the K/V a model computes for the same tokens and weights, besides
# the geometry the KVSpec carries; the weights themselves are named by ``revision``.
_ROPE_FIELDS = ("rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor",
                "max_position_embeddings", "sliding_window", "use_sliding_window")


@dataclass(frozen=True, slots=True)
class GenerateStats:
    """What the last ``generate`` call reused, saved and how fast it produced its first token."""

    num_prompt_tokens: int
    num_reused_tokens: int  # prompt tokens loaded from kvstore instead of prefilled
    reused_tokens_per_tier: dict[str, int]  # the same, by the tier that held each block
    num_saved_tokens: int  # tokens of blocks this call wrote to kvstore
    ttft_s: float  # from the call to the first token's logits (lookup and load included)


def _text_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def kv_spec_for(model: Any, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> KVSpec:
    """The KV geometry of ``model``'s cache: layers, KV heads, head dim, dtype, rope settings."""
    config = _text_config(model)
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    rope = {name: getattr(config, name) for name in _ROPE_FIELDS if hasattr(config, name)}
    digest = hashlib.blake2b(json.dumps(rope, sort_keys=True, default=str).encode(),
                             digest_size=8).hexdigest()
    return KVSpec(num_layers=config.num_hidden_layers, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, block_tokens=block_tokens, dtype=model.dtype,
                  position_scheme=f"rope/{digest}")


def namespace_for(model: Any, *, revision: str, tenant: str = "default",
                  block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Namespace:
    """The namespace of ``model``'s blocks: model id and architecture from its config, the KV
    spec, the weights ``revision`` and the ``tenant``."""
    config = _text_config(model)
    model_id = getattr(model.config, "name_or_path", "") or config.model_type
    architecture = ",".join(getattr(model.config, "architectures", None) or
                            [type(model).__name__])
    return Namespace(model_id=model_id, spec=kv_spec_for(model, block_tokens), revision=revision,
                     tenant=tenant, extra_salt=f"transformers/{architecture}")


def cache_from_kv(kv: torch.Tensor) -> DynamicCache:
    """A ``DynamicCache`` holding ``kv`` (canonical ``[L, 2, T, H, D]``) for a batch of one."""
    cache = DynamicCache()
    for layer, layer_kv in enumerate(kv):
        # [T, H, D] -> [1, H, T, D], contiguous so later appends concatenate plain tensors.
        key, value = (t.permute(1, 0, 2).unsqueeze(0).contiguous() for t in layer_kv)
        cache.update(key, value, layer)
    return cache


def kv_from_cache(cache: DynamicCache, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` tokens of a batch-of-one cache, in the canonical layout."""
    layers = [torch.stack((layer.keys[0, :, :num_tokens], layer.values[0, :, :num_tokens]))
              for layer in cache.layers]
    return torch.stack(layers).permute(0, 1, 3, 2, 4).contiguous().cpu()  # [L, 2, T, H, D]


class _StoreHook(LogitsProcessor):
    """Runs once per generated token, after the forward pass that produced its logits: notes the
    time of the first, and hands every newly completed block of the cache to the saver."""

    def __init__(self, on_step: Any) -> None:
        self._on_step = on_step

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor
                 ) -> torch.FloatTensor:
        self._on_step(input_ids)
        return scores


class CachedModel:
    """A model whose ``generate`` reuses and fills kvstore; see :func:`wrap`."""

    def __init__(self, model: Any, client: Client, ns: Namespace) -> None:
        self.model = model
        self.client = client
        self.namespace = ns
        self.last_stats: GenerateStats | None = None
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-save")

    def generate(self, inputs: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """``model.generate`` with the same arguments and output, for one unpadded prompt."""
        start = time.perf_counter()
        input_ids = kwargs.pop("input_ids", inputs)
        self._check(input_ids, kwargs)
        prompt = input_ids[0].tolist()
        bt = self.namespace.spec.block_tokens
        hit = self.client.lookup(self.namespace, prompt[: (len(prompt) - 1) // bt * bt]) \
            if len(prompt) > bt else None
        cache, per_tier = self._load(prompt, hit)
        run = _Run(self, cache, reused=cache.get_seq_length(), start=start)
        processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
        processors.append(_StoreHook(run.on_step))
        kwargs.setdefault("attention_mask", torch.ones_like(input_ids))
        try:
            output = self.model.generate(input_ids, cache=cache, logits_processor=processors,
                                         **kwargs)
        finally:
            num_saved = run.finish()
        self.last_stats = GenerateStats(
            num_prompt_tokens=len(prompt), num_reused_tokens=run.reused,
            reused_tokens_per_tier=per_tier, num_saved_tokens=num_saved,
            ttft_s=run.ttft_s)
        return output

    def _check(self, input_ids: Any, kwargs: dict[str, Any]) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 \
                or input_ids.shape[0] != 1:
            raise InvalidArgument("generate takes input_ids of shape [1, num_tokens]")
        for name in ("cache", "past_key_values"):
            if kwargs.get(name) is not None:
                raise InvalidArgument(f"generate builds its own cache; do not pass {name}")
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise InvalidArgument("padded prompts are not supported: attention_mask must be all 1")

    def _load(self, prompt: list[int], hit: Any) -> tuple[DynamicCache, dict[str, int]]:
        """The cache of the stored prefix (empty on a miss) and the reused tokens by tier."""
        if hit is None or hit.tokens_to_fetch == 0:
            return DynamicCache(), {}
        kv = self.client.get(self.namespace, prompt[: hit.tokens_to_fetch])
        if kv is None:  # evicted between the lookup and the get
            return DynamicCache(), {}
        # Per-tier counts describe the whole match; a shorter load (advice, or blocks evicted
        # since the lookup) cannot be split by tier.
        per_tier = dict(hit.tokens_per_tier) if kv.shape[2] == hit.matched_tokens else \
            {"unknown": kv.shape[2]}
        return cache_from_kv(kv.to(self.model.device, self.model.dtype)), per_tier

    def close(self) -> None:
        self._saver.shutdown(wait=True)


class _Run:
    """One ``generate`` call's progress: first-token time and the blocks saved so far."""

    def __init__(self, owner: CachedModel, cache: DynamicCache, reused: int, start: float):
        self._owner = owner
        self._cache = cache
        self._start = start
        self._saved_upto = reused  # tokens already in kvstore (the loaded prefix)
        self._pending: list[Future[int]] = []
        self.reused = reused
        self.ttft_s = 0.0

    def on_step(self, input_ids: torch.LongTensor) -> None:
        if not self.ttft_s:
            self.ttft_s = time.perf_counter() - self._start
        bt = self._owner.namespace.spec.block_tokens
        full = self._cache.get_seq_length() // bt * bt
        if full <= self._saved_upto:
            return
        # The cache's tensors are replaced, not written into, as decoding appends, so the copy
        # taken here stays valid while the saver thread sends it.
        tokens = input_ids[0, :full].tolist()
        kv = kv_from_cache(self._cache, full)
        self._pending.append(self._owner._saver.submit(
            self._owner.client.put, self._owner.namespace, tokens, kv))
        self._saved_upto = full

    def finish(self) -> int:
        """Wait for the saves of this call; returns the tokens they newly wrote."""
        return sum(future.result() for future in self._pending)


def wrap(model: Any, client: Client, *, revision: str, tenant: str = "default",
         block_tokens: int = DEFAULT_BLOCK_TOKENS) -> CachedModel:
    """Give ``model`` a ``generate`` that reuses prompt prefixes stored in kvstore.

    Args:
        model: a transformers causal LM whose cache is a ``DynamicCache``.
        client: a connected :class:`kvstore.client.Client`.
        revision: the weights revision (checkpoint hash); blocks of another revision never match.
        tenant: the kvstore tenant the blocks belong to.
        block_tokens: tokens per stored block.

    Returns:
        A :class:`CachedModel`; its ``last_stats`` describe the latest ``generate`` call.
    """
    return CachedModel(model, client, namespace_for(model, revision=revision, tenant=tenant,
                                                    block_tokens=block_tokens))
