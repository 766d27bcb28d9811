"""SGLang HiCache L3 backend: host-pool pages are stored in and loaded from the kvstore daemon.

Enable it with SGLang's dynamic backend option::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang", "class_name": "KVStoreHiCache",
        "interface_v1": 1, "hicache_storage_pass_prefix_keys": true,
        "address": "unix:///run/kvstore/kvstore.sock", "revision": "abc123"}'

Supported: SGLang 0.5.23's ``HiCacheStorage`` v1 interface (``sglang.srt.mem_cache.hicache_storage``:
``batch_exists``, ``batch_get_v1``, ``batch_set_v1``) with an MHA host pool in the
``page_first`` or ``page_first_direct`` layout, whose ``get_page_buffer_meta`` gives two
pointers per page, K then V, each to ``page_size x num_layers x num_kv_heads x head_dim``
contiguous elements. The pre-v1 calls (``get``, ``set``, ``exists`` and their batches without
host indices) are refused: they carry no prefix keys.

SGLang's page keys are hashes of the whole prefix up to their page, and with
``hicache_storage_pass_prefix_keys`` each batch call also carries the keys of the pages before
it from the sequence start (``HiCacheStorageExtraInfo.prefix_keys``). kvstore stores a sequence's
pages as one chain of blocks, block ``i`` under the token ids of page key ``i`` (the key's hash
expanded to ``page_size`` ids), so a batch is one prefix: ``batch_exists`` is one Lookup,
``batch_get_v1`` one lease whose pages from the batch's first are copied straight from the
shared DRAM arena into the host pages, ``batch_set_v1`` one reservation for the batch's pages
behind the stored prefix (a page whose prefix kvstore does not hold is not stored: no prefix
lookup could reach it). Pages move through the client's zero-copy path on the daemon's host.

An MLA host pool (``MLATokenToKVPoolHost``, ``page_first`` or ``page_first_direct``) is stored
as one replicated ``latent`` cache group (``kvstore.integrations.sglang_mla``): keyed without
the tensor-parallel rank, written by SGLang's storage writer only (``is_storage_writer``: rank
0, as SGLang's own cache controller skips the backup on the other ranks) and loaded by every
rank. Decode context parallelism (``dcp_size > 1``, each rank a slice of every page) is refused.

A hybrid model's Mamba and SWA host pools (``register_mem_host_pool_v2``, moved by SGLang's v2
batch calls) are cache groups behind the anchor pool's (``kvstore.integrations.sglang_hybrid``):
a ``state`` group and a ``window`` group (``"swa_window_tokens"`` in the extra config names the
window), the namespace binding every pool's geometry; ``batch_exists_v2`` is one grouped Lookup.
Draft, indexer and DeepSeek V4's compressed pools are refused. The pipeline stage and the
attention context-parallel rank are part of the key where there are several.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolTransfer,
    PoolTransferResult,
)

from kvstore.client import Client
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.groups import CacheGroup, CacheSpec
from kvstore.integrations.sglang_hybrid import KV as KV_POOL
from kvstore.integrations.sglang_hybrid import MAMBA, SWA, HybridPools
from kvstore.integrations.sglang_mla import MLAPages, is_mla_pool, latent_cache
from kvstore.keys import Namespace
from kvstore.spec import KVSpec

logger = logging.getLogger(__name__)

SUPPORTED_LAYOUTS = ("page_first", "page_first_direct")
HYBRID_POOLS = (MAMBA, SWA)  # the v2 pools kvstore stores as cache groups


def page_tokens(key: str, page_size: int) -> np.ndarray:
    """The token ids a SGLang page key is stored under: its hash, expanded to a page."""
    digest = hashlib.shake_128(key.encode()).digest(4 * page_size)
    return np.frombuffer(digest, dtype="<u4")


def _host_view(ptr: int, num_bytes: int, dtype: torch.dtype, shape: tuple[int, ...]
               ) -> torch.Tensor:
    """A tensor over ``num_bytes`` of host memory at ``ptr`` (no copy; the pool owns it)."""
    buffer = (ctypes.c_char * num_bytes).from_address(ptr)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


class KVStoreHiCache(HiCacheStorage):
    """A ``HiCacheStorage`` over the kvstore daemon; see the module docstring.

    SGLang constructs it as ``(storage_config, kwargs)`` and then calls
    :meth:`register_mem_pool_host`; the batch methods run on its storage threads.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self._config = storage_config
        self._extra = extra
        self._client = Client(extra.get("address"), token=extra.get("token"))
        self.namespace: Namespace | None = None
        self._mla: MLAPages | None = None  # set for an MLA host pool
        self._anchor: CacheGroup | None = None  # the anchor pool's group
        self._salt = ""  # the anchor's part of the namespace salt
        self._hybrid: HybridPools | None = None  # set once a Mamba or SWA pool registers

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take the host pool's geometry for the namespace; refuse layouts this cannot read."""
        if is_mla_pool(mem_pool_host):
            self._register_mla(mem_pool_host)
            return
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise InvalidArgument(f"host pool layout {layout!r}: kvstore reads {SUPPORTED_LAYOUTS}")
        if not all(hasattr(mem_pool_host, a) for a in ("layer_num", "head_num", "head_dim")):
            # e.g. DeepSeek V4's compressed pools: neither an MHA nor an MLA host pool.
            raise InvalidArgument(f"host pool {type(mem_pool_host).__name__}: kvstore's HiCache "
                                  "backend reads MHA and MLA host pools only")
        super().register_mem_pool_host(mem_pool_host)
        spec = KVSpec(num_layers=mem_pool_host.layer_num, num_kv_heads=mem_pool_host.head_num,
                      head_dim=mem_pool_host.head_dim, block_tokens=mem_pool_host.page_size,
                      dtype=mem_pool_host.dtype)
        self._anchor = CacheGroup.attention(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                            spec.dtype, name="kv")
        self._salt = f"sglang/{layout}"
        self.namespace = self._namespace(spec)

    def _namespace(self, spec: KVSpec | CacheSpec) -> Namespace:
        return Namespace(
            model_id=self._config.model_name or "sglang", spec=spec,
            revision=str(self._extra.get("revision", "main")),
            tenant=str(self._extra.get("tenant", "default")), tp_rank=self._config.tp_rank,
            tp_size=self._config.tp_size, extra_salt=f"{self._salt}{_stage(self._config)}")

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Take a hybrid model's Mamba or SWA host pool as a cache group behind the anchor's
        (``kvstore.integrations.sglang_hybrid``): the namespace then binds every pool's
        geometry. The anchor's own entry (``kv``) changes nothing; other pools (draft,
        indexer, DeepSeek V4's compressed pools) are refused here, so serving does not fail
        at the first prefetch instead."""
        name = str(host_pool_name)
        if name == KV_POOL:
            if host_pool is not getattr(self, "mem_pool_host", None):
                raise InvalidArgument("SGLang's kv host pool must be the one registered "
                                      "with register_mem_pool_host")
            return
        if name not in HYBRID_POOLS:
            raise InvalidArgument(
                f"SGLang host pool {name!r} ({type(host_pool).__name__}): kvstore's HiCache "
                f"backend stores the KV pool and the hybrid pools {HYBRID_POOLS}; draft, "
                "indexer and DeepSeek V4 pools are not supported yet")
        if self._anchor is None:
            raise InvalidArgument("register_mem_pool_host must be called before "
                                  "register_mem_host_pool_v2")
        if self._hybrid is None:
            self._hybrid = HybridPools(self._anchor, self._ns().spec.block_tokens)
        self._hybrid.add(name, host_pool, self._extra)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self.namespace = self._namespace(self._hybrid.cache())

    def _register_mla(self, pool: Any) -> None:
        if getattr(self._config, "dcp_size", 1) > 1:
            raise InvalidArgument(
                f"MLA host pool under decode context parallelism (dcp_size="
                f"{self._config.dcp_size}): each rank holds a slice of every page, which "
                "kvstore does not key yet; run without DCP")
        cache = latent_cache(pool)
        super().register_mem_pool_host(pool)
        self._mla = MLAPages(pool, cache)
        self._anchor = cache.groups[0]
        # The layout is not in the key: pages are stored in the group's own layout.
        self._salt = "sglang/mla"
        self.namespace = self._namespace(cache)

    def _ns(self) -> Namespace:
        if self.namespace is None:
            raise InvalidArgument("register_mem_pool_host must be called before any transfer")
        return self.namespace

    def _tokens(self, key: str) -> np.ndarray:
        return page_tokens(key, self._ns().spec.block_tokens)

    def _pages_ns(self) -> Namespace:
        """The namespace the anchor pool's pages are put and read in: group 0's own where
        the cache is made of groups (an MLA pool's latent group, a hybrid model's KV)."""
        return self._ns().group(0) if self._ns().is_grouped else self._ns()

    def _chain(self, keys: list[str], extra_info: Any) -> tuple[np.ndarray, int]:
        """The token ids of the chain ``prefix_keys + keys`` and the number of pages before
        ``keys``."""
        prefix = getattr(extra_info, "prefix_keys", None)
        if prefix is None:
            raise InvalidArgument(
                "kvstore stores SGLang pages as chains from the sequence start and needs the "
                "page keys before each batch: set \"hicache_storage_pass_prefix_keys\": true "
                "in --hicache-storage-backend-extra-config")
        chain = [*prefix, *keys]
        if not chain:
            return np.empty(0, dtype="<u4"), 0
        return np.concatenate([self._tokens(key) for key in chain]), len(prefix)

    # ------------------------------------------------------------------------- probes

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored: one Lookup of the chain (of the
        anchor's group alone where hybrid pools are registered: the KV pages this asks for)."""
        tokens, first = self._chain(keys, extra_info)
        ns = self._ns() if self._hybrid is None else self._pages_ns()
        try:
            matched = self._client.lookup(ns, tokens).matched_tokens
        except KVStoreError as exc:
            logger.warning("kvstore lookup failed: %s", exc)
            return 0
        return min(len(keys), max(0, matched // self._ns().spec.block_tokens - first))

    def exists(self, key: str) -> bool:
        raise _pre_v1("exists")

    # ---------------------------------------------------------------------- transfers

    def _pages(self, host_indices: torch.Tensor) -> tuple[list[int], int]:
        """The pointers of each host page (K, V, K, V, ...) and the bytes behind each."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        spec = self._pages_ns().spec
        page_bytes = (spec.block_tokens * spec.num_layers * spec.num_kv_heads * spec.head_dim
                      * spec.torch_dtype.itemsize)
        if any(size != page_bytes for size in sizes):
            raise InvalidArgument(f"host pool pages hold {sorted(set(sizes))} bytes, the "
                                  f"namespace expects {page_bytes}")
        return list(ptrs), page_bytes

    def _host_views(self, ptrs: list[int], page_bytes: int
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) views of each host page, ``[page_size, num_layers, heads, head_dim]``."""
        spec = self._pages_ns().spec
        shape = (spec.block_tokens, spec.num_layers, spec.num_kv_heads, spec.head_dim)
        views = [_host_view(p, page_bytes, spec.torch_dtype, shape) for p in ptrs]
        return list(zip(views[0::2], views[1::2], strict=True))

    def _canonical(self, ptrs: list[int], page_bytes: int) -> torch.Tensor:
        """The pages as one canonical ``[L, 2, pages * page_size, H, D]`` tensor: a strided
        view of the host pool when the pages lie one after another with V a fixed distance
        behind K (no copy), else a copy of each page."""
        spec = self._pages_ns().spec
        item = spec.torch_dtype.itemsize
        k0, v0, num_pages = ptrs[0], ptrs[1], len(ptrs) // 2
        in_order = v0 > k0 and (v0 - k0) % item == 0 and all(
            ptrs[2 * i] == k0 + i * page_bytes and ptrs[2 * i + 1] == v0 + i * page_bytes
            for i in range(num_pages))
        if not in_order:
            return torch.cat([torch.stack((k.transpose(0, 1), v.transpose(0, 1)), dim=1)
                              for k, v in self._host_views(ptrs, page_bytes)], dim=2)
        span = (ptrs[-1] - k0) + page_bytes  # from the first K to the end of the last V
        flat = _host_view(k0, span, spec.torch_dtype, (span // item,))
        row = spec.num_layers * spec.num_kv_heads * spec.head_dim  # one token, all layers
        hd = spec.num_kv_heads * spec.head_dim
        return flat.as_strided(
            (spec.num_layers, 2, num_pages * spec.block_tokens, spec.num_kv_heads,
             spec.head_dim), (hd, (v0 - k0) // item, row, spec.head_dim, 1))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Load each key's page into its host page; a miss or a failed load is False (and so
        is every page after it)."""
        tokens, first = self._chain(keys, extra_info)
        if self._mla is not None:
            return self._mla_get(keys, tokens, first, host_indices)
        pages = self._host_views(*self._pages(host_indices))
        loaded = 0

        def copy_in(block_index: int, kv: torch.Tensor) -> None:
            nonlocal loaded
            # canonical [L, 2, T, H, D] -> host [T, L, H, D] for K and for V, straight from
            # the arena page
            k, v = pages[block_index - first]
            k.copy_(kv[:, 0].transpose(0, 1))
            v.copy_(kv[:, 1].transpose(0, 1))
            loaded += 1

        try:
            self._client.read_blocks(self._pages_ns(), tokens, copy_in, first_block=first)
        except KVStoreError as exc:
            logger.warning("kvstore get failed after %d of %d pages: %s", loaded, len(keys),
                           exc)
        return [i < loaded for i in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Store the host pages under their keys behind the stored prefix; True when stored
        (new or already)."""
        tokens, first = self._chain(keys, extra_info)
        if not keys:
            return []
        if self._mla is not None:
            return self._mla_set(keys, tokens, first, host_indices, extra_info)
        kv = self._canonical(*self._pages(host_indices))
        try:
            self._client.put(self._pages_ns(), tokens, kv, first_block=first)
        except KVStoreError as exc:
            logger.warning("kvstore put failed: %s", exc)
            return [False] * len(keys)
        return [True] * len(keys)

    # ------------------------------------------------- hybrid pools: the v2 calls

    def _hybrid_pools(self) -> HybridPools:
        if self._hybrid is None:
            raise InvalidArgument("SGLang's v2 batch calls move hybrid pools; none was "
                                  "registered with register_mem_host_pool_v2")
        return self._hybrid

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: Any = None) -> PoolTransferResult:
        """How many of ``keys`` lead a prefix at whose end every pool has what its hit
        policy needs: one grouped Lookup (``HybridPools.exists``)."""
        tokens, first = self._chain(keys, extra_info)
        if self._hybrid is None:
            others = [str(t.name) for t in pool_transfers or () if str(t.name) != KV_POOL]
            if others:  # pools never registered here: their pages were never stored
                logger.error("kvstore holds no pages of SGLang pools %s", others)
                return PoolTransferResult(0, {}, [])
            hit = self.batch_exists(keys, extra_info)
            return PoolTransferResult(hit, {KV_POOL: hit} if hit else {},
                                      list(range(1, hit + 1)))
        return self._hybrid.exists(lambda t: self._client.lookup(self._ns(), t), tokens, first,
                                   len(keys), list(pool_transfers or []))

    def _batch_v2(self, transfers: list[PoolTransfer], extra_info: Any, is_set: bool
                  ) -> dict[Any, list[bool]]:
        """Each transfer's per-key results: the anchor's through the v1 path, a hybrid
        pool's through its group; ``prefix_keys + keys`` is each transfer's chain."""
        results: dict[Any, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            if str(transfer.name) == KV_POOL:
                move = self.batch_set_v1 if is_set else self.batch_get_v1
                results[transfer.name] = move(keys, transfer.host_indices, extra_info)
                continue
            tokens, first = self._chain(keys, extra_info)
            results[transfer.name] = self._hybrid_pools().move(
                self._client, self._ns(), transfer, tokens, first, is_set=is_set)
        return results

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: Any = None
                     ) -> dict[Any, list[bool]]:
        """Load each transfer's pages into its host pool; per pool, a success per key."""
        return self._batch_v2(transfers, extra_info, is_set=False)

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: Any = None
                     ) -> dict[Any, list[bool]]:
        """Store each transfer's host pages; per pool, a success per key. Every TP rank
        stores its own Mamba and SWA shards (they are sharded, not replicated)."""
        return self._batch_v2(transfers, extra_info, is_set=True)

    # ------------------------------------------------------------- MLA host pools

    def _mla_get(self, keys: list[str], tokens: np.ndarray, first: int,
                 host_indices: torch.Tensor) -> list[bool]:
        mla = self._mla
        assert mla is not None
        ptrs = mla.pointers(host_indices)
        loaded = 0

        def copy_in(block_index: int, kv: torch.Tensor) -> None:
            nonlocal loaded
            mla.load(kv, ptrs[block_index - first])
            loaded += 1

        try:
            self._client.read_blocks(self._pages_ns(), tokens, copy_in, first_block=first)
        except KVStoreError as exc:
            logger.warning("kvstore get failed after %d of %d pages: %s", loaded, len(keys),
                           exc)
        return [i < loaded for i in range(len(keys))]

    def _mla_set(self, keys: list[str], tokens: np.ndarray, first: int,
                 host_indices: torch.Tensor, extra_info: Any) -> list[bool]:
        mla = self._mla
        assert mla is not None
        if not self._config.is_storage_writer:
            # One copy per TP group: the writer rank stores it; another rank that is asked
            # anyway moves nothing and reports the pages the writer has stored.
            stored = self.batch_exists(keys, extra_info)
            return [i < stored for i in range(len(keys))]
        stored_pages = mla.stored(mla.pointers(host_indices))
        try:
            self._client.put(self._pages_ns(), tokens, stored_pages, first_block=first)
        except KVStoreError as exc:
            logger.warning("kvstore put failed: %s", exc)
            return [False] * len(keys)
        return [True] * len(keys)

    # ------------------------------------------------- the pre-v1 interface, by key

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None
            ) -> torch.Tensor | None:
        raise _pre_v1("get")

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        raise _pre_v1("batch_get")

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        raise _pre_v1("set")

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        raise _pre_v1("batch_set")

    def clear(self) -> None:
        """Drop every page of this model and tenant (SGLang's cache flush, as after a weight
        update): the current revision's even when pinned (``Client.invalidate``), earlier
        revisions' unless pinned."""
        self._client.invalidate(self._ns())
        self._client.evict(tenant=self._ns().tenant, model_id=self._ns().model_id)

    def close(self) -> None:
        self._client.close()


def _stage(config: HiCacheStorageConfig) -> str:
    """The pipeline stage and attention context-parallel rank a pool holds, for the key: each
    stage holds other layers, each CP rank another slice of every page, so they never share
    (as SGLang's own file backend keys them); nothing without PP or CP, so those keys are
    unchanged."""
    out = ""
    if config.pp_size > 1:
        out += f"/pp{config.pp_rank}of{config.pp_size}"
    if config.attn_cp_size > 1:
        out += f"/cp{config.attn_cp_rank}of{config.attn_cp_size}"
    return out


def _pre_v1(method: str) -> InvalidArgument:
    return InvalidArgument(f"HiCacheStorage.{method} carries no prefix keys; kvstore serves "
                           "SGLang's v1 interface: set \"interface_v1\": 1 and "
                           "\"hicache_storage_pass_prefix_keys\": true")
