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
from kvstore.groups import CacheGroup, GroupKind, window_blocks
from kvstore.keys import Namespace, block_keys, snapshot_tokens, token_array

Parts = Mapping[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class LoadedGroup:
    """One group's part of a loaded prefix: its tensors and the first token they hold (0 for
    attention and latent groups; a window's first needed block's; a state has no tokens)."""

    parts: dict[str, torch.Tensor]
    first_token: int = 0


@dataclass(frozen=True, slots=True)
class _Put:
    ns: Namespace
    tokens: np.ndarray
    stored: torch.Tensor
    group: int  # the group's index (what a save returns counts group 0's)


@dataclass(frozen=True, slots=True)
class _Get:
    ns: Namespace
    tokens: np.ndarray
    group: int
    num_tokens: int  # what a prefix group's get must return whole; 0 for a snapshot


class _Plans:
    """What a grouped save and load send, planned once for both clients."""

    def __init__(self, ns: Namespace) -> None:
        if not ns.is_grouped:
            raise InvalidArgument("GroupCache takes a namespace whose spec is a CacheSpec")
        self.namespace = ns
        self.groups: tuple[CacheGroup, ...] = ns.cache.groups
        self.block_tokens = ns.cache.block_tokens

    def _snapshot(self, g: int, tokens: np.ndarray, block: int) -> np.ndarray:
        gns = self.namespace.group(g)
        chain = block_keys(gns, tokens[:(block + 1) * self.block_tokens])
        return snapshot_tokens(chain[block], self.block_tokens)

    def _blocks(self, group: CacheGroup, n: int) -> Sequence[int]:
        if group.kind is GroupKind.STATE:
            return (n - 1,)
        return window_blocks(n, group.window_tokens, self.block_tokens)

    def save(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, n: int,
             data: Sequence[Parts]) -> list[_Put]:
        arr = token_array(tokens)
        bt = self.block_tokens
        if not 1 <= n <= arr.size // bt:
            raise InvalidArgument(f"save of {n} blocks: the tokens hold {arr.size // bt}")
        if len(data) != len(self.groups):
            raise InvalidArgument(f"save takes one entry per group ({len(self.groups)}), "
                                  f"got {len(data)}")
        puts = []
        for g, (group, parts) in enumerate(zip(self.groups, data)):
            gns = self.namespace.group(g)
            if group.is_prefix:
                stored = group.pack(_first_tokens(group, parts, n * bt, n), bt)
                puts.append(_Put(gns, arr[:n * bt], stored, g))
                continue
            for block in self._blocks(group, n):
                one = group.pack(_one_block(group, parts, block, bt), bt)
                puts.append(_Put(gns, self._snapshot(g, arr, block), one, g))
        return puts

    def load(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, n: int) -> list[_Get]:
        arr = token_array(tokens)
        bt = self.block_tokens
        gets = []
        for g, group in enumerate(self.groups):
            gns = self.namespace.group(g)
            if group.is_prefix:
                gets.append(_Get(gns, arr[:n * bt], g, n * bt))
                continue
            gets += [_Get(gns, self._snapshot(g, arr, block), g, 0)
                     for block in self._blocks(group, n)]
        return gets

    def loaded(self, n: int, gets: list[_Get], results: list[torch.Tensor | None]
               ) -> list[LoadedGroup] | None:
        """The groups from each get's result; None if one is missing or short."""
        pieces: list[list[dict[str, torch.Tensor]]] = [[] for _ in self.groups]
        for get, stored in zip(gets, results):
            if stored is None or stored.shape[2] < get.num_tokens:
                return None
            pieces[get.group].append(self.groups[get.group].unpack(stored, self.block_tokens))
        out = []
        for group, got in zip(self.groups, pieces):
            if group.kind is GroupKind.WINDOW:
                first = self._blocks(group, n)[0] * self.block_tokens
                out.append(LoadedGroup(_joined(group, got), first))
            else:
                out.append(LoadedGroup(got[0]))
        return out


class GroupCache:
    """A grouped namespace's pages through ``client`` (a ``kvstore.client.Client``).

    ``save(tokens, n, data)`` makes the prefix of ``n`` blocks whole: every attention and
    latent block below n, the window blocks of n, the state snapshot at n (blocks already
    stored are not written again by the daemon). ``lookup`` is one call for all groups;
    ``load(tokens, n)`` reads what the prefix needs, or None if a page went missing since.
    ``AsyncGroupCache`` is its twin over an ``AsyncClient``.
    """

    def __init__(self, client: Any, ns: Namespace) -> None:
        self._plans = _Plans(ns)
        self.client = client
        self.namespace = ns

    def lookup(self, tokens: Sequence[int] | np.ndarray | torch.Tensor) -> LookupResult:
        """The longest prefix at which every group is whole: one call to the daemon."""
        return self.client.lookup(self.namespace, tokens)

    def save(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, n: int,
             data: Sequence[Parts]) -> int:
        """Store what a prefix of ``n`` blocks needs from ``data``, one entry per group:
        token parts ``[L, T, *shape]`` from token 0 with ``T >= n * block_tokens`` (a window
        group's too: only its window is sent), ``per_block`` parts ``[L, num_blocks,
        *shape]``, a state's ``[L, *shape]`` as it is after exactly ``n`` blocks. Returns the
        tokens group 0's pages newly wrote (a plain put's count for an attention group)."""
        written = 0
        for p in self._plans.save(tokens, n, data):
            count = self.client.put(p.ns, p.tokens, p.stored)
            written += count if p.group == 0 else 0
        return written

    def load(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, n: int
             ) -> list[LoadedGroup] | None:
        """What a prefix of ``n`` blocks needs, one ``LoadedGroup`` per group; None when any
        page is missing (evicted since the lookup): the caller prefills instead."""
        gets = self._plans.load(tokens, n)
        results = []
        for get in gets:
            results.append(self.client.get(get.ns, get.tokens))
            if results[-1] is None:
                return None
        return self._plans.loaded(n, gets, results)


class AsyncGroupCache:
    """``GroupCache`` over a ``kvstore.client.AsyncClient``: the same verbs, awaited."""

    def __init__(self, client: Any, ns: Namespace) -> None:
        self._plans = _Plans(ns)
        self.client = client
        self.namespace = ns

    async def lookup(self, tokens: Sequence[int] | np.ndarray | torch.Tensor) -> LookupResult:
        """The longest prefix at which every group is whole: one call to the daemon."""
        return await self.client.lookup(self.namespace, tokens)

    async def save(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, n: int,
                   data: Sequence[Parts]) -> int:
        """``GroupCache.save``."""
        written = 0
        for p in self._plans.save(tokens, n, data):
            count = await self.client.put(p.ns, p.tokens, p.stored)
            written += count if p.group == 0 else 0
        return written

    async def load(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, n: int
                   ) -> list[LoadedGroup] | None:
        """``GroupCache.load``."""
        gets = self._plans.load(tokens, n)
        results = []
        for get in gets:
            results.append(await self.client.get(get.ns, get.tokens))
            if results[-1] is None:
                return None
        return self._plans.loaded(n, gets, results)


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
