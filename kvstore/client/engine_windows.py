"""An engine's sliding-window layers (a ``window`` cache group) saved and loaded a window at a
time: only the blocks covering the last ``window_tokens`` of a prefix are written, fetched,
acquired or touched (``groups.window_blocks``), each a one-block page of its own keyed by the
group's chain key there (``keys.snapshot_tokens``), moved by the engine kernels in one launch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.client.engine import EngineCache, LoadHandle
from kvstore.client.snapshot_pages import SnapshotPages, snapshot_ids
from kvstore.codecs.device import DeviceLayout
from kvstore.codecs.triton.engine import from_engine, to_engine
from kvstore.errors import InvalidArgument
from kvstore.groups import GroupKind, window_blocks
from kvstore.keys import Namespace


class WindowCache(EngineCache):
    """A window group's paged cache (see the module docstring); ``save`` and ``load`` move the
    window of a prefix, the other verbs are ``EngineCache``'s over the group's namespace.

    Args:
        client: a sync ``kvstore.client.Client``.
        ns: the model's grouped namespace (its spec a ``CacheSpec``).
        group: the index of a ``window`` group in it.
        kv_caches, layout: the group's layers, as ``EngineCache`` takes them.
    """

    def __init__(self, client, ns: Namespace, group: int, kv_caches, *,
                 layout: str | None = None) -> None:
        if not ns.is_grouped or not 0 <= group < len(ns.cache.groups) \
                or ns.cache.groups[group].kind is not GroupKind.WINDOW:
            raise InvalidArgument(f"group {group} of namespace {ns.model_id!r} is not a "
                                  "window group")
        super().__init__(client, ns.group(group), kv_caches, layout=layout)
        self.window_tokens = ns.cache.groups[group].window_tokens
        self._pages = SnapshotPages(client, self.layout.device)

    def close(self) -> None:
        self._pages.close()
        super().close()

    def window(self, tokens: Sequence[int], block_ids) -> tuple[range, list, torch.Tensor]:
        """The window's blocks of the whole blocks of ``tokens``, their pages' token ids and
        their engine block ids."""
        tokens, ids = self._blocks(tokens, block_ids)
        blocks = window_blocks(len(ids), self.window_tokens, self.ns.spec.block_tokens)
        return blocks, snapshot_ids(self.ns, tokens, list(blocks)), ids[blocks.start:]

    def save(self, tokens: Sequence[int], block_ids, stream: torch.cuda.Stream | None = None,
             *, ns: Namespace | None = None) -> int:
        """Store the window of the prefix held in engine pages ``block_ids`` (blocks before
        the window may be the engine's null block: they are never read); returns the blocks
        newly stored."""
        if ns is not None and ns is not self.ns:
            raise InvalidArgument("a window cache saves under its group's namespace")
        _, pages, ids = self.window(tokens, block_ids)

        def write(dev: DeviceLayout, addrs: torch.Tensor, which: list[int]) -> None:
            from_engine(self.layout, dev, addrs, ids[which], stream)

        return self._pages.save(self.ns, pages, write, stream)

    def load(self, tokens: Sequence[int], block_ids, stream: torch.cuda.Stream | None = None,
             ) -> LoadHandle:
        """Write the window of the prefix of ``tokens`` into its engine pages of
        ``block_ids``, all of its blocks or none; ``matched_tokens`` counts the prefix's
        whole blocks from token 0 when the window landed."""
        blocks, pages, ids = self.window(tokens, block_ids)

        def read(dev: DeviceLayout, addrs: torch.Tensor, which: list[int]) -> None:
            to_engine(self.layout, dev, addrs, ids[which], stream)

        return self._pages.load(self.ns, pages, read, stream,
                                blocks.stop * self.ns.spec.block_tokens)
