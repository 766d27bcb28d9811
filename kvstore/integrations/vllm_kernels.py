"""The vLLM connector's worker side on a GPU cache: loads and saves through ``EngineCache``'s
kernels, on streams of the connector's own, never through per-block copies.

What vLLM 0.26 registers on CUDA (its FlashAttention, Triton and FlashInfer backends alike, read
from ``get_kv_cache_shape`` and ``get_kv_cache_stride_order``): per attention layer a tensor of
logical shape ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, K in the first
``head_dim`` of the last dim, whose memory order is ``[num_blocks, block_size, num_kv_heads,
2 * head_dim]`` under the default NHD cache layout (its strides say so; HND keeps the logical
order). That is ``EngineLayout``'s ``fused_hnd`` roles with the tensor's own strides, so
either cache layout is read as it lies.

- Loads: ``start`` makes the load stream wait for what the engine queued so far (the pages
  it writes into may have been read by the last step), each load is one acquire on the
  worker's thread and one launch per layer on the load stream, and ``wait_for_layer(i)``
  makes the engine's stream wait for layer i alone: layer 0 computes while later layers
  land. ``finish`` makes the engine's stream wait for every load of the step.
- Saves: ``gather`` queues, on the save stream behind the step's forward pass, one encode of
  the blocks into device staging, one reordering copy and one copy over the link into pinned
  host memory, and returns at once; the put waits for that copy's event on the save thread
  (``vllm_saves``). A request's blocks stay the engine's until its puts are done
  (``get_finished``), so nothing overwrites them while the copy runs.
"""

from __future__ import annotations

import contextlib

import torch

from kvstore.client.engine import EngineCache, LoadHandle
from kvstore.engine_fp8 import Fp8Cache
from kvstore.errors import InvalidArgument
from kvstore.groups import CacheGroup, CacheSpec
from kvstore.integrations.vllm_fp8 import FP8_CACHE_TENSOR_DTYPES
from kvstore.integrations.vllm_saves import SaveJob
from kvstore.keys import Namespace

VLLM_GPU_LAYOUT = "fused_hnd"  # logical [num_blocks, H, block_size, 2D], any memory order
# vLLM's MLA backends: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] per layer,
# the latent then its rope part. As [num_blocks, block_size, 1, 2 * half] it is the
# ``fused_nhd`` layout of one head whose "K" is the row's first half and "V" its second: exactly
# how a latent cache group's pages hold a row (``CacheGroup`` "rows" storage), so the existing
# kernels move it, raw or through any codec a latent group allows.
MLA_LAYOUT = "fused_nhd"
# An fp8 MLA cache ([num_blocks, block_size, 576] uint8, one per-tensor scale) is one latent
# part of fp8 bytes, stored as the group's bytes: a block's rows back to back, the first half of
# them as "K", the rest as "V" (``CacheGroup`` "bytes" storage). Seen as [num_blocks, 2,
# block_size, 1, width / 2] it is the ``flashinfer`` layout of that, and the byte kernel copies
# each (layer, half) slab as one run.
MLA_FP8_LAYOUT = "flashinfer"


def mla_namespace(*, model_id: str, revision: str, tenant: str, num_layers: int,
                  kv_lora_rank: int, rope_dim: int, block_tokens: int, dtype,
                  tp_rank: int = 0, tp_size: int = 1, adapter_id: str = "",
                  extra_salt: str = "", fp8: Fp8Cache | None = None) -> Namespace:
    """The namespace of an MLA model's cache: one latent group (``kv`` then ``pe``),
    replicated across tensor-parallel ranks, so its pages (``.group(0)``) are keyed without
    the rank and TP=8 stores and moves one copy. ``fp8``: the cache is fp8 bytes, one
    ``latent`` part of the whole row (bind its scales before taking ``.group(0)``:
    ``fp8.bind(ns).group(0)``)."""
    if fp8 is not None:
        parts = [("latent", kv_lora_rank + rope_dim, fp8.torch_dtype)]
    else:
        parts = [("kv", kv_lora_rank, dtype), ("pe", rope_dim, dtype)]
    group = CacheGroup.latent(num_layers, parts)
    return Namespace(model_id=model_id, spec=CacheSpec((group,), block_tokens),
                     revision=revision, adapter_id=adapter_id, tenant=tenant, tp_rank=tp_rank,
                     tp_size=tp_size, extra_salt=extra_salt)


def check_mla_layers(named: list[tuple[str, torch.Tensor]], block_size: int, width: int) -> None:
    """Each registered layer is vLLM's MLA ``[num_blocks, block_size, width]`` with
    contiguous rows; InvalidArgument names the first that is not (DeepSeek's fp8_ds_mla with
    scales inside each row, a sparse indexer's cache)."""
    for name, tensor in named:
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != (block_size, width) \
                or tensor.stride(-1) != 1 or tensor.stride(1) != width or tensor.dtype not in (
                    torch.bfloat16, torch.float16, *FP8_CACHE_TENSOR_DTYPES):
            raise InvalidArgument(
                f"layer {name}: MLA cache {tuple(tensor.shape)} strides {tensor.stride()} "
                f"{tensor.dtype}; kvstore reads vLLM's [num_blocks, {block_size}, {width}] "
                "latent cache in bf16, fp16 or fp8 (uint8)")


