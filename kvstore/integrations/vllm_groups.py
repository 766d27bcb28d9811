"""The vLLM connector under vLLM's hybrid allocator: each kv-cache group of the engine as one of
kvstore's cache groups, and the blocks of each a step loads or saves.

vLLM's hybrid KV cache manager (``SupportsHMA``) gives a model one kv-cache group per kind of
layer (``KVCacheConfig.kv_cache_groups``: its layer names and one ``KVCacheSpec``), one
block table per group, and block ids drawn from one pool: layer i of every group reads the
same tensor, a block id is owned by one group at a time. The groups map one to one onto a
``CacheSpec`` (``cache_spec``), in vLLM's order:

- ``FullAttentionSpec`` -> ``attention`` (``head_size`` / ``head_size_v``: K and V dims);
- ``SlidingWindowSpec`` -> ``window`` of ``sliding_window`` tokens: only the blocks holding a
  prefix's last W tokens are stored or loaded. vLLM hands a sliding group the null block
  (``NULL_BLOCK_ID``) for blocks that left its window: those are never written nor saved;
- ``MLAAttentionSpec`` -> ``latent`` (one row of ``head_size`` elements, replicated across TP);
- ``MambaSpec`` -> ``state`` (its ``shapes`` and ``dtypes``, one part each; ``tp_replicated``).

A hit is the daemon's grouped lookup (every group whole at n). Its load follows vLLM's
asynchronous protocol (``get_num_new_matched_tokens`` answers True): vLLM 0.32's scheduler
takes block-level load errors from a model of one group only and raises for several, so the
worker does the load in ``start_load_kv`` and names the request received (``get_finished``),
and failed where a group was not whole (``get_transfer_results``' ``failed_recving``): vLLM
recomputes it, and the scheduler side never offers that request a hit again. A state group
(vLLM's ``mamba_cache_mode="align"``, prefix caching on) keeps the state at block boundary n in
block n - 1 of its table: that block is the snapshot saved, and the one a load writes.

A model of one group keeps the connector's single-group path (its namespace, keys and pages
are exactly what they were). Refused with the spec that was found: quantized caches
(``kv_quant_mode``), chunked local attention (a chunk needs the blocks from its start, not a
window's), sinks, sliding MLA, DeepSeek's sparse and indexer roles. The CPU copies move
``attention``, ``window`` and ``state`` groups (``vllm_copies``); vLLM's CPU backend runs no
MLA. On a GPU, kvstore's kernels (``vllm_kernels``) move ``attention``, ``window`` and
``latent`` groups, and ``EngineStates`` a ``state`` group's snapshots (``vllm_states``: the
layouts vLLM 0.26 and 0.32 register on CUDA, any other refused by name), with the CPU path's
semantics: the snapshot at n out of and into block n - 1, a missing one fails the load and
writes nothing. A GPU load of any group has landed before the step's first layer runs (the
engine's stream waits for it at the end of ``load_all``: vLLM's Mamba layers call no
``wait_for_layer_load``); a GPU save is read out of the engine's blocks on a stream of its own
behind the step, and the engine's next work waits for that read of a state block (vLLM may
free it and hand it to another request from the next step on).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.groups import FLOAT_DTYPES, CacheGroup, CacheSpec, GroupKind, window_blocks
from kvstore.integrations.vllm_copies import (
    block_views,
    gather_blocks,
    gather_state,
    load_blocks,
    load_state,
    state_rows,
)
from kvstore.integrations.vllm_saves import SaveJob, pieces
from kvstore.integrations.vllm_states import StateTransfers
from kvstore.keys import Namespace, block_keys, snapshot_tokens

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

logger = logging.getLogger(__name__)

# vLLM's BlockPool takes the first block of its free queue as the null block
# (``v1/core/block_pool.py``: ``null_block = free_block_queue.popleft()``), so its id is 0 in
# every version this follows (0.26, 0.32, 0.34); a sliding group's block table holds it for the
# blocks outside the window. It is shared by every request: never written, never saved.
NULL_BLOCK_ID = 0

# Builds one group's GPU mover (``vllm_kernels.KernelTransfers``): (group, its namespace, layers).
Kernels = Callable[[CacheGroup, Namespace, list[torch.Tensor]], Any]

# A gather of one group's blocks: ``(bytes it will hold, the gather)``; the gather returns the
# put to queue (``vllm_saves.AsyncSaves.submit``).
Gather = Callable[[], SaveJob]


@functools.cache
def has_transfer_results() -> bool:
    """Whether vLLM takes a failed asynchronous load by request (0.32:
    ``KVConnectorTransferResults.failed_recving`` through ``get_transfer_results``); 0.26
    only by block id."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "get_transfer_results")


