"""Saving and loading a cache made of groups through a client's verbs: one lookup for all
groups, each group's pages put and got under its own namespace (``kvstore.groups``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.api import LookupResult
from kvstore.errors import InvalidArgument
from kvstore.groups import CacheGroup, GroupKind
from kvstore.keys import Namespace, block_keys, snapshot_tokens, token_array

Parts = Mapping[str, torch.Tensor]


def window_blocks(n: int, window_tokens: int, block_tokens: int) -> range:
    """The blocks a window group needs for a prefix of ``n`` blocks (as the daemon's lookup
    rule, ``kvstore.store.groups.window_blocks``)."""
    first = max(0, n * block_tokens - window_tokens) // block_tokens
    return range(first, n)


@dataclass(frozen=True, slots=True)
class LoadedGroup:
    """One group's part of a loaded prefix: its tensors and the first token they hold (0 for
    attention and latent groups; a window's first needed block's; a state has no tokens)."""

    parts: dict[str, torch.Tensor]
    first_token: int = 0


class GroupCache:
    """A grouped namespace's pages through ``client`` (a ``kvstore.client.Client``).

    ``save(tokens, n, data)`` makes the prefix of ``n`` blocks whole: every attention and
    latent block below n, the window blocks of n, the state snapshot at n (blocks already
    stored are not sent again by the daemon). ``lookup`` is one call for all groups;
    ``load(tokens, n)`` reads what the prefix needs, or None if a page went missing since.
    """

    def __init__(self, client: Any, ns: Namespace) -> None:
        if not ns.is_grouped:
            raise InvalidArgument("GroupCache takes a namespace whose spec is a CacheSpec")
        self.client = client
        self.namespace = ns
        self.groups: tuple[CacheGroup, ...] = ns.cache.groups
        self.block_tokens = ns.cache.block_tokens

    def lookup(self, tokens: Sequence[int] | np.ndarray | torch.Tensor) -> LookupResult:
        return self.client.lookup(self.namespace, tokens)

    def _snapshot(self, g: int, tokens: np.ndarray, block: int) -> np.ndarray:
        gns = self.namespace.group(g)
        chain = block_keys(gns, tokens[:(block + 1) * self.block_tokens])
        return snapshot_tokens(chain[block], self.block_tokens)

    def save(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, n: int,
             data: Sequence[Parts]) -> int:
        """Store what a prefix of ``n`` blocks needs from ``data``, one entry per group:
        token parts ``[L, T, *shape]`` from token 0 with ``T >= n * block_tokens`` (a window
        group's too: only its window is sent), ``per_block`` parts ``[L, num_blocks,
        *shape]``, a state's ``[L, *shape]`` as it is after exactly ``n`` blocks. Returns the
        tokens newly written for the first group (what a plain put returns)."""
        arr = token_array(tokens)
        bt = self.block_tokens
        if not 1 <= n <= arr.size // bt:
            raise InvalidArgument(f"save of {n} blocks: the tokens hold {arr.size // bt}")
        if len(data) != len(self.groups):
            raise InvalidArgument(f"save takes one entry per group ({len(self.groups)}), "
                                  f"got {len(data)}")
        written = []
        for g, (group, parts) in enumerate(zip(self.groups, data)):
            gns = self.namespace.group(g)
            if group.is_prefix:
                stored = group.pack(_first_tokens(group, parts, n * bt, n), bt)
                written.append(self.client.put(gns, arr[:n * bt], stored))
                continue
            if group.kind is GroupKind.STATE:
                blocks: Sequence[int] = (n - 1,)
            else:
                blocks = window_blocks(n, group.window_tokens, bt)
            count = 0
            for block in blocks:
                one = _one_block(group, parts, block, bt)
                count += self.client.put(gns, self._snapshot(g, arr, block), group.pack(one, bt))
            written.append(count)
        return written[0]

    def load(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, n: int
             ) -> list[LoadedGroup] | None:
        """What a prefix of ``n`` blocks needs, one ``LoadedGroup`` per group; None when any
        page is missing (evicted since the lookup): the caller prefills instead."""
        arr = token_array(tokens)
        bt = self.block_tokens
        loaded = []
        for g, group in enumerate(self.groups):
            gns = self.namespace.group(g)
            if group.is_prefix:
                stored = self.client.get(gns, arr[:n * bt])
                if stored is None or stored.shape[2] < n * bt:
                    return None
                loaded.append(LoadedGroup(group.unpack(stored, bt)))
                continue
            blocks = (n - 1,) if group.kind is GroupKind.STATE else \
                window_blocks(n, group.window_tokens, bt)
            pieces = []
            for block in blocks:
                stored = self.client.get(gns, self._snapshot(g, arr, block))
                if stored is None:
                    return None
                pieces.append(group.unpack(stored, bt))
            if group.kind is GroupKind.STATE:
                loaded.append(LoadedGroup(pieces[0]))
            else:
                loaded.append(LoadedGroup(_joined(group, pieces), blocks[0] * bt))
        return loaded


def _first_tokens(group: CacheGroup, parts: Parts, num_tokens: int, num_blocks: int
                  ) -> dict[str, torch.Tensor]:
    out = {}
    for p in group.parts:
        t = parts[p.name]
        out[p.name] = t[:, :num_blocks] if p.per_block else t[:, :num_tokens]
    return out


def _one_block(group: CacheGroup, parts: Parts, block: int, bt: int) -> dict[str, torch.Tensor]:
    if group.kind is GroupKind.STATE:
        return dict(parts)
    return {p.name: parts[p.name][:, block:block + 1] if p.per_block
            else parts[p.name][:, block * bt:(block + 1) * bt] for p in group.parts}


def _joined(group: CacheGroup, pieces: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {p.name: torch.cat([piece[p.name] for piece in pieces], dim=1) for p in group.parts}
