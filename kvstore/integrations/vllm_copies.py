"""The vLLM connector's copies on a CPU cache: vLLM 0.32's CPU attention backend keeps each
layer as ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` read as ``[H, 2N, D]`` per
block (K in the first ``block_size`` rows, V in the rest); these copy blocks between it and
kvstore's canonical ``[L, 2, T, H, D]``, a run of consecutive block ids at a time; and the
snapshots of a hybrid model's state groups between its state pages and kvstore's pages."""

from __future__ import annotations

import torch

from kvstore.client import Client
from kvstore.keys import Namespace
from kvstore.spec import KVSpec


def block_views(layers: list[torch.Tensor], spec: KVSpec) -> list[torch.Tensor]:
    """Each layer's cache as ``[num_blocks, H, 2, N, D]``: index 0 of dim 2 is K, 1 is V."""
    return [t.view(t.shape[0], spec.num_kv_heads, 2, spec.block_tokens, spec.head_dim)
            for t in layers]


def block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """``(position, first block id, length)`` of each run of consecutive ids in ``block_ids``:
    a run is copied as one slice instead of one block at a time."""
    runs: list[tuple[int, int, int]] = []
    for pos, block_id in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((pos, block_id, 1))
    return runs


def gather_blocks(views: list[torch.Tensor], spec: KVSpec, block_ids: list[int]
                  ) -> torch.Tensor:
    """The blocks ``block_ids`` of every layer in the canonical ``[L, 2, T, H, D]`` layout, each
    byte copied once from the cache."""
    bs, n = spec.block_tokens, len(block_ids)
    out = torch.empty(spec.shape(n * bs), dtype=views[0].dtype)
    runs = block_runs(block_ids)
    for layer_out, view in zip(out, views, strict=True):
        # [2, n * N, H, D] seen as the cache's [n, H, 2, N, D]
        dst = layer_out.view(2, n, bs, spec.num_kv_heads, spec.head_dim).permute(1, 3, 0, 2, 4)
        for pos, first_id, length in runs:
            dst[pos : pos + length].copy_(view[first_id : first_id + length])
    return out


def load_blocks(client: Client, ns: Namespace, views: list[torch.Tensor], token_ids: list[int],
                block_ids: list[int], first_block: int, zero_copy: bool | None = None) -> int:
    """Copy the stored blocks of ``token_ids`` from ``first_block`` on into the cache blocks
    ``block_ids``, each page straight from the arena into every layer; returns how many of the
    blocks (counted from the first) the store holds."""

    def copy_in(i: int, kv: torch.Tensor) -> None:
        if i >= len(block_ids):
            return
        for layer, view in zip(kv, views, strict=True):
            view[block_ids[i]].copy_(layer.permute(2, 0, 1, 3))  # [2, N, H, D] -> [H, 2, N, D]

    num_stored = client.read_blocks(ns, token_ids, copy_in, first_block=first_block,
                                    zero_copy=zero_copy)
    return min(num_stored, len(block_ids))


def state_rows(layers: list[torch.Tensor], num_bytes: int) -> list[torch.Tensor]:
    """Each layer of a Mamba-style group as ``[num_blocks, num_bytes]`` uint8: vLLM 0.32 registers
    a state layer as int8 ``[num_blocks, 1, 1, num_bytes]`` whose blocks lie a padded page apart,
    the block's states (conv, then the recurrent state) in its first ``num_bytes``."""
    return [t.view(torch.uint8).reshape(t.shape[0], -1)[:, :num_bytes] for t in layers]


def gather_state(rows: list[torch.Tensor], spec: KVSpec, block_id: int) -> torch.Tensor:
    """The snapshot in block ``block_id`` as one page of ``spec`` (uint8 ``[L, 2, T, H, D]``):
    each layer's state bytes from the start of its page, the rest zeros."""
    out = torch.zeros(spec.shape(spec.block_tokens), dtype=torch.uint8)
    for layer_out, row in zip(out, rows, strict=True):
        layer_out.view(-1)[: row.shape[1]].copy_(row[block_id])
    return out


def load_state(client: Client, ns: Namespace, rows: list[torch.Tensor], token_ids,
               block_id: int) -> int:
    """Copy the stored snapshot page of ``token_ids`` (one block) into block ``block_id``;
    returns 1 if the store held it, else 0."""

    def copy_in(i: int, kv: torch.Tensor) -> None:
        for layer, row in zip(kv, rows, strict=True):
            row[block_id].copy_(layer.reshape(-1)[: row.shape[1]])

    return min(client.read_blocks(ns, token_ids, copy_in), 1)