def _group_of(spec: KVCacheSpec, num_layers: int) -> CacheGroup:
    """The kvstore group of one vLLM kv-cache group's spec; InvalidArgument for one it cannot
    keep whole."""
    from vllm.v1 import kv_cache_interface as kci

    kind = type(spec).__name__
    quant = getattr(spec, "kv_quant_mode", None)
    if quant is not None and int(quant) != 0:
        raise InvalidArgument(f"kv-cache group {kind} has kv_quant_mode={quant!r}; kvstore's "
                              "vLLM connector stores model-dtype caches")
    unsupported = tuple(getattr(kci, name) for name in (
        "ChunkedLocalAttentionSpec", "SinkFullAttentionSpec", "SlidingWindowMLASpec",
        "CrossAttentionSpec", "EncoderOnlyAttentionSpec") if hasattr(kci, name))
    if isinstance(spec, unsupported):
        raise InvalidArgument(f"kv-cache group {kind} is not mapped onto kvstore's groups")
    if isinstance(spec, kci.MLAAttentionSpec):
        role = getattr(spec, "cache_role", None)
        if role is not None and str(getattr(role, "value", role)) != "sparse":
            raise InvalidArgument(f"MLA kv-cache group of role {role!r} is not mapped")
        return CacheGroup.latent(num_layers, [("kv", spec.head_size, spec.dtype)], name="mla")
    if isinstance(spec, kci.SlidingWindowSpec):
        return CacheGroup.attention(num_layers, spec.num_kv_heads, spec.head_size, spec.dtype,
                                    v_head_dim=spec.head_size_v or spec.head_size,
                                    window_tokens=spec.sliding_window, name="sliding")
    if isinstance(spec, kci.FullAttentionSpec):
        if getattr(spec, "attention_chunk_size", None):
            raise InvalidArgument("chunked local attention is not mapped onto kvstore's groups")
        return CacheGroup.attention(num_layers, spec.num_kv_heads, spec.head_size, spec.dtype,
                                    v_head_dim=spec.head_size_v or spec.head_size, name="full")
    if isinstance(spec, kci.MambaSpec):
        mode = getattr(spec, "mamba_cache_mode", "align")
        if mode != "align":
            # "none" keeps one running state per request, in blocks of another size: no
            # snapshot at a block boundary to store or to load into.
            raise InvalidArgument(f"a Mamba kv-cache group with mamba_cache_mode={mode!r} has "
                                  "no per-block states; enable vLLM's prefix caching "
                                  "(mamba_cache_mode='align') to use kvstore with this model")
        parts = {f"state{i}": (tuple(shape), dtype)
                 for i, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes, strict=True))}
        return CacheGroup.state(num_layers, parts, name="mamba",
                                is_replicated=bool(getattr(spec, "tp_replicated", False)))
    raise InvalidArgument(f"kv-cache group {kind} is not mapped onto kvstore's groups")


