"""A transformers ``Cache`` read as kvstore cache groups: which layer feeds which group, read
from the model's own config and cache layer classes (never from model names), and the moves
between a cache and the groups' tensors.

One short forward pass on a fresh ``DynamicCache(config=...)`` shows every layer's kind and
geometry: a layer with K/V (``DynamicLayer``) is attention; one that is ``is_sliding`` with a
``sliding_window`` is a window; one with conv and recurrent states (the linear-attention
layers of gated delta nets and Mamba) is a state; a layer holding neither (a KV-sharing
consumer, a dummy) has nothing to store. An attention layer of one head whose K width is the
config's ``kv_lora_rank`` holds MLA's compressed latent (K: the latent, V: the rope part): a
latent group, the same on every tensor-parallel rank. Layers alike in kind, geometry and dtype
form one group, in the order they first appear.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvstore.errors import InvalidArgument
from kvstore.groups import CacheGroup, CachePart, GroupKind, group_dtype


@dataclass(slots=True)
class _Signature:
    kind: GroupKind
    geometry: tuple
    layers: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The groups of a model's cache and the cache layers that feed each."""

    groups: tuple[CacheGroup, ...]
    layers: tuple[tuple[int, ...], ...]  # per group, the cache layer indices, in order

    @property
    def has_state(self) -> bool:
        return any(g.kind is GroupKind.STATE for g in self.groups)

    @property
    def is_plain(self) -> bool:
        """One full-attention group over every layer with K and V alike: a ``KVSpec``."""
        return len(self.groups) == 1 and self.groups[0].is_plain_kv


def _text_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _has_kv(layer: Any) -> bool:
    keys = getattr(layer, "keys", None)
    return isinstance(keys, torch.Tensor) and keys.numel() > 0


def _states(layer: Any) -> list[tuple[str, torch.Tensor]]:
    """A linear-attention layer's states as (part name, tensor of a batch of one)."""
    out = []
    for kind, states in (("conv", getattr(layer, "conv_states", None)),
                         ("rec", getattr(layer, "recurrent_states", None))):
        for idx, tensor in (states or {}).items():
            if isinstance(tensor, torch.Tensor):
                out.append((f"{kind}{idx}", tensor))
    return out


def probe_layout(model: Any, block_tokens: int) -> CacheLayout:
    """The cache groups of ``model``, read from one forward pass of ``block_tokens`` tokens."""
    cache = fresh_cache(model, keep_sliding=True)
    ids = torch.zeros((1, block_tokens), dtype=torch.long, device=model.device)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    except (ValueError, TypeError, NotImplementedError) as exc:  # a model with a cache of its own
        raise InvalidArgument(f"{type(model).__name__} does not fill a DynamicCache, which the "
                              f"adapter reads its cache groups from: {exc}") from None
    latent_rank = getattr(_text_config(model), "kv_lora_rank", None)
    found: dict[tuple, _Signature] = {}
    for index, layer in enumerate(cache.layers):
        for sig in _signatures(layer, latent_rank):
            found.setdefault((sig.kind, sig.geometry), sig).layers.append(index)
    if not found:
        raise InvalidArgument(f"{type(model).__name__} stored nothing in a DynamicCache, which "
                              "the adapter reads its cache groups from")
    groups, members = [], []
    for sig in found.values():
        name = _group_name(sig)
        groups.append(_group(sig, name))
        members.append(tuple(sig.layers))
    return CacheLayout(tuple(groups), tuple(members))


def _signatures(layer: Any, latent_rank: int | None) -> list[_Signature]:
    sigs = []
    states = _states(layer)
    if states:
        sigs.append(_Signature(GroupKind.STATE, tuple(
            (name, tuple(t.shape[1:]), group_dtype(t.dtype)) for name, t in states)))
    if _has_kv(layer):
        _, heads, _, k_dim = layer.keys.shape
        v_dim = layer.values.shape[-1]
        dtype = group_dtype(layer.keys.dtype)
        window = getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) \
            else None
        if window:
            sigs.append(_Signature(GroupKind.WINDOW, (heads, k_dim, v_dim, dtype, int(window))))
        elif latent_rank and heads == 1 and k_dim == latent_rank:
            sigs.append(_Signature(GroupKind.LATENT, (k_dim, v_dim, dtype)))
        else:
            sigs.append(_Signature(GroupKind.ATTENTION, (heads, k_dim, v_dim, dtype)))
    return sigs


def _group_name(sig: _Signature) -> str:
    layers = ",".join(map(str, sig.layers))
    if len(layers) > 48:  # names are fingerprinted and kept short
        layers = hashlib.blake2b(layers.encode(), digest_size=8).hexdigest()
    return f"layers:{layers}"


