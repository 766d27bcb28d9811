"""SGLang's MLA host pool as one replicated ``latent`` cache group: its pages to and from
the group's stored pages.

SGLang 0.5.23's ``MLATokenToKVPoolHost`` (``sglang/srt/mem_cache/pool_host/mla.py``) keeps
one row of ``kv_cache_dim`` elements per token per layer (``kv_lora_rank + qk_rope_head_dim``,
DeepSeek: 512 + 64; a packed fp8 row when the engine overrides the width), and its
``get_page_buffer_meta`` gives one pointer per page to ``page_size x layer_num x
kv_cache_dim`` contiguous elements: token-major ``[page_size, layer_num, 1, kv_cache_dim]``
in ``page_first``, layer-major ``[layer_num, page_size, 1, kv_cache_dim]`` in
``page_first_direct``. The row is the same on every tensor-parallel rank, so the group is
replicated (keyed without the rank: one copy per TP group, shared by every TP size) and the
layout is not part of the key (pages are stored in the group's canonical layout, so a
``page_first`` instance and a ``page_first_direct`` one share them). Draft (MTP) layers that
SGLang packs into the same pages are layers of the group.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kvstore.errors import InvalidArgument
from kvstore.groups import FLOAT_DTYPES, CacheGroup, CacheSpec, group_dtype

MLA_LAYOUTS = ("page_first", "page_first_direct")


def is_mla_pool(pool: Any) -> bool:
    """Whether ``pool`` is an MLA host pool (``MLATokenToKVPoolHost`` or one shaped like it);
    told by its attributes, so the check needs no import of SGLang's pool modules."""
    return all(hasattr(pool, a) for a in ("kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim"))


def latent_cache(pool: Any) -> CacheSpec:
    """The pool's cache: one replicated latent group of ``layer_num`` layers; a row that is
    ``kv_lora_rank + qk_rope_head_dim`` wide is stored in those two parts, any other width
    (a packed fp8 row) as one part."""
    if pool.layout not in MLA_LAYOUTS:
        raise InvalidArgument(f"MLA host pool layout {pool.layout!r}: kvstore reads "
                              f"{MLA_LAYOUTS}")
    dtype = group_dtype(pool.dtype)
    rank, rope, row = pool.kv_lora_rank, pool.qk_rope_head_dim, pool.kv_cache_dim
    parts = [("kv", rank, dtype), ("pe", rope, dtype)] if rank + rope == row \
        else [("row", row, dtype)]
    group = CacheGroup.latent(pool.layer_num, parts, name="mla", is_replicated=True)
    return CacheSpec((group,), pool.page_size)


class MLAPages:
    """An MLA host pool's pages as the latent group's stored pages and back.

    Where the group is stored as row halves (one float dtype: ``CacheGroup.storage_spec``'s
    ``[L, 2, T, 1, row / 2]``), that layout is a strided view of the host rows, so a store
    hands the client a view of the pool (a run of ``page_first`` pages in order is one view,
    no copy) and a load copies each stored page straight into its host page; other rows (fp8,
    packed bytes) go through ``CacheGroup.pack`` and ``unpack``."""

    def __init__(self, pool: Any, cache: CacheSpec) -> None:
        self.pool = pool
        self.cache = cache
        self.group = cache.groups[0]
        self.layers, self.tokens, self.row = pool.layer_num, pool.page_size, pool.kv_cache_dim
        self.dtype = pool.dtype
        self.page_bytes = self.layers * self.tokens * self.row * self.dtype.itemsize
        self.token_first = pool.layout == "page_first"
        # CacheGroup's "rows" layout: parts of one float dtype, an even row.
        self.is_rows = group_dtype(self.dtype) in FLOAT_DTYPES and self.row % 2 == 0

    def pointers(self, host_indices: torch.Tensor) -> list[int]:
        """The address of each page of ``host_indices``, checked against the pool's geometry."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        if len(ptrs) * self.tokens != len(host_indices) or any(
                size != self.page_bytes for size in sizes):
            raise InvalidArgument(f"MLA host pool gave {len(ptrs)} pages of "
                                  f"{sorted(set(sizes))} bytes for {len(host_indices)} "
                                  f"indices; expected one pointer per page of "
                                  f"{self.page_bytes} bytes")
        return list(ptrs)

    def _flat(self, ptr: int, num_bytes: int) -> torch.Tensor:
        buffer = (ctypes.c_char * num_bytes).from_address(ptr)
        return torch.frombuffer(buffer, dtype=self.dtype)

    def rows(self, ptr: int) -> torch.Tensor:
        """One page as ``[layer_num, page_size, row]`` (no copy)."""
        flat = self._flat(ptr, self.page_bytes)
        if self.token_first:  # [page_size, layer_num, 1, row]
            return flat.view(self.tokens, self.layers, self.row).transpose(0, 1)
        return flat.view(self.layers, self.tokens, self.row)  # page_first_direct

    def _halves(self, ptr: int, num_pages: int) -> torch.Tensor:
        """``num_pages`` pages from ``ptr`` (in order; one page unless ``page_first``) as the
        stored ``[L, 2, T, 1, row / 2]`` layout: a view of the host rows."""
        flat = self._flat(ptr, num_pages * self.page_bytes)
        half, row, t = self.row // 2, self.row, num_pages * self.tokens
        token, layer = (self.layers * row, row) if self.token_first else (row, self.tokens * row)
        return flat.as_strided((self.layers, 2, t, 1, half), (layer, half, token, half, 1))

    def stored(self, ptrs: list[int]) -> torch.Tensor:
        """The pages at ``ptrs`` as the group's stored pages, in order."""
        if not self.is_rows:
            rows = torch.cat([self.rows(p) for p in ptrs], dim=1)  # [L, pages * T, row]
            return self.group.pack(self._parts(rows), self.tokens)
        in_order = all(p == ptrs[0] + i * self.page_bytes for i, p in enumerate(ptrs))
        if self.token_first and in_order:
            return self._halves(ptrs[0], len(ptrs))
        return torch.cat([self._halves(p, 1) for p in ptrs], dim=2)

    def load(self, kv: torch.Tensor, ptr: int) -> None:
        """Copy one stored page ``kv`` (the group's layout, one block) into the page at
        ``ptr``."""
        if self.is_rows:
            self._halves(ptr, 1).copy_(kv)
            return
        parts = self.group.unpack(kv, self.tokens)
        view, pos = self.rows(ptr), 0
        for p in self.group.parts:
            view[:, :, pos:pos + p.numel].copy_(parts[p.name])
            pos += p.numel

    def _parts(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """``[L, T, row]`` rows as the group's parts."""
        out, pos = {}, 0
        for p in self.group.parts:
            out[p.name] = rows[:, :, pos:pos + p.numel]
            pos += p.numel
        return out