def cache_spec(kv_cache_config: KVCacheConfig | None) -> CacheSpec | None:
    """The engine's kv-cache groups as a ``CacheSpec``, one group each, in vLLM's order; None
    for a model of one group (the single-group path) or where vLLM gave no config. The block
    size is the groups' own: vLLM grows it for a Mamba hybrid until an attention page holds a
    state (a Qwen3-Next-shaped model asked for 32 gets 96)."""
    if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) < 2:
        return None
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    sizes = {spec.block_size for spec in specs}
    if len(sizes) != 1:
        raise InvalidArgument(f"kv-cache groups of different block sizes {sorted(sizes)}")
    groups = tuple(_group_of(spec, len(g.layer_names))
                   for spec, g in zip(specs, kv_cache_config.kv_cache_groups, strict=True))
    return CacheSpec(groups, sizes.pop())


def block_bytes(ns: Namespace) -> int:
    """Bytes of one block of every group of ``ns`` (its spec's, for one group)."""
    if not ns.is_grouped:
        return ns.spec.block_bytes
    return sum(ns.cache.storage(g).block_bytes for g in range(len(ns.cache.groups)))


def blocks_to_move(group: CacheGroup, n: int, first: int, block_size: int,
                   block_ids: Sequence[int]) -> list[int]:
    """The block indexes of a prefix of ``n`` blocks that group ``group`` moves from block
    ``first`` on: every one for attention and latent groups; a window's blocks that cover its
    last ``window_tokens`` tokens, minus those vLLM already handed back (the null block);
    the snapshot at n for a state group."""
    if group.is_prefix:
        return list(range(first, n))
    if group.kind is GroupKind.STATE:
        wanted: Sequence[int] = range(max(first, n - 1), n)
    else:
        wanted = window_blocks(n, group.window_tokens, block_size)
    return [b for b in wanted if b >= first and b < len(block_ids)
            and block_ids[b] != NULL_BLOCK_ID]


@dataclass(slots=True)
class _Group:
    """One group's layers on this worker and how its blocks move."""

    group: CacheGroup
    layers: list[torch.Tensor]
    # vllm_kernels.KernelTransfers (vllm_states.StateTransfers for a state group) on a GPU
    # cache; None on the CPU
    kernels: Any = None


