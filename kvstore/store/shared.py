"""The shared tier seen from this host: its batched prefix probe, adopting its blocks into the
local chain, and telling its directory what the local tiers hold."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.errors import CapacityError
from kvstore.keys import BlockKey, Namespace
from kvstore.page import PageMeta
from kvstore.store.directory import BlockDirectory
from kvstore.store.placement import Count, Link, Placement
from kvstore.tiers.base import SharedTier


def directory_observer(links: Sequence[Link]) -> Callable[[PageMeta, str, bool], None] | None:
    """What tells a shared tier's directory which blocks this host's local tiers hold (None
    without a shared tier)."""
    shared = next((link.tier for link in links if isinstance(link.tier, SharedTier)), None)
    if shared is None:
        return None
    local = {link.name for link in links if link.tier is not shared}

    def observe(meta: PageMeta, tier: str, is_held: bool) -> None:
        if tier in local:
            shared.note_local(meta, tier, is_held)

    return observe


class Shared:
    """The store's use of the shared tier of its chain, if it has one (else a no-op).

    Args:
        directory: the store's block directory.
        placement: the store's placement over the chain (storing adopted blocks).
        count: adds to the store's request counters.
    """

    def __init__(self, directory: BlockDirectory, placement: Placement, count: Count) -> None:
        self._dir = directory
        self._placement = placement
        self._count = count

    async def probe(self, ns: Namespace, keys: Sequence[BlockKey], matched: int
                    ) -> tuple[tuple[BlockKey, ...], dict[str, int]]:
        """Past the ``matched`` leading keys the directory knows: the keys the shared tier
        holds next (one batched probe), and the tokens other hosts hold after those."""
        link = self._placement.shared_link()
        if link is None or matched >= len(keys):
            return (), {}
        shared: SharedTier = link.tier  # type: ignore[assignment]
        rest = keys[matched:]
        found = await shared.exists_prefix(rest, ns.tenant)
        held_by = await shared.holders(rest[found:], ns.tenant) if found < len(rest) else []
        cluster: dict[str, int] = {}
        for host in set().union(*held_by):
            run = next((i for i, hosts in enumerate(held_by) if host not in hosts), len(held_by))
            if run:
                cluster[host] = run * ns.spec.block_tokens
        return tuple(rest[:found]), cluster

    @property
    def present(self) -> bool:
        """Whether the chain has a shared tier."""
        return self._placement.shared_link() is not None

    async def holds_all(self, ns: Namespace, keys: Sequence[BlockKey]) -> bool:
        """Whether the shared tier holds every one of ``keys`` (one batched probe; False
        without a shared tier or when it is unreachable)."""
        link = self._placement.shared_link()
        if link is None or not keys:
            return link is not None
        shared: SharedTier = link.tier  # type: ignore[assignment]
        return await shared.exists_prefix(keys, ns.tenant) == len(keys)

    async def extends(self, ns: Namespace, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` the shared tier holds (0 without one)."""
        link = self._placement.shared_link()
        if link is None or not keys:
            return 0
        shared: SharedTier = link.tier  # type: ignore[assignment]
        return await shared.exists_prefix(keys, ns.tenant)

    async def adopt(self, ns: Namespace, keys: Sequence[BlockKey]) -> None:
        """Bring the blocks the shared tier holds just past the local match into the fastest
        tier that takes them (verified by the shared tier: key, checksum, namespace), so the
        get serves them like any local block."""
        link = self._placement.shared_link()
        held = self._dir.match_prefix(keys)
        if link is None or len(held) == len(keys):
            return
        shared: SharedTier = link.tier  # type: ignore[assignment]
        start = len(held)
        pages = await shared.read_many(keys[start:], ns.tenant, ns.fingerprint)
        held = self._dir.match_prefix(keys)  # pinned: making room never evicts the prefix
        self._dir.pin(held)
        try:
            for key, page in zip(keys[start:], pages):
                if page is None:
                    break
                entry = self._dir.get(key)
                if entry is not None and not entry.live:  # being evicted: the prefix ends
                    break
                if entry is None:
                    try:
                        entry = await self._placement.store_new(page.meta, page.data)
                    except CapacityError:
                        break
                    self._count(ns.tenant, promotions=1)
                self._dir.pin([entry])
                held.append(entry)
        finally:
            self._dir.unpin(held)