def check_gpu_layers(named: list[tuple[str, torch.Tensor]], num_kv_heads: int, block_size: int,
                     head_dim: int) -> None:
    """Each registered layer is vLLM's ``[num_blocks, H, block_size, 2 * head_dim]`` with a
    contiguous last dim; InvalidArgument names the first that is not (an MLA latent cache,
    fp8 with inline scales, another backend's layout)."""
    expected = (num_kv_heads, block_size, 2 * head_dim)
    for name, tensor in named:
        if tensor.dim() != 4 or tuple(tensor.shape[1:]) != expected or tensor.stride(-1) != 1:
            raise InvalidArgument(
                f"layer {name}: cache {tuple(tensor.shape)} strides {tensor.stride()} "
                f"{tensor.dtype} on {tensor.device}; kvstore reads vLLM's GPU layout "
                f"[num_blocks, {expected[0]}, {expected[1]}, {expected[2]}] (K then V in the "
                "last dim) of a full-attention model")


class KernelTransfers:
    """One worker's GPU cache registered with kvstore, and the step's loads in flight.

    Args:
        client: the worker's sync client (acquires and late releases).
        ns: a namespace of the cache's geometry (requests bring their own, same spec); for
            an MLA cache, its latent group's (``mla_namespace(...).group(0)``).
        layers: the per-layer tensors in layer order.
        layout: "attention" (K and V side by side) or "mla" (a latent row per token).
        fp8: an fp8 cache's flavour and scales, bound into ``ns`` (``vllm_fp8``).
    """

    def __init__(self, client, ns: Namespace, layers: list[torch.Tensor],
                 layout: str = "attention", fp8: Fp8Cache | None = None) -> None:
        if layout == "mla" and fp8 is not None:
            halves = [t.view(t.shape[0], 2, t.shape[1], 1, t.shape[2] // 2) for t in layers]
            self.cache = EngineCache(client, ns, halves, layout=MLA_FP8_LAYOUT, fp8=fp8)
        elif layout == "mla":
            self.cache = EngineCache(client, ns, [t.unsqueeze(2) for t in layers],
                                     layout=MLA_LAYOUT)
        else:
            self.cache = EngineCache(client, ns, layers, layout=VLLM_GPU_LAYOUT, fp8=fp8)
        self._block_tokens = ns.spec.block_tokens
        device = self.cache.layout.device
        self._cuda = device.type == "cuda"
        self._load_stream = torch.cuda.Stream(device) if self._cuda else None
        self._save_stream = torch.cuda.Stream(device) if self._cuda else None
        self._loads: list[LoadHandle] = []

    def _engine_stream(self):
        return torch.cuda.current_stream(self.cache.layout.device) if self._cuda else None

    def start(self) -> None:
        """Before the step's loads: they run behind what the engine queued so far."""
        if self._cuda:
            self._load_stream.wait_stream(self._engine_stream())

    def load(self, ns: Namespace, token_ids: list[int], block_ids: list[int],
             first_block: int) -> int:
        """Launch the load of blocks ``first_block ..`` of ``token_ids`` into ``block_ids``;
        returns how many blocks, counted from the first, will be valid once it landed."""
        handle = self.cache.load(token_ids, block_ids, self._load_stream, layerwise=True,
                                 advice=False, first_block=first_block, ns=ns)
        if handle.matched_tokens:
            self._loads.append(handle)
        return handle.matched_tokens // self._block_tokens

    def wait_for_layer(self, layer: int) -> None:
        """The engine's stream waits until layer ``layer`` of every load of the step landed."""
        for handle in self._loads:
            handle.wait_for_layer(layer, self._engine_stream())

    def finish(self) -> None:
        """The engine's stream waits for every load of the step; the loads are forgotten
        (their leases go back as they land, on the cache's own worker)."""
        loads, self._loads = self._loads, []
        if not self._cuda:
            return
        stream = self._engine_stream()
        for handle in loads:
            handle.wait_for_layer(self.cache.layout.num_layers - 1, stream)

    def gather(self, req_id: str, ns: Namespace, token_ids: list[int], block_ids: list[int],
               first_block: int, event: object = None) -> SaveJob:
        """Queue the copy-out of blocks ``first_block ..`` behind the step's forward pass;
        the job's put waits for its ``ready`` event."""
        # The engine's stream is taken before the save stream becomes current: inside the
        # block, current_stream() is the save stream, and waiting on it would order nothing.
        stream, engine = self._save_stream, self._engine_stream()
        with torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext():
            if self._cuda:
                stream.wait_stream(engine)
            kv, ready = self.cache.gather(block_ids[first_block:], stream)
        return SaveJob(req_id, ns, token_ids, kv, first_block, ready, event)

    def close(self) -> None:
        self.cache.close()
