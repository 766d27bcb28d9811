"""An engine's recurrent states (a ``state`` cache group: Mamba conv and SSM states, gated
delta net states) saved and loaded as snapshots at block boundaries, straight between the
engine's state slots and the daemon's pages (``kvstore.codecs.triton.state``).

The snapshot of a prefix of n blocks is the state after its n blocks, stored as a one-block
page of its own keyed by the group's chain key at block n - 1 (``keys.snapshot_tokens``): a
save reserves that page alone, a load acquires it alone. Several snapshots move in one launch
(``save_many``, ``load_many``), each its own page; ``gather`` copies them into host memory of
their own for a put on another thread (an engine's step goes on meanwhile).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvstore.client.engine import LoadHandle
from kvstore.client.snapshot_pages import Gathered, SnapshotPages, snapshot_ids
from kvstore.codecs.device import DeviceLayout
from kvstore.codecs.triton.state import StateLayout, load_states, save_states
from kvstore.errors import InvalidArgument
from kvstore.groups import GroupKind
from kvstore.keys import Namespace

Snapshot = tuple[Sequence[int], int, int]  # (tokens, n blocks, engine state slot)


class EngineStates:
    """A state group's slots in an engine, registered with kvstore.

    Args:
        client: a sync ``kvstore.client.Client``.
        ns: the model's grouped namespace (its spec a ``CacheSpec``).
        group: the index of a ``state`` group in it.
        states: per layer, each part's tensor ``[num_slots, *shape]`` (``StateLayout.of``).
    """

    def __init__(self, client, ns: Namespace, group: int,
                 states: Sequence[Mapping[str, torch.Tensor]]) -> None:
        if not ns.is_grouped or not 0 <= group < len(ns.cache.groups) \
                or ns.cache.groups[group].kind is not GroupKind.STATE:
            raise InvalidArgument(f"group {group} of namespace {ns.model_id!r} is not a state "
                                  "group")
        self.ns = ns.group(group)
        self.block_tokens = ns.cache.block_tokens
        self.layout = StateLayout.of(ns.cache.groups[group], self.block_tokens, states)
        self._pages = SnapshotPages(client, self.layout.device)

    def close(self) -> None:
        self._pages.close()

    def _namespace(self, ns: Namespace | None) -> Namespace:
        """``ns`` (a request's own ``Namespace.group`` of the state group: its salt, adapter)
        or the group's; any namespace of the group's page geometry may use the slots."""
        if ns is None or ns is self.ns:
            return self.ns
        if ns.spec != self.ns.spec:
            raise InvalidArgument(f"namespace spec {ns.spec} is not the pages' of "
                                  f"{self.layout.group.label} ({self.ns.spec})")
        return ns

    def _pages_of(self, snapshots: Sequence[Snapshot], ns: Namespace
                  ) -> tuple[list, list[int]]:
        ids, slots = [], []
        for tokens, n, slot in snapshots:
            if not 1 <= n <= len(tokens) // self.block_tokens:
                raise InvalidArgument(f"a snapshot at block {n}: the tokens hold "
                                      f"{len(tokens) // self.block_tokens} whole blocks")
            ids += snapshot_ids(ns, tokens, [n - 1])
            slots.append(slot)
        self.layout.check_slots(slots)
        return ids, slots

    def _checked(self, dev: DeviceLayout) -> None:
        if dev.codec != "raw":  # the daemon refuses lossy tiers for state pages; say so here too
            raise InvalidArgument(f"state pages are stored raw, the device pool's codec is "
                                  f"{dev.codec}")

    def save_many(self, snapshots: Sequence[Snapshot], stream=None,
                  ns: Namespace | None = None) -> int:
        """Store each ``(tokens, n, slot)``: the state in ``slot`` is the one after the first
        ``n`` blocks of ``tokens``. One launch; returns how many snapshots were new. ``ns``: a
        request's namespace of the group (the group's by default)."""
        ns = self._namespace(ns)
        ids, slots = self._pages_of(snapshots, ns)

        def write(dev: DeviceLayout, addrs: torch.Tensor, which: list[int]) -> None:
            self._checked(dev)
            save_states(self.layout, addrs, [slots[i] for i in which], stream)

        return self._pages.save(ns, ids, write, stream)

    def gather(self, snapshots: Sequence[Snapshot], stream=None, ns: Namespace | None = None
               ) -> tuple[list[np.ndarray], Gathered]:
        """Each ``(tokens, n, slot)``'s page, copied out of its slot on ``stream`` (one launch)
        into host memory of its own, for a put elsewhere (``Client.put`` of ``pages[i]``, its
        token ids, and ``gathered.kv[i]`` once ``gathered.ready`` passed). The engine may
        change the slots once ``gathered.taken`` passed."""
        ns = self._namespace(ns)
        ids, slots = self._pages_of(snapshots, ns)

        def write(dev: DeviceLayout, addrs: torch.Tensor, which: list[int]) -> None:
            save_states(self.layout, addrs, [slots[i] for i in which], stream)

        return ids, self._pages.gather(ns, len(ids), write, stream)

    def save(self, tokens: Sequence[int], n: int, slot: int, stream=None,
             ns: Namespace | None = None) -> bool:
        """Store the snapshot at block ``n`` of ``tokens`` from engine state ``slot``."""
        return bool(self.save_many([(tokens, n, slot)], stream, ns))

    def load_many(self, snapshots: Sequence[Snapshot], stream=None,
                  ns: Namespace | None = None) -> LoadHandle:
        """Write each stored snapshot ``(tokens, n, slot)`` into ``slot``: all or none (a
        handle of 0 tokens when one is missing); one launch. ``ns``: a request's namespace of
        the group (the group's by default)."""
        ns = self._namespace(ns)
        ids, slots = self._pages_of(snapshots, ns)

        def read(dev: DeviceLayout, addrs: torch.Tensor, which: list[int]) -> None:
            self._checked(dev)
            load_states(self.layout, addrs, [slots[i] for i in which], stream)

        matched = snapshots[-1][1] * self.block_tokens if snapshots else 0
        return self._pages.load(ns, ids, read, stream, matched)

    def load(self, tokens: Sequence[int], n: int, slot: int, stream=None,
             ns: Namespace | None = None) -> LoadHandle:
        """Write the snapshot at block ``n`` of ``tokens`` into engine state ``slot``; the
        handle's ``matched_tokens`` is ``n`` blocks' tokens, or 0 if it is not stored."""
        return self.load_many([(tokens, n, slot)], stream, ns)