def _group(sig: _Signature, name: str) -> CacheGroup:
    count = len(sig.layers)
    if sig.kind is GroupKind.STATE:
        parts = tuple(CachePart(n, shape, dtype) for n, shape, dtype in sig.geometry)
        return CacheGroup(GroupKind.STATE, count, parts, name=name)
    if sig.kind is GroupKind.LATENT:
        k_dim, v_dim, dtype = sig.geometry
        return CacheGroup.latent(count, [("kv", k_dim, dtype), ("pe", v_dim, dtype)], name=name)
    heads, k_dim, v_dim, dtype = sig.geometry[:4]
    window = sig.geometry[4] if sig.kind is GroupKind.WINDOW else 0
    return CacheGroup.attention(count, heads, k_dim, dtype, v_head_dim=v_dim,
                                window_tokens=window, name=name)


def cache_kwarg(model: Any) -> str:
    """What ``forward`` and ``generate`` call the cache: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def fresh_cache(model: Any, keep_sliding: bool = False) -> DynamicCache:
    """The model's own cache, with sliding-window layers made full-length (unless
    ``keep_sliding``): a window's blocks are read from it at block boundaries, which can lie
    before the last ``sliding_window - 1`` tokens the sliding layer keeps; the model's sliding
    mask, built from the config, still limits what each query sees."""
    cache = DynamicCache(config=model.config)
    if not keep_sliding:
        for i, layer in enumerate(cache.layers):
            if type(layer).__name__ == "DynamicSlidingWindowLayer":
                cache.layers[i] = DynamicLayer()
    return cache


def extract(cache: DynamicCache, layout: CacheLayout, num_tokens: int
            ) -> list[dict[str, torch.Tensor]]:
    """Each group's tensors of the first ``num_tokens`` tokens (states as they are now: the
    caller takes them at a block boundary), copied to CPU."""
    data = []
    for group, members in zip(layout.groups, layout.layers):
        layers = [cache.layers[i] for i in members]
        if group.kind is GroupKind.STATE:
            data.append({p.name: torch.stack([dict(_states(layer))[p.name][0]
                                              for layer in layers]).cpu().clone()
                         for p in group.parts})
            continue
        keys = torch.stack([layer.keys[0, :, :num_tokens] for layer in layers])
        values = torch.stack([layer.values[0, :, :num_tokens] for layer in layers])
        if group.kind is GroupKind.LATENT:  # one head: [L, T, width]
            data.append({"kv": keys[:, 0].cpu(), "pe": values[:, 0].cpu()})
        else:  # [L, H, T, D] -> [L, T, H, D]
            data.append({"k": keys.permute(0, 2, 1, 3).cpu(), "v": values.permute(0, 2, 1, 3).cpu()})
    return data


def fill(cache: DynamicCache, layout: CacheLayout, loaded: list[Any], num_tokens: int,
         device: torch.device) -> None:
    """Put loaded groups (``kvstore.client.groups.LoadedGroup``) into an empty ``cache`` as
    the state after ``num_tokens`` tokens. A window's tokens before its first block are zeros:
    no query from ``num_tokens`` on sees them."""
    for group, members, got in zip(layout.groups, layout.layers, loaded):
        parts = got.parts
        for j, index in enumerate(members):
            layer = cache.layers[index]
            if group.kind is GroupKind.STATE:
                _fill_state(layer, {p.name: parts[p.name][j] for p in group.parts}, num_tokens,
                            device)
                continue
            if group.kind is GroupKind.LATENT:
                k, v = parts["kv"][j][None, None], parts["pe"][j][None, None]
            else:
                k = parts["k"][j].permute(1, 0, 2)[None]
                v = parts["v"][j].permute(1, 0, 2)[None]
            if got.first_token:
                k = torch.cat((k.new_zeros(*k.shape[:2], got.first_token, k.shape[3]), k), dim=2)
                v = torch.cat((v.new_zeros(*v.shape[:2], got.first_token, v.shape[3]), v), dim=2)
            layer.update(k.to(device).contiguous(), v.to(device).contiguous())


def _fill_state(layer: Any, parts: dict[str, torch.Tensor], num_tokens: int,
                device: torch.device) -> None:
    for name, tensor in parts.items():
        idx = int(name[4:] if name.startswith("conv") else name[3:])
        value = tensor[None].to(device)
        if name.startswith("conv"):
            layer.lazy_initialization(conv_states=value, state_idx=idx,
                                      conv_kernel_size=value.shape[-1])
            layer.conv_states[idx].copy_(value)
        else:
            layer.lazy_initialization(recurrent_states=value, state_idx=idx)
            layer.recurrent_states[idx].copy_(value)
        layer.has_previous_state[idx] = True  # the next forward continues from this state
    if hasattr(layer, "cumulative_length_linear"):  # transformers 5.24 on counts tokens here
        layer.cumulative_length_linear.fill_(num_tokens)