class GroupedTransfers:
    """One worker's cache of several groups: each group's loads and saves under its own
    namespace (``Namespace.group``), with that group's block ids.

    Args:
        client: the worker's sync client.
        ns: a grouped namespace of the engine (requests bring their own, same cache).
        layers: each group's per-layer tensors, in the group's layer order.
        kernels: builds a ``KernelTransfers`` for ``(group, its namespace, layers)`` on a
            GPU cache (a state group's snapshots move through ``vllm_states.StateTransfers``
            there); None on the CPU.
        tp_rank: this worker's tensor-parallel rank: a replicated group (an MLA latent, a
            replicated state) is saved by rank 0 alone, the one copy every rank loads.
    """

    def __init__(self, client: Any, ns: Namespace, layers: list[list[torch.Tensor]],
                 kernels: Kernels | None = None, tp_rank: int = 0) -> None:
        cache = ns.cache
        self._client = client
        self._cache = cache
        self._bt = cache.block_tokens
        self._tp_rank = tp_rank
        self._layer_index: dict[str, tuple[int, int]] = {}
        self._received: set[str] = set()  # loads done since take_received
        self._failed: set[str] = set()  # of those, failed, until take_failed
        self._groups: list[_Group] = []
        for g, (group, tensors) in enumerate(zip(cache.groups, layers, strict=True)):
            if kernels is None and group.kind is GroupKind.STATE:
                tensors = _state_rows(group, tensors)
            elif kernels is None and not _is_kv(group):
                raise InvalidArgument(f"{group.label}: kvstore copies vLLM's CPU caches of "
                                      "attention, sliding-window and Mamba groups only")
            elif kernels is None:
                _check_cpu_layers(group, tensors, self._bt)
            if kernels is None:
                moved = None
            elif group.kind is GroupKind.STATE:  # snapshots through EngineStates
                moved = StateTransfers(client, ns, g, tensors)
            else:
                moved = kernels(group, ns.group(g), tensors)
            self._groups.append(_Group(group, tensors, moved))

    @classmethod
    def of(cls, client: Any, ns: Namespace, kv_caches: dict[str, torch.Tensor],
           kv_cache_config: KVCacheConfig, tp_rank: int = 0) -> GroupedTransfers:
        """The tensors vLLM registered (``register_kv_caches``), by group: layer i of a
        group is its pages' layer i; a GPU cache moves through kvstore's kernels."""
        from kvstore.integrations.vllm_kernels import KernelTransfers

        names = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
        missing = [n for group in names for n in group if n not in kv_caches]
        if missing:
            raise InvalidArgument(f"kv-cache group layers {missing[:4]} were not registered")
        layers = [[kv_caches[n] for n in group] for group in names]
        first = layers[0][0]  # vLLM 0.26 registers a state layer as a list of its parts
        on_gpu = (first[0] if isinstance(first, (list, tuple)) else first).device.type == "cuda"

        def kernels(group: CacheGroup, gns: Namespace, tensors: list[torch.Tensor]
                    ) -> KernelTransfers:
            layout = "mla" if group.kind is GroupKind.LATENT else "attention"
            return KernelTransfers(client, gns, tensors, layout=layout)

        out = cls(client, ns, layers, kernels if on_gpu else None, tp_rank)
        out._layer_index = {n: (g, i) for g, group in enumerate(names)
                            for i, n in enumerate(group)}
        return out

    @property
    def kernel_transfers(self) -> list[Any]:
        return [g.kernels for g in self._groups if g.kernels is not None]

    def _views(self, g: int) -> list[torch.Tensor]:
        return block_views(self._groups[g].layers, self._cache.storage(g))

    def _snapshot(self, gns: Namespace, token_ids: np.ndarray, n: int) -> list[bytes]:
        return block_keys(gns, token_ids[:n * self._bt])

    # --------------------------------------------------------------------------- loads

    def load_all(self, loads: Sequence[Any], namespace: Callable[[Any], Namespace],
                 counts: dict[str, int], errors: set[int]) -> None:
        """The step's loads (the connector's ``BlockTransfer``s; ``namespace`` gives each
        its namespace), done now under vLLM's asynchronous protocol: each request is
        received (``take_received``), and failed (``take_failed``) where a group is not whole;
        ``counts`` gets the blocks loaded or not. On a GPU cache they have landed when this
        returns, before vLLM is told."""
        if not loads:
            return
        self.start()
        for load in loads:
            try:
                ok = self.load(namespace(load), load.token_ids, load.groups or [],
                               load.first_block)
            except KVStoreError as exc:
                logger.warning("kvstore load of %s failed: %s", load.req_id, exc)
                ok = False
            counts["loaded_blocks" if ok else "load_error_blocks"] += \
                len(load.block_ids) - load.first_block
            self._received.add(load.req_id)
            if not ok:
                self._failed.add(load.req_id)
                if not has_transfer_results():  # vLLM 0.26: told as the first group's blocks
                    errors.update(load.block_ids[load.first_block:])
        self.finish()

    def take_received(self) -> set[str] | None:
        """Requests whose loads were done since the last call (failed ones too), or None."""
        received, self._received = self._received, set()
        return received or None

    def take_failed(self) -> set[str]:
        """Of those, the requests whose loads failed: vLLM recomputes them whole."""
        failed, self._failed = self._failed, set()
        return failed

    def load(self, ns: Namespace, token_ids: np.ndarray, block_ids: Sequence[Sequence[int]],
             first_block: int) -> bool:
        """Copy what a prefix of ``len(token_ids) // block_size`` blocks needs, from block
        ``first_block`` on, into each group's blocks; True once every group is whole (a page
        gone since the lookup: False, and the caller recomputes the request)."""
        n = len(token_ids) // self._bt
        for g, entry in enumerate(self._groups):
            gns = ns.group(g)
            ids = block_ids[g]
            blocks = blocks_to_move(entry.group, n, first_block, self._bt, ids)
            if entry.group.is_prefix:
                if len(ids) < n or self._load_run(g, gns, token_ids[:n * self._bt], list(ids[:n]),
                                                  first_block) < n:
                    return False
                continue
            if len(blocks) != len(self._needed(entry.group, n, first_block)):
                return False  # the engine holds no block for one the prefix needs
            if isinstance(entry.kernels, StateTransfers):
                if blocks and not entry.kernels.load(gns, token_ids[:n * self._bt], n,
                                                     ids[n - 1]):
                    return False
                continue
            chain = self._snapshot(gns, token_ids, n)
            for b in blocks:
                tokens = snapshot_tokens(chain[b], self._bt)
                if self._load_run(g, gns, tokens, [ids[b]], 0) < 1:
                    return False
        return True

    def _needed(self, group: CacheGroup, n: int, first: int) -> list[int]:
        if group.kind is GroupKind.STATE:
            return [b for b in range(n - 1, n) if b >= first]
        return [b for b in window_blocks(n, group.window_tokens, self._bt) if b >= first]

    def _load_run(self, g: int, gns: Namespace, token_ids: np.ndarray, block_ids: list[int],
                  first_block: int) -> int:
        kernels = self._groups[g].kernels
        if kernels is not None:
            return kernels.load(gns, token_ids, block_ids, first_block)
        if self._groups[g].group.kind is GroupKind.STATE:
            return load_state(self._client, gns, self._groups[g].layers, token_ids, block_ids[0])
        return load_blocks(self._client, gns, self._views(g), token_ids, block_ids, first_block)

    def wait_for_layer(self, layer_name: str) -> None:
        """The engine's stream waits for this layer of the step's loads (GPU caches)."""
        g, layer = self._layer_index.get(layer_name, (0, -1))
        kernels = self._groups[g].kernels
        if kernels is not None and layer >= 0:
            kernels.wait_for_layer(layer)

    # --------------------------------------------------------------------------- saves

    def gathers(self, req_id: str, ns: Namespace, token_ids: np.ndarray,
                block_ids: Sequence[Sequence[int]], first_block: int, stored: Any = None
                ) -> list[tuple[int, Gather]]:
        """The puts that make a prefix of ``len(token_ids) // block_size`` blocks whole from
        block ``first_block`` on, ``(bytes, gather)`` each: a prefix group's new blocks behind
        its stored ones in pieces (``vllm_saves.pieces``), a window group's blocks of the
        window (one page each), never a null block. The first prefix group's pieces carry
        vLLM's stored-block events (``stored``: ``StoredBlocks``)."""
        n = len(token_ids) // self._bt
        out: list[tuple[int, Gather]] = []
        for g, entry in enumerate(self._groups):
            gns = ns.group(g)
            ids = list(block_ids[g][:n])
            blocks = blocks_to_move(entry.group, n, first_block, self._bt, ids)
            if not blocks or entry.group.is_replicated and self._tp_rank != 0:
                continue
            block_bytes = gns.spec.block_bytes
            if entry.group.is_prefix:
                for start, end in pieces(n - first_block, block_bytes):
                    lo, hi = first_block + start, first_block + end
                    event = stored.event(lo, hi) if stored is not None else None

                    def gather(g=g, gns=gns, ids=ids, lo=lo, hi=hi, event=event) -> SaveJob:
                        return self._gather(g, req_id, gns, token_ids[:hi * self._bt], ids[:hi],
                                            lo, event)

                    out.append(((hi - lo) * block_bytes, gather))
                stored = None
                continue
            if isinstance(entry.kernels, StateTransfers):  # blocks is [n - 1]
                def gather_state(moved=entry.kernels, gns=gns, block_id=ids[n - 1]) -> SaveJob:
                    return moved.gather(req_id, gns, token_ids[:n * self._bt], n, block_id)

                out.append((block_bytes, gather_state))
                continue
            chain = self._snapshot(gns, token_ids, n)
            for b in blocks:
                tokens = snapshot_tokens(chain[b], self._bt)

                def gather_one(g=g, gns=gns, tokens=tokens, block_id=ids[b]) -> SaveJob:
                    return self._gather(g, req_id, gns, tokens, [block_id], 0, None)

                out.append((block_bytes, gather_one))
        return out

    def _gather(self, g: int, req_id: str, gns: Namespace, tokens: np.ndarray,
                block_ids: list[int], first: int, event: object) -> SaveJob:
        kernels = self._groups[g].kernels
        if kernels is not None:
            return kernels.gather(req_id, gns, tokens, block_ids, first, event)
        if self._groups[g].group.kind is GroupKind.STATE:
            kv = gather_state(self._groups[g].layers, gns.spec, block_ids[0])
            return SaveJob(req_id, gns, tokens, kv, 0, event=event)
        kv = gather_blocks(self._views(g), gns.spec, block_ids[first:])
        return SaveJob(req_id, gns, tokens, kv, first, event=event)

    def start(self) -> None:
        for kernels in self.kernel_transfers:
            kernels.start()

    def finish(self) -> None:
        for kernels in self.kernel_transfers:
            kernels.finish()

    def close(self) -> None:
        for kernels in self.kernel_transfers:
            kernels.close()


