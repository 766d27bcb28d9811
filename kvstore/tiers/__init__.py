"""Tiers: where encoded pages live. ``base`` holds the contract and the capabilities; this module
is the one registry of tier kinds (``build_tier`` makes the tier a chain link names); each kind
is a module (``hbm``) or a package (``dram``, ``ssd``, ``remote``) whose ``tier`` module holds it.

Adding a kind: write its module, name it in ``_TIER_CLASSES`` here, and its settings class in
``kvstore.config.TIER_KINDS``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.config import TierConfig
    from kvstore.tiers.base import Tier

# kind -> "module:Class"; imported when a chain names the kind, so an optional dependency (CUDA,
# lmdb, redis) only costs the kinds that need it.
_TIER_CLASSES: dict[str, str] = {
    "hbm": "kvstore.tiers.hbm:HbmTier",
    "dram": "kvstore.tiers.dram.tier:DramTier",
    "ssd": "kvstore.tiers.ssd.tier:SsdTier",
    "remote": "kvstore.tiers.remote.tier:RemoteTier",
}


def kinds() -> list[str]:
    """The tier kinds this build implements."""
    return list(_TIER_CLASSES)


def build_tier(link: TierConfig) -> Tier:
    """The tier of ``link.kind`` with ``link.settings``, named ``link.name``."""
    target = _TIER_CLASSES.get(link.kind)
    if target is None:
        raise ValueError(f"no tier implementation of kind {link.kind!r}")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)(link.settings, name=link.name)
