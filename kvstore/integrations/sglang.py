"""SGLang HiCache L3 backend: host-pool pages are stored in and loaded from the kvstore daemon.

Enable it with SGLang's dynamic backend option::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang", "class_name": "KVStoreHiCache",
        "interface_v1": 1, "address": "unix:///run/kvstore/kvstore.sock", "revision": "abc123"}'

Supported: SGLang 0.5.23's ``HiCacheStorage`` interface (``sglang.srt.mem_cache.hicache_storage``)
with an MHA host pool in the ``page_first`` or ``page_first_direct`` layout, whose
``get_page_buffer_meta`` gives two pointers per page, K then V, each to ``page_size x
num_layers x num_kv_heads x head_dim`` contiguous elements.

SGLang's page keys are already hashes of the whole prefix up to that page, so each key is
stored as a one-block entry of its own: its token ids are the key's hash expanded to
``page_size`` ids, and kvstore's chained block key over them names the same prefix. Pages move
through the client's zero-copy path (the shared DRAM arena on the daemon's host): a set copies
the host pages into the canonical layout and the client writes them into reserved slots; a get
verifies and decodes the page and copies it into the host pages.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvstore.client import Client
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import Namespace
from kvstore.spec import KVSpec

logger = logging.getLogger(__name__)

SUPPORTED_LAYOUTS = ("page_first", "page_first_direct")


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

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take the host pool's geometry for the namespace; refuse layouts this cannot read."""
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise InvalidArgument(f"host pool layout {layout!r}: kvstore reads {SUPPORTED_LAYOUTS}")
        super().register_mem_pool_host(mem_pool_host)
        spec = KVSpec(num_layers=mem_pool_host.layer_num, num_kv_heads=mem_pool_host.head_num,
                      head_dim=mem_pool_host.head_dim, block_tokens=mem_pool_host.page_size,
                      dtype=mem_pool_host.dtype)
        self.namespace = Namespace(
            model_id=self._config.model_name or "sglang", spec=spec,
            revision=str(self._extra.get("revision", "main")),
            tenant=str(self._extra.get("tenant", "default")), tp_rank=self._config.tp_rank,
            tp_size=self._config.tp_size, extra_salt=f"sglang/{layout}")

    def _ns(self) -> Namespace:
        if self.namespace is None:
            raise InvalidArgument("register_mem_pool_host must be called before any transfer")
        return self.namespace

    def _tokens(self, key: str) -> np.ndarray:
        return page_tokens(key, self._ns().spec.block_tokens)

    # ------------------------------------------------------------------------- probes

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored."""
        bt = self._ns().spec.block_tokens
        for i, key in enumerate(keys):
            try:
                if self._client.lookup(self._ns(), self._tokens(key)).matched_tokens < bt:
                    return i
            except KVStoreError as exc:
                logger.warning("kvstore lookup failed: %s", exc)
                return i
        return len(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---------------------------------------------------------------------- transfers

    def _pages(self, host_indices: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) views of each host page, ``[page_size, num_layers, heads, head_dim]``."""
        spec = self._ns().spec
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        shape = (spec.block_tokens, spec.num_layers, spec.num_kv_heads, spec.head_dim)
        views = [_host_view(p, n, spec.torch_dtype, shape) for p, n in zip(ptrs, sizes,
                                                                           strict=True)]
        return list(zip(views[0::2], views[1::2], strict=True))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Load each key's page into its host page; a miss or a failed load is False."""
        results = []
        for key, (k, v) in zip(keys, self._pages(host_indices), strict=True):
            try:
                kv = self._client.get(self._ns(), self._tokens(key))
            except KVStoreError as exc:
                logger.warning("kvstore get failed: %s", exc)
                kv = None
            if kv is not None:
                # canonical [L, 2, T, H, D] -> host [T, L, H, D] for K and for V
                k.copy_(kv[:, 0].transpose(0, 1))
                v.copy_(kv[:, 1].transpose(0, 1))
            results.append(kv is not None)
        return results

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Store each host page under its key; True when it is stored (new or already)."""
        results = []
        for key, (k, v) in zip(keys, self._pages(host_indices), strict=True):
            kv = torch.stack((k.transpose(0, 1), v.transpose(0, 1)), dim=1)  # [L, 2, T, H, D]
            try:
                self._client.put(self._ns(), self._tokens(key), kv)
                results.append(True)
            except KVStoreError as exc:
                logger.warning("kvstore put failed: %s", exc)
                results.append(False)
        return results

    # ------------------------------------------------- the pre-v1 interface, by key

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None
            ) -> torch.Tensor | None:
        """The page of ``key`` in kvstore's canonical ``[L, 2, T, H, D]`` layout, or None."""
        return self._client.get(self._ns(), self._tokens(key))

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        return [self.get(key) for key in keys]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Store ``value`` (canonical layout, one page) under ``key``."""
        self._client.put(self._ns(), self._tokens(key), value)
        return True

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return all(self.set(key, value) for key, value in zip(keys, values, strict=True))

    def clear(self) -> None:
        """Drop every page of this model and tenant."""
        self._client.evict(tenant=self._ns().tenant, model_id=self._ns().model_id)

    def close(self) -> None:
        self._client.close()
