"""SGLang's hybrid host pools (Mamba state, sliding-window KV) as kvstore cache groups: the
v2 batch calls of ``HiCacheStorage``.

SGLang 0.5.23's hybrid cache controller (``mem_cache/hybrid_cache/hybrid_cache_controller.py``)
moves a hybrid model's full-attention KV through the v1 calls (``batch_get_v1`` /
``batch_set_v1`` on the anchor pool) and its further pools through ``batch_exists_v2``,
``batch_get_v2`` and ``batch_set_v2``, one ``PoolTransfer`` per pool:

- ``PoolName.MAMBA`` (``pool_host/mamba.py`` ``MambaPoolHost``, one slot per state, page
  size 1, ``page_first`` buffers ``[slots, layers, 1, *shape]``): the state at a node's end
  boundary, keyed by the page key there (``TRAILING_PAGES``, one key). It is a ``state``
  group: one snapshot per page boundary the controller stores, its parts the temporal (SSM)
  state and each conv state, per layer.
- ``PoolName.SWA`` (an MHA host pool over the sliding-window layers' device pool): the
  trailing pages of a node, each keyed by the page key at its position (``TRAILING_PAGES``,
  the window's pages). It is a ``window`` group of ``swa_window_tokens`` (the host pool does
  not know the window, so the backend's extra config names it).
- ``PoolName.KV`` (the anchor, already the attention or latent group) is served by the v1
  calls.

Each batch carries ``prefix_keys`` such that ``prefix_keys + keys`` is one chain from the
sequence start; key ``i`` of a transfer is block ``len(prefix_keys) + i`` of that chain, and
its page is the group's one-block page there (``keys.snapshot_tokens``). ``batch_exists_v2``
is one grouped Lookup: the daemon answers the longest prefix at which the KV pages, the window
pages and the state snapshot are all whole, stepping down to the last stored snapshot when the
newest one is missing, so the backend never reports a hit its get cannot serve.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer, PoolTransferResult

from kvstore.client.snapshot_pages import snapshot_ids
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.groups import CacheGroup, CacheSpec, GroupKind
from kvstore.keys import Namespace

logger = logging.getLogger(__name__)

KV, MAMBA, SWA = "kv", "mamba", "swa"  # SGLang's PoolName values (a str Enum: equal to these)
MAMBA_LAYOUTS = ("page_first", "page_first_direct")
SWA_LAYOUTS = ("page_first", "page_first_direct")


def mamba_group(pool: Any) -> CacheGroup:
    """A ``MambaPoolHost``'s state: per layer, the temporal (SSM) state (none in a conv-only
    model) and each conv state, in their own dtypes."""
    if getattr(pool, "layout", None) not in MAMBA_LAYOUTS:
        raise InvalidArgument(f"Mamba host pool layout {getattr(pool, 'layout', None)!r}: "
                              f"kvstore reads {MAMBA_LAYOUTS}")
    if getattr(pool, "slot_state_buffers", None):
        raise InvalidArgument("Mamba host pool with registered slot side states: kvstore "
                              "stores the temporal and conv states only")
    parts: dict[str, tuple[tuple[int, ...], Any]] = {}
    if pool.temporal_state_elem_size > 0:
        parts["temporal"] = (tuple(pool.temporal_state_shape), pool.temporal_dtype)
    for j, shape in enumerate(pool.conv_state_shapes):
        parts[f"conv{j}"] = (tuple(shape), pool.conv_dtype)
    return CacheGroup.state(pool.num_mamba_layers, parts, name=MAMBA)


def swa_group(pool: Any, window_tokens: Any) -> CacheGroup:
    """An SWA host pool (MHA-shaped) as a window group of ``window_tokens``."""
    if getattr(pool, "layout", None) not in SWA_LAYOUTS or not all(
            hasattr(pool, a) for a in ("layer_num", "head_num", "head_dim")):
        raise InvalidArgument(f"SWA host pool {type(pool).__name__} (layout "
                              f"{getattr(pool, 'layout', None)!r}): kvstore reads MHA-shaped "
                              f"SWA pools in {SWA_LAYOUTS}")
    if not isinstance(window_tokens, int) or isinstance(window_tokens, bool) \
            or window_tokens < 1:
        raise InvalidArgument("an SWA host pool needs \"swa_window_tokens\" (the model's "
                              "sliding window, a positive int) in "
                              f"--hicache-storage-backend-extra-config, got {window_tokens!r}")
    return CacheGroup.attention(pool.layer_num, pool.head_num, pool.head_dim, pool.dtype,
                                window_tokens=window_tokens, name=SWA)


def _host_view(ptr: int, num_bytes: int, dtype: torch.dtype, shape: tuple[int, ...]
               ) -> torch.Tensor:
    buffer = (ctypes.c_char * num_bytes).from_address(ptr)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


class HybridPools:
    """The hybrid pools a backend saw registered, each a group behind the anchor's (group 0),
    and the v2 transfers between their host pages and the groups' one-block pages."""

    def __init__(self, anchor: CacheGroup, block_tokens: int) -> None:
        self.groups: list[CacheGroup] = [anchor]
        self.block_tokens = block_tokens
        self.pools: dict[str, tuple[int, Any]] = {}  # pool name -> (group index, host pool)

    def add(self, name: str, pool: Any, extra: dict[str, Any]) -> None:
        """Take pool ``name`` (MAMBA or SWA) as the next group; refuse anything else."""
        if name in self.pools:
            raise InvalidArgument(f"SGLang host pool {name!r} registered twice")
        if getattr(pool, "page_size", None) != (1 if name == MAMBA else self.block_tokens):
            raise InvalidArgument(f"SGLang host pool {name!r} has page size "
                                  f"{getattr(pool, 'page_size', None)}; kvstore expects "
                                  f"{1 if name == MAMBA else self.block_tokens}")
        group = mamba_group(pool) if name == MAMBA else \
            swa_group(pool, extra.get("swa_window_tokens"))
        CacheSpec((*self.groups, group), self.block_tokens)  # its own checks, before keeping it
        self.pools[name] = (len(self.groups), pool)
        self.groups.append(group)

    def cache(self) -> CacheSpec:
        return CacheSpec(tuple(self.groups), self.block_tokens)

    # ------------------------------------------------------------------ probes

    def _servable(self, transfer: PoolTransfer) -> str | None:
        """Why a hit of ``transfer``'s pool cannot be promised, or None."""
        name = str(transfer.name)
        if name == KV:
            return None
        if name not in self.pools:
            return f"pool {name!r} is not registered with kvstore"
        if transfer.hit_policy != PoolHitPolicy.TRAILING_PAGES:
            return f"pool {name!r} asks hit policy {transfer.hit_policy}; kvstore keeps its " \
                   "trailing pages only"
        group = self.groups[self.pools[name][0]]
        trailing = max(1, len(transfer.keys or ()))
        kept = 1 if group.kind is GroupKind.STATE else \
            -(-group.window_tokens // self.block_tokens)
        if trailing > kept:
            return (f"pool {name!r} asks {trailing} trailing pages; its group keeps {kept} "
                    f"(raise swa_window_tokens to {trailing * self.block_tokens})")
        return None

    def exists(self, lookup: Any, tokens: np.ndarray, first: int, num_keys: int,
               transfers: list[PoolTransfer]) -> PoolTransferResult:
        """One grouped lookup of the chain: the pages of ``keys`` at whose end every group is
        whole; every pool is reported at that boundary, the only one checked."""
        for transfer in transfers:
            why = self._servable(transfer)
            if why is not None:
                logger.error("kvstore cannot serve this hybrid prefetch: %s", why)
                return PoolTransferResult(0, {}, [])
        try:
            matched = lookup(tokens).matched_tokens
        except KVStoreError as exc:
            logger.warning("kvstore lookup failed: %s", exc)
            return PoolTransferResult(0, {}, [])
        hit = min(num_keys, max(0, matched // self.block_tokens - first))
        if hit == 0:
            return PoolTransferResult(0, {}, [])
        hits = {KV: hit, **{transfer.name: hit for transfer in transfers}}
        return PoolTransferResult(hit, hits, [hit])

    # --------------------------------------------------------------- transfers

    def _pages(self, name: str, transfer: PoolTransfer) -> tuple[int, Any, list[int]] | None:
        """(group index, host pool, the first host index of each key's page), or None (logged)
        when the pool is unknown or the indices do not match the keys."""
        if name not in self.pools:
            logger.error("kvstore: pool %r is not registered; refusing its transfer", name)
            return None
        g, pool = self.pools[name]
        keys, indices = transfer.keys or [], transfer.host_indices
        step = pool.page_size
        if indices is None or indices.numel() != len(keys) * step:
            logger.error("kvstore: pool %r transfer of %d keys has %s host indices, expected "
                         "%d", name, len(keys), None if indices is None else indices.numel(),
                         len(keys) * step)
            return None
        return g, pool, indices.cpu()[::step].tolist()

    def _stored(self, g: int, pool: Any, index: int) -> torch.Tensor:
        """The host page at ``index`` as group ``g``'s stored one-block page."""
        group = self.groups[g]
        if group.kind is GroupKind.STATE:
            return group.pack(self._state_views(pool, index), self.block_tokens)
        k, v = self._kv_views(pool, index)
        return torch.stack((k.transpose(0, 1), v.transpose(0, 1)), dim=1)

    def _load(self, g: int, pool: Any, index: int, stored: torch.Tensor) -> None:
        group = self.groups[g]
        if group.kind is GroupKind.STATE:
            parts = group.unpack(stored, self.block_tokens)
            for name, view in self._state_views(pool, index).items():
                view.copy_(parts[name])
            return
        k, v = self._kv_views(pool, index)
        k.copy_(stored[:, 0].transpose(0, 1))
        v.copy_(stored[:, 1].transpose(0, 1))

    @staticmethod
    def _state_views(pool: Any, slot: int) -> dict[str, torch.Tensor]:
        """A Mamba slot's states as ``[layers, *shape]`` views of the host buffers
        (``page_first``: ``[slots, layers, 1, *shape]``)."""
        out = {}
        if pool.temporal_state_elem_size > 0:
            t = pool.temporal_buffer[slot]
            out["temporal"] = t.view(t.shape[0], *t.shape[2:])
        for j, buf in enumerate(pool.conv_buffer):
            c = buf[slot]
            out[f"conv{j}"] = c.view(c.shape[0], *c.shape[2:])
        return out

    def _kv_views(self, pool: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An SWA page's K and V as ``[page_size, layers, heads, head_dim]`` views (the MHA
        host pool's ``get_page_buffer_meta``: two pointers per page)."""
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(index, index + pool.page_size))
        shape = (pool.page_size, pool.layer_num, pool.head_num, pool.head_dim)
        num_bytes = int(np.prod(shape)) * pool.dtype.itemsize
        if len(ptrs) != 2 or any(size != num_bytes for size in sizes):
            raise InvalidArgument(f"SWA host pool gave {len(ptrs)} pointers of {sizes} bytes "
                                  f"for a page; expected K and V of {num_bytes}")
        return (_host_view(ptrs[0], num_bytes, pool.dtype, shape),
                _host_view(ptrs[1], num_bytes, pool.dtype, shape))

    def move(self, client: Any, ns: Namespace, transfer: PoolTransfer, tokens: np.ndarray,
             first: int, *, is_set: bool) -> list[bool]:
        """Store (``is_set``) or load each key's page of ``transfer``; a page that fails ends
        the run (SGLang counts the leading successes)."""
        name = str(transfer.name)
        num_keys = len(transfer.keys or [])
        pages = self._pages(name, transfer)
        if pages is None or num_keys == 0:
            return [False] * num_keys
        g, pool, indices = pages
        gns = ns.group(g)
        ids = snapshot_ids(gns, tokens, [first + i for i in range(num_keys)])
        done = 0
        try:
            for page_tokens, index in zip(ids, indices):
                if is_set:
                    client.put(gns, page_tokens, self._stored(g, pool, index))
                else:
                    stored = client.get(gns, page_tokens)
                    if stored is None:
                        break
                    self._load(g, pool, index, stored)
                done += 1
        except KVStoreError as exc:
            logger.warning("kvstore %s of pool %r failed after %d of %d pages: %s",
                           "put" if is_set else "get", name, done, num_keys, exc)
        return [i < done for i in range(num_keys)]
