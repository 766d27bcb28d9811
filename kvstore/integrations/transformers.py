"""Hugging Face transformers adapter: ``generate`` that loads a prompt's stored prefix into a
``DynamicCache``, prefills only the rest and saves every block it completes.

Supported: transformers 5.x, tested on 5.17 and 5.25 (``generate(..., cache=...)`` from 5.24 on, ``past_key_values``
before), decoder-only models whose cache is a ``DynamicCache``: full attention (Llama, Qwen2/3,
grouped-query attention included), sliding windows (Mistral, Gemma 3, gpt-oss with its sinks),
MLA's compressed latent (DeepSeek V3), and linear-attention or Mamba states beside attention
(Qwen3-Next, Jamba). What the cache holds is read from the model's config and cache layer
classes (``transformers_cache.py``), not from its name: a cache of one kind of full attention
is stored as a ``KVSpec`` as before, anything else as cache groups (``kvstore.groups``). Batches
of one prompt without padding.

Why it is built the way it is:

- K is cached after rotary encoding, so a block is only valid at the absolute positions it was
  computed at. Block keys chain from the first token, so a hit is always a prefix starting at
  position 0, and the rope settings are part of the namespace.
- The attention mask given to ``generate`` covers past plus new tokens (the whole prompt): a
  mask of the suffix alone gives silently wrong logits.
- Sliding-window layers: the adapter makes them keep full-length K/V (the model's own sliding
  mask still limits what each query sees, so the logits are the same) and stores only the
  blocks of each saved prefix's last ``sliding_window`` tokens; a loaded window is preceded by
  zeros no query sees.
- State layers: a recurrent state is only worth storing at a block boundary. A model with one
  prefills the prompt up to its last block boundary itself and saves there, then lets
  ``generate`` prefill the rest; decoding saves at every later boundary. A hit whose snapshot
  is gone falls back to the last boundary whose snapshot is stored (the daemon's lookup).
- At least one prompt token is always prefilled: the first generated token needs its logits.
- The device path (``transformers_device.py``, chosen on CUDA): a plain cache in bf16 or fp16
  loads hits through ``EngineCache``, decoding pages on the device into a buffer the cache's
  layers are built from, and saves encode from that buffer; no K/V passes through a host
  tensor on the way in. Caches of groups, and other dtypes, keep the host path: the prefix
  read into host tensors and copied to the model's device, saves copied back to the host.
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
from kvstore.client.groups import GroupCache
from kvstore.errors import InvalidArgument
from kvstore.groups import CacheSpec
from kvstore.integrations.transformers_cache import (
    CacheLayout,
    cache_kwarg,
    extract,
    fill,
    fresh_cache,
    probe_layout,
)
from kvstore.integrations.transformers_device import DeviceKV, device_path_reason
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


def _position_scheme(model: Any) -> str:
    config = _text_config(model)
    rope = {name: getattr(config, name) for name in _ROPE_FIELDS if hasattr(config, name)}
    digest = hashlib.blake2b(json.dumps(rope, sort_keys=True, default=str).encode(),
                             digest_size=8).hexdigest()
    return f"rope/{digest}"


def kv_spec_for(model: Any, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> KVSpec:
    """The KV geometry of a full-attention ``model``'s cache: layers, KV heads, head dim, dtype,
    rope settings."""
    config = _text_config(model)
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return KVSpec(num_layers=config.num_hidden_layers, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, block_tokens=block_tokens, dtype=model.dtype,
                  position_scheme=_position_scheme(model))


def namespace_for(model: Any, *, revision: str, tenant: str = "default",
                  block_tokens: int = DEFAULT_BLOCK_TOKENS, adapter_id: str = "",
                  layout: CacheLayout | None = None) -> Namespace:
    """The namespace of ``model``'s blocks: model id and architecture from its config, its
    cache (a ``KVSpec`` for one kind of full attention, else its groups), the weights
    ``revision``, the ``adapter_id`` (a LoRA's name and version) and the ``tenant``."""
    config = _text_config(model)
    model_id = getattr(model.config, "name_or_path", "") or config.model_type
    architecture = ",".join(getattr(model.config, "architectures", None) or
                            [type(model).__name__])
    layout = layout or probe_layout(model, block_tokens)
    spec: KVSpec | CacheSpec = kv_spec_for(model, block_tokens) if layout.is_plain else \
        CacheSpec(layout.groups, block_tokens, _position_scheme(model))
    return Namespace(model_id=model_id, spec=spec, revision=revision, adapter_id=adapter_id,
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

    def __init__(self, model: Any, client: Client, ns: Namespace, layout: CacheLayout,
                 device_path: bool = False) -> None:
        self.model = model
        self.client = client
        self.namespace = ns
        self.layout = layout
        self.groups = GroupCache(client, ns) if ns.is_grouped else None
        self.device_kv = DeviceKV(client, ns, model.device, model.dtype) if device_path else None
        self.last_stats: GenerateStats | None = None
        self._cache_kwarg = cache_kwarg(model)
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-save")

    @property
    def block_tokens(self) -> int:
        return self.namespace.spec.block_tokens

    def generate(self, inputs: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """``model.generate`` with the same arguments and output, for one unpadded prompt."""
        start = time.perf_counter()
        input_ids = kwargs.pop("input_ids", inputs)
        self._check(input_ids, kwargs)
        prompt = input_ids[0].tolist()
        bt = self.block_tokens
        limit = (len(prompt) - 1) // bt  # blocks before the last prompt token
        hit = self.client.lookup(self.namespace, prompt[:limit * bt]) if limit else None
        cache, per_tier, reused = self._load(prompt, hit)
        run = _Run(self, cache, reused=reused, start=start)
        if self.layout.has_state and (reused or limit):
            self._prefill_states(run, cache, input_ids, reused, limit * bt)
        processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
        processors.append(_StoreHook(run.on_step))
        kwargs.setdefault("attention_mask", torch.ones_like(input_ids))
        try:
            output = self.model.generate(input_ids, logits_processor=processors,
                                         **{self._cache_kwarg: cache}, **kwargs)
        finally:
            num_saved = run.finish()
            if self.device_kv is not None:
                self.device_kv.finish_loads()
        self.last_stats = GenerateStats(
            num_prompt_tokens=len(prompt), num_reused_tokens=run.reused,
            reused_tokens_per_tier=per_tier, num_saved_tokens=num_saved,
            ttft_s=run.ttft_s)
        return output

    def _prefill_states(self, run: _Run, cache: Any, input_ids: torch.Tensor, reused: int,
                        boundary: int) -> None:
        """Prefill a model with state layers up to the prompt's last token, saving the state at
        each block boundary on the way; ``generate`` then prefills that one token.

        From an empty cache the prompt up to its last block boundary goes in one pass. Once a
        state exists (loaded, or that pass's), the rest goes a token at a time: some models'
        multi-token passes ignore the state they start from (transformers' Jamba scan does),
        while their one-token step, the one decoding uses, always continues it.
        """
        start = reused
        if not start:
            self._prefill(cache, input_ids[:, :boundary])
            run.save(input_ids[0, :boundary].tolist())
            start = boundary
        bt = self.block_tokens
        for pos in range(start, input_ids.shape[1] - 1):
            self._prefill(cache, input_ids[:, pos:pos + 1])
            if (pos + 1) % bt == 0:
                run.save(input_ids[0, :pos + 1].tolist())

    def _prefill(self, cache: Any, ids: torch.Tensor) -> None:
        with torch.no_grad():
            self.model(input_ids=ids.to(self.model.device), use_cache=True,
                       **{self._cache_kwarg: cache})

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

    def _load(self, prompt: list[int], hit: Any) -> tuple[Any, dict[str, int], int]:
        """The cache of the stored prefix (empty on a miss), the reused tokens by tier and in
        all."""
        if hit is None or hit.tokens_to_fetch == 0:
            return self._empty(), {}, 0
        if self.groups is not None:
            return self._load_groups(prompt, hit)
        if self.device_kv is not None:
            return self.device_kv.load(prompt, hit)
        kv = self.client.get(self.namespace, prompt[: hit.tokens_to_fetch])
        if kv is None:  # evicted between the lookup and the get
            return self._empty(), {}, 0
        # Per-tier counts describe the whole match; a shorter load (advice, or blocks evicted
        # since the lookup) cannot be split by tier.
        per_tier = dict(hit.tokens_per_tier) if kv.shape[2] == hit.matched_tokens else \
            {"unknown": kv.shape[2]}
        return cache_from_kv(kv.to(self.model.device, self.model.dtype)), per_tier, kv.shape[2]

    def _load_groups(self, prompt: list[int], hit: Any) -> tuple[Any, dict[str, int], int]:
        n = hit.matched_tokens // self.block_tokens  # every group whole at n: all of it
        loaded = self.groups.load(prompt, n)  # type: ignore[union-attr]  # grouped
        if loaded is None:  # a page evicted between the lookup and the load
            return self._empty(), {}, 0
        cache = fresh_cache(self.model)
        fill(cache, self.layout, loaded, n * self.block_tokens, self.model.device)
        return cache, dict(hit.tokens_per_tier), n * self.block_tokens

    def _empty(self) -> Any:
        return fresh_cache(self.model) if self.groups is not None else DynamicCache()

    def close(self) -> None:
        self._saver.shutdown(wait=True)
        if self.device_kv is not None:
            self.device_kv.close()


class _Run:
    """One ``generate`` call's progress: first-token time and the blocks saved so far."""

    def __init__(self, owner: CachedModel, cache: Any, reused: int, start: float):
        self._owner = owner
        self._cache = cache
        self._start = start
        self._saved_upto = reused  # tokens already in kvstore (the loaded prefix)
        self._pending: list[Future[int]] = []
        self.reused = reused
        self.ttft_s = 0.0

    def on_step(self, input_ids: torch.LongTensor) -> None:
        if not self.ttft_s:
            if self._cache_on_cuda():  # the logits are queued, not computed, when this runs
                torch.cuda.synchronize()
            self.ttft_s = time.perf_counter() - self._start
        bt = self._owner.block_tokens
        held = input_ids.shape[1]  # the cache holds every token generate has seen
        if self._owner.layout.has_state and held % bt:
            return  # a state is saved only where it sits on a block boundary
        if held // bt * bt > self._saved_upto:
            self.save(input_ids[0, : held // bt * bt].tolist())

    def save(self, tokens: list[int]) -> None:
        """Save the prefix ``tokens`` (whole blocks) from the cache as it is now."""
        owner = self._owner
        if len(tokens) <= self._saved_upto:
            return
        if owner.device_kv is not None:
            self._save_device(tokens)
        elif owner.groups is None:
            # The cache's tensors are replaced, not written into, as decoding appends, so the
            # copy taken here stays valid while the saver thread sends it.
            kv = kv_from_cache(self._cache, len(tokens))
            self._pending.append(owner._saver.submit(owner.client.put, owner.namespace,
                                                     tokens, kv))
        else:
            # Copied now: states are updated in place by the next step.
            data = extract(self._cache, owner.layout, len(tokens))
            n = len(tokens) // owner.block_tokens
            self._pending.append(owner._saver.submit(owner.groups.save, tokens, n, data))
        self._saved_upto = len(tokens)

    def _save_device(self, tokens: list[int]) -> None:
        """Stage the new tokens into the device buffer now (decoding replaces the cache's
        tensors, the buffer keeps them) and encode them from there on the saver thread."""
        device_kv = self._owner.device_kv
        if device_kv.needs_room(len(tokens)):  # a grown buffer: no save may still read the old
            self.finish()
        first_block = self._saved_upto // self._owner.block_tokens
        ready = device_kv.stage(self._cache, self._saved_upto, len(tokens))
        self._pending.append(self._owner._saver.submit(device_kv.save, tokens, first_block,
                                                       ready))

    def _cache_on_cuda(self) -> bool:
        return self._owner.model.device.type == "cuda"

    def finish(self) -> int:
        """Wait for the saves of this call; returns the tokens they newly wrote."""
        return sum(future.result() for future in self._pending)


def wrap(model: Any, client: Client, *, revision: str, tenant: str = "default",
         block_tokens: int = DEFAULT_BLOCK_TOKENS, adapter_id: str = "",
         device_path: bool | str = "auto") -> CachedModel:
    """Give ``model`` a ``generate`` that reuses prompt prefixes stored in kvstore.

    Args:
        model: a transformers causal LM whose cache is a ``DynamicCache`` (any mix of full,
            sliding, latent, linear-attention and Mamba layers).
        client: a connected :class:`kvstore.client.Client`.
        revision: the weights revision (checkpoint hash); blocks of another revision never match.
        tenant: the kvstore tenant the blocks belong to.
        block_tokens: tokens per stored block.
        adapter_id: the adapter (LoRA) applied and its version; another never matches.
        device_path: load and save through ``EngineCache`` on the model's device ("auto": when
            the model is on CUDA and its cache can; True: always, an error where it cannot, e.g.
            to run it on CPU tensors in Triton's interpreter; False: through host tensors).

    Returns:
        A :class:`CachedModel`; its ``last_stats`` describe the latest ``generate`` call.
    """
    layout = probe_layout(model, block_tokens)
    ns = namespace_for(model, revision=revision, tenant=tenant, block_tokens=block_tokens,
                       adapter_id=adapter_id, layout=layout)
    return CachedModel(model, client, ns, layout, _use_device_path(device_path, model, ns))


def _use_device_path(asked: bool | str, model: Any, ns: Namespace) -> bool:
    if asked not in ("auto", True, False):
        raise InvalidArgument(f'device_path must be "auto", True or False, got {asked!r}')
    if asked is False:
        return False
    spec = None if ns.is_grouped else ns.spec
    reason = device_path_reason(spec, model.device, model.dtype)
    if asked is True and reason is not None:
        raise InvalidArgument(f"device_path=True, but {type(model).__name__} cannot take it: "
                              f"{reason}")
    return reason is None and (asked is True or model.device.type == "cuda")