def _is_kv(group: CacheGroup) -> bool:
    """Whether ``group`` is K and V alike in one float dtype (attention or a window): what
    vLLM's CPU backend keeps per layer, and its pages' canonical layout."""
    k = group.parts[0]
    return group.kind in (GroupKind.ATTENTION, GroupKind.WINDOW) and len(group.parts) == 2 \
        and group.parts[1].shape == k.shape and k.dtype == group.parts[1].dtype \
        and k.dtype in FLOAT_DTYPES and len(k.shape) == 2


def _state_rows(group: CacheGroup, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A CPU state group's layers as rows of their state bytes (``vllm_copies.state_rows``);
    InvalidArgument names the first layer whose page is not the group's states."""
    num_bytes = group.block_bytes_per_layer(1)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"{group.label} layer {i}: registered a {type(t).__name__}; "
                                  f"kvstore reads vLLM's CPU state pages [num_blocks, 1, 1, "
                                  f"{num_bytes} bytes]")
        if t.dim() != 4 or t.shape[1:3] != (1, 1) or t.shape[3] * t.element_size() != num_bytes \
                or t.stride(-1) != 1 or t.device.type != "cpu":
            raise InvalidArgument(
                f"{group.label} layer {i}: cache {tuple(t.shape)} {t.dtype} strides "
                f"{t.stride()} on {t.device}; kvstore reads vLLM's CPU state pages "
                f"[num_blocks, 1, 1, {num_bytes} bytes]")
    return state_rows(tensors, num_bytes)


def _check_cpu_layers(group: CacheGroup, tensors: list[torch.Tensor], block_size: int) -> None:
    """Each layer is vLLM's CPU ``[num_blocks, H, block_size, 2 * head_dim]``; InvalidArgument
    names the first that is not."""
    k = group.parts[0]
    expected = (k.shape[0], block_size, 2 * k.shape[1])
    for i, tensor in enumerate(tensors):
        if tensor.dim() != 4 or tuple(tensor.shape[1:]) != expected \
                or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise InvalidArgument(
                f"{group.label} layer {i}: cache {tuple(tensor.shape)} strides "
                f"{tensor.stride()} on {tensor.device}; kvstore reads vLLM's CPU layout "
                f"[num_blocks, {expected[0]}, {expected[1]}, {expected[2]}]")

